"""jax_dsa.attention_target and jax_dsa.indexer_loss (pure-JAX reference) against float64 NumPy
oracles: the target, the KL, and every gradient (by central differences in float64)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from cases import make_problem, rel_err
from oracle import attention_target as np_target, indexer_kl as np_kl


@pytest.mark.parametrize("sink,topk", [(False, "none"), (True, "partial")])
def test_attention_target_matches_the_oracle(sink, topk):
    p = make_problem(np.random.default_rng(1), 2, 5, 3, 16, 12, 7, sink=sink, topk=topk)
    tl = None if p.topk_length is None else jnp.asarray(p.topk_length)
    sink_arg = None if p.sink is None else jnp.asarray(p.sink)
    got = np.asarray(jax_dsa.attention_target(p.q, p.kv, jnp.asarray(p.idx), scale=p.scale,
                                              sink=sink_arg, topk_length=tl))
    want = np_target(p, p.scale)
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(got[0, 0], 0.0)  # the dead token
    live = want.sum(-1) > 0
    np.testing.assert_allclose(got.sum(-1)[live], 1.0, rtol=1e-5)
    # With sparse_mla's own lse: the same.
    _, lse = jax_dsa.sparse_mla(p.q, p.kv, jnp.asarray(p.idx), scale=p.scale, sink=sink_arg,
                                topk_length=tl, return_lse=True)
    again = jax_dsa.attention_target(p.q, p.kv, jnp.asarray(p.idx), scale=p.scale,
                                     sink=sink_arg, topk_length=tl, lse=lse)
    np.testing.assert_allclose(np.asarray(again), got, rtol=1e-5, atol=1e-7)


def _loss_problem(seed=2, b=2, t=5, h=3, d=8, s=11, k=6):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d))
    kv = rng.standard_normal((b, s, d))
    w = rng.standard_normal((b, t, h))
    idx = rng.integers(-2, s + 2, (b, t, k)).astype(np.int32)
    idx[..., 1] = idx[..., 0]  # a duplicate
    idx[0, 0] = -1  # a dead token
    lengths = rng.integers(1, k + 1, (b, t)).astype(np.int32)
    target = rng.random((b, t, k))
    target = target / target.sum(-1, keepdims=True)
    return q, kv, w, idx, lengths, target


def test_indexer_loss_value_matches_the_oracle():
    q, k, w, idx, lengths, target = _loss_problem()
    per_token = np.asarray(jax_dsa.indexer_loss(q, k, w, idx, target, scale=0.7,
                                                topk_length=lengths, reduction="none"))
    want = np_kl(q, k, w, idx, lengths, target, 0.7)
    assert rel_err(per_token, want) < 1e-5
    assert per_token[0, 0] == 0.0
    live = np.array([[any(j < lengths[b_, t_] and 0 <= r < k.shape[1]
                          for j, r in enumerate(idx[b_, t_]))
                      for t_ in range(idx.shape[1])] for b_ in range(2)])  # tokens with an entry
    mean = float(jax_dsa.indexer_loss(q, k, w, idx, target, scale=0.7, topk_length=lengths))
    np.testing.assert_allclose(mean, want.sum() / live.sum(), rtol=1e-5)


def test_target_and_loss_under_nested_vmap():
    q, k, w, idx, lengths, target = _loss_problem(seed=8, b=4)
    q, k, w, idx, lengths, target = (jnp.asarray(x.reshape((2, 2) + x.shape[1:]))
                                     for x in (q, k, w, idx, lengths, target))

    def loss(q, k, w, idx, tl, target):
        return jax_dsa.indexer_loss(q, k, w, idx, target, scale=0.7, topk_length=tl,
                                    reduction="none")

    def tgt(q, k, idx, tl):
        return jax_dsa.attention_target(q, k, idx, topk_length=tl)

    got_loss = jax.vmap(jax.vmap(loss))(q, k, w, idx, lengths, target)
    got_tgt = jax.vmap(jax.vmap(tgt))(q, k, idx, lengths)
    for i in range(2):
        for j in range(2):
            np.testing.assert_allclose(
                got_loss[i, j], loss(q[i, j], k[i, j], w[i, j], idx[i, j], lengths[i, j],
                                     target[i, j]), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(
                got_tgt[i, j], tgt(q[i, j], k[i, j], idx[i, j], lengths[i, j]),
                rtol=1e-6, atol=1e-7)


def test_indexer_loss_gradients_match_central_differences():
    """In float64: dq, dk (rows never selected get exactly 0) and dweights against central
    differences of the float64 NumPy oracle."""
    q, k, w, idx, lengths, target = _loss_problem(seed=3)
    with jax.enable_x64(True):
        f = lambda q, k, w: jax_dsa.indexer_loss(q, k, w, idx, target, scale=0.7,  # noqa: E731
                                                 topk_length=lengths, reduction="sum")
        grads = jax.grad(f, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))
    eps = 1e-6
    for name, x, g in zip(("dq", "dk", "dw"), (q, k, w), grads):
        g = np.asarray(g)
        assert g.dtype == np.float64
        fd = np.zeros_like(x)
        it = np.nditer(x, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            xp, xm = x.copy(), x.copy()
            xp[i] += eps
            xm[i] -= eps
            args_p = [xp if n == name else v for n, v in zip(("dq", "dk", "dw"), (q, k, w))]
            args_m = [xm if n == name else v for n, v in zip(("dq", "dk", "dw"), (q, k, w))]
            fd[i] = (np_kl(*args_p[:2], args_p[2], idx, lengths, target, 0.7).sum()
                     - np_kl(*args_m[:2], args_m[2], idx, lengths, target, 0.7).sum()) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7, err_msg=name)
    used = {int(r) for b_ in range(2) for t_ in range(idx.shape[1])
            for j, r in enumerate(idx[b_, t_]) if j < lengths[b_, t_] and 0 <= r < k.shape[1]}
    unused = [r for r in range(k.shape[1]) if r not in used]
    assert np.all(np.asarray(grads[1])[:, unused] == 0)


def test_indexer_loss_trains_the_indexer_toward_the_target():
    """A few SGD steps on q, k, w lower the loss (jit), the target stays a constant."""
    q, k, w, idx, lengths, target = _loss_problem(seed=4)
    args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, w))
    f = jax.jit(jax.value_and_grad(
        lambda q, k, w: jax_dsa.indexer_loss(q, k, w, idx, target, topk_length=lengths),
        argnums=(0, 1, 2)))
    first, _ = f(*args)
    for _ in range(30):
        loss, grads = f(*args)
        args = tuple(a - 0.5 * g for a, g in zip(args, grads))
    assert float(loss) < 0.8 * float(first)


@pytest.mark.parametrize("kwargs,match", [
    (dict(reduction="max"), "reduction"),
    (dict(target=np.zeros((2, 5, 3))), "target must be"),
    (dict(idx=np.zeros((2, 5, 6), np.float32)), "idx must be int32"),
    (dict(idx=np.zeros((2, 5, 0), np.int32), target=np.zeros((2, 5, 0))), "K >= 1"),
    (dict(topk_length=np.full((2, 5), 2 ** 32 + 3, np.int64)), "topk_length holds"),
])
def test_indexer_loss_bad_arguments(kwargs, match):
    q, k, w, idx, lengths, target = _loss_problem()
    args = dict(idx=idx, target=target)
    args.update({n: kwargs.pop(n) for n in ("idx", "target") if n in kwargs})
    with pytest.raises(ValueError, match=match):
        jax_dsa.indexer_loss(q, k, w, args["idx"], args["target"], **kwargs)


def test_three_dim_messages_name_the_callers_shapes():
    q, k, w, idx, lengths, target = _loss_problem()
    with pytest.raises(ValueError,
                       match=r"idx must be int32 \[T, K\] with T = 5; got int32 \(4, 6\)"):
        jax_dsa.indexer_loss(q[0], k[0], w[0], idx[0, :4], target[0, :4])
    with pytest.raises(ValueError,
                       match=r"lse must be \[T, H\] = \(5, 3\); got shape \(1, 5, 3\)"):
        jax_dsa.attention_target(q[0], k[0], idx[0], lse=np.zeros((1, 5, 3), np.float32))
    with pytest.raises(TypeError, match="lse must be floating"):
        jax_dsa.attention_target(q, k, idx, lse=np.zeros((2, 5, 3), np.int32))


def test_deterministic_indexer_loss_gradients_equal_the_default():
    """deterministic=True (dk summed per row in a fixed order) gives the same gradients as the
    scatter-add, the rows duplicated in the lists included; the flag must be a bool."""
    q, k, w, idx, lengths, target = _loss_problem(seed=5)
    idx = idx.copy()
    idx[:, :, 1] = idx[:, :, 0]  # duplicated rows within a token
    args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, w))

    def grads(det):
        f = lambda q, k, w: jax_dsa.indexer_loss(q, k, w, idx, target, topk_length=lengths,  # noqa
                                                 deterministic=det)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*args)

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="deterministic must be"):
        jax_dsa.indexer_loss(*args, idx, target, deterministic=1)


def emulated_target_kernel(q, kv, idx, topk_length, off, *, scale, poison_outputs=False):
    """The target kernel's contract in jnp (ffi.attention_mass): per block of 64 heads, the sum
    of exp(scale q.k - off) over the heads, at the valid entries; 0 elsewhere."""
    b, t, h, _ = q.shape
    s_rows, k = kv.shape[1], idx.shape[2]
    valid = (idx >= 0) & (idx < s_rows) & (jnp.arange(k) < topk_length[..., None])
    rows = jax.vmap(lambda kv_b, i_b: kv_b[i_b])(kv, jnp.clip(idx, 0, s_rows - 1))
    s = jnp.einsum("bthd,btkd->bthk", q.astype(jnp.float32), rows.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    p = jnp.where(valid[:, :, None, :], jnp.exp(s - off[..., None]), 0.0)
    n_hb = -(-h // 64)
    p = jnp.pad(p, [(0, 0), (0, 0), (0, 64 * n_hb - h), (0, 0)])
    return p.reshape(b, t, n_hb, 64, k).sum(axis=3)


def _mesh(shape, names):
    from jax.sharding import Mesh
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _put(x, mesh, *spec):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(*spec)))


@pytest.mark.parametrize("sink,topk,h", [(False, "none", 3), (True, "partial", 70)])
def test_target_kernel_path_with_an_emulated_kernel(monkeypatch, sink, topk, h):
    """The kernel path of jax_dsa.attention_target (the offsets logaddexp(lse, sink) with +inf
    for dead heads, the sum of the head blocks, the normalisation) with the target kernel
    replaced by a jnp emulation of its contract: the float64 oracle's target, unsharded and
    with tokens and heads sharded (the head shards' masses summed before normalising)."""
    from jax_dsa import training as indexer_loss
    from jax_dsa.cute import ffi
    calls = []

    def kernel(q, *args, **kw):
        calls.append(q.shape)
        return emulated_target_kernel(q, *args, **kw)

    monkeypatch.setattr(ffi, "attention_mass", kernel)
    indexer_loss._mass_op.cache_clear()
    p = make_problem(np.random.default_rng(4), 2, 8, h, 16, 12, 7, sink=sink, topk=topk)
    sink_arr = jnp.full((h,), -jnp.inf) if p.sink is None else jnp.asarray(p.sink)
    _, lse = jax_dsa.sparse_mla(p.q, p.kv, jnp.asarray(p.idx), scale=p.scale,
                                sink=None if p.sink is None else sink_arr,
                                topk_length=jnp.asarray(p.lengths), return_lse=True)
    off = indexer_loss.offsets(lse, sink_arr)
    op = indexer_loss._mass_op(p.scale, "cute")
    args = (jnp.asarray(p.q, jnp.float32), jnp.asarray(p.kv, jnp.float32), jnp.asarray(p.idx),
            jnp.asarray(p.lengths), off)
    want = np_target(p, p.scale)
    got = np.asarray(indexer_loss.normalise(op(*args)[0]))
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(got[0, 0], 0.0)  # the dead token
    if jax.device_count() >= 8 and h % 2 == 0:
        mesh = _mesh((2, 2, 2), ("data", "tokens", "heads"))
        sharded = (_put(args[0], mesh, "data", "tokens", "heads"), _put(args[1], mesh, "data"),
                   _put(args[2], mesh, "data", "tokens"), _put(args[3], mesh, "data", "tokens"),
                   _put(args[4], mesh, "data", "tokens", "heads"))
        got = np.asarray(indexer_loss.normalise(op(*sharded)[0]))
        assert rel_err(got, want) < 1e-5
        assert (1, 4, h // 2, 16) in calls, calls  # the kernel ran on one shard's heads
    indexer_loss._mass_op.cache_clear()


def emulated_loss_kernel(q, k, w, idx, topk_length, signal, g, *, scale):
    """The loss kernel's contract in jnp (ffi.indexer_loss_bwd): float32 (dq, dw, dk) of
    sum_t g_t KL_t, dk added only at valid entries, from the forward's signal (dscore =
    g signal), as the reference computes them."""
    from jax_dsa.training import reference_kl_grads
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    dq, dk, dw = reference_kl_grads(f32(q), f32(k), f32(w), idx, topk_length, f32(signal),
                                    f32(g), scale)
    return dq, dw, dk


def emulated_loss_fwd_kernel(q, k, w, idx, topk_length, target, *, scale):
    """The loss kernel's forward contract in jnp (ffi.indexer_loss_fwd): the per-token KL and
    the per-entry signal p_j sum(target) - target_j (0 at invalid entries)."""
    from jax_dsa.training import reference_kl
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return reference_kl(f32(q), f32(k), f32(w), idx, topk_length, f32(target), scale)


def test_loss_kernel_path_with_an_emulated_kernel(monkeypatch):
    """The kernel path of jax_dsa.indexer_loss (the custom_vjp on the kernel ops, argument
    order, the casts) with the kernels replaced by jnp emulations of their contracts: the
    float64 oracles' KL and gradients, unsharded and with batch and tokens sharded (dk summed
    over the token shards)."""
    from jax_dsa import training as indexer_loss
    from jax_dsa.cute import ffi
    from oracle import indexer_loss_grads
    calls = []

    def bwd(q, *args, **kw):
        calls.append(q.shape)
        return emulated_loss_kernel(q, *args, **kw)

    monkeypatch.setattr(ffi, "indexer_loss_bwd", bwd)
    monkeypatch.setattr(ffi, "indexer_loss_fwd", emulated_loss_fwd_kernel)
    for op in (indexer_loss._loss_fwd_op, indexer_loss._loss_bwd_op):
        op.cache_clear()
    q, k, w, idx, lengths, target = _loss_problem(seed=6, t=8)
    g = np.random.default_rng(7).standard_normal(idx.shape[:2])
    args = [jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
            jnp.asarray(w, jnp.float32), jnp.asarray(idx), jnp.asarray(lengths),
            jnp.asarray(target, jnp.float32)]
    want = indexer_loss_grads(q, k, w, idx, lengths, target, g, 0.7)
    want_kl = np_kl(q, k, w, idx, lengths, target, 0.7)

    def run(q, k, w, idx, tl, tgt):
        f = lambda q, k, w: jnp.sum(jnp.asarray(g, jnp.float32) * indexer_loss._kl(  # noqa
            q, k, w, idx, tl, tgt, 0.7, False, "cute"))
        return (indexer_loss._kl(q, k, w, idx, tl, tgt, 0.7, False, "cute"),
                jax.grad(f, argnums=(0, 1, 2))(q, k, w))

    checks = [args]
    if jax.device_count() >= 8:
        mesh = _mesh((2, 4), ("data", "tokens"))
        checks.append([_put(args[0], mesh, "data", "tokens"), _put(args[1], mesh, "data"),
                       _put(args[2], mesh, "data", "tokens"),
                       _put(args[3], mesh, "data", "tokens"),
                       _put(args[4], mesh, "data", "tokens"),
                       _put(args[5], mesh, "data", "tokens")])
    for a in checks:
        kl, grads = jax.jit(run)(*a)
        assert rel_err(kl, want_kl) < 1e-5
        for got, ref in zip(grads, want):
            assert got.dtype == jnp.float32
            assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    if len(checks) > 1:
        assert (1, 2, 3, 8) in calls, calls  # one shard: a batch entry, 2 tokens
    for op in (indexer_loss._loss_fwd_op, indexer_loss._loss_bwd_op):
        op.cache_clear()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_target_and_loss_under_jit_with_sharded_inputs():
    """The public functions (the reference here) under jit with batch, tokens and heads
    sharded give the unsharded results; so do the loss's gradients."""
    p = make_problem(np.random.default_rng(14), 2, 8, 4, 16, 12, 7, sink=True, topk="partial")
    args = (jnp.asarray(p.q), jnp.asarray(p.kv), jnp.asarray(p.idx))
    kw = dict(scale=p.scale, sink=jnp.asarray(p.sink), topk_length=jnp.asarray(p.lengths))
    want = np.asarray(jax_dsa.attention_target(*args, **kw))
    mesh = _mesh((2, 2, 2), ("data", "tokens", "heads"))
    got = jax.jit(lambda q, kv, idx: jax_dsa.attention_target(q, kv, idx, **kw))(
        _put(args[0], mesh, "data", "tokens", "heads"), _put(args[1], mesh, "data"),
        _put(args[2], mesh, "data", "tokens"))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)

    q, k, w, idx, lengths, target = _loss_problem(seed=15, t=8)
    f = lambda q, k, w: jax_dsa.indexer_loss(q, k, w, idx, target, scale=0.7,  # noqa: E731
                                             topk_length=lengths)
    vg = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    want_v, want_g = vg(*(jnp.asarray(x, jnp.float32) for x in (q, k, w)))
    mesh = _mesh((2, 4), ("data", "tokens"))
    got_v, got_g = vg(_put(np.float32(q), mesh, "data", "tokens"),
                      _put(np.float32(k), mesh, "data"),
                      _put(np.float32(w), mesh, "data", "tokens"))
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
