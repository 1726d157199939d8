#!/usr/bin/env python
"""A model of the long backward's DRAM traffic per list order: an LRU cache of whole kv rows.

    python dev/l2_order_sim.py [--shapes v4pro,v32_128k,v4flash] [--l2-mb 50] \\
                               [--orders given,sorted,waves] [--jitter 0.05]

Each access of a row brings its bf16 kv row (gathered) and its fp32 dkv row (the RED) into a
least-recently-used cache of --l2-mb MB, 6 * Dqk bytes a row. A miss reads both from DRAM, and
an eviction writes the dkv row back. The model schedules the backward as it runs: one CTA per
SM, ceil(H / 64) CTAs per token in grid order, each CTA starting on the first SM to free up, so
a wave holds SMs // ceil(H / 64) tokens. A CTA takes one time unit per 64-entry block, times a
factor drawn uniformly from 1 +- jitter (0: the waves move in step and a token's CTAs share
every row; a little jitter lets the CTAs drift apart as they do on the GPU). Lists are
examples/benchmark.make_lists' (the 128-row window, then uniform random rows; T = 4096).
Orders: given, sorted (each list ascending), waves (sorted, every other wave descending).
"Stream" adds Q, dO, O read once and dq written once. What the model leaves out: the L2's
sectors, its two partitions and the stream's share of the cache. For V4-Pro S 64K, sorted, on
the H100 (50 MB) it gives 15.5 GB against 20.7 GB that ncu counted (docs/performance.md,
2026-12-06).
"""
import argparse
import collections
import heapq
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from benchmark import WINDOW, make_lists  # noqa: E402

SHAPES = {  # Dqk, H, K (window + top-k), S
    "v4pro": (512, 128, 1152, 65536),
    "v32_128k": (576, 128, 2048, 131072),
    "v4flash": (512, 64, 640, 65536),
    "v32_8k": (576, 128, 2048, 8192),
}
TOKENS, D_V = 4096, 512


def ordered(idx, order, wave):
    if order == "given":
        return idx
    out = np.sort(idx, axis=1)
    if order == "waves":
        odd = (np.arange(len(out)) // wave) % 2 == 1
        out[odd] = out[odd, ::-1]
    return out


def block_order(tokens, blocks, ctas_per_token, sms, jitter, seed=1):
    """(token, block) in the order the CTAs reach them."""
    rng = np.random.default_rng(seed)
    free = [0.0] * sms  # when each SM frees up
    events = []
    for t in range(tokens):
        for _ in range(ctas_per_token):
            start = heapq.heappop(free)
            pace = 1.0 + jitter * (2.0 * rng.random() - 1.0)
            events += [(start + b * pace, t, b) for b in range(blocks)]
            heapq.heappush(free, start + blocks * pace)
    events.sort()
    return [(t, b) for _, t, b in events]


def traffic(idx, d, cap_bytes, ctas_per_token, sms, jitter):
    """(GB read, GB written) of the kv / dkv rows."""
    cap = int(cap_bytes // (6 * d))
    lru = collections.OrderedDict()
    misses = evictions = 0
    blocks = -(-idx.shape[1] // 64)
    for t, b in block_order(len(idx), blocks, ctas_per_token, sms, jitter):
        for r in idx[t, b * 64:(b + 1) * 64].tolist():
            if r in lru:
                lru.move_to_end(r)
                continue
            misses += 1
            lru[r] = None
            if len(lru) > cap:
                lru.popitem(last=False)
                evictions += 1
    return misses * 6 * d / 1e9, evictions * 4 * d / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="v4pro,v32_128k,v4flash")
    ap.add_argument("--l2-mb", type=float, default=50.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--orders", default="given,sorted,waves")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="each CTA's pace drawn from 1 +- jitter (0: the waves in step)")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        d, h, k, s = SHAPES[name]
        ctas = -(-h // 64)
        wave = args.sms // ctas
        idx = make_lists(np.random.default_rng(0), k - WINDOW, TOKENS, s)[0]
        stream = TOKENS * h * (2 * d + 2 * 2 * D_V + 2 * d) / 1e9
        for order in args.orders.split(","):
            rd, wr = traffic(ordered(idx, order, wave), d, args.l2_mb * 1e6, ctas, args.sms,
                             args.jitter)
            print(f"{name:9s} L2 {args.l2_mb:.0f} MB jitter {args.jitter:.2f} {order:6s} "
                  f"rows read {rd:6.2f} GB, "
                  f"written {wr:6.2f} GB; + stream {stream:.2f} GB = {rd + wr + stream:6.2f} GB",
                  flush=True)


if __name__ == "__main__":
    main()
