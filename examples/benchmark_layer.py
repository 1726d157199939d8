"""Benchmark of one DSA layer's training step, piece by piece (DeepSeek-V4 layout).

    python examples/benchmark_layer.py [--impls cute,xla] [--shapes V4-Flash,V4-Pro] [--small]
                                       [--batches 5] [--calls 10] [--batch-ms 25]
                                       [--save-lists DIR]

T = 4096 queries at the end of a sequence of S = 64K positions: a window of 128 raw-KV rows
plus the indexer's top-k of the S / 4 compressed rows (ratio 4) as a second KV pool, a learned
sink; the indexer has Hi = 64 heads of Di = 128 over the compressed rows. Pieces, each a jitted
function timed on its own (wall clock of back-to-back calls, median of batches of at least
--calls calls grown to about --batch-ms; at the H200's power cap a batch that starts from an
idle GPU runs faster than sustained load: docs/performance.md, "Duty cycle"):

  indexer      jax_dsa.indexer_topk (scores + top-k of the compressed rows)
  attn fwd     jax_dsa.sparse_mla over both pools (o, lse)
  attn bwd     its VJP alone (the residuals as inputs)
  target       jax_dsa.attention_target over the compressed entries (from the saved lse)
  index bwd    jax_dsa.indexer_loss and its gradients (q_i, k_i, weights)
  step         all of it in one program: selection, forward, target, both losses' gradients

Implementations: "cute" and "xla" as `implementation=` takes them (every piece).
--small runs CPU-sized shapes (T = 64, S = 1024) to check the script.
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

WINDOW, RATIO, HI, DI = 128, 4, 64, 128
# (label, H, Dqk, compressed top-k)
SHAPES = [("V4-Flash", 64, 512, 512), ("V4-Pro", 128, 512, 1024)]


def inputs(rng, t, s, h, d):
    n_c = s // RATIO
    bf = jnp.bfloat16

    def normal(*shape, dtype=bf):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    return dict(q=normal(1, t, h, d), kv=normal(1, s, d), kv_c=normal(1, n_c, d),
                sink=normal(h, dtype=jnp.float32), q_i=normal(1, t, HI, DI),
                k_i=normal(1, n_c, DI), w_i=normal(1, t, HI, dtype=jnp.float32),
                window=jnp.asarray(jax_dsa.indices.sliding_window(t, WINDOW, start=s - t))[None])


def pieces(impl, topk, start):
    def select(a):
        return jax_dsa.indexer_topk(a["q_i"], a["k_i"], a["w_i"], topk, scale=DI ** -0.5,
                                    ratio=RATIO, start=start, implementation=impl)

    def attend(q, kv, kv_c, sink, window, idx):
        return jax_dsa.sparse_mla(q, kv, window, sink=sink, return_lse=True,
                                  implementation=impl, extra_kv=kv_c, extra_idx=idx)

    def target(a, idx, lse):
        return jax_dsa.attention_target(a["q"], a["kv_c"], idx, sink=a["sink"], lse=lse,
                                        implementation=impl)

    def index_loss(q_i, k_i, w_i, idx, tgt):
        return jax_dsa.indexer_loss(q_i, k_i, w_i, idx, tgt, scale=DI ** -0.5,
                                    implementation=impl)

    index_grad = jax.grad(index_loss, argnums=(0, 1, 2))

    def step(a):
        idx = select(a)

        def attn_loss(q, kv, kv_c, sink):
            o, _ = attend(q, kv, kv_c, sink, a["window"], idx)
            return jnp.mean(o.astype(jnp.float32) ** 2)

        _, lse = attend(a["q"], a["kv"], a["kv_c"], a["sink"], a["window"], idx)
        grads = jax.grad(attn_loss, argnums=(0, 1, 2, 3))(a["q"], a["kv"], a["kv_c"], a["sink"])
        tgt = target(a, idx, lse)
        return grads, index_grad(a["q_i"], a["k_i"], a["w_i"], idx, tgt)

    return select, attend, target, index_grad, step


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default=None,
                    help="cute and/or xla (default: both where the kernels can run, else xla)")
    ap.add_argument("--shapes", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (T 64, S 1024)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls per batch (at least)")
    ap.add_argument("--batch-ms", type=float, default=25.0,
                    help="grow each batch to about this many ms (host gaps amortised)")
    ap.add_argument("--save-lists", metavar="DIR", default="",
                    help="write each shape's selected compressed lists to DIR/<label>.npy "
                         "([1, T, top-k] int32; label v4flash / v4pro), for a peer to run on")
    args = ap.parse_args(argv)
    t, s = (64, 1024) if args.small else (4096, 65536)
    keep = [x for x in args.shapes.split(",") if x]
    problem = jax_dsa.api.kernel_runtime_problem()
    if args.impls is None:
        impls = ["xla"] if problem else ["cute", "xla"]
        if problem:
            print(f"kernels unavailable ({problem}): timing the reference only")
    else:
        impls = args.impls.split(",")
        if problem and "cute" in impls:
            raise SystemExit(f"benchmark_layer: --impls {args.impls} asks for the kernels, "
                             f"which cannot run here: {problem}")
    print(f"jax {jax.__version__}, jax_dsa {jax_dsa.__version__}, {jax.devices()[0].device_kind};"
          f" T = {t}, S = {s}, window {WINDOW} + compressed top-k at ratio {RATIO}")
    results = []
    for label, h, d, topk in SHAPES:
        if keep and label not in keep:
            continue
        topk = min(topk, s // RATIO)
        a = inputs(np.random.default_rng(0), t, s, h, d)
        for impl in impls:
            select, attend, target, index_grad, step = pieces(impl, topk, s - t)
            idx = jax.jit(select)(a)
            if args.save_lists:
                os.makedirs(args.save_lists, exist_ok=True)
                np.save(os.path.join(args.save_lists, label.lower().replace("-", "") + ".npy"),
                        np.asarray(idx, np.int32))
            fwd = jax.jit(attend)
            fargs = (a["q"], a["kv"], a["kv_c"], a["sink"], a["window"], idx)
            o, lse = fwd(*fargs)
            (_, vjp_fn) = jax.vjp(lambda q, kv, kv_c, sink: attend(q, kv, kv_c, sink, a["window"],
                                                                    idx)[0],
                                  a["q"], a["kv"], a["kv_c"], a["sink"])
            tgt = jax.jit(target)(a, idx, lse)
            timing = (args.calls, args.batches, args.batch_ms)
            times = {
                "indexer": time_call(jax.jit(select), (a,), *timing),
                "attn fwd": time_call(fwd, fargs, *timing),
                "attn bwd": time_call(jax.jit(lambda f, do: f(do)), (vjp_fn, o),
                                      *timing),
                "target": time_call(jax.jit(target), (a, idx, lse), *timing),
                "index bwd": time_call(jax.jit(index_grad), (a["q_i"], a["k_i"], a["w_i"], idx,
                                                             tgt), *timing),
                "step": time_call(jax.jit(step), (a,), *timing),
            }
            results.append((label, impl, times))
            print(f"{label:9s} {impl:10s} " + "  ".join(f"{k} {v * 1e3:8.2f} ms"
                                                       for k, v in times.items()), flush=True)
    return results


if __name__ == "__main__":
    main()
