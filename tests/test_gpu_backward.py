"""The Hopper backward kernel (dq, dkv) against the float64 oracle and the reference (GPU only)."""
import dataclasses
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import api
from jax_dsa.cute import BwdConfig, Config, config as kernel_config, constants
from cases import make_problem, rel_err
import oracle

pytestmark = pytest.mark.gpu

# (B, T, H, Dqk, S, K, sink, topk_length)
CASES = [
    (1, 8, 1, 512, 300, 1, False, "none"),
    (3, 4, 8, 576, 500, 200, True, "partial"),
    (1, 18, 16, 512, 4096, 640, True, "partial"),  # T % 4 != 0: the plain kernel at H = 16
    (2, 4, 24, 576, 700, 63, False, "full"),
    (1, 8, 64, 576, 2000, 640, True, "partial"),
    (2, 4, 100, 512, 900, 1152, True, "none"),
    (1, 4, 128, 576, 3000, 2048, True, "partial"),
    (1, 8, 128, 512, 100, 640, False, "partial"),  # many duplicates: K >> S
    # dkv >= LONG_DKV_MIN_BYTES: the long-context (`_long`) builds
    (1, 8, 64, 512, 40000, 640, True, "partial"),
    (2, 4, 128, 512, 20000, 1152, False, "full"),
    (1, 4, 100, 512, 40000, 640, True, "partial"),  # a partial head block in the `_long` build
    (1, 8, 128, 576, 33000, 2048, True, "partial"),
    (2, 4, 24, 576, 16000, 640, False, "none"),
    # more (token, head block) items than the H200's 132 SMs: several items per CTA of a
    # persistent grid, empty lists among them
    (1, 140, 128, 576, 400, 130, True, "partial"),
    (1, 300, 64, 512, 500, 130, False, "partial"),
]


def _kernel_or_skip(deterministic=False):
    from jax_dsa.cute import ffi
    problem = api.kernel_runtime_problem()
    if problem:
        pytest.skip(problem)
    if not ffi.has_backward():
        pytest.skip("the library was built without the backward kernels")


def _grad_fn(p, dtype, impl, w_o, w_lse, deterministic=False, config=None):
    """(q, kv, sink, jitted function of (q, kv, sink) returning the gradients)."""
    q, kv = jnp.asarray(p.q, dtype), jnp.asarray(p.kv, dtype)
    idx = jnp.asarray(p.idx)
    tl = None if p.topk_length is None else jnp.asarray(p.topk_length)

    def loss(q, kv, sink):
        o, lse = jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, return_lse=True,
                                    implementation=impl, deterministic=deterministic,
                                    config=config)
        return (jnp.sum(o.astype(jnp.float32) * w_o)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse))

    sink = None if p.sink is None else jnp.asarray(p.sink)
    argnums = (0, 1) if sink is None else (0, 1, 2)
    return q, kv, sink, jax.jit(jax.grad(loss, argnums=argnums))


def _grads(p, dtype, impl, w_o, w_lse, deterministic=False, config=None):
    q, kv, sink, fn = _grad_fn(p, dtype, impl, w_o, w_lse, deterministic, config)
    return q, kv, fn(q, kv, sink)


# The grouped backward (by default at H = 32, 16 and 8, G = 64 / H tokens per 64-row token; T a
# multiple of G): tokens whose lists overlap (K close to S), duplicates, invalid entries, partial
# lengths. jax_dsa.cute.select must pick G for each (asserted), so these run grouped by default;
# each also runs with the union computed by XLA (BwdConfig(union="xla")).
GROUPED_CASES = {
    2: [(1, 16, 32, 512, 4096, 640, True, "partial"),
        (2, 8, 32, 576, 60, 48, True, "partial"),
        (1, 10, 32, 512, 100, 640, False, "none")],
    4: [(1, 16, 16, 512, 4096, 640, True, "partial"),
        (2, 8, 16, 576, 60, 48, True, "partial"),
        (1, 12, 16, 512, 100, 640, False, "none"),
        (1, 16, 16, 512, 40000, 640, True, "partial"),  # dkv past the L2: the `_long` build
        (1, 16, 16, 576, 33000, 640, True, "partial"),
        (1, 1200, 16, 512, 400, 128, True, "partial")],  # 300 grouped items (> the SMs)
    8: [(1, 16, 8, 512, 4096, 640, True, "partial"),
        (2, 8, 8, 576, 60, 48, True, "partial"),
        (1, 24, 8, 512, 100, 640, False, "none")],
}


