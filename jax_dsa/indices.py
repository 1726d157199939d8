"""Index builders for DeepSeek-V4-style sparse attention. Absent entries are -1.

A token's list is `window ++ (compressed + offset)` over a KV buffer laid out as
`[window KV (one row per token, S_w rows) | compressed KV (one row per `ratio` tokens)]`,
with offset = S_w. Compressed row j summarises tokens [j * ratio, (j + 1) * ratio) and is
visible to token t once it is complete: (j + 1) * ratio <= t + 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.api import _check_int


def sliding_window(num_tokens: int, window: int, *, start: int = 0):
    """[T, window] int32: token t attends to rows t - window + 1 .. t (oldest first), -1 before 0.

    `start` is the position of the first token (for a chunk that continues a sequence).
    """
    _check_int(num_tokens, "num_tokens", 0)
    _check_int(window, "window", 1)
    _check_int(start, "start", 0)
    t = start + jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    rows = t - (window - 1) + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.where(rows >= 0, rows, -1)


def num_compressed(num_tokens: int, ratio: int) -> int:
    """Complete compressed rows for a sequence of num_tokens."""
    _check_int(num_tokens, "num_tokens", 0)
    _check_int(ratio, "ratio", 1)
    return num_tokens // ratio


def compressed_visible(num_tokens: int, ratio: int, *, start: int = 0):
    """[T, n_c] bool: compressed row j is visible to token t iff (j + 1) * ratio <= t + 1."""
    _check_int(start, "start", 0)
    n_c = num_compressed(start + num_tokens, ratio)
    t = start + jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    j = jnp.arange(n_c, dtype=jnp.int32)[None, :]
    return (j + 1) * ratio <= t + 1


def compressed_causal(num_tokens: int, ratio: int, *, start: int = 0):
    """[T, n_c] int32: every visible compressed row (ascending), -1 for the rest.

    This is the ratio-128 case of DeepSeek-V4: attend to all causal compressed entries.
    """
    visible = compressed_visible(num_tokens, ratio, start=start)
    j = jnp.arange(visible.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(visible, j, -1)


def causal_topk(scores, k: int, ratio: int, *, start: int = 0):
    """Top-k visible compressed rows per token from indexer scores.

    Args:
      scores: [..., T, n_c] indexer scores (any float dtype).
      k: entries per token; tokens with fewer visible rows get -1 in the remaining slots.
    Returns:
      [..., T, k] int32, highest score first.
    """
    num_tokens, n_c = scores.shape[-2], scores.shape[-1]
    _check_int(k, "k", 1)
    visible = compressed_visible(num_tokens, ratio, start=start)
    if visible.shape[1] != n_c:
        raise ValueError(f"scores has {n_c} compressed rows; {num_tokens} tokens from position "
                         f"{start} at ratio {ratio} have {visible.shape[1]}")
    # ranked in the scores' own precision (at least float32)
    masked = jnp.where(visible, scores.astype(jnp.promote_types(scores.dtype, jnp.float32)),
                       -jnp.inf)
    if k > n_c:
        pad = [(0, 0)] * (masked.ndim - 1) + [(0, k - n_c)]
        masked = jnp.pad(masked, pad, constant_values=-jnp.inf)
    _, picked = jax.lax.top_k(masked, k)
    # A token's visible rows are a prefix of the rows (ties go to the smaller row), so its
    # first count slots hold them, a visible row scoring -inf included.
    count = jnp.sum(visible, axis=-1, dtype=jnp.int32)[:, None]
    slot = jnp.arange(k, dtype=jnp.int32)
    return jnp.where(slot < count, picked.astype(jnp.int32), -1)


def concat_window_compressed(window_idx, compressed_idx, offset: int):
    """`window ++ (compressed + offset)` along the last axis, keeping -1 for absent entries.

    offset is the number of window rows in the KV buffer (where compressed row 0 sits).
    """
    _check_int(offset, "offset", 0)
    if window_idx.shape[:-1] != compressed_idx.shape[:-1]:
        raise ValueError(f"window_idx {window_idx.shape} and compressed_idx {compressed_idx.shape} "
                         "must agree on all but the last axis")
    shifted = jnp.where(compressed_idx >= 0, compressed_idx + offset, -1)
    return jnp.concatenate([window_idx.astype(jnp.int32), shifted.astype(jnp.int32)], axis=-1)
