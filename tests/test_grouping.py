"""jax_dsa.grouping: merged index lists of consecutive tokens.

Two properties: each token's multiset of valid rows is exactly the union entries carrying its bit;
and attention computed over a group's union (rows of all G tokens' heads at once, each masked to
its own token's entries) gives the reference's outputs and gradients, duplicates, invalid entries,
topk_length, dead rows and sinks included.
"""
import collections
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import grouping
from jax_dsa.grouping import MEMBER_SHIFT, group_lists
from cases import make_problem, rel_err


def _valid_rows(idx, lengths, s):
  return [int(r) for j, r in enumerate(idx) if j < lengths and 0 <= r < s]


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_union_entries_reproduce_every_tokens_list(group):
  rng = np.random.default_rng(group)
  b, t, k, s = 2, 16, 40, 50  # K close to S: many duplicates inside and across tokens
  p = make_problem(rng, b, t, 1, 8, s, k, topk="partial")
  rows, member, length = map(np.asarray, group_lists(
      jnp.asarray(p.idx), jnp.asarray(p.lengths), s, group))
  assert rows.shape == member.shape == (b, t // group, group * k)
  for bi in range(b):
    for gi in range(t // group):
      n = length[bi, gi]
      assert np.all(np.diff(rows[bi, gi, :n]) >= 0)
      assert np.all(rows[bi, gi, n:] == -1) and np.all(member[bi, gi, n:] == 0)
      assert np.all(member[bi, gi, :n] > 0) and np.all(member[bi, gi, :n] < 1 << group)
      for g in range(group):
        tok = gi * group + g
        want = collections.Counter(_valid_rows(p.idx[bi, tok], p.lengths[bi, tok], s))
        got = collections.Counter(
            int(r) for r, m in zip(rows[bi, gi, :n], member[bi, gi, :n]) if m >> g & 1)
        assert got == want, (bi, tok)


def test_large_row_counts_take_the_two_key_sort_with_the_same_result():
  # (S + 1) * G beyond int32 cannot be one sort key; that path must give the same union.
  rng = np.random.default_rng(7)
  p = make_problem(rng, 1, 16, 1, 8, 50, 40, topk="partial")
  idx = jnp.asarray(p.idx)
  lengths = jnp.asarray(p.lengths)
  small = group_lists(idx, lengths, 50, 8)
  idx_big = jnp.where((idx >= 50) | (idx < 0), -1, idx)  # the same valid entries under S = 2^29
  big = group_lists(idx_big, lengths, 1 << 29, 8)
  for a, b in zip(small, big):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_group_lists_rejects_bad_groups():
  idx = jnp.zeros((1, 6, 3), jnp.int32)
  tl = jnp.full((1, 6), 3, jnp.int32)
  with pytest.raises(ValueError, match="multiple of group"):
    group_lists(idx, tl, 10, 4)
  with pytest.raises(ValueError, match="group must be in 1..31"):
    group_lists(idx, tl, 10, 0)


def _grouped_attention(q, kv, rows, member, length, sink, scale, d_v):
  """Dense fp32 attention over each group's union: q [B, T, H, D] viewed as [B, T/G, G*H, D];
  head row r of a group belongs to token r // H and sees only the entries with that bit."""
  b, t, h, d = q.shape
  n, u = rows.shape[1], rows.shape[2]
  group = t // n
  qg = q.reshape(b, n, group * h, d)
  used = jnp.arange(u)[None, None, :] < length[..., None]
  kv_u = jax.vmap(lambda x, i: x[jnp.where(i >= 0, i, 0)])(kv, rows)  # [B, n, U, D]
  token = jnp.arange(group * h) // h
  sees = used[:, :, None, :] & ((member[:, :, None, :] >> token[None, None, :, None]) & 1 > 0)
  s = jnp.einsum("bnrd,bnud->bnru", qg, kv_u, precision="highest") * scale
  s = jnp.where(sees, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m[..., None])
  l = jnp.sum(e, axis=-1)
  sink_r = jnp.tile(sink, group)[None, None, :]
  o = jnp.einsum("bnru,bnud->bnrd", e, kv_u[..., :d_v], precision="highest")
  o = o / (l + jnp.exp(sink_r - m))[..., None]
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return o.reshape(b, t, h, d_v), lse.reshape(b, t, h)


@pytest.mark.parametrize("h,group", [(4, 4), (2, 8), (8, 2)])
def test_attention_over_the_union_matches_the_reference(h, group):
  rng = np.random.default_rng(100 + h)
  b, t, d, s, k = 2, 8, 16, 24, 12
  p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial", d_v=12)
  q, kv, sink = jnp.asarray(p.q), jnp.asarray(p.kv), jnp.asarray(p.sink)
  idx, tl = jnp.asarray(p.idx), jnp.asarray(p.lengths)
  rows, member, length = group_lists(idx, tl, s, group)
  w_o = jnp.asarray(rng.standard_normal((b, t, h, p.d_v)), jnp.float32)
  w_lse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)

  def loss(o, lse):
    return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

  def reference(q, kv, sink):
    return jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=p.d_v,
                              return_lse=True, implementation="xla")

  def grouped(q, kv, sink):
    return _grouped_attention(q, kv, rows, member, length, sink, p.scale, p.d_v)

  (o_r, lse_r), (o_g, lse_g) = reference(q, kv, sink), grouped(q, kv, sink)
  assert rel_err(o_g, o_r) < 1e-5
  np.testing.assert_array_equal(np.isfinite(lse_g), np.isfinite(lse_r))
  finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
  assert rel_err(finite(lse_g), finite(lse_r)) < 1e-5
  grads_r = jax.grad(lambda *a: loss(*reference(*a)), argnums=(0, 1, 2))(q, kv, sink)
  grads_g = jax.grad(lambda *a: loss(*grouped(*a)), argnums=(0, 1, 2))(q, kv, sink)
  for name, g, r in zip(("dq", "dkv", "dsink"), grads_g, grads_r):
    assert rel_err(g, r) < 1e-4, (name, rel_err(g, r))