def _case_id(c):
    return "B{}T{}H{}D{}S{}K{}{}-{}".format(*c[:6], "-sink" if c[6] else "", c[7])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_kernel_matches_oracle_and_reference(case):
    _check_kernel_gradients(case)


@pytest.mark.parametrize("case", [c for g in sorted(GROUPED_CASES) for c in GROUPED_CASES[g]],
                         ids=_case_id)
@pytest.mark.parametrize("union", ["kernel", "xla"])
def test_grouped_backward_matches_oracle_and_reference(case, union):
    _kernel_or_skip()
    b, t, h, d, s, k = case[:6]
    assert kernel_config.select((b, t, h, d), k, s).bwd.group == 64 // h, "not run grouped"
    _check_kernel_gradients(case, Config(bwd=BwdConfig(group=64 // h, union=union)))


# float16 (dS kept unscaled, P stored as c p~ / scale, dQ and dKV scaled in fp32): the plain
# kernel at one and two head blocks, a grouped one, and the `_long` builds at H 100 (a partial
# second head block) and 128.
FLOAT16_CASES = [(2, 4, 100, 576, 700, 200, True, "partial"),
                 (1, 16, 16, 512, 4096, 640, True, "partial"),
                 (1, 4, 100, 512, 40000, 640, True, "partial"),
                 (1, 8, 128, 576, 33000, 2048, True, "partial")]


@pytest.mark.parametrize("case", FLOAT16_CASES, ids=_case_id)
def test_float16_backward_matches_oracle_and_reference(case):
    _check_kernel_gradients(case, dtype=jnp.float16)


@pytest.mark.parametrize("case", [GROUPED_CASES[4][0], GROUPED_CASES[8][1]], ids=_case_id)
def test_plain_backward_at_small_h_through_config(case):
    """The plain (ungrouped) kernel where select would group, pinned by config=."""
    _check_kernel_gradients(case, Config(bwd=BwdConfig(group=1)))


# Each token's rows in ascending order (BwdConfig.sort_rows; the default where dkv outgrows the
# L2, so the `_long` CASES above run sorted) pinned on at small S (duplicates, invalid entries,
# partial lengths, a grouped-by-default H run plain) and off past the L2 (the lists as given).
SORT_CASES = [
    ((1, 8, 128, 512, 100, 640, False, "partial"), True),
    ((3, 4, 8, 576, 500, 200, True, "partial"), True),
    ((2, 4, 100, 512, 900, 1152, True, "none"), True),
    ((1, 8, 64, 512, 40000, 640, True, "partial"), False),
    ((1, 8, 128, 576, 33000, 2048, True, "partial"), False),
]


@pytest.mark.parametrize("case,sort_rows", SORT_CASES,
                         ids=lambda c: _case_id(c) if isinstance(c, tuple) else f"sort{c}")
def test_backward_rows_sorted_or_as_given_through_config(case, sort_rows):
    b, t, h, d, s, k = case[:6]
    past_l2 = b * s * d * 4 >= constants.LONG_DKV_MIN_BYTES
    assert kernel_config.select((b, t, h, d), k, s).bwd.sort_rows == past_l2
    _check_kernel_gradients(case, Config(bwd=BwdConfig(sort_rows=sort_rows)))


def _rows_order_oracle(idx, lengths, s, wave=0):
    """What the row-order kernel gives: per token the valid entries stably ordered by
    row * 127 // S (by 126 minus it for the flattened tokens n with n // wave odd, wave > 0),
    then S for each invalid entry; and the valid count."""
    b, t, k = idx.shape
    rows = np.full((b, t, k), s, np.int32)
    count = np.zeros((b, t), np.int32)
    for i in range(b):
        for j in range(t):
            head = idx[i, j, :max(0, min(k, lengths[i, j]))]
            valid = head[(head >= 0) & (head < s)]
            bucket = valid.astype(np.int64) * 127 // s
            if wave and (i * t + j) // wave % 2:
                bucket = 126 - bucket
            order = np.argsort(bucket, kind="stable")
            rows[i, j, :valid.size] = valid[order]
            count[i, j] = valid.size
    return rows, count


@pytest.mark.parametrize("b,t,k,s", [(2, 3, 1, 5), (1, 5, 31, 1000), (2, 4, 33, 40),
                                     (1, 7, 640, 65536), (1, 3, 2048, 131072),
                                     (1, 2, 5000, 300), (1, 2, 70, 2**31 - 1),
                                     (2, 150, 64, 70000)])
@pytest.mark.parametrize("ctas", ["none", "one", "two", "all"])
def test_rows_order_kernel_matches_its_oracle(b, t, k, s, ctas):
    """ffi.rows_order (the default BwdConfig.sort_rows step): exact, stable within a bucket,
    invalid entries (negative, >= S, past topk_length, including lengths 0 and > K) last; with
    ctas_per_token > 0, every other wave of SMs // ctas_per_token tokens descending ("all":
    one SM per token, so every other token)."""
    _kernel_or_skip()
    from jax_dsa.cute import ffi
    if not ffi.has_rows_order():
        pytest.skip("the library was built without the row-order kernel")
    sms = jax.devices()[0].core_count
    ctas_per_token = {"none": 0, "one": 1, "two": 2, "all": sms}[ctas]
    wave = max(1, sms // ctas_per_token) if ctas_per_token else 0
    rng = np.random.default_rng()
    idx = rng.integers(-3, min(s, 2**31 - 4) + 3, (b, t, k)).astype(np.int64)
    idx[..., ::5] = rng.integers(0, 3, idx[..., ::5].shape)  # duplicates
    idx = np.clip(idx, -2**31, 2**31 - 1).astype(np.int32)
    lengths = rng.integers(0, k + 3, (b, t)).astype(np.int32)
    lengths.flat[0] = 0
    rows, count = ffi.rows_order(jnp.asarray(idx), jnp.asarray(lengths), s, ctas_per_token)
    want_rows, want_count = _rows_order_oracle(idx, lengths, s, wave)
    np.testing.assert_array_equal(np.asarray(count), want_count)
    np.testing.assert_array_equal(np.asarray(rows), want_rows)


def _check_kernel_gradients(case, config=None, dtype=jnp.bfloat16):
    _kernel_or_skip()
    b, t, h, d, s, k, sink, topk = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    p = make_problem(rng, b, t, h, d, s, k, sink=sink, topk=topk)
    w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    q, kv, got = _grads(p, dtype, "cute", w_o, w_lse, config=config)
    _, _, ref = _grads(p, dtype, "xla", w_o, w_lse)
    want = oracle.dense_grads(np.asarray(q, np.float32), np.asarray(kv, np.float32), p.idx,
                              p.lengths, p.sink, p.scale, 512, w_o, w_lse)
    for name, g, r, w in zip(("dq", "dkv", "dsink"), got, ref, want):
        g = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, w) < 2e-2, (name, "vs oracle", rel_err(g, w))
        assert rel_err(g, r) < 2e-2, (name, "vs reference", rel_err(g, r))
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[0, 0], 0.0)  # dead row


@pytest.mark.parametrize("h,d", [(24, 576), (100, 512), (16, 512)],
                         ids=["H24D576", "H100D512", "H16D512"])
@pytest.mark.parametrize("mode", ["atomic", "deterministic", "sorted"])
def test_backward_never_writes_outside_valid_rows(mode, h, d):
    """Batches 0 and 2 select nothing, batch 1 lists -1, -S, S, S + 7 next to valid rows: a write
    at an invalid row of batch 1 would land in batch 0's last or batch 2's first rows (flat
    layout), which must stay exactly zero; rows of batch 1 never listed must stay zero too.
    Deterministic: a workspace of 4 tokens at H=24, Dqk 576 (18 tokens in 5 chunks) and of 2 at
    H=100, Dqk 512 (two head blocks, each adding to the same rows: 9 chunks). H=16 runs 8 tokens
    per batch, so the atomic backward runs grouped (4 tokens per union); "sorted" runs the plain
    backward with each token's rows sorted first (BwdConfig.sort_rows)."""
    deterministic = mode == "deterministic"
    _kernel_or_skip(deterministic)
    config = {"atomic": None, "sorted": Config(bwd=BwdConfig(sort_rows=True)),
              "deterministic": Config(bwd=BwdConfig(workspace_bytes=4 * 70 * 576 * 4))}[mode]
    rng = np.random.default_rng(5)
    b, t, s, k = 3, 8 if h == 16 else 6, 40, 70
    if h == 16 and mode == "atomic":
        assert kernel_config.select((b, t, h, d), k, s).bwd.group == 4, "not run grouped"
    p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="full", dead_row=False)
    p.idx[1] = rng.integers(10, 30, (t, k))
    p.idx[1, :, ::3] = -1
    p.idx[1, :, 1::7] = s
    p.idx[1, :, 2::11] = s + 7
    p.idx[1, :, 4::13] = -s
    p.topk_length[0] = 0
    p.topk_length[2] = 0
    w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
    _, _, (dq, dkv, _) = _grads(p, jnp.bfloat16, "cute", w_o, np.zeros((b, t, h), np.float32),
                               deterministic, config)
    dkv = np.asarray(dkv, np.float32)
    assert np.all(dkv[0] == 0) and np.all(dkv[2] == 0)
    untouched = np.setdiff1d(np.arange(s), p.idx[1][(p.idx[1] >= 0) & (p.idx[1] < s)])
    assert np.all(dkv[1, untouched] == 0) and np.any(dkv[1] != 0)
    assert np.all(np.asarray(dq, np.float32)[[0, 2]] == 0)


@pytest.mark.parametrize("h", [16, 64])
def test_nan_sink_gives_nan_gradients_on_the_kernel(h):
    """A NaN sink reaches dsink for its head (and the gradients it touches) on the kernels."""
    _kernel_or_skip()
    rng = np.random.default_rng(h)
    p = make_problem(rng, 1, 8, h, 512, 300, 64, sink=True, topk="none", dead_row=False)
    p.sink[3] = np.nan
    w_o = rng.standard_normal((1, 8, h, 512)).astype(np.float32)
    _, _, (dq, dkv, dsink) = _grads(p, jnp.bfloat16, "cute", w_o, np.zeros((1, 8, h), np.float32))
    dsink, dq = np.asarray(dsink), np.asarray(dq, np.float32)
    assert np.isnan(dsink[3]) and np.all(np.isfinite(np.delete(dsink, 3)))
    assert np.all(np.isnan(dq[:, :, 3])) and np.all(np.isfinite(np.delete(dq, 3, axis=2)))


@pytest.mark.parametrize("case", [(1, 8, 16, 512, 300, 64), (1, 4, 128, 576, 3000, 2048),
                                  (1, 2, 128, 576, 5000, 2048),  # decode: the split forward
                                  (1, 8, 64, 512, 40000, 640)],  # the `_long` build
                         ids=lambda c: "B{}T{}H{}D{}S{}K{}".format(*c))
def test_rows_no_valid_entry_uses_may_hold_nan_or_inf_on_the_kernels(case):
    """Invalid entries are never read (zero-filled rows): NaN / inf in rows that only invalid
    entries name leave o, lse and the gradients as with those rows finite."""
    _kernel_or_skip()
    b, t, h, d, s, k = case
    rng = np.random.default_rng(s + h)
    p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial")
    p.idx[np.isin(p.idx, (0, 7))] = 1  # rows 0 and 7: named only by the invalid slots below
    p.idx[0, 1, :2], p.topk_length[0, 1] = (0, 7), 0
    bad = dataclasses.replace(p, kv=p.kv.copy())
    bad.kv[:, 0], bad.kv[:, 7] = np.nan, np.inf
    w_o = rng.standard_normal((b, t, h, p.d_v)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    outs = []
    for prob in (p, bad):
        q, kv = jnp.asarray(prob.q, jnp.bfloat16), jnp.asarray(prob.kv, jnp.bfloat16)
        o, lse = jax_dsa.sparse_mla(q, kv, jnp.asarray(prob.idx), sink=jnp.asarray(prob.sink),
                                    topk_length=jnp.asarray(prob.topk_length), return_lse=True,
                                    implementation="cute")
        outs.append((o, lse, *_grads(prob, jnp.bfloat16, "cute", w_o, w_lse)[2]))
    _assert_unread_rows_changed_nothing(("o", "lse", "dq", "dkv", "dsink"), *outs)
    assert np.all(np.asarray(outs[1][3], np.float32)[:, [0, 7]] == 0), "dkv of unnamed rows"


def _assert_unread_rows_changed_nothing(names, clean, bad):
    """The outputs with poisoned unread rows (bad) against those without (clean): no NaN, the
    forward's o and lse the same bits (no atomics), the gradients within 1e-2 (dkv and dsink
    add in any order; a bf16 dkv may differ by one step)."""
    for name, c, x in zip(names, clean, bad):
        c, x = np.asarray(c, np.float32), np.asarray(x, np.float32)
        assert not np.isnan(x).any(), f"{name}: NaN from a row no valid entry names"
        if name in ("o", "lse"):
            np.testing.assert_array_equal(x, c, err_msg=name)
        else:
            assert rel_err(x, c) < 1e-2, name


def _bf16_step(x):
    """Distance from |x| to the next larger bf16 number (8 significant bits); 0 where x = 0."""
    x = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.where(x > 0, x, 1.0)))
    return np.where(x > 0, 2.0 ** (e - 7), 0.0)


