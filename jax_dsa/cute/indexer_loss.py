"""The indexer loss on the Hopper kernels (ffi/kernels/sm90/indexer_loss.py).

Inputs are canonical (jax_dsa/indexer_loss.py): q [B, T, Hi, 128] bf16/f16 with Hi <= 64, k
[B, S, 128], weights [B, T, Hi], idx [B, T, K] int32 with K <= INDEXER_LOSS_MAX_K, topk_length
[B, T], target [B, T, K] (the backward: the forward's signal in its place, and the per-token
cotangent g [B, T]). One CTA per token recomputes the selected scores; the forward writes the
token's KL and each entry's signal p_j sum(target) - target_j (d KL / d score_j), the backward,
one pass over the list with it, dq and dweights and adds dk (fp32 atomics, never at an invalid
entry); no [B, T, Hi, K] array is formed.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.cute import ffi
from jax_dsa.cute.constants import INDEXER_DIM as DIM, INDEXER_LOSS_MAX_K as MAX_K
from jax_dsa.cute.constants import INDEXER_MAX_HEADS as MAX_HEADS


def shape_problem(q, k, idx) -> str | None:
    """Why the kernel cannot take these (canonical) inputs, or None."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"the indexer-loss kernel takes bfloat16/float16, not {q.dtype}"
    if q.shape[3] != DIM:
        return f"the indexer-loss kernel takes Di = {DIM}; got Di = {q.shape[3]}"
    if q.shape[2] > MAX_HEADS:
        return f"the indexer-loss kernel takes Hi <= {MAX_HEADS}; got Hi = {q.shape[2]}"
    if idx.shape[2] > MAX_K:
        return f"the indexer-loss kernel takes K <= {MAX_K} entries; got K = {idx.shape[2]}"
    if not ffi.has_indexer_loss():
        return "the kernel library was built without the indexer-loss kernels"
    return None


def forward(q, k, w, idx, topk_length, target, scale):
    """(The per-token KL [B, T], the signal [B, T, K] for `backward`), float32."""
    return ffi.indexer_loss_fwd(q, k, w, idx, topk_length, target, scale=scale)


def backward(q, k, w, idx, topk_length, signal, g, scale):
    """(dq, dk, dweights), float32, of sum_t g[b, t] KL_t; signal: forward's."""
    dq, dw, dk = ffi.indexer_loss_bwd(q, k, w, idx, topk_length, signal, g, scale=scale)
    return dq, dk, dw