# (forced JAX_DSA_BWD_IMPL, H, T, K, S, deterministic, union kernel built) -> group
BACKWARD_GROUP_CASES = [
    ("", 16, 4096, 640, 4096, False, True, 4),
    ("", 8, 4096, 640, 4096, False, True, 8),
    ("", 8, 16, 768, 4096, False, True, 8),      # G * K = 6144: the union kernel's capacity
    ("", 8, 16, 769, 4096, False, True, 1),      # beyond it: the plain kernel
    ("", 16, 4096, 2048, 4096, False, True, 1),
    ("", 16, 4098, 640, 4096, False, True, 1),   # T not a multiple of 4
    ("", 16, 4096, 640, 4096, True, True, 1),    # deterministic
    ("", 16, 4096, 640, 1 << 23, False, True, 1),  # S too large for the membership bits
    ("", 16, 4096, 640, 4096, False, False, 1),  # library without the grouped kernels
    ("", 32, 4096, 640, 4096, False, True, 2),
    ("", 32, 4096, 3072, 4096, False, True, 2),   # G * K = 6144
    ("", 32, 4096, 3073, 4096, False, True, 1),
    ("", 32, 4097, 640, 4096, False, True, 1),   # T odd
    ("", 32, 4096, 640, 4096, True, True, 1),    # deterministic
    ("", 24, 4096, 640, 4096, False, True, 1),   # 64 / H not a whole number of tokens
    ("", 64, 4096, 640, 4096, False, True, 1),
    ("", 4, 4096, 640, 4096, False, True, 1),
    ("wg", 16, 4096, 640, 4096, False, True, 1),  # a forced plain variant never groups
    ("wgk3", 8, 4096, 640, 4096, False, True, 1),
    ("wgg4", 16, 4096, 2048, 4096, False, True, 4),  # forced: the union by XLA beyond 6144
    ("wgg4", 8, 4096, 640, 4096, False, True, 1),  # forced, but H * G != 64
    ("wgg2", 32, 4096, 640, 4096, False, True, 2),
    ("wgg2", 16, 4096, 640, 4096, False, True, 1),  # forced, but H * G != 64
    ("wgg4m", 16, 4096, 640, 4096, False, True, 4),  # a grouped candidate: its G
    ("wgg8m", 16, 4096, 640, 4096, False, True, 1),  # ... and only where H * G = 64
]


