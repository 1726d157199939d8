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


def one_list(idx, topk_length, idx2, topk_length2, s1: int, s2: int):
    """(idx, topk_length) of both lists over the two pools numbered as one (pool 1's rows
    [0, s1), pool 2's from s1 on): the lists side by side with the second's rows offset by s1
    and every invalid entry (out of its pool's range or past its length) -1, so that none
    points into the other pool."""
    def valid(i, length, s):
        return (i >= 0) & (i < s) & (jnp.arange(i.shape[2])[None, None, :] < length[..., None])

    both = jnp.concatenate([jnp.where(valid(idx, topk_length, s1), idx, -1),
                            jnp.where(valid(idx2, topk_length2, s2), idx2 + s1, -1)], axis=2)
    return both, jnp.full(both.shape[:2], both.shape[2], jnp.int32)


def one_pool(kv, idx, topk_length, kv2, idx2, topk_length2):
    """(kv, idx, topk_length) of one pool holding both: the pools concatenated along S and
    one_list's lists."""
    both, length = one_list(idx, topk_length, idx2, topk_length2, kv.shape[1], kv2.shape[1])
    return jnp.concatenate([kv, kv2.astype(kv.dtype)], axis=1), both, length


def _local_forward_two_pool(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, *, scale,
                            d_v, impl, config, deterministic):
    """The two-pool forward of one shard: the two-pool kernel where the resolved forward is
    the unsplit pingpong kernel, else the one-pool forward over the concatenation."""
    def concatenated(impl_):
        kv_c, idx_c, len_c = one_pool(kv, idx, topk_length, kv2, idx2, topk_length2)
        return _local_forward(q, kv_c, idx_c, len_c, sink, scale=scale, d_v=d_v, impl=impl_,
                              config=config, deterministic=deterministic)

    def kernel(*_):
        from jax_dsa.cute import ffi
        from jax_dsa.cute.config import FwdConfig
        k, s = idx.shape[-1] + idx2.shape[-1], kv.shape[1] + kv2.shape[1]
        cfg = kernel_config.resolve(config, q.shape, k, s, deterministic)
        if (cfg.fwd == FwdConfig("pingpong", 1) and idx.shape[-1] > 0
                and ffi.has_two_pool_forward()):
            return ffi.sparse_mla_fwd_two_pool(q, kv, idx, topk_length, kv2, idx2,
                                               topk_length2, sink, scale=scale)
        return concatenated("cute")

    if impl == "xla":
        return concatenated("xla")
    if impl == "cute":
        return kernel()
    return lax.platform_dependent(q, cuda=kernel, default=lambda *_: concatenated("xla"))


def _local_backward_two_pool(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, o, lse, do,
                             dlse, *, scale, d_v, impl, config, deterministic):
    """The two-pool backward of one shard, (dq, dkv fp32, dkv2 fp32, dsink [B, H]): the
    two-pool kernel (pools read in place) where the resolved backward is the plain one, else
    the one-pool backward over the concatenation, its dkv split back into the pools."""
    s1, s2 = kv.shape[1], kv2.shape[1]
    local = dict(scale=scale, d_v=d_v, config=config, deterministic=deterministic)

    def split(dq, dkv, dsink):  # dkv over both pools' rows -> one per pool
        return dq, dkv[:, :s1], dkv[:, s1:], dsink

    def concatenated(impl_):
        kv_c, idx_c, len_c = one_pool(kv, idx, topk_length, kv2, idx2, topk_length2)
        return split(*_local_backward(q, kv_c, idx_c, len_c, sink, o, lse, do, dlse,
                                      impl=impl_, **local))

    def kernel(*_):
        from jax_dsa.cute import ffi, kernel as cute_kernel
        k = idx.shape[-1] + idx2.shape[-1]
        cfg = kernel_config.resolve(config, q.shape, k, s1 + s2, deterministic)
        if deterministic or cfg.bwd.group != 1 or not ffi.has_two_pool_backward():
            return concatenated("cute")
        idx_c, len_c = one_list(idx, topk_length, idx2, topk_length2, s1, s2)
        return split(*cute_kernel.backward_two_pool(q, kv, kv2, idx_c, len_c, sink, o, lse, do,
                                                    dlse, scale=scale))

    if impl == "xla" or not _backward_kernel_built():
        return concatenated("xla")
    if impl == "cute":
        return kernel()
    return lax.platform_dependent(q, cuda=kernel, default=lambda *_: concatenated("xla"))


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


@functools.lru_cache(maxsize=None)
def _ops_two_pool(scale: float, d_v: int, impl: str, config, deterministic: bool):
    local = dict(config=config, deterministic=deterministic)
    return (sharding.make_forward_two_pool(
                functools.partial(_local_forward_two_pool, **local), scale, d_v, impl),
            sharding.make_backward_two_pool(
                functools.partial(_local_backward_two_pool, **local), scale, d_v, impl))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def attention_two_pool(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, scale, d_v, impl,
                       config, deterministic):
    """attention over two pools in one softmax (token t's entries: idx[b, t] into kv, then
    idx2[b, t] into kv2), as `attention` over `one_pool`'s concatenation gives it. The forward
    and the backward read both pools in place where their kernels allow (else they run over
    the concatenation, the backward splitting dkv back into the pools)."""
    fwd, _ = _ops_two_pool(scale, d_v, impl, config, deterministic)
    return fwd(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink)


def _attention_two_pool_fwd(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, scale, d_v,
                            impl, config, deterministic):
    fwd, _ = _ops_two_pool(scale, d_v, impl, config, deterministic)
    o, lse = fwd(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink)
    return (o, lse), (q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, o, lse)


def _attention_two_pool_bwd(scale, d_v, impl, config, deterministic, residuals, cotangents):
    q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, o, lse = residuals
    do, dlse = cotangents
    _, bwd = _ops_two_pool(scale, d_v, impl, config, deterministic)
    dq, dkv, dkv2, dsink = bwd(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, o, lse,
                               do.astype(o.dtype), dlse.astype(lse.dtype))
    return (dq, dkv.astype(kv.dtype), None, None, dkv2.astype(kv2.dtype), None, None,
            jnp.sum(dsink, axis=0))


attention_two_pool.defvjp(_attention_two_pool_fwd, _attention_two_pool_bwd)
