"""The Hopper forward kernel against the float64 oracle and the reference (GPU only).

Outputs are poisoned: the FFI handler's test switch fills o and lse with NaN on the stream
before the launch, so an element the kernel fails to write reads NaN.
"""
import dataclasses
import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import api
from cases import make_problem, rel_err
import oracle

pytestmark = pytest.mark.gpu

# (B, T, H, Dqk, S, K, sink, topk_length). Covers H in {1, 8, 16, 24, 48, 64, 72, 96, 100, 120,
# 128}, Dqk 512/576, K in {1, 63, 640, 1152, 2048}, B in {1, 3}.
CASES = [
    (1, 16, 1, 512, 300, 1, False, "none"),
    (3, 8, 8, 576, 2000, 63, True, "partial"),
    (1, 32, 16, 512, 4096, 640, True, "partial"),
    (2, 16, 24, 576, 1000, 640, False, "full"),
    (1, 16, 48, 512, 3000, 1152, True, "none"),
    (1, 16, 64, 576, 4096, 640, True, "partial"),
    (3, 4, 72, 512, 500, 63, False, "partial"),
    (1, 8, 96, 576, 5000, 2048, True, "partial"),
    (1, 8, 100, 512, 2000, 640, True, "none"),
    (2, 4, 120, 576, 700, 1152, False, "partial"),
    (1, 8, 128, 512, 4096, 640, True, "partial"),
    (1, 8, 128, 576, 3000, 2048, True, "full"),
    (2, 4, 128, 576, 64, 1, True, "none"),
    (1, 8, 3, 512, 100, 63, True, "partial"),
]


def _kernel_or_skip():
    problem = api.kernel_runtime_problem()
    if problem:
        pytest.skip(problem)


def _run_kernel(p, dtype, scale=None, config=None):
    """The forward on the kernels for `config` (default: what jax_dsa.cute.select picks, the
    list split included) with poisoned kernel outputs: (q, kv, o, lse) on the device."""
    from jax_dsa.cute import config as kernel_config, kernel as cute_kernel
    q, kv = jnp.asarray(p.q, dtype), jnp.asarray(p.kv, dtype)
    sink = np.full(p.q.shape[2], -np.inf, np.float32) if p.sink is None else p.sink
    scale = p.scale if scale is None else scale
    cfg = kernel_config.resolve(config, p.q.shape, p.idx.shape[2], p.kv.shape[1], False)
    fwd = jax.jit(functools.partial(cute_kernel.forward, scale=scale, config=cfg,
                                    poison_outputs=True))
    o, lse = fwd(q, kv, jnp.asarray(p.idx), jnp.asarray(p.lengths), jnp.asarray(sink))
    return q, kv, o, lse


def _assert_matches_oracle(p, q, kv, o, lse, scale):
    """o / lse against the float64 oracle on the same (rounded) q / kv: nothing unwritten or
    NaN, dead rows exactly (o = 0, lse = -inf), o within 1e-2 relative, lse within 2e-3."""
    o_ref, lse_ref = oracle.numpy_forward(np.asarray(q, np.float32), np.asarray(kv, np.float32),
                                          p.idx, p.lengths, p.sink, scale, 512)
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "unwritten or NaN outputs"
    dead = np.isneginf(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), dead)
    assert np.all(o[dead] == 0.0)
    assert rel_err(o, o_ref) < 1e-2, rel_err(o, o_ref)
    assert np.max(np.abs(lse[~dead] - lse_ref[~dead]), initial=0.0) < 2e-3 * max(
        1.0, np.max(np.abs(lse_ref[~dead]), initial=0.0))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}{}-{}".format(
    *c[:6], "-sink" if c[6] else "", c[7]))
def test_forward_kernel_matches_oracle(case):
    _kernel_or_skip()
    b, t, h, d, s, k, sink, topk = case
    p = make_problem(np.random.default_rng(zlib.crc32(repr(case).encode())), b, t, h, d, s, k,
                     sink=sink, topk=topk)
    _assert_matches_oracle(p, *_run_kernel(p, jnp.bfloat16), p.scale)


