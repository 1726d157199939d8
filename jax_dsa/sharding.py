"""Sharding and batching rules for the sparse-MLA operations (forward, backward), the indexer's
selection, the attention target and the indexer loss.

Given kv and idx, tokens, batch entries and heads of q are independent. Under `jax.jit` with
sharded inputs, `custom_partitioning` keeps q/o/lse (and dq) sharded over batch, tokens and heads,
replicates kv's S and D and idx's K, and sums the partial dkv (over token and head shards) and the
partial sink gradient (over token shards) inside the partitioned computation. Inside `shard_map`
(all mesh axes manual) custom_partitioning lowers the plain per-shard call, and shard_map's own
transpose sums the cotangents of replicated inputs.

The indexer's selection and the indexer loss shard over batch and tokens (each token carries
its position, so a token shard knows its start) and replicate k and the heads (the score sums
over them); the loss's dk is summed over token shards. The attention target's mass (summed over
heads) shards over batch, tokens and heads and is summed over head shards.

A batch, token or head dimension that its mesh axes do not split evenly (a sharding constraint
can ask for that) is replicated instead: XLA would pad the last shards, and the padding would
join the partial sums.

`vmap` over any of them folds the mapped axis into the batch axis B (one call, no loop).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

# Operands: q [b t h d], kv [b s d], idx [b t k], topk_length [b t], sink [h].
_FWD_RULE = "b t h d, b s d, b t k, b t, h -> b t h v, b t h"
# The two-pool forward adds pool 2 (kv2 [b r d], idx2 [b t n], topk_length2 [b t]) before sink.
_FWD2_RULE = "b t h d, b s d, b t k, b t, b r d, b t n, b t, h -> b t h v, b t h"
# Backward adds o, lse, do, dlse; returns dq, dkv (fp32), dsink per batch entry [b h].
_BWD_RULE = ("b t h d, b s d, b t k, b t, h, b t h v, b t h, b t h v, b t h"
             " -> b t h d, b s d, b h")
# The two-pool backward: the two-pool forward's operands, then o, lse, do, dlse; returns dq,
# dkv, dkv2 (fp32), dsink [b h].
_BWD2_RULE = ("b t h d, b s d, b t k, b t, b r d, b t n, b t, h, b t h v, b t h, b t h v, b t h"
              " -> b t h d, b s d, b r d, b h")
_REPLICATED_FACTORS = ("d", "s", "k", "v")
_REPLICATED_FACTORS2 = ("d", "s", "k", "r", "n", "v")  # in order of appearance
# The indexer: q [b t h d], k [b s d], weights [b t h], positions [b t] -> scores, idx [b t n].
_INDEXER_RULE = "b t h d, b s d, b t h, b t -> b t n, b t n"
# The attention target's mass: q, kv, idx, topk_length, off [b t h] -> mass summed over heads.
_MASS_RULE = "b t h d, b s d, b t k, b t, b t h -> b t k"
# The indexer loss: q, k, weights, idx, topk_length, target [b t k] -> KL per token and the
# per-entry signal [b t k]; the backward takes the signal in the target's place and the
# cotangent g [b t], and returns dq, dk (fp32), dweights.
_LOSS_FWD_RULE = "b t h d, b s d, b t h, b t k, b t, b t k -> b t, b t k"
_LOSS_BWD_RULE = "b t h d, b s d, b t h, b t k, b t, b t k, b t -> b t h d, b s d, b t h"


def _entries(sharding, ndim: int):
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _even(entry, size: int, sharding):
    """`entry` when its mesh axes split `size` evenly, else None (replicated). An uneven split
    pads the last shards, and the padded rows would join the partial sums (dkv, dsink, mass)."""
    axes = _axes(entry)
    if not axes:
        return entry
    parts = 1
    for a in axes:
        parts *= sharding.mesh.shape[a]
    return entry if size % parts == 0 else None


def _q_layout(arg_shapes):
    """Mesh axes of q's batch, token and head dimensions (D is never sharded); a dimension
    that its axes do not split evenly is replicated."""
    q = arg_shapes[0]
    return tuple(_even(e, n, q.sharding) for e, n in zip(_entries(q.sharding, 4)[:3], q.shape))


def _named(mesh, specs):
    return tuple(NamedSharding(mesh, s) for s in specs)


def _fwd_specs(b, t, h):
    args = (P(b, t, h, None), P(b, None, None), P(b, t, None), P(b, t), P(h))
    outs = (P(b, t, h, None), P(b, t, h))
    return args, outs


def _fwd2_specs(b, t, h):
    (q, kv, idx, length, sink), outs = _fwd_specs(b, t, h)
    return (q, kv, idx, length, kv, idx, length, sink), outs


def _bwd_specs(b, t, h):
    fwd_args, (o, lse) = _fwd_specs(b, t, h)
    args = fwd_args + (o, lse, o, lse)
    outs = (P(b, t, h, None), P(b, None, None), P(b, h))
    return args, outs


def _fold_vmap(op: Callable, num_outputs: int, sink_pos: int | None = 4):
    """Make `op` (arrays with a leading batch axis B) vmappable by folding the vmapped axis into B.

    Every output leads with B (the sink gradient is returned per batch entry for this reason), so
    outputs unfold uniformly. The sink ([H], argument `sink_pos`; None: no such argument) has no
    B axis: if it is batched we map sequentially. The rule calls the vmappable op itself, so an
    outer vmap (nested vmap, vmap of jacrev) folds its axis in the same way.
    """
    folded = jax.custom_batching.custom_vmap(op)

    @folded.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = tuple(jnp.asarray(x) for x in args)  # batched NumPy constants reach here unconverted
        if sink_pos is not None and in_batched[sink_pos]:
            outs = jax.lax.map(lambda a: folded(*a), tuple(
                x if bat else jnp.broadcast_to(x, (axis_size,) + x.shape)
                for x, bat in zip(args, in_batched)))
            return outs, (True,) * num_outputs

        def fold(i, x, bat):
            if i == sink_pos:
                return x
            if not bat:
                x = jnp.broadcast_to(x, (axis_size,) + x.shape)
            return x.reshape((axis_size * x.shape[1],) + x.shape[2:])

        outs = folded(*(fold(i, x, bat) for i, (x, bat) in enumerate(zip(args, in_batched))))
        outs = tuple(y.reshape((axis_size, y.shape[0] // axis_size) + y.shape[1:]) for y in outs)
        return outs, (True,) * num_outputs

    return folded


def make_forward(local_fwd: Callable, scale: float, d_v: int, impl: str):
    """Partitioned, vmappable forward: (q, kv, idx, topk_length, sink) -> (o, lse)."""

    def body(q, kv, idx, topk_length, sink):
        return local_fwd(q, kv, idx, topk_length, sink, scale=scale, d_v=d_v, impl=impl)

    op = custom_partitioning(body)

    def infer(mesh, arg_shapes, result_shape):
        _, outs = _fwd_specs(*_q_layout(arg_shapes))
        return _named(mesh, outs)

    def partition(mesh, arg_shapes, result_shape):
        args, outs = _fwd_specs(*_q_layout(arg_shapes))
        return mesh, body, _named(mesh, outs), _named(mesh, args)

    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=_FWD_RULE, need_replication_factors=_REPLICATED_FACTORS)
    return _fold_vmap(op, num_outputs=2)


def make_forward_two_pool(local_fwd: Callable, scale: float, d_v: int, impl: str):
    """Partitioned, vmappable two-pool forward: (q, kv, idx, topk_length, kv2, idx2,
    topk_length2, sink) -> (o, lse); pool 2 shards like pool 1."""

    def body(*args):
        return local_fwd(*args, scale=scale, d_v=d_v, impl=impl)

    return _partitioned(body, _FWD2_RULE, _REPLICATED_FACTORS2,
                        lambda arg_shapes: _fwd2_specs(*_q_layout(arg_shapes)), None, 2,
                        sink_pos=7)


def make_backward(local_bwd: Callable, scale: float, d_v: int, impl: str):
    """Partitioned, vmappable backward:
    (q, kv, idx, topk_length, sink, o, lse, do, dlse) -> (dq, dkv fp32, dsink [B, H])."""

    def body(*args):
        return local_bwd(*args, scale=scale, d_v=d_v, impl=impl)

    op = custom_partitioning(body)

    def infer(mesh, arg_shapes, result_shape):
        _, outs = _bwd_specs(*_q_layout(arg_shapes))
        return _named(mesh, outs)

    def partition(mesh, arg_shapes, result_shape):
        b, t, h = _q_layout(arg_shapes)
        args, outs = _bwd_specs(b, t, h)

        def lower(*shard_args):
            dq, dkv, dsink = body(*shard_args)
            # Partial sums: every token/head shard scattered into its own copy of dkv.
            kv_reduce = _axes(t) + _axes(h)
            if kv_reduce:
                dkv = jax.lax.psum(dkv, kv_reduce)
            if _axes(t):
                dsink = jax.lax.psum(dsink, _axes(t))
            return dq, dkv, dsink

        return mesh, lower, _named(mesh, outs), _named(mesh, args)

    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=_BWD_RULE, need_replication_factors=_REPLICATED_FACTORS)
    return _fold_vmap(op, num_outputs=3)


def make_backward_two_pool(local_bwd: Callable, scale: float, d_v: int, impl: str):
    """Partitioned, vmappable two-pool backward: (q, kv, idx, topk_length, kv2, idx2,
    topk_length2, sink, o, lse, do, dlse) -> (dq, dkv fp32, dkv2 fp32, dsink [B, H]); both
    pools' partial gradients are summed over token and head shards, dsink over token shards."""

    def body(*args):
        return local_bwd(*args, scale=scale, d_v=d_v, impl=impl)

    def specs(arg_shapes):
        b, t, h = _q_layout(arg_shapes)
        args, (dq, dkv, dsink) = _bwd_specs(b, t, h)
        fwd2_args, _ = _fwd2_specs(b, t, h)
        return fwd2_args + args[5:], (dq, dkv, dkv, dsink)

    def reduce(arg_shapes, out):
        _, t, h = _q_layout(arg_shapes)
        dq, dkv, dkv2, dsink = out
        kv_reduce = _axes(t) + _axes(h)
        if kv_reduce:
            dkv, dkv2 = jax.lax.psum(dkv, kv_reduce), jax.lax.psum(dkv2, kv_reduce)
        if _axes(t):
            dsink = jax.lax.psum(dsink, _axes(t))
        return dq, dkv, dkv2, dsink

    return _partitioned(body, _BWD2_RULE, _REPLICATED_FACTORS2, specs, reduce, 4, sink_pos=7)