# (B, T, H, Dqk, S, K, sink, topk_length, workspace budget in tokens or None for the default)
DET_CASES = [
    (2, 5, 3, 576, 40, 70, True, "partial", 3),  # K > S: duplicates; chunks cross batches
    (1, 16, 64, 512, 4096, 640, True, "partial", 5),
    (2, 4, 100, 576, 900, 1152, False, "none", None),  # two head blocks share entries
    (1, 8, 128, 512, 100, 640, True, "partial", 3),
    (1, 280, 64, 576, 300, 130, True, "partial", None),  # 280 items in one chunk
]


@pytest.mark.parametrize("case", DET_CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}{}-{}-ws{}".format(
    *c[:6], "-sink" if c[6] else "", c[7], c[8]))
def test_deterministic_backward_matches_oracle(case):
    _kernel_or_skip(deterministic=True)
    b, t, h, d, s, k, sink, topk, ws_tokens = case
    config = None
    if ws_tokens is not None:
        n_hb = -(-h // 64)
        config = Config(bwd=BwdConfig(workspace_bytes=ws_tokens * k * n_hb * d * 4))
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    p = make_problem(rng, b, t, h, d, s, k, sink=sink, topk=topk)
    w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    q, kv, got = _grads(p, jnp.bfloat16, "cute", w_o, w_lse, deterministic=True, config=config)
    _, _, atomic = _grads(p, jnp.bfloat16, "cute", w_o, w_lse)
    want = oracle.dense_grads(np.asarray(q, np.float32), np.asarray(kv, np.float32), p.idx,
                              p.lengths, p.sink, p.scale, 512, w_o, w_lse)
    for name, g, a, w in zip(("dq", "dkv", "dsink"), got, atomic, want):
        g = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, w) < 2e-2, (name, "vs oracle", rel_err(g, w))
        # Same products; only the fp32 summation order of dkv differs from the atomic kernel, so
        # after rounding to bf16 they differ by at most one bf16 step (plus fp32 reordering noise
        # where a sum cancels). A relative-to-max bound is not sound here: one bf16 step of an
        # element near the max is up to 2**-7 of it.
        a = np.asarray(a, np.float32)
        tol = _bf16_step(np.maximum(np.abs(g), np.abs(a))) + 1e-5 * np.max(np.abs(a))
        assert np.all(np.abs(g - a) <= tol), (name, "vs atomic", float(np.max(np.abs(g - a) - tol)))
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[0, 0], 0.0)  # dead row


