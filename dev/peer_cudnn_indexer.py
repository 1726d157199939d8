"""Peer benchmark: cuDNN-frontend 1.32.0's SM90 lightning indexer (dense fp32 scores) and its
radix top-k on an H200, at the shapes of examples/benchmark_indexer.py and of one V4 layer.

T = 4096 queries at the end of a sequence of S positions (q_causal_offsets = S - T), Hi = 64,
Di = 128, q / k bf16, w fp32, all standard normal, sm_scale = Di^-0.5, one batch row. `ratio`
is the compression: k holds S / ratio rows, row j visible to token t iff (j + 1) * ratio <=
S - T + t + 1 (the rule jax_dsa.indexer_topk uses); the top-k of row t sees that many columns
(seq_lens). Shapes (label, S, ratio, topk):

- the issue's rows: S 8K / 32K / 128K at ratio 1, k 2048; S 128K at ratio 4, k 512;
- the V4 layer of examples/benchmark_layer.py: S 64K at ratio 4 (16384 rows), k 512
  (V4-Flash) and 1024 (V4-Pro).

Timing: CUDA events around each whole wrapper call (its allocations included); a warm-up call
first (it compiles), then 3 repetitions of 5 back-to-back calls, the median per call in us.
The top-k is timed with tie_break=1 (equal scores to the smaller column: jax_dsa's rule) and
with the default (arbitrary); neither sorts its output, which jax_dsa's does (highest first).

  PYTHONPATH=$W:$W/nvidia_cutlass_dsl/dsl_packages python3 dev/peer_cudnn_indexer.py [LABEL ...]
Prints one RESULT line per shape (or RESULT ... FAILED <type>: <message>).
"""
import sys

import torch

T, HI, DI = 4096, 64, 128
SHAPES = [("S8K", 8192, 1, 2048), ("S32K", 32768, 1, 2048), ("S128K", 131072, 1, 2048),
          ("S128K-r4-k512", 131072, 4, 512),
          ("layer-v4flash", 65536, 4, 512), ("layer-v4pro", 65536, 4, 1024)]


def event_us(fn, calls=5, reps=3):
    """Median over `reps` of the mean time of `calls` back-to-back calls, in microseconds."""
    fn()
    torch.cuda.synchronize()
    start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    per = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        per.append(start.elapsed_time(stop) * 1e3 / calls)
    return sorted(per)[len(per) // 2]


def run(label, s, ratio, topk):
    from cudnn.deepseek_sparse_attention import indexer_forward_wrapper, indexer_top_k_wrapper
    rows = s // ratio
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((1, T, HI, DI), generator=g, device="cuda").bfloat16()
    k = torch.randn((1, rows, 1, DI), generator=g, device="cuda").bfloat16()
    w = torch.randn((1, T, HI), generator=g, device="cuda")
    offsets = torch.tensor([s - T], dtype=torch.int32, device="cuda")
    visible = ((s - T + torch.arange(T, device="cuda") + 1) // ratio).int()
    torch.cuda.reset_peak_memory_stats()

    def scores():
        return indexer_forward_wrapper(q, k, w, ratio=ratio, sm_scale=DI ** -0.5,
                                       q_causal_offsets=offsets)["scores"]

    sc = scores().view(T, rows)
    # check the mask of one token against the visibility rule
    t = T // 2
    n_vis = int(visible[t])
    row = sc[t]
    mask_ok = bool(torch.isfinite(row[:n_vis]).all()) and bool(torch.isinf(row[n_vis:]).all())
    us_s = event_us(scores)
    us_k1 = event_us(lambda: indexer_top_k_wrapper(sc, visible, topk, tie_break=1))
    us_k0 = event_us(lambda: indexer_top_k_wrapper(sc, visible, topk))
    pairs = float(visible.double().sum())
    tflops = 2.0 * pairs * HI * DI / us_s / 1e6
    print(f"RESULT cudnn indexer {label} S={s} ratio={ratio} rows={rows} topk={topk} "
          f"scores_us={us_s:.0f} ({tflops:.0f} TFLOP/s on visible) topk_us={us_k1:.0f} "
          f"(tie_break=1; default {us_k0:.0f}) total_us={us_s + us_k1:.0f} mask_ok={mask_ok} "
          f"peak_MB={torch.cuda.max_memory_allocated() / 2**20:.0f}", flush=True)


def main():
    print(f"NOTE torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    want = sys.argv[1:]
    for label, s, ratio, topk in SHAPES:
        if want and label not in want:
            continue
        try:
            run(label, s, ratio, topk)
        except Exception as e:  # report and go on with the next shape
            print(f"RESULT cudnn indexer {label} FAILED {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
