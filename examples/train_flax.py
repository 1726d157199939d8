"""A tiny DeepSeek-V4-like attention layer trained with optax under a (data x heads) mesh.

q and kv projections, a KV buffer [window KV | compressed KV], indices = sliding window ++
causal compressed rows, jax_dsa.flax.SparseMLA with a learnable sink, an output projection.
Trains a few steps two ways on the same mesh:
  jit        params and batch placed with NamedShardings; XLA and jax_dsa's partitioning rules
             keep q sharded over (batch, heads);
  shard_map  each device runs its H/n heads explicitly; the head-parallel output is summed
             with a psum (the usual row-parallel projection), and the gradients of replicated
             weights (kv projection) are summed by shard_map itself.
On a CPU machine it uses 8 fake devices:  python examples/train_flax.py
"""
from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # fake CPU devices; ignored by GPU backends
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dsa import indices
from jax_dsa.flax import SparseMLA

try:
    from jax import shard_map
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map


class V4Attention(nnx.Module):
    def __init__(self, d_model, num_heads, head_dim, d_v, window, ratio, *, rngs,
                 dtype=jnp.float32, implementation=None):
        init = nnx.initializers.lecun_normal()
        self.wq = nnx.Param(init(rngs.params(), (d_model, num_heads, head_dim)))
        self.wkv = nnx.Param(init(rngs.params(), (d_model, head_dim)))
        self.wo = nnx.Param(init(rngs.params(), (num_heads, d_v, d_model)) * 0.5)
        self.attn = SparseMLA(num_heads, d_v=d_v, implementation=implementation)
        self.window, self.ratio, self.dtype = window, ratio, dtype

    def __call__(self, x):
        b, t, _ = x.shape
        q = jnp.einsum("btm,mhd->bthd", x, self.wq[...])
        kv = jnp.einsum("btm,md->btd", x, self.wkv[...])
        n_c = indices.num_compressed(t, self.ratio)
        compressed = kv[:, : n_c * self.ratio].reshape(b, n_c, self.ratio, -1).mean(axis=2)
        buffer = jnp.concatenate([kv, compressed], axis=1)
        idx = indices.concat_window_compressed(indices.sliding_window(t, self.window),
                                               indices.compressed_causal(t, self.ratio), offset=t)
        # Attention runs in the compute dtype (bf16 for the Hopper kernels); weights stay fp32.
        o = self.attn(q.astype(self.dtype), buffer.astype(self.dtype),
                      jnp.broadcast_to(idx, (b,) + idx.shape))
        return jnp.einsum("bthv,hvm->btm", o, self.wo[...])


def param_spec(path, _):
    """Head-parallel layout: q projection, output projection and sink split over 'heads'."""
    name = path[0].key if hasattr(path[0], "key") else str(path[0])
    return {"wq": P(None, "heads", None), "wo": P("heads", None, None),
            "attn": P("heads")}.get(name, P())


def make_mesh(num_heads, devices=None, heads=None):
    """(data, heads) mesh over `devices` (default: all); heads = 2 when it divides, else 1."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if heads is None:
        heads = 2 if n % 2 == 0 and num_heads % 2 == 0 else 1
    if n % heads or num_heads % heads:
        raise ValueError(f"{heads} head shards do not divide {n} devices and {num_heads} heads")
    return Mesh(np.array(devices).reshape(n // heads, heads), ("data", "heads"))


def make_data(key, batch, tokens, d_model):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (batch, tokens, d_model), jnp.float32)
    teacher = jax.random.normal(kw, (d_model, d_model)) / np.sqrt(d_model)
    y = jnp.tanh(jnp.cumsum(x, axis=1) / np.sqrt(tokens)) @ teacher  # needs attention over time
    return x, y


def build(mode, *, batch=8, tokens=32, d_model=64, num_heads=8, head_dim=32, d_v=16, window=8,
          ratio=4, dtype=jnp.float32, seed=0, implementation=None, devices=None,
          head_shards=None):
    """The model's sharded parameters, a batch, and loss_fn(state, x, y) for `mode`."""
    model = V4Attention(d_model, num_heads, head_dim, d_v, window, ratio, rngs=nnx.Rngs(seed),
                        dtype=dtype, implementation=implementation)
    graphdef, state = nnx.split(model)
    mesh = make_mesh(num_heads, devices, head_shards)
    specs = jax.tree_util.tree_map_with_path(param_spec, state)
    state = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), state, specs)
    x, y = make_data(jax.random.key(seed + 1), batch, tokens, d_model)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    if mode == "jit":
        def loss_fn(state, x, y):
            return jnp.mean((forward(state, x).astype(jnp.float32) - y) ** 2)
    elif mode == "shard_map":
        def per_shard(state, x, y):
            y_hat = jax.lax.psum(forward(state, x).astype(jnp.float32), "heads")
            return jax.lax.pmean(jnp.mean((y_hat - y) ** 2), "data")

        loss_fn = shard_map(per_shard, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                            out_specs=P())
    else:
        raise ValueError(f"mode must be 'jit' or 'shard_map'; got {mode!r}")
    return loss_fn, state, x, y, mesh


def train(mode, *, steps=8, lr=1e-2, verbose=True, **model_kw):
    """Adam steps on `mode`'s loss; returns the losses. model_kw: see build()."""
    loss_fn, state, x, y, mesh = build(mode, **model_kw)
    opt = optax.adam(lr)
    opt_state = opt.init(state)

    @jax.jit
    def step(state, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state, x, y)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    losses = []
    for i in range(steps):
        state, opt_state, loss = step(state, opt_state, x, y)
        losses.append(float(loss))
        if verbose:
            print(f"[{mode}] mesh {dict(mesh.shape)} step {i}: loss {losses[-1]:.5f}")
    return losses


# A layer the Hopper kernels run (bf16, Dqk 576 = 512 latent + 64 rope, d_v 512).
KERNEL_SHAPE = dict(batch=4, tokens=256, d_model=256, num_heads=16, head_dim=576, d_v=512,
                    window=64, ratio=4, dtype=jnp.bfloat16, lr=3e-3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mode", choices=["jit", "shard_map", "both"], default="both")
    parser.add_argument("--kernel-shape", action="store_true",
                        help="a shape the Hopper kernels take: bf16, 16 heads, Dqk 576, d_v 512")
    args = parser.parse_args(argv)
    modes = ["jit", "shard_map"] if args.mode == "both" else [args.mode]
    shape = KERNEL_SHAPE if args.kernel_shape else {}
    results = {m: train(m, steps=args.steps, **shape) for m in modes}
    for m, losses in results.items():
        print(f"{m}: loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    return results


if __name__ == "__main__":
    main()