@pytest.mark.parametrize("h", [16, 128])
def test_deterministic_backward_is_bitwise_reproducible(h):
    """10 runs of jax.grad with deterministic=True give bitwise identical dq, dkv and dsink, on a
    problem where every kv row collects hundreds of contributions (the atomic kernel's fp32 sums
    then depend on the order the atomics land in; printed for information)."""
    _kernel_or_skip(deterministic=True)
    rng = np.random.default_rng(h)
    b, t, d, s, k = 1, 1024, 576, 512, 640
    p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial")
    w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    q, kv, sink, fn = _grad_fn(p, jnp.bfloat16, "cute", w_o, w_lse, deterministic=True)
    first = [np.asarray(g) for g in fn(q, kv, sink)]
    for _ in range(9):
        for name, g0, g in zip(("dq", "dkv", "dsink"), first, fn(q, kv, sink)):
            np.testing.assert_array_equal(np.asarray(g), g0, err_msg=name)
    _, _, _, atomic_fn = _grad_fn(p, jnp.bfloat16, "cute", w_o, w_lse)
    atomic = [np.asarray(atomic_fn(q, kv, sink)[1]) for _ in range(3)]
    differs = any(not np.array_equal(a, atomic[0]) for a in atomic[1:])
    print(f"H={h}: atomic dkv differs between runs: {differs}")


