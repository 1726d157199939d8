"""Training the lightning indexer: the attention's target distribution and the KL loss.

DeepSeek-V3.2 trains the indexer against the main attention: for token t the target over its
selected entries j is the attention probability summed over heads and L1-normalised,

    target[b, t, j] = sum_h p[b, t, h, j] / sum_{h, j} p[b, t, h, j]    (0 at invalid entries)

with p the softmax of `sparse_mla` (the sink in its denominator), and the loss is
KL(target || softmax_j(score[b, t, idx[b, t, j]])) with the indexer's score of
`jax_dsa.indexer_topk`. The target is a constant of the loss (the indexer's inputs are detached
from the main model's graph, and the target is not differentiated).

Two implementations of each: the Hopper kernels (jax_dsa/cute/target.py: each entry's mass
summed over 64-head blocks from q, kv and the saved lse, no [B, T, H, K] array;
jax_dsa/cute/indexer_loss.py: one CTA per token computes the selected scores, their softmax,
the KL and each entry's gradient signal d KL / d score; in the backward dq, dweights and dk by
fp32 atomics from that signal), and the pure-JAX reference here (the CPU/TPU path and the
kernels' oracle), chunked over tokens (memory O(chunk * K * D)). The loss is a
`jax.custom_vjp` whose forward keeps the signal [B, T, K] (float32, the target's size) as a
residual and whose backward gives dq_i, dk_i (scatter-added over the rows of k_i, never at an
invalid entry) and dweights.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa import api, reference, sharding

_HIGHEST = lax.Precision.HIGHEST


def attention_target(q, kv, idx, *, scale=None, sink=None, topk_length=None, lse=None,
                     implementation=None):
    """target [B, T, K] (float32; float64 for float64 inputs): sparse_mla's probabilities summed
    over heads and normalised over the token's entries; 0 at invalid entries and on tokens
    without a valid entry. Takes sparse_mla's arguments (3-D layouts too); `lse` ([B, T, H], as
    sparse_mla returns it) saves recomputing it. Not differentiable (a training target). With
    a sink each head's probabilities have the sink in their denominator, as in sparse_mla's
    output, so a head that gives the sink more weight counts less in the sum over heads.

    implementation: None (the Hopper target kernel where it can run: bf16/fp16, Dqk 512 or 576,
    H <= 128; else the reference), "xla", "cute", or a sequence of them tried in order. Under
    jit with sharded inputs batch, tokens and heads shard (the head shards' masses are summed
    before the normalisation). Inside shard_map with the heads split, each shard would
    normalise over its own heads only: keep the heads whole there.
    """
    call = api._prepare(q, kv, idx, scale, sink, topk_length, None, True, "xla", False, None)
    q, kv, idx, tl = (lax.stop_gradient(x) for x in (call.q, call.kv, call.idx, call.topk_length))
    from jax_dsa.cute import target as cute_target
    problem = api.op_kernel_problem(lambda: cute_target.shape_problem(q, kv), q, kv)
    impl = api.choose(implementation, problem, "attention_target", q)
    if lse is None:
        _, lse = api.sparse_mla(q, kv, idx, scale=call.scale, sink=sink, topk_length=tl,
                                return_lse=True, implementation="xla" if impl == "xla" else None)
    else:
        lse = api._as_array(lse, "lse")
        want = q.shape[1:3] if call.unbatched else q.shape[:3]
        if lse.shape != want:
            layout = "[T, H]" if call.unbatched else "[B, T, H]"
            raise ValueError(f"lse must be {layout} = {want}; got shape {lse.shape}")
        if not jnp.issubdtype(lse.dtype, jnp.floating):
            raise TypeError(f"lse must be floating (as sparse_mla returns it); got {lse.dtype}")
        api._check_float(lse, "lse")
        lse = lse[None] if call.unbatched else lse
    off = offsets(lax.stop_gradient(lse), lax.stop_gradient(call.sink),
                  reference.acc_dtype(q.dtype))
    (mass,) = _mass_op(call.scale, impl)(q, kv, idx, tl, off)
    target = normalise(mass)
    return target[0] if call.unbatched else target


def offsets(lse, sink, dtype=jnp.float32):
    """off [B, T, H] = logaddexp(lse, sink) (+inf where lse = -inf: a dead head), so that
    p * (the KV's share of the softmax) = exp(score - off) for each entry."""
    lse = lse.astype(dtype)
    sink = sink.astype(dtype)[None, None, :]
    return jnp.where(jnp.isneginf(lse), jnp.inf, jnp.logaddexp(lse, sink))


def normalise(mass):
    """mass [B, T, K] (summed over heads) -> the target (0 where a token has none)."""
    total = jnp.sum(mass, axis=-1, keepdims=True)
    return jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0)


