"""The indexer's training target on the Hopper target kernel (ffi/kernels/sm90/attention_target.py).

target[b, t, j] = sum_h p[b, t, h, j] / sum_{h, j} p[b, t, h, j] with p sparse_mla's
probabilities (the sink in their denominator): the kernel gives each entry's mass summed over
each block of 64 heads from off = logaddexp(lse, sink) (p = exp(scale q.k - off); +inf for a
dead head, whose terms are 0); the head blocks are summed and normalised here. No [B, T, H, K]
array is formed.

Not yet the default of `jax_dsa.attention_target` (the reference): `attention_target` below is
the kernel path, reached by the GPU tests (tests/test_gpu_target.py) until it has run there.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_dsa import api
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


def normalise(mass):
    """[B, T, n_hb, K] head-block masses -> the target [B, T, K] (0 where a token has none)."""
    mass = jnp.sum(mass, axis=2)
    total = jnp.sum(mass, axis=-1, keepdims=True)
    return jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0)


def offsets(lse, sink):
    """off [B, T, H] = logaddexp(lse, sink) (+inf where lse = -inf: a dead head)."""
    lse = lse.astype(jnp.float32)
    sink = sink.astype(jnp.float32)[None, None, :]
    return jnp.where(jnp.isneginf(lse), jnp.inf, jnp.logaddexp(lse, sink))


def attention_target(q, kv, idx, *, scale=None, sink=None, topk_length=None, lse=None,
                     poison_outputs=False):
    """`jax_dsa.attention_target` on the kernels: the forward kernel for lse when it is not
    given, then the target kernel. Raises NotImplementedError where the kernels cannot run."""
    call = api._prepare(q, kv, idx, scale, sink, topk_length, None, True, "cute", False, None)
    problem = shape_problem(call.q, call.kv)
    if problem:
        raise NotImplementedError(problem)
    if lse is None:
        _, lse = api.sparse_mla(call.q, call.kv, call.idx, scale=call.scale, sink=sink,
                                topk_length=call.topk_length, return_lse=True,
                                implementation="cute")
    else:
        lse = api._as_array(lse, "lse")
        lse = lse[None] if call.unbatched else lse
        if lse.shape != call.q.shape[:3]:
            raise ValueError(f"lse must be [B, T, H] = {call.q.shape[:3]}; got shape "
                             f"{lse.shape}")
    target = run(call.q, call.kv, call.idx, call.topk_length, call.sink, lse, call.scale,
                 poison_outputs)
    return target[0] if call.unbatched else target


def run(q, kv, idx, topk_length, sink, lse, scale, poison_outputs=False):
    """The target [B, T, K] from canonical inputs (api._prepare's: q [B, T, H, Dqk], sink [H]
    with -inf for none, topk_length [B, T]) and lse [B, T, H]."""
    mass = ffi.attention_mass(q, kv, idx, topk_length, offsets(lse, sink), scale=scale,
                              poison_outputs=poison_outputs)
    return normalise(mass)