def test_reference_backward_with_deterministic_is_bitwise_reproducible_on_gpu():
    """implementation="xla" promises the same: its dkv is an XLA scatter-add, which must not
    depend on the order of GPU atomics when deterministic=True."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no GPU")
    rng = np.random.default_rng(3)
    b, t, h, d, s, k = 1, 256, 16, 576, 128, 256
    p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial")
    w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
    w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
    q, kv, sink, fn = _grad_fn(p, jnp.bfloat16, "xla", w_o, w_lse, deterministic=True)
    first = [np.asarray(g) for g in fn(q, kv, sink)]
    for _ in range(4):
        for name, g0, g in zip(("dq", "dkv", "dsink"), first, fn(q, kv, sink)):
            np.testing.assert_array_equal(np.asarray(g), g0, err_msg=name)


@pytest.mark.parametrize("b,h,d,s1,k1,sinks",
                         [(1, 128, 576, 600, 128, "all"), (2, 64, 512, 600, 128, "all"),
                          (2, 100, 576, 600, 128, "all"), (1, 16, 512, 600, 128, "all"),
                          (1, 128, 512, 40000, 128, "all"), (1, 128, 576, 33000, 128, "all"),
                          (2, 128, 512, 600, 70, "some"), (2, 100, 576, 600, 1, "none")],
                         ids=["B1H128D576", "B2H64D512", "B2H100D576", "B1H16D512",
                              "B1H128D512S40000", "B1H128D576S33000", "B2H128D512K70",
                              "B2H100D576K1"])
def test_two_pools_on_the_kernels_match_the_oracle(b, h, d, s1, k1, sinks):
    """sparse_mla(..., extra_kv=, extra_idx=, extra_topk_length=) on the kernels: o, lse and the
    gradients of q, both pools and the sink against the float64 oracle on the concatenated
    pool (the window over a raw KV next to a top-k over a compressed KV). B1H128D576 and
    B2H100D576 run the two pools in one softmax (the two-pool backward kernel), B2H64D512
    combines one attention per pool, B1H16D512 runs grouped over the concatenation;
    B1H128D512S40000's and B1H128D576S33000's dkv outgrow the L2 (the two-pool `_long`
    builds). B2H128D512K70 and B2H100D576K1: pool 1's list not a multiple of 64 entries, a
    token with no valid entry in either list (a dead row), heads without a sink (-inf) beside
    heads with one, and no sink at all."""
    _kernel_or_skip()
    rng = np.random.default_rng(b * 1000 + h + d + k1)
    p1 = make_problem(rng, b, 8, h, d, s1, k1, sink=True, topk="partial")  # window
    if sinks == "some":
        p1.sink[::3] = -np.inf
    p2 = make_problem(rng, b, 8, h, d, 300, 640, topk="partial")  # compressed top-k
    p2.idx[0, 0, :] = -1  # with p1's token (0, 0), nothing to attend to: a dead row
    sink = None if sinks == "none" else jnp.asarray(p1.sink)
    q = jnp.asarray(p1.q, jnp.bfloat16)
    kv1, kv2 = jnp.asarray(p1.kv, jnp.bfloat16), jnp.asarray(p2.kv, jnp.bfloat16)
    s1 = p1.kv.shape[1]
    kv_cat, idx_cat = oracle.one_pool(kv1, p1.idx, p1.lengths, kv2, p2.idx, p2.lengths)
    full = np.full((b, 8), idx_cat.shape[2], np.int32)
    w_o = rng.standard_normal((b, 8, h, 512)).astype(np.float32)
    w_lse = rng.standard_normal((b, 8, h)).astype(np.float32)

    def loss(q, kv1, kv2, sink):
        o, lse = jax_dsa.sparse_mla(q, kv1, jnp.asarray(p1.idx), sink=sink,
                                    topk_length=jnp.asarray(p1.topk_length), return_lse=True,
                                    implementation="cute", extra_kv=kv2,
                                    extra_idx=jnp.asarray(p2.idx),
                                    extra_topk_length=jnp.asarray(p2.topk_length))
        return (jnp.sum(o.astype(jnp.float32) * w_o)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, kv1, kv2, sink)
    sink_np = None if sink is None else p1.sink
    o_ref, lse_ref = oracle.numpy_forward(np.asarray(q, np.float32), kv_cat, idx_cat, full,
                                          sink_np, p1.scale, 512)
    assert rel_err(np.asarray(o, np.float32), o_ref) < 1e-2
    dead = np.isneginf(lse_ref)
    assert dead[0, 0].all()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), dead)
    want = oracle.dense_grads(np.asarray(q, np.float32), kv_cat, idx_cat, full, sink_np,
                              p1.scale, 512, w_o, w_lse)
    want = [want[0], want[1][:, :s1], want[1][:, s1:]] + want[2:]
    assert grads[3] is None if sink is None else grads[3].shape == (h,)
    if sinks == "some":
        assert np.all(np.asarray(grads[3])[::3] == 0.0)  # no sink, no gradient
    for name, g, w in zip(("dq", "dkv", "dextra_kv", "dsink"), grads, want):
        g = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))
@pytest.mark.parametrize("h,d", [(128, 576), (64, 512)], ids=["H128D576", "H64D512"])
def test_two_pool_backward_reads_both_pools_in_place(h, d):
    """At a prefill shape (B 2, T 64) the gradients of a two-pool call come from the two-pool
    backward kernel, with no [B, S1 + S2, Dqk] copy of the pools in the program, and equal
    those of the one-pool kernels over the caller's concatenation."""
    _kernel_or_skip()
    from jax_dsa import _core
    rng = np.random.default_rng(h + d + 7)
    b, t = 2, 64
    p1 = make_problem(rng, b, t, h, d, 600, 128, sink=True, topk="partial")
    p2 = make_problem(rng, b, t, h, d, 300, 320, topk="partial")
    q = jnp.asarray(p1.q, jnp.bfloat16)
    kv1, kv2 = jnp.asarray(p1.kv, jnp.bfloat16), jnp.asarray(p2.kv, jnp.bfloat16)
    sink = jnp.asarray(p1.sink)
    lists = tuple(jnp.asarray(x) for x in (p1.idx, p1.topk_length, p2.idx, p2.topk_length))
    w_o = jnp.asarray(rng.standard_normal((b, t, h, 512)), jnp.float32)

    def two(q, kv1, kv2, sink):
        o = jax_dsa.sparse_mla(q, kv1, lists[0], sink=sink, topk_length=lists[1],
                               implementation="cute", extra_kv=kv2, extra_idx=lists[2],
                               extra_topk_length=lists[3])
        return jnp.sum(o.astype(jnp.float32) * w_o)

    def one(q, kv_c, sink, idx_c, len_c):
        o = jax_dsa.sparse_mla(q, kv_c, idx_c, sink=sink, topk_length=len_c,
                               implementation="cute")
        return jnp.sum(o.astype(jnp.float32) * w_o)

    grad_two = jax.jit(jax.grad(two, argnums=(0, 1, 2, 3)))
    text = grad_two.lower(q, kv1, kv2, sink).as_text()
    assert "jax_dsa_sparse_mla_bwd_two_pool_sm90" in text
    assert f"tensor<{b}x{p1.kv.shape[1] + p2.kv.shape[1]}x{d}xbf16>" not in text
    got = grad_two(q, kv1, kv2, sink)
    kv_c, idx_c, len_c = _core.one_pool(kv1, lists[0], lists[1], kv2, lists[2], lists[3])
    dq, dkv_c, dsink = jax.jit(jax.grad(one, argnums=(0, 1, 2)))(q, kv_c, sink, idx_c, len_c)
    s1 = p1.kv.shape[1]
    want = (dq, dkv_c[:, :s1], dkv_c[:, s1:], dsink)
    for name, g, w in zip(("dq", "dkv", "dextra_kv", "dsink"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, w) < 1e-2, (name, rel_err(g, w))


@pytest.mark.parametrize("h,d,s1", [(128, 576, 600), (64, 512, 600), (128, 512, 40000)],
                         ids=["H128D576", "H64D512", "H128D512S40000"])
def test_two_pools_rows_no_valid_entry_uses_may_hold_nan_on_the_kernels(h, d, s1):
    """As the one-pool test, with both pools: row 0 of each is named only by invalid slots and
    holds NaN (S1 = 40000: the two-pool `_long` build)."""
    _kernel_or_skip()
    rng = np.random.default_rng(h + d + s1)
    p1 = make_problem(rng, 1, 8, h, d, s1, 128, sink=True, topk="partial")
    p2 = make_problem(rng, 1, 8, h, d, 300, 640, topk="partial")
    for p in (p1, p2):
        p.idx[p.idx == 0] = 1
        p.idx[0, 1, 0], p.topk_length[0, 1] = 0, 0  # row 0: only past topk_length
    w_o = jnp.asarray(rng.standard_normal((1, 8, h, 512)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((1, 8, h)), jnp.float32)

    def run(kv1, kv2):
        def f(q, kv1, kv2, sink):
            o, lse = jax_dsa.sparse_mla(q, kv1, jnp.asarray(p1.idx), sink=sink,
                                        topk_length=jnp.asarray(p1.topk_length),
                                        extra_kv=kv2, extra_idx=jnp.asarray(p2.idx),
                                        extra_topk_length=jnp.asarray(p2.topk_length),
                                        return_lse=True, implementation="cute")
            loss = (jnp.sum(o.astype(jnp.float32) * w_o)
                    + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse))
            return loss, (o, lse)
        args = (jnp.asarray(p1.q, jnp.bfloat16), jnp.asarray(kv1, jnp.bfloat16),
                jnp.asarray(kv2, jnp.bfloat16), jnp.asarray(p1.sink))
        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(*args)
        return [np.asarray(x, np.float32) for x in (*out, *grads)]

    bad1, bad2 = p1.kv.copy(), p2.kv.copy()
    bad1[:, 0] = bad2[:, 0] = np.nan
    clean, bad = run(p1.kv, p2.kv), run(bad1, bad2)
    _assert_unread_rows_changed_nothing(("o", "lse", "dq", "dkv1", "dkv2", "dsink"), clean, bad)
    assert np.all(bad[3][:, 0] == 0) and np.all(bad[4][:, 0] == 0), "dkv of the unnamed rows"