# H <= 32 can run either forward kernel: both, in one process, through the public config=.
SMALL_H_CASES = [(2, 8, 8, 576, 2000, 63, True, "partial"), (1, 16, 32, 512, 4096, 640, True,
                                                             "partial"),
                 (1, 8, 3, 576, 100, 1152, False, "none")]


@pytest.mark.parametrize("case", SMALL_H_CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}".format(*c[:6]))
def test_both_forward_kernels_at_small_h_through_config(case):
    _kernel_or_skip()
    from jax_dsa.cute import Config, FwdConfig
    b, t, h, d, s, k, sink, topk = case
    p = make_problem(np.random.default_rng(zlib.crc32(repr(case).encode())), b, t, h, d, s, k,
                     sink=sink, topk=topk)
    q, kv = jnp.asarray(p.q, jnp.bfloat16), jnp.asarray(p.kv, jnp.bfloat16)
    outs = {}
    for kernel in ("small_heads", "pingpong"):
        sink_arg = None if p.sink is None else jnp.asarray(p.sink)
        f = jax.jit(functools.partial(jax_dsa.sparse_mla, sink=sink_arg,
                                      topk_length=None if p.topk_length is None else jnp.asarray(
                                          p.topk_length), return_lse=True,
                                      implementation="cute", config=Config(fwd=FwdConfig(kernel))))
        o, lse = f(q, kv, jnp.asarray(p.idx))
        _assert_matches_oracle(p, q, kv, o, lse, p.scale)
        outs[kernel] = np.asarray(o, np.float32)
    assert rel_err(outs["small_heads"], outs["pingpong"]) < 1e-2


# Decode (few tokens): each token's list split into parts run as tokens of their own and
# combined by lse. (B, T, H, Dqk, S, K, sink, topk_length, kernel, splits); ragged last parts,
# parts beyond topk_length, dead tokens, invalid entries, sinks, both kernels.
SPLIT_CASES = [
    (1, 8, 128, 576, 65536, 2048, True, "partial", "pingpong", 8),
    (2, 1, 128, 576, 5000, 2048, True, "full", "pingpong", 16),
    (4, 1, 64, 512, 3000, 1152, False, "partial", "pingpong", 3),
    (1, 3, 100, 576, 4096, 1000, True, "none", "pingpong", 7),
    (2, 2, 16, 512, 4096, 640, True, "partial", "small_heads", 5),
    (1, 4, 32, 576, 2000, 2048, False, "partial", "small_heads", 16),
    (3, 1, 8, 512, 300, 63, True, "none", "small_heads", 2),
    (1, 2, 64, 512, 300, 5, True, "full", "pingpong", 4),  # the last part holds no entry
    (2, 1, 128, 576, 300, 5, True, "partial", "pingpong", 8),  # parts of one entry, 3 empty
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}-{}-{}x{}".format(
    *c[:6], *c[7:]))
def test_split_forward_matches_oracle(case):
    _kernel_or_skip()
    from jax_dsa.cute import Config, FwdConfig
    b, t, h, d, s, k, sink, topk, kernel, splits = case
    p = make_problem(np.random.default_rng(zlib.crc32(repr(case).encode())), b, t, h, d, s, k,
                     sink=sink, topk=topk)
    _assert_matches_oracle(p, *_run_kernel(p, jnp.bfloat16,
                                           config=Config(fwd=FwdConfig(kernel, splits))), p.scale)


