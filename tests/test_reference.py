"""The pure-JAX implementation (implementation="xla") against the float64 oracles."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import zlib

import numpy as np
import pytest

import jax_dsa
from jax_dsa import reference
from cases import make_problem, rel_err
import oracle

# (B, T, H, Dqk, S, K, sink, topk_length): every H, Dqk, K and B of the matrix appears.
CASES = [
    (1, 4, 1, 512, 50, 1, False, "none"),
    (3, 3, 3, 576, 80, 63, True, "partial"),
    (1, 2, 16, 512, 700, 640, True, "full"),
    (2, 2, 64, 576, 300, 63, False, "partial"),
    (1, 3, 100, 512, 90, 63, True, "none"),
    (1, 3, 128, 576, 700, 640, True, "partial"),
    (3, 2, 128, 512, 40, 1, False, "full"),
]


def _run(p, **kw):
    return jax_dsa.sparse_mla(p.q, p.kv, p.idx, sink=p.sink, topk_length=p.topk_length,
                              d_v=p.d_v, return_lse=True, implementation="xla", **kw)


def _loss_weights(rng, p):
    b, t, h, _ = p.q.shape
    return (rng.standard_normal((b, t, h, p.d_v)).astype(np.float32),
            rng.standard_normal((b, t, h)).astype(np.float32))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}{}-{}".format(
    *c[:6], "-sink" if c[6] else "", c[7]))
def test_forward_and_grads_fp32_match_float64_oracle(case):
    b, t, h, d, s, k, sink, topk = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    p = make_problem(rng, b, t, h, d, s, k, sink=sink, topk=topk)
    o, lse = _run(p)
    o_ref, lse_ref = oracle.numpy_forward(p.q, p.kv, p.idx, p.lengths, p.sink, p.scale, p.d_v)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert o.shape == (b, t, h, p.d_v) and lse.shape == (b, t, h)
    assert rel_err(o, o_ref) < 1e-5
    dead = np.isneginf(lse_ref)
    assert dead[0, 0].all(), "the problem has a dead row"
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), dead)
    assert rel_err(np.asarray(lse)[~dead], lse_ref[~dead]) < 1e-5
    np.testing.assert_array_equal(np.asarray(o)[dead], 0.0)

    w_o, w_lse = _loss_weights(rng, p)

    def loss(q, kv, sink_):
        o, lse = jax_dsa.sparse_mla(q, kv, p.idx, sink=sink_, topk_length=p.topk_length,
                                    d_v=p.d_v, return_lse=True, implementation="xla")
        return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    argnums = (0, 1, 2) if sink else (0, 1)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(p.q, p.kv, p.sink)
    want = oracle.dense_grads(p.q, p.kv, p.idx, p.lengths, p.sink, p.scale, p.d_v, w_o, w_lse)
    for name, g, w in zip(("dq", "dkv", "dsink"), grads, want):
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, w) < 1e-5, (name, rel_err(g, w))
    dq = np.asarray(grads[0])
    np.testing.assert_array_equal(dq[0, 0], 0.0)  # the dead row gets no gradient


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_oracle(dtype):
    rng = np.random.default_rng(7)
    p = make_problem(rng, 2, 3, 16, 576, 200, 63, sink=True, topk="partial")
    q, kv = jnp.asarray(p.q, dtype), jnp.asarray(p.kv, dtype)
    o, lse = jax_dsa.sparse_mla(q, kv, p.idx, sink=p.sink, topk_length=p.topk_length,
                                return_lse=True, implementation="xla")
    assert o.dtype == dtype
    o_ref, lse_ref = oracle.numpy_forward(np.asarray(q, np.float32), np.asarray(kv, np.float32),
                                          p.idx, p.lengths, p.sink, p.scale, 512)
    assert rel_err(o, o_ref) < 1e-2
    live = np.isfinite(lse_ref)
    assert rel_err(np.asarray(lse)[live], lse_ref[live]) < 1e-3

    w_o, w_lse = _loss_weights(rng, p)
    grads = jax.grad(lambda q, kv, s: jnp.sum(jax_dsa.sparse_mla(
        q, kv, p.idx, sink=s, topk_length=p.topk_length, implementation="xla")
        .astype(jnp.float32) * w_o), argnums=(0, 1, 2))(q, kv, p.sink)
    want = oracle.dense_grads(np.asarray(q, np.float32), np.asarray(kv, np.float32), p.idx,
                              p.lengths, p.sink, p.scale, 512, w_o, np.zeros_like(w_lse))
    assert grads[0].dtype == dtype and grads[1].dtype == dtype and grads[2].dtype == jnp.float32
    for g, w in zip(grads, want):
        assert rel_err(g, w) < 2e-2


def test_reference_chunking_is_exact():
    """Chunks of 2 tokens over T=5 (so the last chunk is padded) give the unchunked answer."""
    rng = np.random.default_rng(3)
    p = make_problem(rng, 2, 5, 4, 64, 30, 9, sink=True, topk="partial", d_v=48)
    args = (p.q, p.kv, p.idx, p.lengths, p.sink)
    o1, l1 = reference.forward(*args, scale=p.scale, d_v=p.d_v, chunk=2)
    o2, l2 = reference.forward(*args, scale=p.scale, d_v=p.d_v, chunk=5)
    np.testing.assert_allclose(o1, o2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    do = rng.standard_normal(o1.shape).astype(np.float32)
    dl = rng.standard_normal(l1.shape).astype(np.float32)
    g1 = reference.backward(*args, o1, l1, do, dl, scale=p.scale, d_v=p.d_v, chunk=2)
    g2 = reference.backward(*args, o2, l2, do, dl, scale=p.scale, d_v=p.d_v, chunk=5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_chunk_size_bounds_memory():
    # One chunk's gather and scores stay within the element budget, whatever T is.
    for t in (1, 4096, 1 << 20):
        c = reference.chunk_tokens(t, 2048, 576, 128)
        assert 1 <= c <= t and c * 2048 * (576 + 128) <= reference._CHUNK_ELEMENTS


def test_dead_rows_zero_output_and_gradients_with_and_without_sink():
    rng = np.random.default_rng(11)
    for sink in (False, True):
        p = make_problem(rng, 1, 3, 4, 32, 10, 5, sink=sink, topk="partial", d_v=16)
        p.idx[0, 1] = np.array([-1, 10, 11, -5, 99], np.int32)  # every entry invalid
        p.topk_length[0, 2] = 0                                   # nothing selected
        o, lse = _run(p)
        assert np.all(np.asarray(o)[0, 1:] == 0) and np.all(np.isneginf(np.asarray(lse)[0, 1:]))
        grads = jax.grad(lambda q, kv, s: jnp.sum(jax_dsa.sparse_mla(
            q, kv, p.idx, sink=s, topk_length=p.topk_length, d_v=16, return_lse=True,
            implementation="xla")[0]), argnums=(0, 1, 2) if sink else (0, 1))(p.q, p.kv, p.sink)
        for g in grads:
            assert np.all(np.isfinite(g))
        assert np.all(np.asarray(grads[0])[0, 1:] == 0)


def test_jax_grad_agrees_with_autodiff_of_naive_dense_formulation():
    """Same check in float32 JAX: the custom_vjp against jax.grad of a dense masked softmax."""
    rng = np.random.default_rng(5)
    p = make_problem(rng, 2, 4, 6, 40, 25, 12, sink=True, topk="partial", d_v=32)
    counts = jnp.asarray(oracle.multiplicity(p.idx, p.lengths, 25), jnp.float32)
    w_o = rng.standard_normal((2, 4, 6, 32)).astype(np.float32)

    def naive(q, kv, sink):
        return jnp.sum(oracle.dense_forward(q, kv, counts, sink, p.scale, 32)[0] * w_o)

    def ours(q, kv, sink):
        return jnp.sum(_run(dataclasses.replace(p, q=q, kv=kv, sink=sink))[0] * w_o)

    g_naive = jax.grad(naive, argnums=(0, 1, 2))(p.q, p.kv, p.sink)
    g_ours = jax.grad(ours, argnums=(0, 1, 2))(p.q, p.kv, p.sink)
    for a, b in zip(g_ours, g_naive):
        assert rel_err(a, b) < 1e-5


def test_three_dim_layout_equals_batch_of_one():
    rng = np.random.default_rng(9)
    p = make_problem(rng, 1, 4, 3, 32, 20, 6, sink=True, topk="partial", d_v=16)
    o4, l4 = _run(p)
    o3, l3 = jax_dsa.sparse_mla(p.q[0], p.kv[0], p.idx[0], sink=p.sink,
                                topk_length=p.topk_length[0], d_v=16, return_lse=True)
    np.testing.assert_array_equal(o3, o4[0])
    np.testing.assert_array_equal(l3, l4[0])
    assert jax_dsa.sparse_mla(p.q[0], p.kv[0], p.idx[0], d_v=16).shape == (4, 3, 16)


def test_jit_vmap_checkpoint():
    rng = np.random.default_rng(13)
    n = 3
    ps = [make_problem(rng, 2, 3, 4, 32, 20, 6, sink=True, topk="partial", d_v=16)
          for _ in range(n)]
    q = np.stack([p.q for p in ps]); kv = np.stack([p.kv for p in ps])
    # jnp arrays: jax itself rejects NumPy arrays vmapped into a custom_vjp under checkpoint.
    idx = jnp.asarray(np.stack([p.idx for p in ps]))
    tl = jnp.asarray(np.stack([p.topk_length for p in ps]))
    sink = ps[0].sink

    def f(q, kv, idx, tl, sink):
        return jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=16, return_lse=True)

    o_v, l_v = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None)))(q, kv, idx, tl, sink)
    for i in range(n):
        o_i, l_i = f(q[i], kv[i], idx[i], tl[i], sink)
        np.testing.assert_allclose(o_v[i], o_i, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(l_v[i], l_i, rtol=1e-6)

    # vmap with kv shared across the mapped axis, and the sink mapped too.
    sinks = np.stack([p.sink for p in ps])
    o_s = jax.vmap(f, in_axes=(0, None, 0, 0, 0))(q, kv[0], idx, tl, sinks)[0]
    np.testing.assert_allclose(o_s[2], f(q[2], kv[0], idx[2], tl[2], sinks[2])[0],
                               rtol=1e-6, atol=1e-6)

    def loss(q, kv, sink):
        return jnp.sum(jax.vmap(f, in_axes=(0, 0, 0, 0, None))(q, kv, idx, tl, sink)[0] ** 2)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, sink)
    g_ckpt = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, kv, sink)
    g_loop = [jax.grad(lambda q_, kv_, s_: jnp.sum(f(q_, kv_, idx[i], tl[i], s_)[0] ** 2),
                       argnums=(0, 1, 2))(q[i], kv[i], sink) for i in range(n)]
    for a, b in zip(g, g_ckpt):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[0][1], g_loop[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[1][2], g_loop[2][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[2], sum(gl[2] for gl in g_loop), rtol=1e-5, atol=1e-5)


def test_nested_vmap_and_per_example_jacobian():
    """Two vmapped axes fold into B like one; vmap(jacrev) gives each example's own Jacobian."""
    rng = np.random.default_rng(17)
    ps = [make_problem(rng, 1, 3, 2, 16, 9, 4, sink=True, topk="partial", d_v=8)
          for _ in range(6)]
    q = jnp.asarray(np.stack([p.q[0] for p in ps]).reshape(2, 3, 3, 2, 16))
    kv = jnp.asarray(np.stack([p.kv[0] for p in ps]).reshape(2, 3, 9, 16))
    idx = jnp.asarray(np.stack([p.idx[0] for p in ps]).reshape(2, 3, 3, 4))
    tl = jnp.asarray(np.stack([p.topk_length[0] for p in ps]).reshape(2, 3, 3))
    sink = ps[0].sink

    def f(q, kv, idx, tl):
        return jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=8)

    got = jax.jit(jax.vmap(jax.vmap(f)))(q, kv, idx, tl)
    for i in range(2):
        for j in range(3):
            want = f(q[i, j], kv[i, j], idx[i, j], tl[i, j])
            np.testing.assert_allclose(got[i, j], want, rtol=1e-6, atol=1e-6)

    def total(q, kv, idx, tl):
        return jnp.sum(f(q, kv, idx, tl) ** 2)

    jac = jax.vmap(jax.jacrev(total, argnums=(0, 1)))(q[0], kv[0], idx[0], tl[0])
    for j in range(3):
        want = jax.grad(total, argnums=(0, 1))(q[0, j], kv[0, j], idx[0, j], tl[0, j])
        np.testing.assert_allclose(jac[0][j], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(jac[1][j], want[1], rtol=1e-5, atol=1e-6)


def test_deterministic_reference_backward_matches_the_scatter():
    """The in-order dkv sum (sort + segmented scan) equals the plain scatter-add up to fp32
    rounding, with duplicates, invalid entries and topk_length."""
    from jax_dsa import reference
    rng = np.random.default_rng(11)
    b, t, h, d, s, k = 2, 6, 3, 64, 9, 20
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(-2, s + 2, (b, t, k)), jnp.int32)
    tl = jnp.asarray(rng.integers(0, k + 1, (b, t)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    o, lse = reference.forward(q, kv, idx, tl, sink, scale=0.1, d_v=32)
    do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    args = (q, kv, idx, tl, sink, o, lse, do, dlse)
    plain = reference.backward(*args, scale=0.1, d_v=32, chunk=4)
    ordered = reference.backward(*args, scale=0.1, d_v=32, chunk=4, deterministic=True)
    for a, b_ in zip(plain, ordered):
        np.testing.assert_allclose(np.asarray(b_), np.asarray(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits,k,topk", [(2, 64, "partial"), (3, 100, "none"), (8, 640, "full"),
                                           (5, 7, "partial")])
def test_split_forward_equals_the_whole_list(splits, k, topk):
    """The decode path's arithmetic (reference.split_forward / combine_partials): a list run as
    `splits` parts (ragged last part, parts beyond topk_length dead, a dead token, invalid
    entries, a sink) and combined by lse gives the float64 oracle's o and lse."""
    p = make_problem(np.random.default_rng(1000 * splits + k), 2, 3, 4, 576, 200, k, sink=True,
                     topk=topk)
    part = functools.partial(reference.forward, scale=p.scale, d_v=p.d_v)
    o, lse = jax.jit(functools.partial(reference.split_forward, part, splits=splits))(
        p.q, p.kv, p.idx, p.lengths, jnp.asarray(p.sink))
    o_ref, lse_ref = oracle.numpy_forward(p.q, p.kv, p.idx, p.lengths, p.sink, p.scale, p.d_v)
    dead = np.isneginf(lse_ref)
    assert dead[0, 0].all()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), dead)
    assert rel_err(o, o_ref) < 1e-5
    np.testing.assert_allclose(np.asarray(lse)[~dead], lse_ref[~dead], rtol=1e-5, atol=1e-5)