def make_indexer_topk(local: Callable):
    """Partitioned, vmappable selection: (q, k, weights, positions) -> (scores, idx)."""
    def specs(arg_shapes):
        b, t, _ = _q_layout(arg_shapes)
        return ((P(b, t, None, None), P(b, None, None), P(b, t, None), P(b, t)),
                (P(b, t, None), P(b, t, None)))

    return _partitioned(local, _INDEXER_RULE, ("h", "d", "s", "n"), specs, None, 2)


def _partitioned(local: Callable, rule: str, replicated: tuple[str, ...], specs: Callable,
                 reduce: Callable | None, num_outputs: int, sink_pos: int | None = None):
    """custom_partitioning of `local` (returns a tuple of arrays) with `specs(arg_shapes)` ->
    (argument specs, output specs) and `reduce(arg_shapes, outputs)` summing partial outputs
    inside the partitioned computation; vmappable (_fold_vmap)."""
    op = custom_partitioning(local)

    def infer(mesh, arg_shapes, result_shape):
        return _named(mesh, specs(arg_shapes)[1])

    def partition(mesh, arg_shapes, result_shape):
        args, outs = specs(arg_shapes)

        def lower(*shard_args):
            out = local(*shard_args)
            return reduce(arg_shapes, out) if reduce else out

        return mesh, lower, _named(mesh, outs), _named(mesh, args)

    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule, need_replication_factors=replicated)
    return _fold_vmap(op, num_outputs=num_outputs, sink_pos=sink_pos)


