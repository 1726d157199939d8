"""Two KV pools against one: what sparse_mla's second pool costs (DeepSeek-V4 layout).

    python dev/bench_two_pools.py [--small] [--impl cute]      (on the GPU machine)

The shapes of examples/benchmark_layer.py (T = 4096 at the end of S = 64K; a window of 128 raw
rows plus a top-k of the S / 4 compressed rows, a sink). Per shape, the attention forward and
its VJP (gradients to q, both pools and the sink), each timed like benchmark_layer's pieces:

  two pools  sparse_mla(q, kv, window, extra_kv=kv_c, extra_idx=topk)
  one pool   sparse_mla(q, kv_cat, window ++ (topk + S)): the same K rows in one buffer that the
             caller already holds (built once, outside the timed calls)

Both attend to the same entries, so the outputs agree (printed: the largest difference).
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import jax_dsa  # noqa: E402
from benchmark import time_call  # noqa: E402
from benchmark_layer import RATIO, SHAPES, inputs  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (T 64, S 1024)")
    ap.add_argument("--impl", default=None, help="sparse_mla's implementation= (default: None)")
    ap.add_argument("--batches", type=int, default=5)
    args = ap.parse_args(argv)
    t, s = (64, 1024) if args.small else (4096, 65536)
    print(f"jax {jax.__version__}, jax_dsa {jax_dsa.__version__}, {jax.devices()[0].device_kind};"
          f" T = {t}, S = {s}, ratio {RATIO}", flush=True)
    rng = np.random.default_rng(0)
    for label, h, d, topk in SHAPES:
        topk = min(topk, s // RATIO)
        a = inputs(rng, t, s, h, d)
        # each token's list: topk random visible compressed rows (-1 where fewer are visible)
        position = (s - t) + jnp.arange(t)[:, None]
        visible = (jnp.arange(s // RATIO)[None, :] + 1) * RATIO <= position + 1
        keys = jnp.where(visible, jnp.asarray(rng.random((t, s // RATIO), np.float32)), -1.0)
        val, top = jax.lax.top_k(keys, topk)
        top = jnp.where(val >= 0, top, -1).astype(jnp.int32)[None]
        kv_cat = jnp.concatenate([a["kv"], a["kv_c"]], axis=1)
        idx_cat = jax_dsa.indices.concat_window_compressed(a["window"], top, s)

        def two(q, kv, kv_c, sink):
            return jax_dsa.sparse_mla(q, kv, a["window"], sink=sink, extra_kv=kv_c,
                                      extra_idx=top, implementation=args.impl)

        def one(q, kv_cat, sink):
            return jax_dsa.sparse_mla(q, kv_cat, idx_cat, sink=sink, implementation=args.impl)

        def grads(f, n):
            def loss(*x):
                return jnp.sum(f(*x).astype(jnp.float32) ** 2)
            return jax.jit(jax.grad(loss, argnums=tuple(range(n))))

        two_args = (a["q"], a["kv"], a["kv_c"], a["sink"])
        one_args = (a["q"], kv_cat, a["sink"])
        diff = jnp.max(jnp.abs(jax.jit(two)(*two_args).astype(jnp.float32)
                               - jax.jit(one)(*one_args).astype(jnp.float32)))
        times = {
            "fwd two pools": time_call(jax.jit(two), two_args, 3, args.batches),
            "fwd one pool": time_call(jax.jit(one), one_args, 3, args.batches),
            "fwd+bwd two pools": time_call(grads(two, 4), two_args, 3, args.batches),
            "fwd+bwd one pool": time_call(grads(one, 3), one_args, 3, args.batches),
        }
        print(f"{label:9s} H {h} K {128 + topk}: "
              + "  ".join(f"{k} {v * 1e3:7.3f} ms" for k, v in times.items())
              + f"  (max |o2 - o1| = {float(diff):.2e})", flush=True)


if __name__ == "__main__":
    main()
