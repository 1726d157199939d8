"""Flax NNX module: sparse MLA with a learnable per-head attention sink.

Needs flax (`pip install "jax_dsa[flax]"`); `import jax_dsa` then `jax_dsa.flax` imports it.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa import indices
from jax_dsa.api import _check_int, sparse_mla
from jax_dsa.indexer import indexer_topk
from jax_dsa.training import attention_target, indexer_loss


class SparseMLA(nnx.Module):
    """Sparse MLA over a shared latent KV, with an optional learnable sink per head.

    Call with q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K] (or the 3-D layouts), optionally
    topk_length and a second pool (extra_kv, extra_idx, extra_topk_length); returns
    o [B, T, H, d_v] (and lse when return_lse=True), exactly as `jax_dsa.sparse_mla`.

    Args:
      num_heads: H, the number of query heads (the sink's length).
      use_sink: learn a sink (one logit per head, in the softmax denominator only).
      sink_init: the sink's initial value: a number, or an initializer
        `init(key, shape, dtype)` (e.g. `nnx.initializers.zeros_init()`), which needs `rngs`.
      sink_sharding: mesh axis names for the sink, e.g. ("heads",) for head-parallel meshes:
        the parameter carries them as `sharding` metadata (`nnx.with_partitioning`), so
        `nnx.get_partition_spec` gives its PartitionSpec. Flax >= 0.12 also places such a
        parameter on its mesh when it is created (eager sharding), as for every NNX parameter
        with sharding metadata: build the module under `jax.set_mesh(mesh)`, or
        inside `nnx.use_eager_sharding(False)` to keep only the metadata.
      scale, d_v, implementation, config: as `jax_dsa.sparse_mla`.
      deterministic_backward: sparse_mla's `deterministic` (bitwise reproducible gradients); not
        called `deterministic` because NNX's train() / eval() set attributes of that name.
      dtype: the dtype the attention computes in (q and kv are cast to it; bf16 or fp16 for the
        Hopper kernels); None: the promoted dtype of q and kv.
      param_dtype: the sink parameter's dtype (float32 by default; the kernels take float32).
      rngs: `nnx.Rngs`, needed when sink_init is an initializer.
    """

    def __init__(self, num_heads: int, *, use_sink: bool = True,
                 sink_init: float | Callable = 0.0, sink_sharding: tuple | None = None,
                 scale: float | None = None, d_v: int | None = None,
                 implementation=None, config=None, deterministic_backward: bool = False,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.num_heads = num_heads = _check_int(num_heads, "num_heads", 1)
        self.scale = scale
        self.d_v = d_v
        self.implementation = implementation
        self.config = config
        self.deterministic_backward = deterministic_backward
        self.dtype = dtype
        self.param_dtype = param_dtype
        sink = None
        if use_sink:
            if callable(sink_init):
                if rngs is None:
                    raise ValueError("sink_init is an initializer: SparseMLA needs rngs")
                init = sink_init
            else:
                value = sink_init
                init = lambda key, shape, dtype: jnp.full(shape, value, dtype)  # noqa: E731
            if sink_sharding is not None:
                init = nnx.with_partitioning(init, tuple(sink_sharding))
            key = rngs.params() if rngs is not None else None
            try:
                sink = nnx.Param(init(key, (num_heads,), param_dtype))
            except ValueError as e:
                if sink_sharding is None or "mesh" not in str(e):
                    raise
                raise ValueError(
                    f"sink_sharding={tuple(sink_sharding)!r}: this flax places the sink on a "
                    "mesh when it is created; build SparseMLA under "
                    "jax.set_mesh(mesh), or inside nnx.use_eager_sharding(False) for "
                    "the metadata alone") from e
            if tuple(sink.shape) != (num_heads,):
                raise ValueError(f"sink_init must give shape ({num_heads},); got "
                                 f"{tuple(sink.shape)}")
        self.sink = sink

    def __call__(self, q, kv, idx, *, topk_length=None, return_lse: bool = False, extra_kv=None,
                 extra_idx=None, extra_topk_length=None):
        sink = None
        if self.sink is not None:
            sink = self.sink[...]
            # Under shard_map a head-parallel shard holds H / n heads and the matching slice of
            # the sink, so q is checked against the sink it gets, not against num_heads.
            if q.shape[-2] != sink.shape[0]:
                raise ValueError(f"SparseMLA(num_heads={self.num_heads}) holds a sink for "
                                 f"{sink.shape[0]} heads here, but q has {q.shape[-2]} heads "
                                 f"(q shape {tuple(q.shape)})")
            sink = sink.astype(jnp.promote_types(sink.dtype, jnp.float32))
        dtype = self.dtype or jnp.promote_types(q.dtype, kv.dtype)
        if extra_kv is not None:
            extra_kv = extra_kv.astype(dtype)
        return sparse_mla(q.astype(dtype), kv.astype(dtype), idx, scale=self.scale, sink=sink,
                          topk_length=topk_length, d_v=self.d_v, return_lse=return_lse,
                          implementation=self.implementation, config=self.config,
                          deterministic=self.deterministic_backward, extra_kv=extra_kv,
                          extra_idx=extra_idx, extra_topk_length=extra_topk_length)


class Indexer(nnx.Module):
    """DeepSeek's lightning indexer: per token Hi query heads of dim Di, one shared key head and
    per-token head weights, all linear in the (detached) hidden state.

    `__call__(x, kv_x=None)` gives (q_i [B, T, Hi, Di], k_i [B, S, Di], weights [B, T, Hi]) for
    `jax_dsa.indexer_topk` / `indexer_loss`; the keys come from kv_x when given (e.g. compressed
    rows), else from x. Weights carry a Hi^-0.5 factor, scores a Di^-0.5 scale (`scale`).
    """

    def __init__(self, d_model: int, num_heads: int = 64, head_dim: int = 128, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        init = nnx.initializers.lecun_normal()
        self.wq = nnx.Param(init(rngs.params(), (d_model, num_heads, head_dim), param_dtype))
        self.wk = nnx.Param(init(rngs.params(), (d_model, head_dim), param_dtype))
        self.ww = nnx.Param(init(rngs.params(), (d_model, num_heads), param_dtype))
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim ** -0.5

    def __call__(self, x, kv_x=None):
        kv_x = x if kv_x is None else kv_x
        q = jnp.einsum("btm,mhd->bthd", x, self.wq[...])
        k = jnp.einsum("bsm,md->bsd", kv_x, self.wk[...])
        w = jnp.einsum("btm,mh->bth", x, self.ww[...]) * self.num_heads ** -0.5
        return q, k, w


class DSAttention(nnx.Module):
    """A DeepSeek Sparse Attention layer: MLA-style shared latent KV, sparse MLA, and the indexer
    trained against the attention.

    `__call__(x, *, stage)` returns (y [B, T, d_model], aux) with aux = {"indexer_loss", "idx",
    "target"}. Two styles:

      "v3.2"  attention over the indexer's `topk` positions of the sequence itself (DeepSeek-V3.2).
      "v4"    DeepSeek-V4: a sliding window of `window` positions over the raw KV, plus compressed
              rows (row j: the mean hidden state of positions [j * ratio, (j + 1) * ratio), its
              own KV projection; visible once complete) as a second KV pool under the same
              softmax (sparse_mla's extra_kv). With `topk` the indexer selects compressed rows
              (ratio 4 layers); with topk=None every visible compressed row is attended (the
              dense ratio-128 layers: no indexer).

    stage "dense" (the indexer warm-up) attends to every candidate (every causal position, or
    every visible compressed row) and trains the indexer's KL against that attention's
    distribution over them; stage "sparse" attends to the indexer's top-k and trains the KL over
    those. The indexer sees the hidden state detached from the attention's graph, and the target
    is a constant, so the indexer loss trains only the indexer and the task loss only the rest.
    The attention's per-head sink is learned (SparseMLA).

    dtype and implementation are SparseMLA's and apply to the indexer's selection, the target
    and the indexer loss too: with a dtype set (bf16 / fp16 for the Hopper kernels) the
    indexer's q and k and the target's q and kv are cast to it (the gradients flow back through
    the casts); the losses are float32.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, d_v: int, *, topk,
                 index_heads: int = 4, index_dim: int = 16, rngs: nnx.Rngs, dtype=None,
                 implementation=None, style: str = "v3.2", window: int = 8, ratio: int = 4):
        if style not in ("v3.2", "v4"):
            raise ValueError(f"style must be 'v3.2' or 'v4'; got {style!r}")
        if topk is None and style != "v4":
            raise ValueError("topk=None (no indexer) is the dense compressed layer of style 'v4'")
        init = nnx.initializers.lecun_normal()
        self.wq = nnx.Param(init(rngs.params(), (d_model, num_heads, head_dim)))
        self.wkv = nnx.Param(init(rngs.params(), (d_model, head_dim)))
        self.wo = nnx.Param(init(rngs.params(), (num_heads, d_v, d_model)) * 0.5)
        self.attn = SparseMLA(num_heads, d_v=d_v, dtype=dtype, implementation=implementation)
        self.indexer = (Indexer(d_model, index_heads, index_dim, rngs=rngs)
                        if topk is not None else None)
        self.wkv_c = (nnx.Param(init(rngs.params(), (d_model, head_dim))) if style == "v4"
                      else None)
        self.topk, self.style, self.window, self.ratio = topk, style, window, ratio
        self.dtype, self.implementation = dtype, implementation

    def _cast(self, x):
        """x in the layer's dtype when one is set (bf16 / fp16: the Hopper kernels)."""
        return x if self.dtype is None else x.astype(self.dtype)

    def _select(self, q_i, k_i, w_i, ratio=1):
        """The indexer's top-k, its q and k in the layer's dtype when one is set."""
        q_i, k_i = self._cast(q_i), self._cast(k_i)
        return indexer_topk(q_i, k_i, w_i, self.topk, scale=self.indexer.scale, ratio=ratio,
                            implementation=self.implementation)

    def __call__(self, x, *, stage: str = "sparse"):
        if stage not in ("dense", "sparse"):
            raise ValueError(f"stage must be 'dense' or 'sparse'; got {stage!r}")
        if jnp.ndim(x) != 3 or x.shape[-1] != self.wq.shape[0]:
            raise ValueError(f"x must be [B, T, d_model = {self.wq.shape[0]}]; got shape "
                             f"{jnp.shape(x)}")
        q = jnp.einsum("btm,mhd->bthd", x, self.wq[...])
        kv = jnp.einsum("btm,md->btd", x, self.wkv[...])
        if self.style == "v3.2":
            o, lse, pool, idx, q_i, k_i, w_i = self._v32(x, q, kv, stage)
        else:
            o, lse, pool, idx, q_i, k_i, w_i = self._v4(x, q, kv, stage)
        y = jnp.einsum("bthv,hvm->btm", o, self.wo[...].astype(o.dtype))
        sink = None if self.attn.sink is None else jax.lax.stop_gradient(self.attn.sink[...])
        # The target over the indexer's candidates: the attention's probabilities of those
        # entries (with the whole call's lse, so each head weighs as in the attention).
        target = attention_target(self._cast(jax.lax.stop_gradient(q)),
                                  self._cast(jax.lax.stop_gradient(pool)), idx, sink=sink,
                                  lse=jax.lax.stop_gradient(lse),
                                  implementation=self.implementation)
        if self.indexer is None:
            loss = jnp.zeros((), jnp.float32)
        else:
            loss = indexer_loss(self._cast(q_i), self._cast(k_i), w_i, idx, target,
                                scale=self.indexer.scale, implementation=self.implementation)
        return y, {"indexer_loss": loss, "idx": idx, "target": target}

    def _v32(self, x, q, kv, stage):
        b, t, _ = x.shape
        q_i, k_i, w_i = self.indexer(jax.lax.stop_gradient(x))
        if stage == "dense":
            pos = jnp.arange(t)
            idx = jnp.where(pos[None, :] <= pos[:, None], pos[None, :], -1)
            idx = jnp.broadcast_to(idx.astype(jnp.int32), (b, t, t))
        else:
            idx = self._select(q_i, k_i, w_i)
        o, lse = self.attn(q, kv, idx, return_lse=True)
        return o, lse, kv, idx, q_i, k_i, w_i

    def _v4(self, x, q, kv, stage):
        b, t, m = x.shape
        n_c = indices.num_compressed(t, self.ratio)
        if n_c < 1:
            raise ValueError(f"style 'v4' needs T >= ratio = {self.ratio} (one complete "
                             f"compressed row); got T = {t}")
        x_c = x[:, :n_c * self.ratio].reshape(b, n_c, self.ratio, m).mean(axis=2)
        kv_c = jnp.einsum("bsm,md->bsd", x_c, self.wkv_c[...])
        window = jnp.broadcast_to(indices.sliding_window(t, self.window), (b, t, self.window))
        q_i = k_i = w_i = None
        if self.indexer is not None:
            q_i, k_i, w_i = self.indexer(jax.lax.stop_gradient(x),
                                         kv_x=jax.lax.stop_gradient(x_c))
        if stage == "dense" or self.indexer is None:
            idx = jnp.broadcast_to(indices.compressed_causal(t, self.ratio), (b, t, n_c))
        else:
            idx = self._select(q_i, k_i, w_i, ratio=self.ratio)
        o, lse = self.attn(q, kv, window, return_lse=True, extra_kv=kv_c, extra_idx=idx)
        return o, lse, kv_c, idx, q_i, k_i, w_i
