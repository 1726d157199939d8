"""The lightning indexer on the Hopper score kernel (ffi/kernels/sm90/indexer_scores.py).

Inputs are canonical (jax_dsa/indexer.py): q [B, T, Hi, 128] bf16/f16 with Hi <= 64, k [B, S,
128], weights [B, T, Hi]. The score kernel writes the scores of a chunk of tokens, [B, ct, S]
float32 (ct chosen so that a chunk stays within _CHUNK_BYTES), and the radix-select kernel
(ffi/kernels/sm90/indexer_topk.py; XLA's top_k above INDEXER_MAX_TOPK entries) selects from it,
one chunk after another inside one loop: peak memory is one chunk's scores, never [T, S].
(The selection without the score matrix in HBM is a next step: docs/kernel_log.md.)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa.cute import ffi
from jax_dsa.cute.constants import INDEXER_DIM as DIM, INDEXER_MAX_HEADS as MAX_HEADS
from jax_dsa.cute.constants import INDEXER_MAX_TOPK as MAX_TOPK
# Bytes of one token chunk's fp32 scores.
_CHUNK_BYTES = 256 << 20


def shape_problem(q, k) -> str | None:
    """Why the kernel cannot take these (canonical) inputs, or None."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"the indexer kernel takes bfloat16/float16, not {q.dtype}"
    if q.shape[3] != DIM:
        return f"the indexer kernel takes Di = {DIM}; got Di = {q.shape[3]}"
    if q.shape[2] > MAX_HEADS:
        return f"the indexer kernel takes Hi <= {MAX_HEADS}; got Hi = {q.shape[2]}"
    if not ffi.has_indexer():
        return "the kernel library was built without the indexer kernels"
    return None


def chunk_tokens(b: int, t: int, s: int) -> int:
    return int(max(1, min(t, _CHUNK_BYTES // (4 * b * s))))


def scores(q, k, w, *, scale, ratio, start):
    """[B, T, S] float32, -inf where not visible."""
    return ffi.indexer_scores(q, k, w, jnp.int32(start), scale=scale, ratio=ratio)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def topk(q, k, w, start, topk_, scale, ratio):
    """(scores, idx) [B, T, topk]: highest first, ties to the smaller row, (-inf, -1) past the
    visible rows. start (the position of token 0, an int32 scalar) may be traced."""
    b, t, h, d = q.shape
    s_rows = k.shape[1]
    ct = chunk_tokens(b, t, s_rows)
    n = -(-t // ct)
    q = jnp.pad(q, [(0, 0), (0, n * ct - t), (0, 0), (0, 0)])
    w = jnp.pad(w.astype(jnp.float32), [(0, 0), (0, n * ct - t), (0, 0)])

    def chunk(i):
        q_c = lax.dynamic_slice_in_dim(q, i * ct, ct, axis=1)
        w_c = lax.dynamic_slice_in_dim(w, i * ct, ct, axis=1)
        sc = ffi.indexer_scores(q_c, k, w_c, start + i * ct, scale=scale, ratio=ratio)
        if topk_ <= MAX_TOPK:
            return ffi.indexer_topk(sc, topk_)
        if topk_ > s_rows:
            sc = jnp.pad(sc, [(0, 0), (0, 0), (0, topk_ - s_rows)],
                         constant_values=-jnp.inf)
        best, idx = lax.top_k(sc, topk_)  # equal scores: the smaller row first
        return best, jnp.where(jnp.isneginf(best), -1, idx.astype(jnp.int32))

    best, idx = lax.map(chunk, jnp.arange(n, dtype=jnp.int32))
    best = jnp.moveaxis(best, 0, 1).reshape(b, n * ct, topk_)[:, :t]
    idx = jnp.moveaxis(idx, 0, 1).reshape(b, n * ct, topk_)[:, :t]
    return best, idx