def test_combine_partials_sink_only_dead_and_nan():
    """Every part dead: o = 0, lse = -inf (with or without a sink); a NaN sink gives NaN."""
    o_parts = jnp.ones((2, 3, 4, 8))  # [T, n, H, d_v]
    lse_parts = jnp.full((2, 3, 4), -jnp.inf)
    sink = jnp.array([0.5, -jnp.inf, 1.0, jnp.nan])
    o, lse = reference.combine_partials(o_parts, lse_parts, sink, axis=1)
    assert np.all(np.asarray(o)[:, :3] == 0.0) and np.all(np.isneginf(np.asarray(lse)[:, :3]))
    assert np.all(np.isnan(np.asarray(o)[:, 3]))
    lse_parts = lse_parts.at[:, 1].set(0.0)  # one live part of weight e^0 = 1
    o, lse = reference.combine_partials(o_parts, lse_parts, sink, axis=1)
    np.testing.assert_allclose(np.asarray(o)[:, 0], 1.0 / (1.0 + np.exp(0.5)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(o)[:, 1], 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse)[:, :3], 0.0, atol=1e-7)


@pytest.mark.parametrize("concatenate", [False, True], ids=["combined", "concatenated"])
@pytest.mark.parametrize("sink,topk", [(True, "partial"), (False, "none"), (True, "full")])
def test_two_pools_equal_one_pool_over_both(sink, topk, concatenate, monkeypatch):
    """extra_kv / extra_idx / extra_topk_length, in both forms (one call per pool combined by
    lse, and one call over the pools concatenated inside the op): o, lse and every gradient
    (q, both pools, sink) as the float64 oracle gives them on the concatenated pool; a token
    dead in both pools gets o = 0 and no gradient."""
    from jax_dsa import api
    monkeypatch.setattr(api, "_concatenate_pools", lambda *a: concatenate)
    jax.clear_caches()
    rng = np.random.default_rng(31 + len(topk) + sink)
    p1 = make_problem(rng, 2, 3, 4, 576, 50, 20, sink=sink, topk=topk)
    p2 = make_problem(rng, 2, 3, 4, 576, 30, 9, topk="partial")
    p2.q = p1.q
    kv_cat, idx_cat = oracle.one_pool(p1.kv, p1.idx, p1.lengths, p2.kv, p2.idx, p2.lengths)
    full = np.full(idx_cat.shape[:2], idx_cat.shape[2], np.int32)
    o_ref, lse_ref = oracle.numpy_forward(p1.q, kv_cat, idx_cat, full, p1.sink, p1.scale, 512)

    def call(q, kv, kv2, sink_):
        return jax_dsa.sparse_mla(q, kv, p1.idx, sink=sink_, topk_length=p1.topk_length,
                                  return_lse=True, implementation="xla", extra_kv=kv2,
                                  extra_idx=p2.idx, extra_topk_length=p2.topk_length)

    o, lse = call(p1.q, p1.kv, p2.kv, p1.sink)
    assert rel_err(o, o_ref) < 1e-5
    dead = np.isneginf(lse_ref)
    assert dead[0, 0].all()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), dead)
    np.testing.assert_allclose(np.asarray(lse)[~dead], lse_ref[~dead], rtol=1e-5, atol=1e-5)

    w_o, w_lse = _loss_weights(rng, p1)

    def loss(q, kv, kv2, sink_):
        o, lse = call(q, kv, kv2, sink_)
        return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    argnums = (0, 1, 2, 3) if sink else (0, 1, 2)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(p1.q, p1.kv, p2.kv, p1.sink)
    want = oracle.dense_grads(p1.q, kv_cat, idx_cat, full, p1.sink, p1.scale, 512, w_o, w_lse)
    s1 = p1.kv.shape[1]
    want = [want[0], want[1][:, :s1], want[1][:, s1:]] + want[2:]
    for name, g, w in zip(("dq", "dkv", "dextra_kv", "dsink"), grads, want):
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, w) < 1e-5, (name, rel_err(g, w))
    np.testing.assert_array_equal(np.asarray(grads[0])[0, 0], 0.0)


