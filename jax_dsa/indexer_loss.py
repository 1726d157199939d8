"""Training the lightning indexer: the attention's target distribution and the KL loss.

DeepSeek-V3.2 trains the indexer against the main attention: for token t the target over its
selected entries j is the attention probability summed over heads and L1-normalised,

    target[b, t, j] = sum_h p[b, t, h, j] / sum_{h, j} p[b, t, h, j]    (0 at invalid entries)

with p the softmax of `sparse_mla` (the sink in its denominator), and the loss is
KL(target || softmax_j(score[b, t, idx[b, t, j]])) with the indexer's score of
`jax_dsa.indexer_topk`. The target is a constant of the loss (the indexer's inputs are detached
from the main model's graph, and the target is not differentiated).

Both are the pure-JAX reference here, chunked over tokens (memory O(chunk * K * D)); the loss is
a `jax.custom_vjp` whose backward gives dq_i, dk_i (scatter-added over the rows of k_i, never at
an invalid entry) and dweights.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa import api, reference

_HIGHEST = lax.Precision.HIGHEST


def attention_target(q, kv, idx, *, scale=None, sink=None, topk_length=None, lse=None):
    """target [B, T, K] (float32; float64 for float64 inputs): sparse_mla's probabilities summed
    over heads and normalised over the token's entries; 0 at invalid entries and on tokens
    without a valid entry. Takes sparse_mla's arguments (3-D layouts too); `lse` ([B, T, H], as
    sparse_mla returns it) saves recomputing it. Not differentiable (a training target)."""
    call = api._prepare(q, kv, idx, scale, sink, topk_length, None, True, "xla", False, None)
    q, kv, idx, tl, sink = call.q, call.kv, call.idx, call.topk_length, call.sink
    if lse is None:
        _, lse = reference.forward(q, kv, idx, tl, sink, scale=call.scale, d_v=call.d_v)
    else:
        lse = api._as_array(lse, "lse")
        lse = lse[None] if call.unbatched else lse
        if lse.shape != q.shape[:3]:
            raise ValueError(f"lse must be [B, T, H] = {q.shape[:3]}; got shape {lse.shape}")
    target = _target(q, kv, idx, tl, sink, lax.stop_gradient(lse), call.scale)
    target = lax.stop_gradient(target)
    return target[0] if call.unbatched else target


@functools.partial(jax.jit, static_argnums=(6,))
def _target(q, kv, idx, tl, sink, lse, scale):
    b, t, h, d = q.shape
    s_rows = kv.shape[1]
    k = idx.shape[2]
    acc = reference.acc_dtype(q.dtype)
    chunk = reference.chunk_tokens(t, k, d, h)
    (qc, ic, lc, lsec), pad = reference._chunked(chunk, q, idx, tl, lse)
    sink = sink.astype(acc)

    def one_chunk(args):
        q_, i_, l_, lse_ = args
        valid = reference.valid_mask(i_, l_, s_rows)
        rows = reference._gather_rows(kv, i_, valid)
        s = reference._scores(q_, rows, valid, scale)
        live = jnp.isfinite(lse_)
        lse_ = lse_.astype(acc)
        p = jnp.where(live[..., None], jnp.exp(s - jnp.where(live, lse_, 0.0)[..., None]), 0.0)
        c, _ = reference.sink_split(sink[None, None, :], lse_)
        mass = jnp.sum(p * c[..., None], axis=2)  # [B, c, K]: summed over heads
        total = jnp.sum(mass, axis=-1, keepdims=True)
        return jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0)

    return reference._merge(lax.map(one_chunk, (qc, ic, lc, lsec)), pad)


def indexer_loss(q, k, weights, idx, target, *, scale=1.0, topk_length=None, reduction="mean",
                 deterministic=False):
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
        sums its entries' contributions in a fixed order instead of by scatter-add atomics.

    Differentiable in q, k and weights (custom_vjp); tokens without a valid entry give 0.
    """
    api._check_flag(deterministic, "deterministic")
    call = _prepare_loss(q, k, weights, idx, target, scale, topk_length, reduction)
    per_token = _kl(call["q"], call["k"], call["w"], call["idx"], call["tl"], call["target"],
                    call["scale"], bool(deterministic))
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
    if call["unbatched"]:
        idx, target = idx[None], target[None]
        if topk_length is not None:
            topk_length = api._as_array(topk_length, "topk_length", index=True)[None]
    b, t = call["q"].shape[:2]
    if idx.dtype != jnp.int32 or idx.ndim != 3 or idx.shape[:2] != (b, t):
        raise ValueError(f"idx must be int32 [B, T, K] with [B, T] = {(b, t)}; got "
                         f"{idx.dtype} {idx.shape}")
    if target.shape != idx.shape or not jnp.issubdtype(target.dtype, jnp.floating):
        raise ValueError(f"target must be floating, shaped like idx {idx.shape}; got "
                         f"{target.dtype} {target.shape}")
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
    """(per-token KL [B, c], softmax [B, c, K]) over the valid entries."""
    m = jnp.max(score, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(score - m), 0.0)
    z = jnp.sum(e, axis=-1, keepdims=True)
    log_p = jnp.where(valid, score - m - jnp.log(jnp.where(z > 0, z, 1.0)), 0.0)
    tgt = jnp.where(valid, target.astype(score.dtype), 0.0)
    xlogx = jnp.where(tgt > 0, tgt * jnp.log(jnp.where(tgt > 0, tgt, 1.0)), 0.0)
    kl = jnp.sum(xlogx - tgt * log_p, axis=-1)
    return kl, e / jnp.where(z > 0, z, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _kl(q, k, w, idx, tl, target, scale, deterministic):
    """Per-token KL [B, T]."""
    (qc, wc, ic, lc, tc), pad = _token_chunks(q, idx, q, w, idx, tl, target)

    def one_chunk(args):
        q_, w_, i_, l_, t_ = args
        valid, _, _, score = _selected(q_, k, w_, i_, l_, scale)
        return _kl_terms(score, valid, t_)[0]

    return reference._merge(lax.map(one_chunk, (qc, wc, ic, lc, tc)), pad)


def _kl_fwd(q, k, w, idx, tl, target, scale, deterministic):
    return _kl(q, k, w, idx, tl, target, scale, deterministic), (q, k, w, idx, tl, target)


def _kl_bwd(scale, deterministic, res, g):
    """d KL_t / d score_j = p_j * sum(target) - target_j; then through the weighted ReLU."""
    q, k, w, idx, tl, target = res
    b, t, h, d = q.shape
    s_rows = k.shape[1]
    acc = reference.acc_dtype(q.dtype)
    (qc, wc, ic, lc, tc, gc), pad = _token_chunks(q, idx, q, w, idx, tl, target, g)

    def one_chunk(dk_acc, args):
        q_, w_, i_, l_, t_, g_ = args
        valid, rows, dots, score = _selected(q_, k, w_, i_, l_, scale)
        _, p = _kl_terms(score, valid, t_)
        tgt = jnp.where(valid, t_.astype(acc), 0.0)
        dscore = g_.astype(acc)[..., None] * (p * jnp.sum(tgt, -1, keepdims=True) - tgt)
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
        return dk_acc, (dq.astype(q.dtype), dw.astype(w.dtype))

    dk0 = reference.varying_like(jnp.zeros((b, s_rows, d), acc), q, idx, g)
    dk, (dq, dw) = lax.scan(one_chunk, dk0, (qc, wc, ic, lc, tc, gc))
    return (reference._merge(dq, pad), dk.astype(k.dtype), reference._merge(dw, pad), None,
            None, None)


_kl.defvjp(_kl_fwd, _kl_bwd)
