"""Forward and backward of one device's shard on the Hopper kernels, for a resolved Config.

Inputs are canonical: q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K] int32, topk_length
[B, T] int32, sink [H] float32 (-inf for "no sink"). The one-pool backward's sink terms are
plain JAX (the kernels compute dq, the fp32 dkv and delta = rowsum(do * o)); the two-pool
kernel computes them itself.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_dsa import reference
from jax_dsa.cute import ffi, grouping
from jax_dsa.cute.config import Config, grouping_problem


def forward(q, kv, idx, topk_length, sink, *, scale, config: Config, poison_outputs=False):
    """(o [B, T, H, 512] q.dtype, lse [B, T, H] float32); config.fwd.splits > 1 splits each
    token's list into parts combined by lse: the pingpong kernel's decode form reads the parts
    in place and a combine kernel merges them (ffi.sparse_mla_fwd_split), the small-heads
    kernel runs them as tokens of their own (reference.split_forward). poison_outputs (tests):
    the kernel's outputs start as NaN."""
    splits = config.fwd.splits
    if splits > 1 and config.fwd.kernel == "pingpong":
        return ffi.sparse_mla_fwd_split(q, kv, idx, topk_length, sink, scale=scale,
                                        parts=splits, poison_outputs=poison_outputs)
    run = functools.partial(ffi.sparse_mla_fwd, scale=scale, kernel=config.fwd.kernel,
                            poison_outputs=poison_outputs)
    if splits == 1:
        return run(q, kv, idx, topk_length, sink)
    return reference.split_forward(run, q, kv, idx, topk_length, sink, splits=splits)


def backward(q, kv, idx, topk_length, sink, o, lse, do, dlse, *, scale, config: Config,
             deterministic: bool):
    """(dq, dkv float32, dsink [B, H])."""
    coef, sink_share = _coef(sink, lse, dlse)
    bwd = config.bwd
    if deterministic:
        dq, dkv, delta = ffi.sparse_mla_bwd_deterministic(
            q, kv, idx, topk_length, lse, do, o, coef, scale=scale,
            workspace_bytes=bwd.workspace_bytes)
    elif bwd.group > 1:
        dq, dkv, delta = _grouped_backward(q, kv, idx, topk_length, lse, do, o, coef,
                                           scale=scale, group=bwd.group, union=bwd.union)
    else:
        if bwd.sort_rows:
            idx, topk_length = rows_in_order(idx, topk_length, kv.shape[1],
                                             ctas_per_token=-(-q.shape[2] // 64))
        dq, dkv, delta = ffi.sparse_mla_bwd(q, kv, idx, topk_length, lse, do, o, coef,
                                            scale=scale)
    return dq, dkv, _dsink(sink, sink_share, delta)


def rows_in_order(idx, topk_length, num_kv_rows: int, ctas_per_token: int = 0):
    """(idx, topk_length) with each token's valid rows first, in row order (BwdConfig.sort_rows):
    the row-order kernel (rows bucketed by row * 127 // S, the list's order within a bucket:
    ffi/kernels/sm90/rows_order.py; descending for every other wave of the backward's CTAs when
    ctas_per_token > 0) where the library has it, else `rows_ascending` (all ascending)."""
    if ffi.has_rows_order() and 0 < num_kv_rows < 2**31:
        return ffi.rows_order(idx, topk_length, num_kv_rows, ctas_per_token)
    return rows_ascending(idx, topk_length, num_kv_rows)


def rows_ascending(idx, topk_length, num_kv_rows: int):
    """Each token's list as its valid rows in ascending order followed by its invalid entries
    (as row `num_kv_rows`, itself invalid), and the valid count as topk_length: the same
    multiset of valid rows, so the same sums up to fp32 rounding (BwdConfig.sort_rows)."""
    k = idx.shape[-1]
    slot = jnp.arange(k, dtype=jnp.int32)
    valid = (idx >= 0) & (idx < num_kv_rows) & (slot < topk_length[..., None])
    rows = jnp.sort(jnp.where(valid, idx, jnp.int32(num_kv_rows)), axis=-1)
    return rows, jnp.sum(valid, axis=-1, dtype=jnp.int32)


def _coef(sink, lse, dlse):
    """The kernels' per-row coef [B, T, H, 2] = (c, dlse), c = 1 / (1 + e^(sink - lse)), and
    the sink's share of each row for dsink: dS_j = p~_j (c dP_j - (c delta - dlse)), where the
    kernel computes delta."""
    c, sink_share = reference.sink_split(sink[None, None, :], lse)
    return jnp.stack([c, dlse], axis=-1), sink_share


def _dsink(sink, sink_share, delta):
    """dsink [B, H] from the kernel's delta (0 for "no sink", -inf)."""
    return jnp.where(jnp.isneginf(sink)[None, :], 0.0, -jnp.sum(sink_share * delta, axis=1))


def backward_two_pool(q, kv, kv2, idx, topk_length, sink, o, lse, do, dlse, *, scale):
    """The plain backward over two pools read in place (idx numbers kv's rows, then kv2's
    from S1 on: jax_dsa._core.one_list; the kernel computes c and dsink): (dq, dkv float32
    [B, S1 + S2, Dqk], dsink [B, H])."""
    return ffi.sparse_mla_bwd_two_pool(q, kv, kv2, idx, topk_length, lse, do, o, sink, dlse,
                                       scale=scale)


def _grouped_backward(q, kv, idx, topk_length, lse, do, o, coef, *, scale, group, union):
    """`group` consecutive tokens of H heads run as one 64-row token over the union of their
    lists (jax_dsa.cute.grouping), computed by the list-union kernel or by XLA."""
    b, t, h, _ = q.shape
    s_rows = kv.shape[1]
    problem = grouping_problem(q.shape, s_rows, group, False)
    if problem:
        raise ValueError(problem)
    if union == "kernel":
        entries, length = ffi.group_union(idx, topk_length, s_rows, group)
    else:
        rows, member, length = grouping.group_lists(idx, topk_length, s_rows, group)
        entries = grouping.pack_entries(rows, member)
    n = t // group

    def view(x):  # [B, T, H, ...] -> [B, T / group, group * H, ...] (rows stay contiguous)
        return x.reshape(b, n, group * h, *x.shape[3:])

    dq, dkv, delta = ffi.sparse_mla_bwd(view(q), kv, entries, length, view(lse), view(do),
                                        view(o), view(coef), scale=scale, group=group)
    return dq.reshape(q.shape), dkv, delta.reshape(b, t, h)