def test_decode_splits_by_default_and_matches_the_unsplit_kernel():
    """8 decode tokens at H = 128, K = 2048: select splits the lists, and the public call gives
    the oracle's result and the unsplit kernel's within bf16 rounding."""
    _kernel_or_skip()
    from jax_dsa.cute import Config, FwdConfig, config as kernel_config
    p = make_problem(np.random.default_rng(8), 8, 1, 128, 576, 65536, 2048, sink=True,
                     topk="partial")
    assert kernel_config.select(p.q.shape, 2048, 65536).fwd.splits > 1
    plan = jax_dsa.explain(jnp.asarray(p.q, jnp.bfloat16), jnp.asarray(p.kv, jnp.bfloat16), p.idx,
                           sink=p.sink, topk_length=p.topk_length)
    assert plan.config.fwd.splits > 1, plan
    q, kv, o, lse = _run_kernel(p, jnp.bfloat16)
    _assert_matches_oracle(p, q, kv, o, lse, p.scale)
    _, _, o1, lse1 = _run_kernel(p, jnp.bfloat16, config=Config(fwd=FwdConfig("pingpong", 1)))
    assert rel_err(o, o1) < 1e-2
    live = np.isfinite(np.asarray(lse1))
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(lse1)[live], rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("h", [16, 64])
def test_nan_sink_gives_nan_for_its_head_on_the_kernel(h):
    """A NaN sink must reach o on the kernels as on the reference (both forward kernels)."""
    _kernel_or_skip()
    p = make_problem(np.random.default_rng(h), 1, 8, h, 512, 300, 64, sink=True, topk="none",
                     dead_row=False)  # every row live
    p.sink[3] = np.nan
    q, kv, o, lse = _run_kernel(p, jnp.bfloat16)
    o = np.asarray(o, np.float32)
    assert np.all(np.isnan(o[:, :, 3])), "NaN sink must give NaN o"
    others = [i for i in range(h) if i != 3]
    assert np.all(np.isfinite(o[:, :, others])) and np.all(np.isfinite(np.asarray(lse)))