@functools.lru_cache(maxsize=None)
def _mass_op(scale, impl):
    """(q, kv, idx, topk_length, off) -> (mass [B, T, K],): each entry's exp(score - off)
    summed over heads; jitted and partitioned (jax_dsa.sharding.make_attention_mass)."""
    def kernel(q, kv, idx, tl, off):
        from jax_dsa.cute import target as cute_target
        return (cute_target.mass(q, kv, idx, tl, off, scale),)

    def local(*args):
        return api.dispatch(impl, lambda *a: (_reference_mass(*a, scale),), kernel, *args)

    return jax.jit(sharding.make_attention_mass(local))


def _reference_mass(q, kv, idx, tl, off, scale):
    """The reference of the mass, in token chunks (memory O(chunk * K * (D + H)))."""
    s_rows = kv.shape[1]
    (qc, ic, lc, oc), pad = _token_chunks(q, idx, q, idx, tl, off)

    def one_chunk(args):
        q_, i_, l_, o_ = args
        valid = reference.valid_mask(i_, l_, s_rows)
        s = reference._scores(q_, reference._gather_rows(kv, i_, valid), valid, scale)
        return jnp.sum(jnp.exp(s - o_.astype(s.dtype)[..., None]), axis=2)  # 0 where invalid

    return reference._merge(lax.map(one_chunk, (qc, ic, lc, oc)), pad)


def indexer_loss(q, k, weights, idx, target, *, scale=1.0, topk_length=None, reduction="mean",
                 deterministic=False, implementation=None):
    """KL(target || softmax over the selected entries of the indexer's scores), per token.

    Args:
      q [B, T, Hi, Di], k [B, S, Di], weights [B, T, Hi]: the indexer's inputs (3-D layouts
        without B too), as `jax_dsa.indexer_topk` takes them.
      idx [B, T, K] int32: the selected rows (invalid entries: idx < 0, idx >= S or slot >=
        topk_length, excluded from the softmax); target [B, T, K]: `attention_target`'s output
        (treated as a constant).
      scale: as indexer_topk. reduction: "mean" over tokens with a valid entry, "sum", or
        "none" ([B, T]).
      deterministic: make dk bitwise reproducible run to run (as sparse_mla's): each row of k
        sums its entries' contributions in a fixed order instead of by scatter-add atomics
        (the gradients then come from the reference: the kernel adds dk by atomics).
      implementation: None (the Hopper loss kernels where they run: bf16/fp16, Di = 128,
        Hi <= 64, K <= 4096; else the reference), "xla", "cute", or a sequence of them tried
        in order. Under jit with sharded inputs batch and tokens shard (heads and k are
        replicated; dk is summed over the token shards).

    Differentiable in q, k and weights (custom_vjp); tokens without a valid entry give 0.
    """
    api._check_flag(deterministic, "deterministic")
    call = _prepare_loss(q, k, weights, idx, target, scale, topk_length, reduction)
    from jax_dsa.cute import indexer_loss as cute_loss
    problem = api.op_kernel_problem(
        lambda: cute_loss.shape_problem(call["q"], call["k"], call["idx"]), call["q"], call["k"])
    impl = api.choose(implementation, problem, "indexer_loss", call["q"])
    per_token = _kl(call["q"], call["k"], call["w"], call["idx"], call["tl"], call["target"],
                    call["scale"], bool(deterministic), impl)
    if reduction == "none":
        return per_token[0] if call["unbatched"] else per_token
    live = jnp.any(reference.valid_mask(call["idx"], call["tl"], call["k"].shape[1]), axis=-1)
    total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(live), 1).astype(total.dtype)


