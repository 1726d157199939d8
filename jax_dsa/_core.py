"""The differentiable core: custom_vjp over the (sharded, vmappable) forward and backward ops.

Inputs are canonical here: q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K] int32,
topk_length [B, T] int32, sink [H] float32 (-inf for "no sink"). `impl` is already resolved:
"xla" (reference), "cute" (kernel, forced) or "auto" (kernel when lowered for CUDA, reference on
any other platform).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa import grouping, reference, sharding


def _local_forward(q, kv, idx, topk_length, sink, *, scale, d_v, impl):
  def ref(*args):
    return reference.forward(*args, scale=scale, d_v=d_v)

  def kernel(*args):
    from jax_dsa import _native  # the built library's loader; only reached when it exists
    return _native.sparse_mla_fwd(*args, scale=scale)

  args = (q, kv, idx, topk_length, sink)
  if impl == "xla":
    return ref(*args)
  if impl == "cute":
    return kernel(*args)
  return lax.platform_dependent(*args, cuda=kernel, default=ref)


# G * K at most for the list-union kernel (jax_dsa/kernels/sm90/group_union.py CAPACITY; its
# FFI handler checks it too).
UNION_CAPACITY = 6144


@functools.lru_cache(maxsize=None)
def _forced_bwd_impl() -> str:
  """JAX_DSA_BWD_IMPL, read once ("" when unset or "default")."""
  tag = os.environ.get("JAX_DSA_BWD_IMPL", "")
  return "" if tag in ("default", "wgmma") else tag


def _backward_group(q_shape, k: int, s_rows: int, deterministic: bool) -> int:
  """How many consecutive tokens the atomic backward runs as one 64-row token (1: none).

  By default G = 64 / H at H = 32 (G = 2), H = 16 (G = 4) and H = 8 (G = 8): the tokens' index
  lists overlap (the window), so the union carries fewer rows than the lists and the dkv
  atomics, the H <= 64 kernel's floor, shrink with it (docs/performance.md). Only calls the
  grouped kernel can serve (_grouping_problem) whose union the list-union kernel computes
  (G * K <= UNION_CAPACITY) are grouped; the others run the plain kernel.
  JAX_DSA_BWD_IMPL=wgg<G> (or a grouped candidate wgg<G><suffix>) groups every call it can by
  G (the union by XLA beyond the union kernel); any other forced variant (e.g. "wg") never
  groups."""
  forced = _forced_bwd_impl()
  if forced.startswith("wgg") and forced[3:4].isdigit():  # e.g. wgg4, or a candidate wgg4m
    group = int(forced[3])
    return 1 if _grouping_problem(q_shape, s_rows, group, deterministic) else group
  h = q_shape[2]
  if forced or h not in (8, 16, 32):
    return 1
  group = 64 // h
  if _grouping_problem(q_shape, s_rows, group, deterministic) or group * k > UNION_CAPACITY:
    return 1
  from jax_dsa import _native
  return group if _native.has_group_union() else 1  # the library builds all or none


def _grouping_problem(q_shape, s_rows: int, group: int, deterministic: bool) -> str:
  """Why a backward call cannot run grouped by `group` tokens ("" if it can)."""
  _, t, h, _ = q_shape
  if deterministic or h * group != 64 or t % group or s_rows >= 1 << grouping.MEMBER_SHIFT:
    return (f"the grouped backward (by {group} tokens) needs H * {group} = 64, T a multiple of "
            f"{group}, S < 2^{grouping.MEMBER_SHIFT} and deterministic=False; got H={h}, T={t}, "
            f"S={s_rows}, deterministic={deterministic}")
  return ""


def _kernel_backward(q, kv, idx, topk_length, sink, o, lse, do, dlse, *, scale, deterministic):
  """dq, dkv and delta = rowsum(do * o) on the Hopper kernel; the sink terms in plain JAX."""
  from jax_dsa import _native
  c, sink_share = reference.sink_split(sink[None, None, :], lse)
  # dS_j = p~_j * (c * dP_j - (c * delta - dlse)): the kernel computes delta and needs c, dlse.
  coef = jnp.stack([c, dlse], axis=-1)
  group = _backward_group(q.shape, idx.shape[-1], kv.shape[1], deterministic)
  if group > 1:
    dq, dkv, delta = _grouped_kernel_backward(q, kv, idx, topk_length, lse, do, o, coef,
                                              scale=scale, deterministic=deterministic,
                                              group=group)
  else:
    bwd = _native.sparse_mla_bwd_deterministic if deterministic else _native.sparse_mla_bwd
    dq, dkv, delta = bwd(q, kv, idx, topk_length, lse, do, o, coef, scale=scale)
  dsink = jnp.where(jnp.isneginf(sink)[None, :], 0.0, -jnp.sum(sink_share * delta, axis=1))
  return dq, dkv, dsink


def _grouped_kernel_backward(q, kv, idx, topk_length, lse, do, o, coef, *, scale, deterministic,
                             group):
  """The grouped backward kernel: `group` consecutive tokens of H heads run as one 64-row token
  over the union of their lists (jax_dsa.grouping). Only H * group == 64."""
  from jax_dsa import _native
  b, t, h, _ = q.shape
  s_rows = kv.shape[1]
  problem = _grouping_problem(q.shape, s_rows, group, deterministic)
  if problem:
    raise NotImplementedError(problem)
  if _use_union_kernel(idx.shape[-1], group):
    entries, length = _native.group_union(idx, topk_length, s_rows, group)
  else:
    rows, member, length = grouping.group_lists(idx, topk_length, s_rows, group)
    entries = grouping.pack_entries(rows, member)
  n = t // group

  def view(x):  # [B, T, H, ...] -> [B, T / group, group * H, ...] (rows stay contiguous)
    return x.reshape(b, n, group * h, *x.shape[3:])

  dq, dkv, delta = _native.sparse_mla_bwd(view(q), kv, entries, length, view(lse), view(do),
                                          view(o), view(coef), scale=scale, group=group)
  return dq.reshape(q.shape), dkv, delta.reshape(b, t, h)


def _use_union_kernel(k: int, group: int) -> bool:
  """Whether the grouped backward takes its list union from the CUDA kernel
  (_native.group_union; G * K <= UNION_CAPACITY) rather than from XLA (jax_dsa.grouping, 0.4 ms
  at the benchmark's H = 16 shape). JAX_DSA_GROUP_UNION=xla forces XLA's, for comparison."""
  from jax_dsa import _native
  if os.environ.get("JAX_DSA_GROUP_UNION", "") == "xla" or group * k > UNION_CAPACITY:
    return False
  return _native.has_group_union()


def _local_backward(q, kv, idx, topk_length, sink, o, lse, do, dlse, *, scale, d_v, impl,
                    deterministic):
  def ref(*args):
    return reference.backward(*args, scale=scale, d_v=d_v, deterministic=deterministic)

  def kernel(*args):
    return _kernel_backward(*args, scale=scale, deterministic=deterministic)

  args = (q, kv, idx, topk_length, sink, o, lse, do, dlse)
  if impl == "xla" or not _backward_kernel_built(deterministic):
    return ref(*args)
  if impl == "cute":
    return kernel(*args)
  return lax.platform_dependent(*args, cuda=kernel, default=ref)


@functools.lru_cache(maxsize=None)
def _backward_kernel_built(deterministic: bool = False) -> bool:
  """A library built without the backward kernels (or without the deterministic one) leaves
  every implementation differentiating with the reference formulas (they need only the
  forward's o and lse)."""
  try:
    from jax_dsa import _native
  except ImportError:
    return False
  return hasattr(_native, "sparse_mla_bwd") and _native.has_backward(deterministic)


@functools.lru_cache(maxsize=None)
def _ops(scale: float, d_v: int, impl: str, deterministic: bool):
  local_bwd = functools.partial(_local_backward, deterministic=deterministic)
  return (sharding.make_forward(_local_forward, scale, d_v, impl),
          sharding.make_backward(local_bwd, scale, d_v, impl))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def attention(q, kv, idx, topk_length, sink, scale, d_v, impl, deterministic):
  """(o [B, T, H, d_v], lse [B, T, H] float32); differentiable in q, kv and sink."""
  fwd, _ = _ops(scale, d_v, impl, deterministic)
  return fwd(q, kv, idx, topk_length, sink)


def _attention_fwd(q, kv, idx, topk_length, sink, scale, d_v, impl, deterministic):
  fwd, _ = _ops(scale, d_v, impl, deterministic)
  o, lse = fwd(q, kv, idx, topk_length, sink)
  return (o, lse), (q, kv, idx, topk_length, sink, o, lse)


def _attention_bwd(scale, d_v, impl, deterministic, residuals, cotangents):
  q, kv, idx, topk_length, sink, o, lse = residuals
  do, dlse = cotangents
  _, bwd = _ops(scale, d_v, impl, deterministic)
  dq, dkv, dsink = bwd(q, kv, idx, topk_length, sink, o, lse, do.astype(o.dtype),
                       dlse.astype(jnp.float32))
  return dq, dkv.astype(kv.dtype), None, None, jnp.sum(dsink, axis=0)


attention.defvjp(_attention_fwd, _attention_bwd)
