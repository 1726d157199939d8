"""Index lists of consecutive tokens merged into one list per group (for a small-H backward).

At small H a kernel that works on 64 rows of (token, head) wastes most of its tile on one token,
and every (token, entry) pair adds its own fp32 dkv row. Merging the lists of G consecutive tokens
lets one pass over the union of their rows serve all G tokens: the G * H rows of a group are
contiguous in q / dO / o / lse / dq ([B, T, H, D] viewed as [B, T / G, G * H, D]), and each union
entry carries a bit per token saying whose list it is in. On the benchmark's lists (window 128 +
512 random rows of 4096) the union of 4 tokens has 0.69 of their pairs, of 8 tokens 0.54
(docs/performance.md).

Entries are keyed by (row, occurrence): a row that appears n times in one token's list (each
occurrence is a separate softmax term) becomes n union entries, so membership is one bit per
token, never a count.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa.cute.constants import MEMBER_SHIFT  # pack_entries: row | membership << it
from jax_dsa.reference import valid_mask


def _run_starts(x):
    """[..., n] -> bool [..., n]: True where x differs from its left neighbour (and at 0)."""
    return jnp.concatenate([jnp.ones_like(x[..., :1], bool), x[..., 1:] != x[..., :-1]], axis=-1)


def _fill_forward(values, starts):
    """values at the run starts carried over each run (values must not decrease across starts)."""
    return lax.cummax(jnp.where(starts, values, jnp.iinfo(jnp.int32).min), axis=values.ndim - 1)


def _segmented_max_before(values, starts):
    """For each position, the max of `values` over the earlier positions of its run (0 if none)."""
    def combine(a, b):
        (start_a, max_a), (start_b, max_b) = a, b
        return start_a | start_b, jnp.where(start_b, max_b, jnp.maximum(max_a, max_b))

    _, inclusive = lax.associative_scan(combine, (starts, values), axis=values.ndim - 1)
    before = jnp.concatenate([jnp.zeros_like(inclusive[..., :1]), inclusive[..., :-1]], axis=-1)
    return jnp.where(starts, 0, before)


def group_lists(idx, topk_length, num_kv_rows: int, group: int):
    """Merge the valid entries of each `group` consecutive tokens.

    Args:
      idx: [B, T, K] int32, T a multiple of `group`.
      topk_length: [B, T] int32 (entries at slots >= it are not used).
      num_kv_rows: S (entries outside [0, S) are not used).
      group: G, 1..31 tokens per group.
    Returns:
      rows [B, T / G, G * K] int32: the union's rows, ascending, -1 after the first `length`;
      member [B, T / G, G * K] int32: bit g set iff the entry belongs to token G * i + g's list
        (0 after `length`);
      length [B, T / G] int32: union entries of each group.

    One sort per group of its G * K entries by (row, token); then the n-th occurrence of a row in
    token g's list (occ = n) joins union entry (row, occ), which the first such entry opens.
    """
    b, t, k = idx.shape
    if not 1 <= group <= 31:
        raise ValueError(f"group must be in 1..31; got {group}")
    if t % group:
        raise ValueError(f"the number of tokens ({t}) must be a multiple of group ({group})")
    n, u = t // group, group * k
    valid = valid_mask(idx, topk_length, num_kv_rows)
    # Invalid entries get the row S: they sort last and open no union entry.
    row = jnp.where(valid, idx, num_kv_rows).reshape(b, n, u)
    token = jnp.broadcast_to((jnp.arange(t, dtype=jnp.int32) % group)[None, :, None], (b, t, k))
    token = token.reshape(b, n, u)
    if (num_kv_rows + 1) * group <= jnp.iinfo(jnp.int32).max:
        key = jnp.sort(row * group + token, axis=-1)  # one int32 key: a single-operand sort
        row, token = key // group, key % group
    else:
        row, token = lax.sort((row, token), dimension=2, num_keys=2)
    pos = lax.broadcasted_iota(jnp.int32, row.shape, 2)
    row_start = _run_starts(row)
    pair_start = row_start | _run_starts(token)
    occ = pos - _fill_forward(pos, pair_start)  # n-th occurrence of the row in this token's list
    used = row < num_kv_rows
    # (row, occ) is new when no earlier token of the group has that many occurrences of the row.
    new = used & (occ + 1 > _segmented_max_before(occ + 1, row_start))
    opened = jnp.cumsum(new, axis=-1, dtype=jnp.int32)  # union entries up to here
    length = opened[..., -1]
    slot = _fill_forward(opened - new, row_start) + occ  # the row's first union slot + occ
    slot = jnp.where(used, slot, u)  # out of range: dropped by the scatters

    def per_group(slot, row, bit):
        rows = jnp.full(slot.shape, -1, jnp.int32).at[slot].max(row, mode="drop")
        # The bits of one (row, occurrence) come from distinct tokens, so their sum is their OR.
        member = jnp.zeros(slot.shape, jnp.int32).at[slot].add(bit, mode="drop")
        return rows, member

    flat = lambda x: x.reshape(b * n, u)
    rows, member = jax.vmap(per_group)(flat(slot), flat(row), flat(jnp.left_shift(1, token)))
    return rows.reshape(b, n, u), member.reshape(b, n, u), length


def pack_entries(rows, member):
    """One int32 per union entry for the grouped backward kernel: row | member << MEMBER_SHIFT,
    -1 where rows is -1. Needs rows < 2^MEMBER_SHIFT and member < 2^(31 - MEMBER_SHIFT)."""
    return jnp.where(rows >= 0, rows | jnp.left_shift(member, MEMBER_SHIFT), -1)
