"""jax_dsa.cute.grouping: merged index lists of consecutive tokens.

Two properties: each token's multiset of valid rows is exactly the union entries carrying its bit;
and attention computed over a group's union (rows of all G tokens' heads at once, each masked to
its own token's entries) gives the reference's outputs and gradients, duplicates, invalid entries,
topk_length, dead rows and sinks included.
"""
import collections
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa.cute import BwdConfig, Config, config as kernel_config, constants, grouping
from jax_dsa.cute.grouping import MEMBER_SHIFT, group_lists
from cases import make_problem, rel_err


def _valid_rows(idx, lengths, s):
    return [int(r) for j, r in enumerate(idx) if j < lengths and 0 <= r < s]


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_union_entries_reproduce_every_tokens_list(group):
    rng = np.random.default_rng(group)
    b, t, k, s = 2, 16, 40, 50  # K close to S: many duplicates inside and across tokens
    p = make_problem(rng, b, t, 1, 8, s, k, topk="partial")
    rows, member, length = map(np.asarray, group_lists(
        jnp.asarray(p.idx), jnp.asarray(p.lengths), s, group))
    assert rows.shape == member.shape == (b, t // group, group * k)
    for bi in range(b):
        for gi in range(t // group):
            n = length[bi, gi]
            assert np.all(np.diff(rows[bi, gi, :n]) >= 0)
            assert np.all(rows[bi, gi, n:] == -1) and np.all(member[bi, gi, n:] == 0)
            assert np.all(member[bi, gi, :n] > 0) and np.all(member[bi, gi, :n] < 1 << group)
            for g in range(group):
                tok = gi * group + g
                want = collections.Counter(_valid_rows(p.idx[bi, tok], p.lengths[bi, tok], s))
                got = collections.Counter(
                    int(r) for r, m in zip(rows[bi, gi, :n], member[bi, gi, :n]) if m >> g & 1)
                assert got == want, (bi, tok)


def test_large_row_counts_take_the_two_key_sort_with_the_same_result():
    # (S + 1) * G beyond int32 cannot be one sort key; that path must give the same union.
    rng = np.random.default_rng(7)
    p = make_problem(rng, 1, 16, 1, 8, 50, 40, topk="partial")
    idx = jnp.asarray(p.idx)
    lengths = jnp.asarray(p.lengths)
    small = group_lists(idx, lengths, 50, 8)
    idx_big = jnp.where((idx >= 50) | (idx < 0), -1, idx)  # the same valid entries under S = 2^29
    big = group_lists(idx_big, lengths, 1 << 29, 8)
    for a, b in zip(small, big):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_group_lists_rejects_bad_groups():
    idx = jnp.zeros((1, 6, 3), jnp.int32)
    tl = jnp.full((1, 6), 3, jnp.int32)
    with pytest.raises(ValueError, match="multiple of group"):
        group_lists(idx, tl, 10, 4)
    with pytest.raises(ValueError, match="group must be in 1..31"):
        group_lists(idx, tl, 10, 0)


def _grouped_attention(q, kv, rows, member, length, sink, scale, d_v):
    """Dense fp32 attention over each group's union: q [B, T, H, D] viewed as [B, T/G, G*H, D];
    head row r of a group belongs to token r // H and sees only the entries with that bit."""
    b, t, h, d = q.shape
    n, u = rows.shape[1], rows.shape[2]
    group = t // n
    qg = q.reshape(b, n, group * h, d)
    used = jnp.arange(u)[None, None, :] < length[..., None]
    kv_u = jax.vmap(lambda x, i: x[jnp.where(i >= 0, i, 0)])(kv, rows)  # [B, n, U, D]
    token = jnp.arange(group * h) // h
    sees = used[:, :, None, :] & ((member[:, :, None, :] >> token[None, None, :, None]) & 1 > 0)
    s = jnp.einsum("bnrd,bnud->bnru", qg, kv_u, precision="highest") * scale
    s = jnp.where(sees, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m[..., None])
    l = jnp.sum(e, axis=-1)
    sink_r = jnp.tile(sink, group)[None, None, :]
    o = jnp.einsum("bnru,bnud->bnrd", e, kv_u[..., :d_v], precision="highest")
    o = o / (l + jnp.exp(sink_r - m))[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.reshape(b, t, h, d_v), lse.reshape(b, t, h)


@pytest.mark.parametrize("h,group", [(4, 4), (2, 8), (8, 2)])
def test_attention_over_the_union_matches_the_reference(h, group):
    rng = np.random.default_rng(100 + h)
    b, t, d, s, k = 2, 8, 16, 24, 12
    p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial", d_v=12)
    q, kv, sink = jnp.asarray(p.q), jnp.asarray(p.kv), jnp.asarray(p.sink)
    idx, tl = jnp.asarray(p.idx), jnp.asarray(p.lengths)
    rows, member, length = group_lists(idx, tl, s, group)
    w_o = jnp.asarray(rng.standard_normal((b, t, h, p.d_v)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)

    def loss(o, lse):
        return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    def reference(q, kv, sink):
        return jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=p.d_v,
                                  return_lse=True, implementation="xla")

    def grouped(q, kv, sink):
        return _grouped_attention(q, kv, rows, member, length, sink, p.scale, p.d_v)

    (o_r, lse_r), (o_g, lse_g) = reference(q, kv, sink), grouped(q, kv, sink)
    assert rel_err(o_g, o_r) < 1e-5
    np.testing.assert_array_equal(np.isfinite(lse_g), np.isfinite(lse_r))
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
    assert rel_err(finite(lse_g), finite(lse_r)) < 1e-5
    grads_r = jax.grad(lambda *a: loss(*reference(*a)), argnums=(0, 1, 2))(q, kv, sink)
    grads_g = jax.grad(lambda *a: loss(*grouped(*a)), argnums=(0, 1, 2))(q, kv, sink)
    for name, g, r in zip(("dq", "dkv", "dsink"), grads_g, grads_r):
        assert rel_err(g, r) < 1e-4, (name, rel_err(g, r))


# (H, T, K, S, deterministic) -> the group jax_dsa.cute.select picks
BACKWARD_GROUP_CASES = [
    (16, 4096, 640, 4096, False, 4),
    (8, 4096, 640, 4096, False, 8),
    (8, 16, 768, 4096, False, 8),      # G * K = 6144: the union kernel's capacity
    (8, 16, 769, 4096, False, 1),      # beyond it: the plain kernel
    (16, 4096, 2048, 4096, False, 1),
    (16, 4098, 640, 4096, False, 1),   # T not a multiple of 4
    (16, 4096, 640, 4096, True, 1),    # deterministic
    (16, 4096, 640, 1 << 23, False, 1),  # S too large for the membership bits
    (32, 4096, 640, 4096, False, 2),
    (32, 4096, 3072, 4096, False, 2),   # G * K = 6144
    (32, 4096, 3073, 4096, False, 1),
    (32, 4097, 640, 4096, False, 1),   # T odd
    (32, 4096, 640, 4096, True, 1),    # deterministic
    (24, 4096, 640, 4096, False, 1),   # 64 / H not a whole number of tokens
    (64, 4096, 640, 4096, False, 1),
    (4, 4096, 640, 4096, False, 1),
]


@pytest.mark.parametrize("case", BACKWARD_GROUP_CASES, ids=str)
def test_backward_group_choice(case):
    """Which calls the backward runs grouped by default (jax_dsa.cute.select)."""
    h, t, k, s, deterministic, want = case
    cfg = kernel_config.select((1, t, h, 576), k, s, deterministic=deterministic)
    assert cfg.bwd.group == want
    assert cfg.fwd.kernel == ("small_heads" if h <= 32 else "pingpong")
    # Resolving None fields gives the same choice; a pinned valid choice is kept.
    assert kernel_config.resolve(None, (1, t, h, 576), k, s, deterministic) == cfg
    pinned = Config(bwd=BwdConfig(group=1))
    assert kernel_config.resolve(pinned, (1, t, h, 576), k, s, deterministic).bwd.group == 1


@pytest.mark.parametrize("bwd,h,t,k,s,deterministic,match", [
    (BwdConfig(group=4), 8, 8, 4, 32, False, "H \\* 4 = 64"),
    (BwdConfig(group=4), 16, 6, 4, 32, False, "T a multiple"),
    (BwdConfig(group=4), 16, 8, 4, 32, True, "deterministic"),
    (BwdConfig(group=4), 16, 8, 2048, 32, False, "union='xla'"),
])
def test_pinned_backward_config_that_cannot_run_raises(bwd, h, t, k, s, deterministic, match):
    with pytest.raises(ValueError, match=match):
        kernel_config.resolve(Config(bwd=bwd), (1, t, h, 576), k, s, deterministic)
    # The XLA union has no capacity limit.
    if k > constants.UNION_CAPACITY // 4:
        kernel_config.resolve(Config(bwd=BwdConfig(group=4, union="xla")), (1, t, h, 576), k, s,
                              deterministic)


@pytest.mark.parametrize("b,h,d,k,s,deterministic,want", [
    (1, 64, 512, 640, 65536, False, True),    # dkv 128 MB: past the L2
    (1, 128, 576, 2048, 131072, False, True),
    (4, 128, 512, 1152, 8192, False, True),   # the batch's dkv together: 64 MB
    (1, 128, 576, 2048, 8192, False, False),  # 18 MB: in the L2
    (1, 64, 512, 640, 65536, True, False),    # deterministic: entries sorted its own way
    (1, 16, 512, 640, 65536, False, False),   # grouped
])
def test_backward_sorts_rows_where_dkv_outgrows_the_l2(b, h, d, k, s, deterministic, want):
    cfg = kernel_config.select((b, 4096, h, d), k, s, deterministic=deterministic)
    assert cfg.bwd.sort_rows == want
    assert kernel_config.resolve(None, (b, 4096, h, d), k, s, deterministic) == cfg


def test_rows_ascending_keeps_the_valid_rows():
    """kernel.rows_ascending (BwdConfig.sort_rows): per token the valid rows (0 <= row < S,
    slot < topk_length) in ascending order, duplicates kept, then S for the rest, and their
    count as the new length."""
    from jax_dsa.cute.kernel import rows_ascending
    rng = np.random.default_rng()
    b, t, k, s = 2, 9, 37, 20
    idx = rng.integers(-5, s + 5, (b, t, k)).astype(np.int32)
    lengths = rng.integers(0, k + 3, (b, t)).astype(np.int32)
    lengths[0, 0] = 0
    rows, count = (np.asarray(x) for x in rows_ascending(jnp.asarray(idx), jnp.asarray(lengths), s))
    for i in range(b):
        for j in range(t):
            head = idx[i, j, :lengths[i, j]]
            want = np.sort(head[(head >= 0) & (head < s)])
            assert count[i, j] == want.size
            np.testing.assert_array_equal(rows[i, j, :want.size], want)
            assert np.all(rows[i, j, want.size:] == s)


def test_config_fields_are_checked():
    from jax_dsa.cute import FwdConfig
    with pytest.raises(ValueError, match="FwdConfig.kernel"):
        FwdConfig("ws2")
    with pytest.raises(ValueError, match="BwdConfig.group"):
        BwdConfig(group=3)
    with pytest.raises(ValueError, match="BwdConfig.union"):
        BwdConfig(union="cpu")
    with pytest.raises(TypeError, match="BwdConfig.sort_rows"):
        BwdConfig(sort_rows=1)
    with pytest.raises(ValueError, match="BwdConfig.sort_rows"):
        BwdConfig(group=4, sort_rows=True)
    with pytest.raises(TypeError, match="Config.bwd"):
        Config(bwd=FwdConfig())
    with pytest.raises(TypeError, match="config must be"):
        jax_dsa.sparse_mla(jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 3, 8)),
                           jnp.zeros((1, 2, 1), jnp.int32), d_v=8, config="pingpong")


def test_constants_reach_the_kernels_and_handlers_from_one_place():
    """The kernels and handlers take the shared constants from jax_dsa/cute/constants.py (the
    build generates jax_dsa_constants.h): no copy of them in the sources (read as text: no GPU
    or CuTe DSL needed)."""
    import re
    root = os.path.join(os.path.dirname(__file__), "..", "ffi")
    union = open(os.path.join(root, "kernels", "sm90", "group_union.py")).read()
    assert re.search(r"^from jax_dsa.cute.constants import MEMBER_SHIFT", union, re.M)
    assert not re.search(r"^(CAPACITY|TABLES|MEMBER_SHIFT) = ", union, re.M)
    for cc in ("group_union.cc", "sparse_mla_bwd.cc", "sparse_mla_fwd.cc", "common.h"):
        text = open(os.path.join(root, cc)).read()
        assert not re.search(r"constexpr int64_t k(UnionCapacity|UnionTables|MemberShift|DV)\b",
                             text), cc
    assert constants.UNION_CAPACITY == 3 * max(constants.UNION_TABLES) // 4
    assert constants.GROUPS == (2, 4, 8) and 31 - constants.MEMBER_SHIFT >= max(constants.GROUPS)


def _grouped_kernel_emulator(q, kv, entries, length, lse, do, o, coef, scale, group):
    """What the grouped backward kernel (`group=4`, H' = 64 rows of 4 tokens x 16 heads)
    computes, in dense fp32: entry j of a group is row entry & (2^23 - 1), seen by head row i when
    bit 23 + i // 16 is set; the rest as jax_dsa.cute.ffi.sparse_mla_bwd documents."""
    assert group == 4
    b, n, rows_h, d = q.shape
    s_rows = kv.shape[1]
    u = entries.shape[2]
    row = entries & ((1 << MEMBER_SHIFT) - 1)
    ok = (entries >= 0) & (row < s_rows) & (jnp.arange(u)[None, None, :] < length[..., None])
    tok = jnp.arange(rows_h) // (rows_h // 4)
    bit = (entries[:, :, None, :] >> (MEMBER_SHIFT + tok[None, None, :, None])) & 1
    sees = ok[:, :, None, :] & (bit > 0)
    kv_u = jax.vmap(lambda x, i: x[i])(kv, jnp.where(ok, row, 0)).astype(jnp.float32)
    q32, do32, o32 = (x.astype(jnp.float32) for x in (q, do, o))
    s = jnp.einsum("bnhd,bnud->bnhu", q32, kv_u, precision="highest") * scale
    live = jnp.isfinite(lse)
    p = jnp.where(sees & live[..., None], jnp.exp(s - jnp.where(live, lse, 0.0)[..., None]), 0.0)
    delta = jnp.sum(do32 * o32, axis=-1)
    c, dlse = coef[..., 0], coef[..., 1]
    dp = jnp.einsum("bnhd,bnud->bnhu", do32, kv_u[..., :512], precision="highest")
    ds = p * (c[..., None] * dp - (c * delta - dlse)[..., None])
    dq = scale * jnp.einsum("bnhu,bnud->bnhd", ds, kv_u, precision="highest")
    drow = scale * jnp.einsum("bnhu,bnhd->bnud", ds, q32, precision="highest")
    dv = jnp.einsum("bnhu,bnhd->bnud", c[..., None] * p, do32, precision="highest")
    drow = drow.at[..., :512].add(dv)
    target = jnp.where(ok, row, s_rows).reshape(b, n * u)
    dkv = jax.vmap(lambda t, r: jnp.zeros((s_rows + 1, d), jnp.float32).at[t].add(r)[:s_rows])(
        target, drow.reshape(b, n * u, d))
    return dq.astype(q.dtype), dkv, delta


def _union_kernel_emulator(idx, topk_length, num_kv_rows, group):
    """jax_dsa.cute.ffi.group_union's contract without a GPU: the packed union entries and lengths, each
    group's valid entries in another order (the kernel emits them in hash-slot order)."""
    rows, member, length = grouping.group_lists(idx, topk_length, num_kv_rows, group)
    packed = grouping.pack_entries(rows, member)
    width = packed.shape[-1]
    pos = jnp.arange(width, dtype=jnp.int32)
    # Reverse the first `length` entries of each group; the -1 padding stays at the end.
    src = jnp.where(pos < length[..., None], length[..., None] - 1 - pos, pos)
    return jnp.take_along_axis(packed, src, axis=-1), length


@pytest.mark.parametrize("union", ["xla", "kernel"])
def test_grouped_backward_plumbing_matches_the_reference(monkeypatch, union):
    """jax_dsa.cute.kernel's grouped path (views, packed entries, union lengths, delta and dsink)
    with the kernel replaced by _grouped_kernel_emulator, and the list union taken from XLA or
    from the union kernel (emulated), gives the reference backward's gradients."""
    from jax_dsa import reference
    from jax_dsa.cute import ffi, kernel
    rng = np.random.default_rng(7)
    b, t, h, d, s, k = 2, 8, 16, 576, 40, 24
    p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial")
    q, kv, sink = jnp.asarray(p.q), jnp.asarray(p.kv), jnp.asarray(p.sink)
    idx, tl = jnp.asarray(p.idx), jnp.asarray(p.lengths)
    o, lse = reference.forward(q, kv, idx, tl, sink, scale=p.scale, d_v=512)
    do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    want = reference.backward(q, kv, idx, tl, sink, o, lse, do, dlse, scale=p.scale, d_v=512)
    cfg = kernel_config.resolve(Config(bwd=BwdConfig(group=4, union=union)), q.shape, k, s, False)
    monkeypatch.setattr(ffi, "sparse_mla_bwd", _grouped_kernel_emulator)
    monkeypatch.setattr(ffi, "group_union", _union_kernel_emulator)
    got = kernel.backward(q, kv, idx, tl, sink, o, lse, do, dlse, scale=p.scale, config=cfg,
                          deterministic=False)
    for name, g, w in zip(("dq", "dkv", "dsink"), got, want):
        assert rel_err(g, w) < 1e-4, (name, rel_err(g, w))


def test_forward_splits_the_lists_only_when_the_tokens_leave_the_gpu_empty():
    from jax_dsa.cute import FwdConfig
    sel = kernel_config.select_fwd
    assert sel((8, 1, 128, 576), 2048) == FwdConfig("pingpong", 8)  # 16 CTAs -> 128
    assert sel((1, 64, 128, 576), 2048).splits == 1  # 128 CTAs fill the GPU
    assert sel((1, 4096, 128, 576), 2048).splits == 1
    assert sel((1, 32, 128, 576), 2048).splits == 2
    assert sel((2, 1, 16, 512), 640) == FwdConfig("small_heads", 2)  # K / 256 parts at most
    assert sel((1, 8, 64, 512), 200).splits == 1  # too few entries to split
    for shape, k in [((8, 1, 128, 576), 2048), ((3, 5, 40, 512), 5000), ((1, 1, 1, 512), 1)]:
        cfg = sel(shape, k)
        ctas = shape[0] * shape[1] * (1 if shape[2] <= 32 else -(-shape[2] // 64))
        assert cfg.splits == 1 or (ctas * cfg.splits <= kernel_config.SPLIT_TARGET_CTAS
                                   and k // cfg.splits >= kernel_config.SPLIT_MIN_ENTRIES)
    with pytest.raises(ValueError, match="FwdConfig.splits"):
        FwdConfig(splits=0)
    with pytest.raises(ValueError, match="FwdConfig.splits"):
        FwdConfig(splits=True)


@pytest.mark.parametrize("call,error,match", [
    (lambda: BwdConfig(group=4.0), ValueError, "BwdConfig.group"),
    (lambda: BwdConfig(group=True), ValueError, "BwdConfig.group"),
    (lambda: kernel_config.select((4096, 16, 576), 640, 65536), ValueError, "q_shape"),
    (lambda: kernel_config.select((1, 4096, 16, 576), 640, 65536, deterministic="no"),
     TypeError, "deterministic"),
])
def test_config_and_select_refuse_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
