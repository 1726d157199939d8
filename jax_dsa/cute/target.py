"""The indexer's training target on the Hopper target kernel (ffi/kernels/sm90/attention_target.py).

target[b, t, j] = sum_h p[b, t, h, j] / sum_{h, j} p[b, t, h, j] with p sparse_mla's
probabilities (the sink in their denominator). One CTA per token loads Q once, gathers the
token's rows 64 at a time, computes S^T = K Q^T by wgmma (rows on M, heads on N) and sums
exp2(S * scale - off) over each 64-head block, off = logaddexp(lse, sink) (+inf for a dead head);
`mass` sums the head blocks. jax_dsa.attention_target normalises.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.cute import ffi
from jax_dsa.cute.constants import MAX_HEADS


def shape_problem(q, kv) -> str | None:
    """Why the kernel cannot take these (canonical) inputs, or None."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"the target kernel takes bfloat16/float16, not {q.dtype}"
    if q.shape[3] not in (512, 576):
        return f"the target kernel takes Dqk 512 or 576; got {q.shape[3]}"
    if q.shape[2] > MAX_HEADS:
        return f"the target kernel takes H <= {MAX_HEADS}; got H = {q.shape[2]}"
    if not ffi.has_target():
        return "the kernel library was built without the target kernels"
    return None


def mass(q, kv, idx, topk_length, off, scale, poison_outputs=False):
    """[B, T, K] float32: each entry's exp(score - off) summed over the heads, 0 at invalid
    entries. Canonical q [B, T, H, Dqk], kv, idx, topk_length [B, T]; off [B, T, H]
    (jax_dsa.indexer_loss.offsets). poison_outputs (tests): NaN-fill before the launch."""
    per_block = ffi.attention_mass(q, kv, idx, topk_length, off, scale=scale,
                                   poison_outputs=poison_outputs)
    return jnp.sum(per_block, axis=2)