@pytest.mark.parametrize("case", BACKWARD_GROUP_CASES, ids=str)
def test_backward_group_choice(case, monkeypatch):
  """Which calls the backward runs grouped (_core._backward_group)."""
  from jax_dsa import _core, _native
  forced, h, t, k, s, deterministic, built, want = case
  monkeypatch.setattr(_core, "_forced_bwd_impl", lambda: forced)
  monkeypatch.setattr(_native, "has_group_union", lambda: built, raising=False)
  assert _core._backward_group((1, t, h, 576), k, s, deterministic) == want


def test_union_capacity_matches_the_kernel():
  """_core.UNION_CAPACITY is the list-union kernel's CAPACITY, and its FFI handler
  (ffi/group_union.cc) has the same capacity and table sizes (read from the sources, which
  needs no GPU and no nvidia-cutlass-dsl)."""
  import re
  from jax_dsa import _core
  path = os.path.join(os.path.dirname(jax_dsa.__file__), "kernels", "sm90", "group_union.py")
  with open(path) as f:
    kernel = f.read()
  capacity = int(re.search(r"^CAPACITY = (\d+)", kernel, re.M).group(1))
  tables = [int(x) for x in re.search(r"^TABLES = \(([\d, ]+)\)", kernel, re.M).group(1).split(",")]
  assert _core.UNION_CAPACITY == capacity == 3 * max(tables) // 4
  handler = os.path.join(os.path.dirname(__file__), "..", "ffi", "group_union.cc")
  with open(handler) as f:
    cc = f.read()
  assert int(re.search(r"kUnionCapacity = (\d+);", cc).group(1)) == capacity
  cc_tables = re.search(r"kUnionTables\[\] = \{([\d, ]+)\};", cc).group(1)
  assert [int(x) for x in cc_tables.split(",")] == sorted(tables)


@pytest.mark.parametrize("h,t,deterministic", [(8, 8, False), (16, 6, False), (16, 8, True)])
def test_grouped_backward_refuses_what_it_cannot_run(h, t, deterministic, monkeypatch):
  """The grouped path refuses a call it cannot serve; under JAX_DSA_BWD_IMPL=wgg4 (and by
  default) such a call runs the plain kernel instead (the library picks the grouped kernel per
  call)."""
  from jax_dsa import _core, _native
  q = jnp.zeros((1, t, h, 8), jnp.bfloat16)
  kv = jnp.zeros((1, 32, 8), jnp.bfloat16)
  idx = jnp.zeros((1, t, 4), jnp.int32)
  tl = jnp.full((1, t), 4, jnp.int32)
  lse = jnp.zeros((1, t, h), jnp.float32)
  with pytest.raises(NotImplementedError, match="grouped backward"):
    _core._grouped_kernel_backward(q, kv, idx, tl, lse, q, q, jnp.stack([lse, lse], -1),
                                   scale=1.0, deterministic=deterministic, group=4)
  calls = []

  def plain_kernel(q, kv, idx, topk_length, lse, do, o, coef, scale, group=1):
    calls.append(group)
    return (jnp.zeros_like(q), jnp.zeros(kv.shape, jnp.float32),
            jnp.zeros(q.shape[:3], jnp.float32))

  monkeypatch.setattr(_core, "_forced_bwd_impl", lambda: "wgg4")
  monkeypatch.setattr(_native, "sparse_mla_bwd", plain_kernel, raising=False)
  monkeypatch.setattr(_native, "sparse_mla_bwd_deterministic", plain_kernel, raising=False)
  sink = jnp.zeros((h,), jnp.float32)
  _core._kernel_backward(q, kv, idx, tl, sink, q, lse, q, lse, scale=1.0,
                         deterministic=deterministic)
  assert calls == [1]