def _prepare_loss(q, k, weights, idx, target, scale, topk_length, reduction):
    from jax_dsa import indexer
    call = indexer._prepare(q, k, weights, scale, 1, 0)
    idx = api._as_array(idx, "idx", index=True)
    target = api._as_array(target, "target")
    b, t = call["q"].shape[:2]
    if call["unbatched"]:  # messages in the caller's 3-D layout
        if idx.dtype != jnp.int32 or idx.ndim != 2 or idx.shape[0] != t:
            raise ValueError(f"idx must be int32 [T, K] with T = {t}; got {idx.dtype} "
                             f"{idx.shape}")
    elif idx.dtype != jnp.int32 or idx.ndim != 3 or idx.shape[:2] != (b, t):
        raise ValueError(f"idx must be int32 [B, T, K] with [B, T] = {(b, t)}; got "
                         f"{idx.dtype} {idx.shape}")
    if target.shape != idx.shape or not jnp.issubdtype(target.dtype, jnp.floating):
        raise ValueError(f"target must be floating, shaped like idx {idx.shape}; got "
                         f"{target.dtype} {target.shape}")
    api._check_float(target, "target")
    if idx.shape[-1] == 0:
        raise ValueError("idx must list at least one entry per token (K >= 1)")
    if call["unbatched"]:
        idx, target = idx[None], target[None]
        if topk_length is not None:
            topk_length = api._as_array(topk_length, "topk_length", index=True)[None]
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    tl = api._check_topk_length(topk_length, b, t, idx.shape[2], False)
    return dict(q=call["q"], k=call["k"], w=call["weights"], idx=idx, tl=tl,
                target=lax.stop_gradient(target), scale=call["scale"],
                unbatched=call["unbatched"])


def _token_chunks(q, idx, *arrays):
    """reference._chunked of `arrays` ([B, T, ...]) in chunks sized for q and idx."""
    _, t, h, d = q.shape
    return reference._chunked(reference.chunk_tokens(t, idx.shape[2], d, h), *arrays)


def _selected(q_, k, w_, i_, l_, scale):
    """Per chunk: valid [B, c, K], gathered rows [B, c, K, D], the pre-ReLU products
    [B, c, H, K] and the scores [B, c, K] (-inf at invalid entries)."""
    acc = reference.acc_dtype(q_.dtype)
    valid = reference.valid_mask(i_, l_, k.shape[1])
    rows = reference._gather_rows(k, i_, valid)
    dots = jnp.einsum("bthd,btkd->bthk", q_, rows, precision=_HIGHEST,
                      preferred_element_type=acc) * scale
    score = jnp.einsum("bthk,bth->btk", jnp.maximum(dots, 0.0), w_.astype(acc),
                       precision=_HIGHEST)
    return valid, rows, dots, jnp.where(valid, score, -jnp.inf)


def _kl_terms(score, valid, target):
    """(per-token KL [B, c], signal [B, c, K]) over the valid entries; signal: d KL / d score,
    p_j * sum(target) - target_j (0 at the invalid entries)."""
    m = jnp.max(score, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(score - m), 0.0)
    z = jnp.sum(e, axis=-1, keepdims=True)
    log_p = jnp.where(valid, score - m - jnp.log(jnp.where(z > 0, z, 1.0)), 0.0)
    tgt = jnp.where(valid, target.astype(score.dtype), 0.0)
    xlogx = jnp.where(tgt > 0, tgt * jnp.log(jnp.where(tgt > 0, tgt, 1.0)), 0.0)
    kl = jnp.sum(xlogx - tgt * log_p, axis=-1)
    p = e / jnp.where(z > 0, z, 1.0)
    signal = jnp.where(valid, p * jnp.sum(tgt, axis=-1, keepdims=True) - tgt, 0.0)
    return kl, signal


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _kl(q, k, w, idx, tl, target, scale, deterministic, impl):
    """Per-token KL [B, T]."""
    return _loss_fwd_op(scale, impl)(q, k, w, idx, tl, target)[0]


def _kl_fwd(q, k, w, idx, tl, target, scale, deterministic, impl):
    kl, signal = _loss_fwd_op(scale, impl)(q, k, w, idx, tl, target)
    return kl, (q, k, w, idx, tl, signal)


def _kl_bwd(scale, deterministic, impl, res, g):
    q, k, w, idx, tl, signal = res
    # The kernel adds dk by atomics: the deterministic gradients come from the reference.
    dq, dk, dw = _loss_bwd_op(scale, "xla" if deterministic else impl, deterministic)(
        q, k, w, idx, tl, signal, g)
    return dq.astype(q.dtype), dk.astype(k.dtype), dw.astype(w.dtype), None, None, None


