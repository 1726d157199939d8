"""Decode forward timings: the list split (FwdConfig.splits) against the unsplit kernel.

    python dev/bench_decode.py [--tokens 8,64] [--splits 1,2,4,8,16]

Inputs as examples/benchmark.py --decode (B sequences of S = 64K, one token each, H = 128,
Dqk 576, K = 128 window + 1920 random rows, a sink). Two timings per configuration, medians:
"b2b" = back-to-back jitted calls, wall clock (examples/benchmark.py's method; includes the host
dispatch when it exceeds the device time) and "in-jit" = N calls on N different q inside one
jitted program, wall clock / N (no dispatch between calls: the device time of the op with its
XLA pre- and post-processing).
"""
import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import benchmark  # noqa: E402

import jax_dsa  # noqa: E402
from jax_dsa.cute import Config, FwdConfig, config as kernel_config  # noqa: E402


def wall(fn, *args, reps=30, batches=7):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - start) / reps)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,64")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for b in map(int, args.tokens.split(",")):
        q, kv, idx, sink, _ = benchmark.make_inputs(128, 1920, 1, 65536, 576, batch=b)
        qs = jnp.stack([q * (1 + 0.01 * i) for i in range(args.inner)])
        default = kernel_config.select(q.shape, idx.shape[-1], kv.shape[1]).fwd
        for s in ["default"] + args.splits.split(","):
            fwd = default if s == "default" else FwdConfig("pingpong", int(s))
            call = functools.partial(jax_dsa.sparse_mla, sink=sink, return_lse=True,
                                     implementation="cute", config=Config(fwd=fwd))
            one = jax.jit(lambda q, kv, idx: call(q, kv, idx))
            many = jax.jit(lambda qs, kv, idx: [call(qs[i], kv, idx)
                                                for i in range(args.inner)])
            t1 = wall(one, q, kv, idx)
            tn = wall(many, qs, kv, idx, reps=3) / args.inner
            print(f"B={b:3d} splits={fwd.splits:2d}{' (default)' if s == 'default' else '':10s}"
                  f" b2b {t1 * 1e6:7.1f} us   in-jit {tn * 1e6:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