def test_small_heads_config_refuses_large_h():
    _kernel_or_skip()
    from jax_dsa.cute import Config, FwdConfig
    q = jnp.zeros((1, 2, 64, 512), jnp.bfloat16)
    kv = jnp.zeros((1, 8, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="small_heads"):
        jax_dsa.sparse_mla(q, kv, jnp.zeros((1, 2, 4), jnp.int32), implementation="cute",
                           config=Config(fwd=FwdConfig("small_heads")))


@pytest.mark.parametrize("h,d", [(16, 512), (64, 512), (128, 576)])
def test_running_max_that_jumps_between_blocks(h, d):
    """Scores whose scale grows (or shrinks) by ~30 log2 units along each token's entry list, so
    the online softmax must move its running max many times in one token (and, in reverse
    order, never): exercises the O / row-sum rescaling that random normal inputs barely touch."""
    _kernel_or_skip()
    rng = np.random.default_rng(h * 1000 + d)
    t, s, k = 24, 4096, 640
    p = make_problem(rng, 1, t, h, d, s, k, sink=True, topk="partial", dead_row=False)
    row_scale = np.geomspace(0.25, 16.0, s).astype(np.float32)
    p.kv *= row_scale[None, :, None]
    idx = np.sort(rng.choice(s, size=(t, k)), axis=-1)  # ascending: the scores grow
    idx[1::2] = idx[1::2, ::-1]  # descending on odd tokens: the first block holds the max
    p.idx = idx[None].astype(np.int32)
    q, kv, o, lse = _run_kernel(p, jnp.bfloat16)
    o_ref, lse_ref = oracle.numpy_forward(np.asarray(q, np.float32), np.asarray(kv, np.float32),
                                          p.idx, p.lengths, p.sink, p.scale, 512)
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "unwritten or NaN outputs"
    live = ~np.isneginf(lse_ref)
    assert np.ptp(lse_ref[live]) > 10.0, "the problem does not spread the scores"
    np.testing.assert_array_equal(np.isneginf(lse), ~live)
    assert rel_err(o, o_ref) < 1e-2, rel_err(o, o_ref)
    assert np.max(np.abs(lse[live] - lse_ref[live])) < 2e-3 * np.max(np.abs(lse_ref[live]))


@pytest.mark.parametrize("h,d,scale", [(16, 512, 0.0), (64, 576, -0.04), (128, 512, 0.0),
                                       (100, 512, -0.02)])
def test_zero_and_negative_scale(h, d, scale):
    """scale <= 0 with invalid entries: a kernel that masks before scaling gets -inf * 0 = NaN or
    -inf * (-c) = +inf for the masked scores. (scale 0: uniform weights over the valid entries.)"""
    _kernel_or_skip()
    p = make_problem(np.random.default_rng(h + d), 1, 12, h, d, 3000, 640, sink=True,
                     topk="partial")
    _assert_matches_oracle(p, *_run_kernel(p, jnp.bfloat16, scale=scale), scale)


def test_float16_and_default_dispatch_use_the_kernel():
    _kernel_or_skip()
    p = make_problem(np.random.default_rng(1), 2, 8, 16, 576, 800, 640, sink=True, topk="partial")
    q, kv, o, lse = _run_kernel(p, jnp.float16)
    o_ref, _ = oracle.numpy_forward(np.asarray(q, np.float32), np.asarray(kv, np.float32),
                                    p.idx, p.lengths, p.sink, p.scale, 512)
    assert o.dtype == jnp.float16 and rel_err(o, o_ref) < 1e-2
    o_api = jax_dsa.sparse_mla(q, kv, jnp.asarray(p.idx), sink=jnp.asarray(p.sink),
                               topk_length=jnp.asarray(p.topk_length), implementation="cute")
    np.testing.assert_array_equal(np.asarray(o_api), np.asarray(o))
    text = jax.jit(lambda q, kv: jax_dsa.sparse_mla(q, kv, jnp.asarray(p.idx))).lower(
        q, kv).as_text()
    assert "jax_dsa_sparse_mla_fwd_sm90" in text, "implementation=None did not pick the kernel"


def test_repeated_runs_are_bitwise_identical():
    _kernel_or_skip()
    p = make_problem(np.random.default_rng(2), 1, 64, 64, 512, 4096, 640, sink=True,
                     topk="partial")
    outs = [_run_kernel(p, jnp.bfloat16)[2:] for _ in range(3)]
    for o, lse in outs[1:]:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(outs[0][0]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(outs[0][1]))


def test_million_tokens_and_64bit_row_addressing():
    """T = 2^20 + 3 (grid limits) and kv with more than 2^31 elements (64-bit offsets).

    With one valid entry and no sink, o is that row's first 512 values exactly and lse = s.
    """
    _kernel_or_skip()
    rng = np.random.default_rng(3)
    t = (1 << 20) + 3
    q = jnp.asarray(rng.standard_normal((1, t, 2, 512), np.float32), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, 4096, 512), np.float32), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, 4096, (1, t, 1)), jnp.int32)
    o = jax_dsa.sparse_mla(q, kv, idx, implementation="cute")
    np.testing.assert_array_equal(np.asarray(o[0, :, 0]), np.asarray(kv[0, idx[0, :, 0], :512]))
    np.testing.assert_array_equal(np.asarray(o[0, :, 1]), np.asarray(kv[0, idx[0, :, 0], :512]))
    del q, kv, o

    s = (1 << 22) + 7  # 2^22 rows * 576 > 2^31 elements
    kv = jnp.asarray(rng.standard_normal((1, 1024, 576), np.float32), jnp.bfloat16)
    kv = jnp.tile(kv, (1, s // 1024 + 1, 1))[:, :s]
    rows = jnp.asarray([[[s - 1], [s - 2], [5], [s - 1025]]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 4, 3, 576), np.float32), jnp.bfloat16)
    o, lse = jax_dsa.sparse_mla(q, kv, rows, return_lse=True, implementation="cute")
    want = np.asarray(kv[0, rows[0, :, 0], :512])
    np.testing.assert_array_equal(np.asarray(o[0, :, 1]), want)
    s_exp = np.einsum("thd,td->th", np.asarray(q[0], np.float32),
                      np.asarray(kv[0, rows[0, :, 0]], np.float32)) * 576 ** -0.5
    np.testing.assert_allclose(np.asarray(lse[0]), s_exp, rtol=1e-3, atol=1e-3)


# Two pools read in place by the two-pool forward kernel (ffi.sparse_mla_fwd_two_pool), against
# the oracle on the concatenation. (B, T, H, Dqk, S1, K1, S2, K2, sink, topk1, topk2): pool 1's
# list not a multiple of the 64-row block (100, 1), partial / no lengths, invalid entries on
# both sides of each pool (make_problem's lists), dead tokens, padded heads.
TWO_POOL_CASES = [
    (2, 12, 128, 576, 600, 128, 300, 640, True, "partial", "partial"),
    (1, 16, 64, 512, 200, 100, 90, 70, False, "none", "partial"),
    (1, 9, 100, 576, 50, 1, 40, 200, True, "full", "none"),
    (2, 5, 40, 512, 64, 130, 700, 1152, True, "partial", "full"),
]


@pytest.mark.parametrize("case", TWO_POOL_CASES, ids=lambda c: "B{}T{}H{}D{}-{}x{}+{}x{}".format(
    *c[:8]))
def test_two_pool_forward_kernel_matches_oracle(case):
    _kernel_or_skip()
    from jax_dsa import _core
    from jax_dsa.cute import ffi
    b, t, h, d, s1, k1, s2, k2, sink, topk1, topk2 = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    p1 = make_problem(rng, b, t, h, d, s1, k1, sink=sink, topk=topk1)
    p2 = make_problem(rng, b, t, h, d, s2, k2, topk=topk2)
    q = jnp.asarray(p1.q, jnp.bfloat16)
    kv1, kv2 = jnp.asarray(p1.kv, jnp.bfloat16), jnp.asarray(p2.kv, jnp.bfloat16)
    sink_arr = np.full(h, -np.inf, np.float32) if p1.sink is None else p1.sink
    fwd = jax.jit(functools.partial(ffi.sparse_mla_fwd_two_pool, scale=p1.scale,
                                    poison_outputs=True))
    o, lse = fwd(q, kv1, jnp.asarray(p1.idx), jnp.asarray(p1.lengths), kv2, jnp.asarray(p2.idx),
                 jnp.asarray(p2.lengths), jnp.asarray(sink_arr))
    kv_cat, idx_cat, len_cat = (np.asarray(x) for x in _core.one_pool(
        kv1, jnp.asarray(p1.idx), jnp.asarray(p1.lengths), kv2, jnp.asarray(p2.idx),
        jnp.asarray(p2.lengths)))
    cat = dataclasses.replace(p1, kv=kv_cat.astype(np.float32), idx=idx_cat, topk_length=len_cat)
    _assert_matches_oracle(cat, q, kv_cat, o, lse, p1.scale)


def test_two_pools_run_the_two_pool_kernel_and_match_the_one_pool_kernel():
    """Prefill with two pools (the V4 layout: a window over the raw KV, a top-k over the
    compressed KV) runs the two-pool forward kernel (no concatenate in the program) and gives
    the one-pool kernel's result on the concatenation."""
    _kernel_or_skip()
    from jax_dsa import _core
    rng = np.random.default_rng(5)
    p1 = make_problem(rng, 1, 128, 64, 512, 4096, 128, sink=True, topk="partial")
    p2 = make_problem(rng, 1, 128, 64, 512, 1024, 512, topk="partial")
    q = jnp.asarray(p1.q, jnp.bfloat16)
    kv1, kv2 = jnp.asarray(p1.kv, jnp.bfloat16), jnp.asarray(p2.kv, jnp.bfloat16)
    args = (jnp.asarray(p1.idx), jnp.asarray(p1.topk_length), jnp.asarray(p2.idx),
            jnp.asarray(p2.topk_length), jnp.asarray(p1.sink))

    def two(q, kv1, kv2, i1, l1, i2, l2, sink):
        return jax_dsa.sparse_mla(q, kv1, i1, sink=sink, topk_length=l1, return_lse=True,
                                  implementation="cute", extra_kv=kv2, extra_idx=i2,
                                  extra_topk_length=l2)

    text = jax.jit(two).lower(q, kv1, kv2, *args).as_text()
    assert "jax_dsa_sparse_mla_fwd_two_pool_sm90" in text and "concatenate" not in text
    o2, lse2 = jax.jit(two)(q, kv1, kv2, *args)
    kv_c, idx_c, len_c = _core.one_pool(kv1, args[0], args[1], kv2, args[2], args[3])
    o1, lse1 = jax.jit(functools.partial(jax_dsa.sparse_mla, return_lse=True,
                                         implementation="cute"))(q, kv_c, idx_c, sink=args[4],
                                                                  topk_length=len_c)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse2)), np.isneginf(np.asarray(lse1)))
    assert rel_err(np.asarray(o2, np.float32), np.asarray(o1, np.float32)) < 1e-2
    live = np.isfinite(np.asarray(lse1))
    np.testing.assert_allclose(np.asarray(lse2)[live], np.asarray(lse1)[live], rtol=1e-5,
                               atol=1e-4)
