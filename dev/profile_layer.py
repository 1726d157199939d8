#!/usr/bin/env python
"""One call of a layer piece between cudaProfilerStart / Stop, for a per-kernel profile:

    ncu --profile-from-start off --cache-control none --clock-control none \\
        --metrics gpu__time_duration.sum python dev/profile_layer.py [V4-Flash|V4-Pro] [attn_bwd]
    python dev/profile_layer.py V4-Pro attn_bwd 400   # then 10 calls after 3 s idle, 400 more

Inputs and pieces are examples/benchmark_layer.py's (T 4096, S 64K, window + compressed top-k,
implementation "cute"). Pieces: attn_bwd (the attention VJP alone), attn_fwd, step.
"""
import ctypes
import glob
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import benchmark_layer as bl  # noqa: E402


def cudart():
    """libcudart of the JAX CUDA plugin (or the system's)."""
    for pat in ("nvidia/cu13/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*"):
        for site in sys.path:
            for f in glob.glob(os.path.join(site, pat)):
                return ctypes.CDLL(f)
    return ctypes.CDLL("libcudart.so")


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "V4-Flash"
    piece = sys.argv[2] if len(sys.argv) > 2 else "attn_bwd"
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    _, h, d, topk = next(s for s in bl.SHAPES if s[0] == label)
    t, s = 4096, 65536
    a = bl.inputs(np.random.default_rng(0), t, s, h, d)
    select, attend, _, _, step = bl.pieces("cute", topk, s - t)
    idx = jax.jit(select)(a)
    fargs = (a["q"], a["kv"], a["kv_c"], a["sink"], a["window"], idx)
    fwd = jax.jit(attend)
    if piece == "attn_bwd":
        o, _ = fwd(*fargs)
        _, vjp_fn = jax.vjp(lambda q, kv, kv_c, sink: attend(q, kv, kv_c, sink, a["window"],
                                                              idx)[0],
                            a["q"], a["kv"], a["kv_c"], a["sink"])
        fn, args = jax.jit(lambda f, do: f(do)), (vjp_fn, o)
    elif piece == "attn_fwd":
        fn, args = fwd, fargs
    else:
        fn, args = jax.jit(step), (a,)
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    rt = cudart()
    rt.cudaProfilerStart()
    jax.block_until_ready(fn(*args))
    rt.cudaProfilerStop()
    if repeat:  # a burst from an idle GPU, then sustained back-to-back calls (at the power cap)
        for name, n, idle in (("burst", 10, 3.0), ("sustained", repeat, 0.0)):
            time.sleep(idle)
            start = time.perf_counter()
            for _ in range(n):
                out = fn(*args)
            jax.block_until_ready(out)
            print(f"{label} {piece} {name}: {n} calls, "
                  f"{(time.perf_counter() - start) / n * 1e3:.3f} ms per call (wall clock)")
    print("profile_layer done", label, piece)


if __name__ == "__main__":
    main()
