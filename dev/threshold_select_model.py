"""NumPy model of a threshold-filtered selection: a plan for the indexer's top-k without the dense
[T, S] scores in HBM.

    python dev/threshold_select_model.py [--s 32768] [--t 256] [--k 2048]

Today the selection writes each 512-token chunk's fp32 scores ([ct, S], 256 MB) and the top-k
kernel reads them back twice: at T = 4096, S = 128K that is 2.1 GB written and 4.3 GB read, the
~2.4 ms between the score kernel's 14.7 ms and the selection's 17.1 ms. The plan:

1. A sample pass on the kernels that exist: `indexer_scores` / `indexer_topk` over the rows
   k[SAMPLE - 1 :: SAMPLE] at ratio SAMPLE * ratio (row j of the sample is row SAMPLE j +
   SAMPLE - 1, visible under the same rule), 1 / SAMPLE of the GEMM; per token the r-th largest
   sampled visible score, r = ceil(MARGIN * k * m / V) (m sampled visible rows, V visible rows):
   a threshold tau that about MARGIN * k of the token's rows reach. (`--tiles` samples every
   SAMPLE-th 256-row tile instead, the form a score kernel could skip to.)
2. The main pass: the score kernel over every tile, whose epilogue appends (score, row) to the
   token's candidate buffer (capacity CAP) only where score >= tau, instead of storing every
   score.
3. A final selection over each token's candidates (the top-k kernel on (score, row) pairs).

Exactness: if a token has at least k candidates, tau is at most its k-th largest score, so every
row scoring at least that (ties included) is a candidate and the top-k of the candidates is the
top-k of the row (ties to the smaller row as today). A token with fewer than k candidates (tau
too high) or more than CAP (tau too low) takes the present dense path: the model counts those.
Tokens that see at most k rows take them all (no threshold).

The model draws q, k, w at random, computes the scores in float32, runs the plan and checks it
against a lexsort top-k per token; it prints the candidates per token and the fallback rate for
i.i.d. rows and for rows with a slowly varying common component (neighbouring rows alike, so the
high scores gather in some tiles: the hard case for a tile sample).
"""
import argparse

import numpy as np

TILE = 256


def scores(q, kr, w, scale):
    """[T, S] float32: sum_h w[t, h] * relu(scale * q[t, h] . kr[s])."""
    t, h, d = q.shape
    s = np.maximum(np.float32(scale) * (q.reshape(t * h, d) @ kr.T), np.float32(0)).reshape(t, h, -1)
    return np.einsum("th,ths->ts", w, s.astype(np.float32)).astype(np.float32)


def exact_topk(row, k):
    order = np.lexsort((np.arange(row.size), -row))  # score descending, then row ascending
    return order[:k]


def plan(sc, start, k, sample, margin, cap, tiles=False):
    """(selection per token or None where it falls back, candidates per token)."""
    t_n, s_n = sc.shape
    rows = np.arange(s_n)
    sampled = (rows // TILE) % sample == 0 if tiles else rows % sample == sample - 1
    picks, counts = [], []
    for t in range(t_n):
        visible = start + t + 1
        row = sc[t, :visible]
        if visible <= k:
            picks.append(exact_topk(row, k))
            counts.append(visible)
            continue
        samp = np.sort(row[sampled[:visible]])[::-1]
        r = int(np.ceil(margin * k * samp.size / visible))
        tau = samp[r - 1] if r <= samp.size else -np.inf
        cand = np.nonzero(row >= tau)[0]
        counts.append(cand.size)
        if cand.size < k or cand.size > cap:
            picks.append(None)
            continue
        picks.append(cand[exact_topk(row[cand], k)])
    return picks, np.array(counts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--s", type=int, default=32768)
    ap.add_argument("--t", type=int, default=256)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--sample", type=int, default=16)
    ap.add_argument("--margin", type=float, default=2.0)
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--tiles", action="store_true", help="sample 256-row tiles, not rows")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    d = 128
    start = args.s - args.t
    q = rng.standard_normal((args.t, args.heads, d), dtype=np.float32)
    w = rng.standard_normal((args.t, args.heads), dtype=np.float32) / np.sqrt(args.heads)
    base = rng.standard_normal((args.s, d), dtype=np.float32)
    drift = np.cumsum(rng.standard_normal((args.s, d), dtype=np.float32), 0)
    drift /= np.std(drift)  # a random walk along the rows, unit spread
    cases = {"iid rows": base, "drifting rows": (0.5 * base + drift).astype(np.float32)}
    for name, kr in cases.items():
        sc = scores(q, kr, w, d ** -0.5)
        picks, counts = plan(sc, start, args.k, args.sample, args.margin, args.cap,
                               args.tiles)
        wrong = 0
        for t, p in enumerate(picks):
            if p is not None:
                ref = exact_topk(sc[t, :start + t + 1], args.k)
                wrong += int(not np.array_equal(p, ref))
        falls = sum(p is None for p in picks)
        print(f"{name:14s} S {args.s} T {args.t} k {args.k} sample 1/{args.sample} "
              f"{'tiles' if args.tiles else 'rows'} "
              f"margin {args.margin}: candidates per token median {np.median(counts):.0f}, "
              f"p99 {np.percentile(counts, 99):.0f}, max {counts.max()}; fallbacks {falls} / "
              f"{args.t}; wrong selections {wrong}")


if __name__ == "__main__":
    main()
