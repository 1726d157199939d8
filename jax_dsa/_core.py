"""The differentiable core: custom_vjp over the (sharded, vmappable) forward and backward ops.

Inputs are canonical here: q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K] int32,
topk_length [B, T] int32, sink [H] float32 (-inf for "no sink"). `impl` is already resolved:
"xla" (reference), "cute" (kernel, forced) or "auto" (kernel when lowered for CUDA, reference on
any other platform). `config` (a jax_dsa.cute.Config, possibly with None fields) is resolved
per device shard, on the shard's shapes, by jax_dsa.cute.config.resolve.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa import reference, sharding
from jax_dsa.cute import config as kernel_config


def _local_forward(q, kv, idx, topk_length, sink, *, scale, d_v, impl, config, deterministic):
    def ref(*args):
        return reference.forward(*args, scale=scale, d_v=d_v)

    def kernel(*args):
        from jax_dsa.cute import kernel as cute_kernel
        cfg = kernel_config.resolve(config, q.shape, idx.shape[-1], kv.shape[1], deterministic)
        return cute_kernel.forward(*args, scale=scale, config=cfg)

    args = (q, kv, idx, topk_length, sink)
    if impl == "xla":
        return ref(*args)
    if impl == "cute":
        return kernel(*args)
    return lax.platform_dependent(*args, cuda=kernel, default=ref)


def _local_backward(q, kv, idx, topk_length, sink, o, lse, do, dlse, *, scale, d_v, impl,
                    config, deterministic):
    def ref(*args):
        return reference.backward(*args, scale=scale, d_v=d_v, deterministic=deterministic)

    def kernel(*args):
        from jax_dsa.cute import kernel as cute_kernel
        cfg = kernel_config.resolve(config, q.shape, idx.shape[-1], kv.shape[1], deterministic)
        return cute_kernel.backward(*args, scale=scale, config=cfg, deterministic=deterministic)

    args = (q, kv, idx, topk_length, sink, o, lse, do, dlse)
    if impl == "xla" or not _backward_kernel_built():
        return ref(*args)
    if impl == "cute":
        return kernel(*args)
    return lax.platform_dependent(*args, cuda=kernel, default=ref)


@functools.lru_cache(maxsize=None)
def _backward_kernel_built() -> bool:
    """A library built without the backward kernels leaves every implementation differentiating
    with the reference formulas (they need only the forward's o and lse)."""
    from jax_dsa.cute import ffi
    return ffi.has_backward()


@functools.lru_cache(maxsize=None)
def _ops(scale: float, d_v: int, impl: str, config, deterministic: bool):
    local = dict(config=config, deterministic=deterministic)
    return (sharding.make_forward(functools.partial(_local_forward, **local), scale, d_v, impl),
            sharding.make_backward(functools.partial(_local_backward, **local), scale, d_v,
                                   impl))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def attention(q, kv, idx, topk_length, sink, scale, d_v, impl, config, deterministic):
    """(o [B, T, H, d_v], lse [B, T, H] float32); differentiable in q, kv and sink."""
    fwd, _ = _ops(scale, d_v, impl, config, deterministic)
    return fwd(q, kv, idx, topk_length, sink)


def _attention_fwd(q, kv, idx, topk_length, sink, scale, d_v, impl, config, deterministic):
    fwd, _ = _ops(scale, d_v, impl, config, deterministic)
    o, lse = fwd(q, kv, idx, topk_length, sink)
    return (o, lse), (q, kv, idx, topk_length, sink, o, lse)


def _attention_bwd(scale, d_v, impl, config, deterministic, residuals, cotangents):
    q, kv, idx, topk_length, sink, o, lse = residuals
    do, dlse = cotangents
    _, bwd = _ops(scale, d_v, impl, config, deterministic)
    dq, dkv, dsink = bwd(q, kv, idx, topk_length, sink, o, lse, do.astype(o.dtype),
                         dlse.astype(lse.dtype))
    return dq, dkv.astype(kv.dtype), None, None, jnp.sum(dsink, axis=0)


attention.defvjp(_attention_fwd, _attention_bwd)
