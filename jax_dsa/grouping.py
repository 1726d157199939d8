"""Index lists of consecutive tokens merged into one list per group (for a small-H backward).

At small H a kernel that works on 64 rows of (token, head) wastes most of its tile on one token,
and every (token, entry) pair adds its own fp32 dkv row. Merging the lists of G consecutive tokens
lets one pass over the union of their rows serve all G tokens: the G * H rows of a group are
contiguous in q / dO / o / lse / dq ([B, T, H, D] viewed as [B, T / G, G * H, D]), and each union
entry carries a bit per token saying whose list it is in. On the benchmark's lists (window 128 +
512 random rows of 4096) the union of 4 tokens has 0.69 of their pairs, of 8 tokens 0.54
(docs/performance.md, "Where the time goes").

Entries are keyed by (row, occurrence): a row that appears n times in one token's list (each
occurrence is a separate softmax term) becomes n union entries, so membership is one bit per
token, never a count.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa.reference import valid_mask

# pack_entries: an entry is its kv row | membership bits << MEMBER_SHIFT (rows < 2^23, G <= 8).
MEMBER_SHIFT = 23


def _occurrences(rows):
  """[..., n] rows sorted ascending -> [..., n] index of each among the equal rows before it."""
  pos = lax.broadcasted_iota(jnp.int32, rows.shape, rows.ndim - 1)
  starts = jnp.concatenate([jnp.ones_like(rows[..., :1], bool), rows[..., 1:] != rows[..., :-1]],
                           axis=-1)
  first = lax.cummax(jnp.where(starts, pos, 0), axis=rows.ndim - 1)
  return pos - first


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
  """
  b, t, k = idx.shape
  if not 1 <= group <= 31:
    raise ValueError(f"group must be in 1..31; got {group}")
  if t % group:
    raise ValueError(f"the number of tokens ({t}) must be a multiple of group ({group})")
  n = t // group
  valid = valid_mask(idx, topk_length, num_kv_rows)
  # Invalid entries get the key S: they sort last and form no union entry.
  key = jnp.sort(jnp.where(valid, idx, num_kv_rows), axis=-1)
  occ = _occurrences(key)
  bit = jnp.left_shift(jnp.int32(1), jnp.arange(t, dtype=jnp.int32) % group)
  bit = jnp.broadcast_to(bit[None, :, None], (b, t, k))
  key, occ, bit = (x.reshape(b, n, group * k) for x in (key, occ, bit))
  key, occ, bit = lax.sort((key, occ, bit), dimension=2, num_keys=2)
  new = jnp.concatenate(
      [jnp.ones_like(key[..., :1], bool),
       (key[..., 1:] != key[..., :-1]) | (occ[..., 1:] != occ[..., :-1])], axis=-1)
  entry = jnp.cumsum(new, axis=-1, dtype=jnp.int32) - 1  # union slot of each sorted entry
  used = key < num_kv_rows
  length = jnp.sum(new & used, axis=-1, dtype=jnp.int32)

  def per_group(slot, row, bits):
    rows = jnp.full(slot.shape, -1, jnp.int32).at[slot].max(row)
    # The bits of one (row, occurrence) come from distinct tokens, so their sum is their OR.
    member = jnp.zeros(slot.shape, jnp.int32).at[slot].add(bits)
    return rows, member

  flat = lambda x: x.reshape(b * n, group * k)
  rows, member = jax.vmap(per_group)(flat(entry), flat(jnp.where(used, key, -1)),
                                     flat(jnp.where(used, bit, 0)))
  rows, member = rows.reshape(b, n, group * k), member.reshape(b, n, group * k)
  return rows, member, length


def pack_entries(rows, member):
  """One int32 per union entry for the grouped backward kernel: row | member << MEMBER_SHIFT,
  -1 where rows is -1. Needs rows < 2^MEMBER_SHIFT and member < 2^(31 - MEMBER_SHIFT)."""
  return jnp.where(rows >= 0, rows | jnp.left_shift(member, MEMBER_SHIFT), -1)
