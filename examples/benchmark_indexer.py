"""Benchmark of the lightning indexer's selection (jax_dsa.indexer_topk) on the GPU.

    python examples/benchmark_indexer.py [--impls cute,xla] [--shapes S8K,...] [--out DIR]

DeepSeek's long-context prefill: T = 4096 queries at the end of a sequence (start = context -
T), Hi = 64 heads of Di = 128, bf16, one shared key head; ratio 1 (plain causal, S = context
rows) and V4's compressed rows (ratio 4, S = context / 4). For each shape and implementation
it prints the median time of the whole selection (scores + top-k), of the scores alone (the
kernel's dense [T, S] output, implementation "cute" only) with the score GEMM's TFLOP/s over
the visible (token, row) pairs, and the device memory the compiled selection needs beyond its
inputs (XLA's memory analysis: outputs + temporaries). Timing as examples/benchmark.py: jitted
calls back to back, the device synchronised once per batch, median over batches after warm-up.
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_dsa  # noqa: E402
from benchmark import time_call  # noqa: E402  (examples/benchmark.py, beside this)

T, HI, DI = 4096, 64, 128
# (label, context, ratio, topk)
SHAPES = [("S8K k2048", 8192, 1, 2048), ("S32K k2048", 32768, 1, 2048),
          ("S128K k512", 131072, 1, 512), ("S128K k1024", 131072, 1, 1024),
          ("S128K k2048", 131072, 1, 2048), ("V4 ratio4 128K k512", 131072, 4, 512),
          # the V4 layer of benchmark_layer.py: 16384 compressed rows, V4-Flash / V4-Pro top-k
          ("V4 layer 64K k512", 65536, 4, 512), ("V4 layer 64K k1024", 65536, 4, 1024)]


def extra_bytes(fn, args):
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return m.output_size_in_bytes + m.temp_size_in_bytes
    except Exception:
        return float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="cute,xla")
    ap.add_argument("--shapes", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    keep = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in SHAPES if not keep or s[0] in keep]
    print(f"jax {jax.__version__}, jax_dsa {jax_dsa.__version__}, {jax.devices()[0].device_kind}")
    rows = []
    rng = np.random.default_rng(0)
    for label, context, ratio, topk in shapes:
        s_rows = context // ratio
        start = context - T
        q = jnp.asarray(rng.standard_normal((1, T, HI, DI), np.float32), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((1, s_rows, DI), np.float32), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((1, T, HI), np.float32))
        pos = start + np.arange(T)
        visible = float(np.clip((pos + 1) // ratio, 0, s_rows).sum())
        flops = 2.0 * visible * HI * DI
        for impl in impls:
            sel = jax.jit(lambda q, k, w, impl=impl: jax_dsa.indexer_topk(
                q, k, w, topk, scale=DI ** -0.5, ratio=ratio, start=start,
                implementation=impl))
            calls = 3 if impl == "cute" else 1
            t_sel = time_call(sel, (q, k, w), calls, args.batches)
            mem = extra_bytes(sel, (q, k, w))
            t_sc = float("nan")
            if impl == "cute":
                sc = jax.jit(lambda q, k, w: jax_dsa.indexer_scores(
                    q, k, w, scale=DI ** -0.5, ratio=ratio, start=start, implementation="cute"))
                t_sc = time_call(sc, (q, k, w), calls, args.batches)
            rows.append((label, s_rows, ratio, topk, impl, t_sel, t_sc, flops / t_sc / 1e12
                         if impl == "cute" else float("nan"), mem / 2**20))
            print(f"{label:22s} {impl:5s} selection {t_sel * 1e3:9.2f} ms  scores "
                  f"{t_sc * 1e3:8.2f} ms ({rows[-1][7]:5.0f} TFLOP/s)  extra {mem / 2**20:7.0f} MB",
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmark_indexer.md"), "w") as f:
        f.write(f"T = {T}, Hi = {HI}, Di = {DI}, bf16; {jax.devices()[0].device_kind}, "
                f"jax {jax.__version__}\n\n| shape | S rows | ratio | k | impl | selection ms "
                f"| scores ms | score TFLOP/s | extra MB |\n|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write("| {} | {} | {} | {} | {} | {:.2f} | {:.2f} | {:.0f} | {:.0f} |\n".format(
                r[0], r[1], r[2], r[3], r[4], r[5] * 1e3, r[6] * 1e3, r[7], r[8]))


if __name__ == "__main__":
    sys.exit(main())