def _grouped_kernel_emulator(q, kv, entries, length, lse, do, o, coef, scale, group):
  """What the grouped backward kernel (`group=4`, H' = 64 rows of 4 tokens x 16 heads)
  computes, in dense fp32: entry j of a group is row entry & (2^23 - 1), seen by head row i when
  bit 23 + i // 16 is set; the rest as _native.sparse_mla_bwd documents."""
  assert group == 4
  b, n, rows_h, d = q.shape
  s_rows = kv.shape[1]
  u = entries.shape[2]
  row = entries & ((1 << MEMBER_SHIFT) - 1)
  ok = (entries >= 0) & (row < s_rows) & (jnp.arange(u)[None, None, :] < length[..., None])
  tok = jnp.arange(rows_h) // (rows_h // 4)
  bit = (entries[:, :, None, :] >> (MEMBER_SHIFT + tok[None, None, :, None])) & 1
  sees = ok[:, :, None, :] & (bit > 0)
  kv_u = jax.vmap(lambda x, i: x[i])(kv, jnp.where(ok, row, 0)).astype(jnp.float32)
  q32, do32, o32 = (x.astype(jnp.float32) for x in (q, do, o))
  s = jnp.einsum("bnhd,bnud->bnhu", q32, kv_u, precision="highest") * scale
  live = jnp.isfinite(lse)
  p = jnp.where(sees & live[..., None], jnp.exp(s - jnp.where(live, lse, 0.0)[..., None]), 0.0)
  delta = jnp.sum(do32 * o32, axis=-1)
  c, dlse = coef[..., 0], coef[..., 1]
  dp = jnp.einsum("bnhd,bnud->bnhu", do32, kv_u[..., :512], precision="highest")
  ds = p * (c[..., None] * dp - (c * delta - dlse)[..., None])
  dq = scale * jnp.einsum("bnhu,bnud->bnhd", ds, kv_u, precision="highest")
  drow = scale * jnp.einsum("bnhu,bnhd->bnud", ds, q32, precision="highest")
  dv = jnp.einsum("bnhu,bnhd->bnud", c[..., None] * p, do32, precision="highest")
  drow = drow.at[..., :512].add(dv)
  target = jnp.where(ok, row, s_rows).reshape(b, n * u)
  dkv = jax.vmap(lambda t, r: jnp.zeros((s_rows + 1, d), jnp.float32).at[t].add(r)[:s_rows])(
      target, drow.reshape(b, n * u, d))
  return dq.astype(q.dtype), dkv, delta


def _union_kernel_emulator(idx, topk_length, num_kv_rows, group):
  """_native.group_union's contract without a GPU: the packed union entries and lengths, each
  group's valid entries in another order (the kernel emits them in hash-slot order)."""
  rows, member, length = grouping.group_lists(idx, topk_length, num_kv_rows, group)
  packed = grouping.pack_entries(rows, member)
  width = packed.shape[-1]
  pos = jnp.arange(width, dtype=jnp.int32)
  # Reverse the first `length` entries of each group; the -1 padding stays at the end.
  src = jnp.where(pos < length[..., None], length[..., None] - 1 - pos, pos)
  return jnp.take_along_axis(packed, src, axis=-1), length


@pytest.mark.parametrize("union", ["xla", "kernel"])
def test_grouped_backward_plumbing_matches_the_reference(monkeypatch, union):
  """_core's grouped path (views, packed entries, union lengths, delta and dsink) with the
  kernel replaced by _grouped_kernel_emulator, and the list union taken from XLA or from the
  union kernel (emulated), gives the reference backward's gradients."""
  from jax_dsa import _core, _native, reference
  rng = np.random.default_rng(7)
  b, t, h, d, s, k = 2, 8, 16, 576, 40, 24
  p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="partial")
  q, kv, sink = jnp.asarray(p.q), jnp.asarray(p.kv), jnp.asarray(p.sink)
  idx, tl = jnp.asarray(p.idx), jnp.asarray(p.lengths)
  o, lse = reference.forward(q, kv, idx, tl, sink, scale=p.scale, d_v=512)
  do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
  dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
  want = reference.backward(q, kv, idx, tl, sink, o, lse, do, dlse, scale=p.scale, d_v=512)
  # The default groups (G = 64 / 16) when the union kernel is built; wgg4 forces it otherwise.
  monkeypatch.setattr(_core, "_forced_bwd_impl", lambda: "" if union == "kernel" else "wgg4")
  monkeypatch.setattr(_native, "sparse_mla_bwd", _grouped_kernel_emulator, raising=False)
  monkeypatch.setattr(_native, "has_group_union", lambda: union == "kernel", raising=False)
  monkeypatch.setattr(_native, "group_union", _union_kernel_emulator, raising=False)
  got = _core._kernel_backward(q, kv, idx, tl, sink, o, lse, do, dlse, scale=p.scale,
                               deterministic=False)
  for name, g, w in zip(("dq", "dkv", "dsink"), got, want):
    assert rel_err(g, w) < 1e-4, (name, rel_err(g, w))