def make_attention_mass(local: Callable):
    """Partitioned, vmappable (q, kv, idx, topk_length, off) -> (mass [B, T, K],): each entry's
    attention mass summed over the heads; a head shard's partial sum is summed over head
    shards."""
    def specs(arg_shapes):
        b, t, h = _q_layout(arg_shapes)
        return ((P(b, t, h, None), P(b, None, None), P(b, t, None), P(b, t), P(b, t, h)),
                (P(b, t, None),))

    def reduce(arg_shapes, out):
        heads = _axes(_q_layout(arg_shapes)[2])
        return tuple(jax.lax.psum(x, heads) for x in out) if heads else out

    return _partitioned(local, _MASS_RULE, ("d", "s", "k"), specs, reduce, 1)


def _loss_specs(arg_shapes):
    b, t, _ = _q_layout(arg_shapes)
    return (P(b, t, None, None), P(b, None, None), P(b, t, None), P(b, t, None), P(b, t),
            P(b, t, None))


def make_indexer_loss_fwd(local: Callable):
    """Partitioned, vmappable (q, k, weights, idx, topk_length, target) -> (KL [B, T],
    signal [B, T, K])."""
    def specs(arg_shapes):
        b, t, _ = _q_layout(arg_shapes)
        return _loss_specs(arg_shapes), (P(b, t), P(b, t, None))

    return _partitioned(local, _LOSS_FWD_RULE, ("h", "d", "s", "k"), specs, None, 2)


def make_indexer_loss_bwd(local: Callable):
    """Partitioned, vmappable (q, k, weights, idx, topk_length, signal, g) ->
    (dq, dk fp32, dweights): dk is summed over token shards."""
    def specs(arg_shapes):
        b, t, _ = _q_layout(arg_shapes)
        return (_loss_specs(arg_shapes) + (P(b, t),),
                (P(b, t, None, None), P(b, None, None), P(b, t, None)))

    def reduce(arg_shapes, out):
        tokens = _axes(_q_layout(arg_shapes)[1])
        dq, dk, dw = out
        return (dq, jax.lax.psum(dk, tokens) if tokens else dk, dw)

    return _partitioned(local, _LOSS_BWD_RULE, ("h", "d", "s", "k"), specs, reduce, 3)
