"""Does the order of each token's list change the backward's time at long context?

    python dev/list_order_bench.py [--shapes "V4-Flash S=64K,V4-Pro S=64K"] [--batch-ms 1500]
                                   [--orders given,bucketed,waves] [--no-fwd]

The backward adds every entry's fp32 dkv row with a RED; past L2 (S 64K-128K) a RED that misses
L2 costs HBM traffic. The order of a token's entries does not change the result (up to fp32
rounding of the sums), only which rows the CTAs running at the same time touch. Orders timed
(examples/benchmark.py --long inputs, bwd pass and timing):
  given    the benchmark's lists (the 128-row window, then uniform random rows);
  sorted   each list in ascending row order;
  phased   sorted, then rotated so that the CTAs resident at one time walk the same rows: token t
           starts at block (-t * blocks / resident_tokens) mod blocks, resident_tokens = the
           number of SMs / CTAs per token (CTAs start one after another in token order).
  zigzag   sorted, every other token in descending order;
  waves    sorted, the tokens of every other wave (resident_tokens consecutive tokens) in
           descending order: each wave sweeps the rows the way the last one ended, where the L2
           still holds the previous wave's last rows;
  bucketed ordered by row // (S / 127) only, the given order within a bucket (what a one-pass
           bucket sort gives: enough for the REDs' locality if the blocks are wider than a
           bucket).
Each runs with the lists' order pinned (BwdConfig(sort_rows=False)); then "library" = the given
lists with the default config, which orders them inside the call where dkv outgrows the L2
(BwdConfig.sort_rows); then the forward with the lists given and sorted; last XLA's sort
(jax_dsa.cute.kernel.rows_ascending) and the row-order step the library runs (rows_in_order:
the kernel where built), each by itself. Prints the median time per call of each and the
largest dkv difference against `given`.
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import benchmark  # noqa: E402

from jax_dsa.cute import BwdConfig, Config  # noqa: E402
from jax_dsa.cute.kernel import rows_ascending, rows_in_order  # noqa: E402


def orders(idx, heads, sms, num_kv_rows):
    idx = np.asarray(idx)
    B, T, K = idx.shape
    srt = np.sort(idx, axis=2)
    blocks = -(-K // 64)
    resident = max(1, sms // (1 if heads <= 64 else 2))
    phased = np.empty_like(srt)
    for t in range(T):
        shift = ((-t * blocks) // resident) % blocks * 64
        phased[:, t] = np.roll(srt[:, t], -shift, axis=1)
    zigzag = srt.copy()
    zigzag[:, 1::2] = srt[:, 1::2, ::-1]
    waves = srt.copy()
    odd = (np.arange(T) // resident) % 2 == 1
    waves[:, odd] = srt[:, odd, ::-1]
    # 127 buckets of S / 127 rows, the lists' own order within a bucket, invalid entries last
    bucket = np.where(idx >= 0, idx.astype(np.int64) * 127 // num_kv_rows, 127)
    bucketed = np.take_along_axis(idx, np.argsort(bucket, axis=2, kind="stable"), axis=2)
    return {"given": idx, "sorted": srt, "phased": phased, "zigzag": zigzag,
            "bucketed": bucketed, "waves": waves}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="V4-Flash S=64K,V4-Pro S=64K,V3.2 S=128K")
    ap.add_argument("--batch-ms", type=float, default=1500.0)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--orders", default="given,sorted,phased,zigzag,bucketed,waves",
                    help="the pre-ordered lists to time (the first is the dkv reference)")
    ap.add_argument("--no-fwd", action="store_true", help="skip the forward rows")
    args = ap.parse_args()
    dev = jax.devices()[0]
    sms = getattr(dev, "core_count", 132) or 132
    print(f"jax {jax.__version__}, {dev.device_kind}, {sms} SMs")
    pinned = benchmark.make_fn("cute", "bwd", Config(bwd=BwdConfig(sort_rows=False)))
    default = benchmark.make_fn("cute", "bwd")
    fwd, _ = benchmark.make_fn("cute", "fwd")
    for label, h, topk, tokens, seq, d, batch in benchmark.LONG:
        if label not in args.shapes.split(","):
            continue
        q, kv, idx, sink, _ = benchmark.make_inputs(h, topk, tokens, seq, d, batch)
        ref = None
        ordered_lists = orders(idx, h, sms, seq)
        runs = [(name, pinned, ordered_lists[name]) for name in args.orders.split(",")]
        for name, (fn, prep), ordered in runs + [("library", default, idx)]:
            fargs = prep(q, kv, jnp.asarray(ordered), sink)
            us = benchmark.time_call(fn, fargs, 10, args.batches, args.batch_ms) * 1e6
            dkv = np.asarray(fn(*fargs)[1], np.float32)
            if ref is None:
                ref, diff = dkv, 0.0
            else:
                diff = float(np.max(np.abs(dkv - ref)) / np.max(np.abs(ref)))
            print(f"{label:16s} {name:7s} bwd {us:9.1f} us   "
                  f"dkv max diff vs {runs[0][0]} {diff:.2e}",
                  flush=True)
        for name in () if args.no_fwd else ("given", "sorted"):
            ordered = jnp.asarray(ordered_lists[name])
            us = benchmark.time_call(fwd, (q, kv, ordered, sink), 10, args.batches,
                                     args.batch_ms) * 1e6
            print(f"{label:16s} {name:7s} fwd {us:9.1f} us", flush=True)
        length = jnp.full(idx.shape[:2], idx.shape[2], jnp.int32)
        ctas = -(-h // 64)  # the backward's CTAs per token, which sets the row order's waves
        for name, form in (("sort (XLA)", rows_ascending),
                           ("row order", lambda i, n, s: rows_in_order(i, n, s, ctas))):
            sort = jax.jit(lambda i, n: form(i, n, seq))
            us = benchmark.time_call(sort, (idx, length), 10, args.batches, 200.0) * 1e6
            print(f"{label:16s} {name} alone {us:9.1f} us", flush=True)


if __name__ == "__main__":
    main()