def test_two_pool_arguments_name_themselves():
    q = jnp.zeros((1, 2, 4, 8))
    kv = jnp.zeros((1, 3, 8))
    idx = jnp.zeros((1, 2, 1), jnp.int32)
    kw = dict(d_v=8, implementation="xla")
    with pytest.raises(ValueError, match="extra_kv and extra_idx go together"):
        jax_dsa.sparse_mla(q, kv, idx, extra_kv=kv, **kw)
    with pytest.raises(ValueError, match="extra_idx's batch and token"):
        jax_dsa.sparse_mla(q, kv, idx, extra_kv=kv, extra_idx=jnp.zeros((1, 3, 1), jnp.int32),
                           **kw)
    with pytest.raises(TypeError, match="extra_kv must have q's dtype"):
        jax_dsa.sparse_mla(q, kv, idx, extra_kv=kv.astype(jnp.bfloat16), extra_idx=idx, **kw)
    with pytest.raises(ValueError, match="extra_topk_length must be"):
        jax_dsa.sparse_mla(q, kv, idx, extra_kv=kv, extra_idx=idx,
                           extra_topk_length=jnp.zeros((1, 3), jnp.int32), **kw)
    with pytest.raises(ValueError, match="extra_kv's last dimension"):
        jax_dsa.sparse_mla(q, kv, idx, extra_kv=jnp.zeros((1, 3, 9)), extra_idx=idx, **kw)
