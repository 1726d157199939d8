"""The attention target and the indexer loss (value, value + gradients, the gradients alone) at
the V4 layer shapes of examples/benchmark_layer.py, with more calls per batch than the layer
benchmark, for same-lease A/Bs of those kernels: run it once per tree, alternating,

    PYTHONPATH=TREE python dev/time_training_pieces.py [--calls 20] [--batches 5]

(TREE: a checkout with its own jax_dsa/_lib). Prints one line per shape with the medians in ms
and checksums that two correct trees share.
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_dsa

sys.path.insert(0, os.path.join(os.path.dirname(jax_dsa.__file__), "..", "examples"))
from benchmark import time_call  # noqa: E402
from benchmark_layer import DI, RATIO, SHAPES, inputs, pieces  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--s", type=int, default=65536)
    ap.add_argument("--impl", default="cute", help="cute (the kernels) or xla (the reference)")
    args = ap.parse_args(argv)
    print(f"jax_dsa from {os.path.dirname(jax_dsa.__file__)}; T {args.t}, S {args.s}")
    for label, h, d, topk in SHAPES:
        topk = min(topk, args.s // RATIO)
        a = inputs(np.random.default_rng(0), args.t, args.s, h, d)
        select, attend, target, index_grad, _ = pieces(args.impl, topk, args.s - args.t)
        idx = jax.jit(select)(a)
        _, lse = jax.jit(attend)(a["q"], a["kv"], a["kv_c"], a["sink"], a["window"], idx)
        tgt_fn = jax.jit(target)
        tgt = tgt_fn(a, idx, lse)
        loss = jax.jit(lambda q, k, w, i, g: jax_dsa.indexer_loss(
            q, k, w, i, g, scale=DI ** -0.5, implementation=args.impl))
        grad = jax.jit(index_grad)
        largs = (a["q_i"], a["k_i"], a["w_i"], idx, tgt)
        t_tgt = time_call(tgt_fn, (a, idx, lse), args.calls, args.batches)
        t_loss = time_call(loss, largs, args.calls, args.batches)
        t_grad = time_call(grad, largs, args.calls, args.batches)
        # the backward alone: the VJP of the mean loss, its residuals computed beforehand
        _, vjp = jax.vjp(lambda q, k, w: loss(q, k, w, idx, tgt), *largs[:3])
        back = jax.jit(lambda f, ct: f(ct))
        t_back = time_call(back, (vjp, jnp.ones((), jnp.float32)), args.calls, args.batches)
        print(f"{label} (H {h}, topk {topk}): target {t_tgt * 1e3:.3f} ms, indexer loss "
              f"{t_loss * 1e3:.3f} ms, loss + gradients {t_grad * 1e3:.3f} ms, gradients "
              f"alone {t_back * 1e3:.3f} ms; checksums "
              f"target max {float(jnp.max(tgt)):.6f}, loss {float(loss(*largs)):.6f}",
              flush=True)


if __name__ == "__main__":
    main()
