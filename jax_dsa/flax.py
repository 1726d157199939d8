"""Flax NNX module owning the learnable per-head attention sink."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.api import sparse_mla


class SparseMLA(nnx.Module):
    """Sparse MLA over a shared latent KV, with an optional learnable sink per head.

    Call with q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K] (or the 3-D layouts); returns
    o [B, T, H, d_v] (and lse when return_lse=True), exactly as `jax_dsa.sparse_mla`.
    deterministic_backward is sparse_mla's `deterministic` (bitwise reproducible gradients); it
    is not called `deterministic` because NNX's train() / eval() set attributes of that name.
    """

    def __init__(self, num_heads: int, *, use_sink: bool = True, sink_init: float = 0.0,
                 scale: float | None = None, d_v: int = 512, implementation: str | None = None,
                 deterministic_backward: bool = False):
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1; got {num_heads}")
        self.num_heads = num_heads
        self.scale = scale
        self.d_v = d_v
        self.implementation = implementation
        self.deterministic_backward = deterministic_backward
        self.sink = nnx.Param(jnp.full((num_heads,), sink_init, jnp.float32)) if use_sink else None

    def __call__(self, q, kv, idx, *, topk_length=None, return_lse: bool = False):
        # No check of q's heads against num_heads: under shard_map a head-parallel shard holds
        # H / n heads and the matching slice of the sink; sparse_mla checks that the two agree.
        sink = None if self.sink is None else self.sink[...]
        return sparse_mla(q, kv, idx, scale=self.scale, sink=sink, topk_length=topk_length,
                          d_v=self.d_v, return_lse=return_lse, implementation=self.implementation,
                          deterministic=self.deterministic_backward)