_kl.defvjp(_kl_fwd, _kl_bwd)


@functools.lru_cache(maxsize=None)
def _loss_fwd_op(scale, impl):
    """(q, k, w, idx, tl, target) -> (KL [B, T], signal [B, T, K]: d KL / d score, which the
    backward takes), jitted and partitioned."""
    def kernel(*args):
        from jax_dsa.cute import indexer_loss as cute_loss
        return cute_loss.forward(*args, scale)

    def local(*args):
        return api.dispatch(impl, lambda *a: reference_kl(*a, scale), kernel, *args)

    return jax.jit(sharding.make_indexer_loss_fwd(local))


@functools.lru_cache(maxsize=None)
def _loss_bwd_op(scale, impl, deterministic):
    """(q, k, w, idx, tl, signal, g) -> (dq, dk, dw) in the accumulation dtype (float32;
    float64 for float64 inputs), jitted and partitioned (dk summed over token shards)."""
    def kernel(*args):
        from jax_dsa.cute import indexer_loss as cute_loss
        return cute_loss.backward(*args, scale)

    def local(*args):
        return api.dispatch(impl, lambda *a: reference_kl_grads(*a, scale, deterministic),
                            kernel, *args)

    return jax.jit(sharding.make_indexer_loss_bwd(local))


def reference_kl(q, k, w, idx, tl, target, scale):
    """The reference's (per-token KL [B, T], signal [B, T, K]: d KL / d score), in token
    chunks."""
    (qc, wc, ic, lc, tc), pad = _token_chunks(q, idx, q, w, idx, tl, target)

    def one_chunk(args):
        q_, w_, i_, l_, t_ = args
        valid, _, _, score = _selected(q_, k, w_, i_, l_, scale)
        return _kl_terms(score, valid, t_)

    kl, signal = lax.map(one_chunk, (qc, wc, ic, lc, tc))
    return reference._merge(kl, pad), reference._merge(signal, pad)


def reference_kl_grads(q, k, w, idx, tl, signal, g, scale, deterministic=False):
    """The reference's (dq, dk, dw) of sum_t g[b, t] KL_t, in the accumulation dtype: from
    the forward's signal d KL_t / d score_j = p_j * sum(target) - target_j (as the kernel
    takes it) through the weighted ReLU."""
    b, t, h, d = q.shape
    s_rows = k.shape[1]
    acc = reference.acc_dtype(q.dtype)
    (qc, wc, ic, lc, sc, gc), pad = _token_chunks(q, idx, q, w, idx, tl, signal, g)

    def one_chunk(dk_acc, args):
        q_, w_, i_, l_, s_, g_ = args
        valid, rows, dots, _ = _selected(q_, k, w_, i_, l_, scale)
        dscore = g_.astype(acc)[..., None] * s_.astype(acc)
        dscore = jnp.where(valid, dscore, 0.0)  # [B, c, K]
        active = (dots > 0).astype(acc)  # ReLU'
        dw = jnp.einsum("btk,bthk->bth", dscore, jnp.maximum(dots, 0.0), precision=_HIGHEST)
        ddots = scale * active * dscore[:, :, None, :] * w_.astype(acc)[..., None]  # [B,c,H,K]
        dq = jnp.einsum("bthk,btkd->bthd", ddots, rows.astype(acc), precision=_HIGHEST)
        drow = jnp.einsum("bthk,bthd->btkd", ddots, q_.astype(acc), precision=_HIGHEST)
        target_rows = jnp.where(valid, i_, s_rows)  # invalid entries point past the end: dropped
        scatter = (reference._scatter_add_rows_in_order if deterministic
                   else reference._scatter_add_rows)
        dk_acc = jax.vmap(scatter)(dk_acc, target_rows, drow)
        return dk_acc, (dq, dw)

    dk0 = reference.varying_like(jnp.zeros((b, s_rows, d), acc), q, idx, g)
    dk, (dq, dw) = lax.scan(one_chunk, dk0, (qc, wc, ic, lc, sc, gc))
    return reference._merge(dq, pad), dk, reference._merge(dw, pad)
