"""Sharded execution on 8 fake CPU devices: jit with NamedSharding inputs, and shard_map."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_dsa
from cases import make_problem

try:
    from jax import shard_map as _shard_map
except ImportError:  # jax < 0.8
    from jax.experimental.shard_map import shard_map as _shard_map

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _problem(b=2, t=4, h=16):
    p = make_problem(np.random.default_rng(21), b, t, h, 48, 40, 10, sink=True, topk="partial",
                     d_v=32)
    w_o = np.random.default_rng(22).standard_normal((b, t, h, 32)).astype(np.float32)
    w_l = np.random.default_rng(23).standard_normal((b, t, h)).astype(np.float32)
    return p, w_o, w_l


def _loss(p, w_o, w_l, q, kv, sink, idx, tl):
    o, lse = jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=32, return_lse=True)
    return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_l), (o, lse)


def _unsharded(p, w_o, w_l):
    f = jax.jit(jax.value_and_grad(functools.partial(_loss, p, w_o, w_l), argnums=(0, 1, 2),
                                   has_aux=True))
    return f(p.q, p.kv, p.sink, p.idx, p.topk_length)


def _assert_same(got, want):
    (l1, (o1, lse1)), g1 = got
    (l2, (o2, lse2)), g2 = want
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse1, lse2, rtol=1e-5)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_spec", [P("data", "tok", "head"), P("data", None, ("tok", "head")),
                                    P(None, ("data", "tok"), "head")])
def test_jit_with_named_shardings_partitions_without_gathering_q(q_spec):
    p, w_o, w_l = _problem()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "tok", "head"))
    spec4 = tuple(q_spec) + (None,) * (4 - len(q_spec))
    b_ax, t_ax, h_ax = spec4[:3]
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(p.q, P(*spec4)), put(p.kv, P(b_ax, None, None)), put(p.sink, P(h_ax)),
            put(p.idx, P(b_ax, t_ax, None)), put(p.topk_length, P(b_ax, t_ax)))
    f = jax.jit(jax.value_and_grad(functools.partial(_loss, p, w_o, w_l), argnums=(0, 1, 2),
                                   has_aux=True))
    got = f(*args)
    _assert_same(got, _unsharded(p, w_o, w_l))
    (_, (o, lse)), (dq, dkv, dsink) = got
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec4)), 4)
    assert dq.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec4)), 4)
    hlo = f.lower(*args).compile().as_text()
    # Nothing is gathered (q least of all): only reductions of dkv, dsink and the loss remain.
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert "all-reduce" in hlo


def test_shard_map_head_parallel_matches_unsharded():
    """128 heads over 8 devices = 16 per shard; kv and idx replicated; no psum by the user."""
    p, w_o, w_l = _problem(b=1, t=3, h=128)
    mesh = Mesh(np.array(jax.devices()[:8]), ("head",))

    def per_shard(q, kv, sink, idx, tl, w_o_, w_l_):
        assert q.shape[2] == 16
        o, lse = jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=32,
                                    return_lse=True)
        part = jnp.sum(o * w_o_) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_l_)
        return o, lse, part[None]

    sharded = _shard_map(per_shard, mesh=mesh,
                         in_specs=(P(None, None, "head"), P(), P("head"), P(), P(),
                                   P(None, None, "head"), P(None, None, "head")),
                         out_specs=(P(None, None, "head"), P(None, None, "head"), P("head")))

    def loss(q, kv, sink):
        o, lse, partial_losses = sharded(q, kv, sink, p.idx, p.topk_length, w_o, w_l)
        return jnp.sum(partial_losses), (o, lse)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(p.q, p.kv, p.sink)
    _assert_same(got, _unsharded(p, w_o, w_l))


@pytest.mark.parametrize("concatenate", [False, True], ids=["combined", "in_one_softmax"])
def test_two_pools_under_named_shardings_match_unsharded(concatenate, monkeypatch):
    """extra_kv / extra_idx with q sharded over batch, tokens and heads: o, lse and the
    gradients of q, both pools and the sink as unsharded, and q is never gathered."""
    from jax_dsa import api
    monkeypatch.setattr(api, "_concatenate_pools", lambda *a: concatenate)
    jax.clear_caches()
    p, w_o, w_l = _problem()
    p2 = make_problem(np.random.default_rng(24), 2, 4, 16, 48, 30, 7, topk="partial", d_v=32)

    def loss(q, kv, kv2, sink, idx, tl, idx2, tl2):
        o, lse = jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=32,
                                    return_lse=True, extra_kv=kv2, extra_idx=idx2,
                                    extra_topk_length=tl2)
        return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_l), (o, lse)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    args = (p.q, p.kv, p2.kv, p.sink, p.idx, p.topk_length, p2.idx, p2.topk_length)
    want = f(*args)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "tok", "head"))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    specs = (P("data", "tok", "head", None), P("data", None, None), P("data", None, None),
             P("head"), P("data", "tok", None), P("data", "tok"), P("data", "tok", None),
             P("data", "tok"))
    sharded = tuple(put(x, s) for x, s in zip(args, specs))
    got = f(*sharded)
    _assert_same(got, want)
    (_, (o, _)), _ = got
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, specs[0]), 4)
    hlo = f.lower(*sharded).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.mark.parametrize("q_spec", [P(None, "x"), P(None, None, "x")], ids=["tokens", "heads"])
def test_uneven_shardings_inside_jit_give_the_unsharded_gradients(q_spec):
    """A sharding constraint may split T = 12 tokens or H = 12 heads over 8 devices (device_put
    refuses that, with_sharding_constraint does not). XLA pads the last shards; the partial
    dkv / dsink / target mass must not take the padding in, so such a dimension is replicated."""
    p, w_o, w_l = _problem(b=1, t=12, h=12)
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))

    def loss(q, kv, sink, idx, tl, constrain=True, square=False):
        if constrain:
            q = jax.lax.with_sharding_constraint(q, NamedSharding(mesh, q_spec))
        value, (o, lse) = _loss(p, w_o, w_l, q, kv, sink, idx, tl)
        if square:  # do depends on o (XLA lays the padding out differently)
            value = value + jnp.sum(o.astype(jnp.float32) ** 2)
        return value, (o, lse)

    # dkv and dsink are the sums over shards (JAX refuses to differentiate the uneven
    # constraint itself, so not q; dq is per shard and was never at risk).
    replicated = NamedSharding(mesh, P())  # jit refuses uneven output shardings
    # Full lists (no topk_length): a padded token of an explicit length array reads 0 entries.
    args = (p.q, p.kv, p.sink, p.idx, None)
    for square in (False, True):
        f = jax.jit(lambda *a: jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(x, replicated),
            jax.value_and_grad(functools.partial(loss, square=square), argnums=(1, 2),
                               has_aux=True)(*a)))
        want = jax.value_and_grad(functools.partial(loss, constrain=False, square=square),
                                  argnums=(1, 2), has_aux=True)(*args)
        _assert_same(f(*args), want)

    def target(q, kv, idx, tl):
        q = jax.lax.with_sharding_constraint(q, NamedSharding(mesh, q_spec))
        out = jax_dsa.attention_target(q, kv, idx, sink=p.sink, topk_length=tl)
        return jax.lax.with_sharding_constraint(out, replicated)

    for tl in (None, p.topk_length):
        want = jax_dsa.attention_target(p.q, p.kv, p.idx, sink=p.sink, topk_length=tl)
        got = jax.jit(target)(p.q, p.kv, p.idx, tl)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_uneven_token_sharding_inside_jit_sums_only_real_tokens():
    """The same with T = 12 tokens over 8 devices, the lists full and all valid."""
    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.standard_normal((1, 12, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 24, 16)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 24, (1, 12, 6)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))

    def loss(q, kv, sink, constrain):
        if constrain:
            q = jax.lax.with_sharding_constraint(q, NamedSharding(mesh, P(None, "x")))
        return jnp.sum(jax_dsa.sparse_mla(q, kv, idx, sink=sink) ** 2)

    g = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=3)
    for got, want in zip(g(q, kv, sink, True), g(q, kv, sink, False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
