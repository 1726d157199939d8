"""The deterministic backward's entry order, prepared in XLA for the handler.

The deterministic backward stores one fp32 row of Dqk per (entry, 64-head block) into a
workspace, chunk by chunk of tokens; the dkv_reduce kernel then adds, for each kv row, its run
of workspace rows in a fixed order. `chunk_tokens` sizes the chunk to a byte budget (rounded
down to whole waves of 132 CTAs when that leaves at least one wave); `entry_order` sorts each
chunk's entries by destination row.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsa.reference import valid_mask

_SM_COUNT = 132
NO_ROW = np.iinfo(np.int32).max  # sort key of invalid entries: after every kv row


def chunk_tokens(n_tok: int, k: int, d_qk: int, heads: int, budget: int) -> int:
    """Tokens per chunk of the deterministic backward for a workspace of `budget` bytes
    (static: shapes only)."""
    per_token = k * (-(-heads // 64)) * d_qk * 4
    tc = max(1, budget // per_token)
    if tc >= _SM_COUNT:
        tc -= tc % _SM_COUNT
    return int(max(1, min(tc, n_tok)))


def entry_order(idx, topk_length, num_kv_rows: int, chunk: int):
    """Per chunk of `chunk` tokens, the entries sorted by destination kv row (stable).

    Returns int32 arrays of n_chunks * chunk * K elements (chunk-major): order (the entry's id
    within its chunk, (bt - t_begin) * K + j), seg_end (one past the end of the run of equal rows
    at a run's first position, 0 elsewhere and for invalid entries) and rows (b * S + idx).
    """
    B, T, K = idx.shape
    valid = valid_mask(idx, topk_length, num_kv_rows)
    base = (jnp.arange(B, dtype=jnp.int32) * num_kv_rows)[:, None, None]
    rows = jnp.where(valid, idx + base, NO_ROW).reshape(-1)
    n_chunks = -(-(B * T) // chunk)
    width = chunk * K
    rows = jnp.pad(rows, (0, n_chunks * width - rows.size), constant_values=NO_ROW)
    rows = rows.reshape(n_chunks, width)
    local = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    rows, order = lax.sort((rows, local), dimension=1, num_keys=1, is_stable=True)
    start = jnp.concatenate(
        [jnp.ones((n_chunks, 1), bool), rows[:, 1:] != rows[:, :-1]], axis=1)
    # One past the end of each run: the next run start to the right (width after the last).
    next_start = lax.cummin(jnp.where(start, local, width), axis=1, reverse=True)
    end = jnp.concatenate(
        [next_start[:, 1:], jnp.full((n_chunks, 1), width, jnp.int32)], axis=1)
    seg_end = jnp.where(start & (rows != NO_ROW), end, 0)
    return order.reshape(-1), seg_end.reshape(-1), rows.reshape(-1)
