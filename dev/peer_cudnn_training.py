"""Peer benchmark: cuDNN-frontend 1.32.0's SM90 DSA training kernels on an H200.

Times two kernels of one DSA layer's training step at DeepSeek-V4 shapes (T = 4096 queries at
the end of S = 65536 positions; one KV pool: the S/4 = 16384 compressed rows; each token's list
= topk distinct uniform random rows among the rows visible to it, -1 where fewer are visible):

- score_recompute: `sparse_attn_score_recompute_wrapper(q [1,T,H,512] bf16, k [1,S/4,512] bf16,
  lse [1,T,H] fp32, idx [1,T,topk] int32, softmax_scale)` -> {'target': [1,T,topk] fp32}, the
  indexer's KL target (attention probabilities exp(s*scale - lse) summed over heads, L1-normalised
  over the token's entries; -1 entries give 0). The API takes no sink: lse is the KV-only
  natural-log log-sum-exp (the kernel multiplies it by log2(e) itself), computed here by a
  chunked float32 torch reference with softmax_scale = 1/sqrt(512).
- indexer_bwd: `indexer_backward_wrapper(index_q [1,T,64,128], weights [1,T,64], index_k
  [1,S/4,128] (all bf16: the API rejects fp32 weights), attn_score, index_score (target and
  predict, [1,T,topk] fp32, here softmaxes of random values), idx, grad_loss [1] fp32, sm_scale)`
  -> {'d_index_q', 'd_weights', 'd_index_k'} (bf16). It overwrites attn_score with the score
  gradient in place, so later calls read that as their target; the work does not depend on it.

- attn_bwd: `sparse_attention_backward_wrapper(q [T,H,512] bf16, kv [S + S/4, 512] bf16, out,
  dout, lse [T,H] fp32, sink [H] fp32, idx [T, 128 + topk] int32, softmax_scale)` -> {'dq',
  'dkv', 'd_sink'}: the layer's sparse attention backward, its two pools as one (the peer takes
  one pool): the raw rows [0, S) then the compressed rows from S on; each token's list = the
  window of the 128 raw positions ending at it, then its topk compressed rows (those of the
  indexer lists above, + S). out / lse (KV-only, natural log) from a chunked float32 torch
  reference with the sink in the denominator, as the peer's API expects.

Timing: CUDA events around the whole wrapper call (its allocations, the lse transpose and the
score-gradient / dK-cast launches included); a warm-up call first (it compiles; its wall time is
first_s), then 3 repetitions of 5 back-to-back calls, median per-call time in microseconds;
peak_MB = torch.cuda.max_memory_allocated() since just before the warm-up (inputs included).

Needs torch and the cuDNN-frontend wheels on PYTHONPATH: nvidia-cudnn-frontend 1.32.0,
nvidia-cutlass-dsl with its libs (including `nvidia_cutlass_dsl/dsl_packages`), apache-tvm-ffi.
  PYTHONPATH=$W:$W/nvidia_cutlass_dsl/dsl_packages python3 dev/peer_cudnn_training.py [v4flash]
Prints one RESULT line per kernel and shape (or RESULT ... FAILED <type>: <message>).
A second argument names the pieces to run (comma-separated: score_recompute, indexer_bwd,
attn_bwd; default all). A third names a directory of lists to use instead of the uniform random
ones: <label>.npy, [1, T, topk] int32, as `examples/benchmark_layer.py --save-lists DIR` writes
the lists our indexer selected (so that both libraries run the same entries). A fourth, N > 0,
adds per kernel a burst (10 calls after 3 s idle) and N sustained back-to-back calls between
events, as `dev/profile_layer.py LABEL PIECE N` times ours.
"""
import os
import statistics
import sys
import time

import numpy as np
import torch

T, S, RATIO = 4096, 65536, 4
REPEAT = 0  # main's fourth argument: burst and sustained timings of that many calls
ROWS = S // RATIO  # compressed KV rows
D, HI, DI = 512, 64, 128  # attention head dim; indexer heads and head dim
SHAPES = [("v4flash", 64, 512), ("v4pro", 128, 1024)]  # label, attention heads H, topk
N_CHECK = 256  # tokens whose target is checked against the torch reference


def dsa_fn(name):
    """A public function of cudnn.deepseek_sparse_attention, or an error raised when called."""
    try:
        import cudnn.deepseek_sparse_attention as dsa
        return getattr(dsa, name)
    except Exception as e:  # missing wheel or name: report it as that candidate's failure
        err = e

        def missing(*args, **kwargs):
            raise err
        return missing


def make_indices(topk, g, chunk=512):
    """[1, T, topk] int32: distinct uniform random visible rows per token, -1 padding."""
    start = S - T
    out = torch.full((T, topk), -1, dtype=torch.int32, device="cuda")
    cols = torch.arange(ROWS, device="cuda")[None]
    for a in range(0, T, chunk):
        t = torch.arange(a, min(T, a + chunk), device="cuda")[:, None]
        visible = (cols + 1) * RATIO <= start + t + 1
        keys = torch.rand((t.shape[0], ROWS), generator=g, device="cuda").masked_fill(~visible, -1)
        vals, idx = keys.topk(min(topk, ROWS), dim=1)
        out[a:a + t.shape[0], :idx.shape[1]] = torch.where(vals >= 0, idx, -1).int()
    return out[None].contiguous()


def chunk_scores(q, kv, ids, scale):
    """(rows [t, k, D] float32, s = scale q rows^T [t, H, k], -inf at -1 entries) for a chunk
    of tokens' lists ids [t, k]."""
    rows = kv.index_select(0, ids.clamp(min=0).reshape(-1).long()).view(*ids.shape, -1).float()
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    return rows, s.masked_fill((ids < 0)[:, None, :], float("-inf"))


@torch.no_grad()
def reference_lse(q, kv, idx, scale, chunk=128):
    """KV-only natural-log lse [1, T, H] over each token's valid entries, and the normalised
    head-summed target of the first N_CHECK tokens."""
    q, kv, idx = q[0], kv[0], idx[0]
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    targets = []
    for a in range(0, T, chunk):
        _, s = chunk_scores(q[a:a + chunk], kv, idx[a:a + chunk], scale)
        lse[a:a + chunk] = torch.logsumexp(s, -1)
        if a < N_CHECK:
            p = torch.exp(s - lse[a:a + chunk, :, None]).sum(1)
            targets.append(p / p.sum(-1, keepdim=True))
    return lse[None].contiguous(), torch.cat(targets)[:N_CHECK]


def msg(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def bench(kernel, label, heads, topk, candidates):
    """Warm-up with the first candidate that works, then time it. Returns the warm-up output."""
    head = f"RESULT cudnn {kernel} {label}"
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    errors = []
    for name, fn in candidates:
        try:
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            break
        except Exception as e:
            errors.append(e)
            print(f"NOTE cudnn {kernel} {label}: {name} failed: {msg(e)}", flush=True)
    else:
        e = errors[0]
        print(f"{head} FAILED {msg(e)}", flush=True)
        return None
    print(f"NOTE cudnn {kernel} {label}: using {name}", flush=True)
    try:
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        per = []
        for _ in range(3):
            e0.record()
            for _ in range(5):
                fn()
            e1.record()
            e1.synchronize()
            per.append(e0.elapsed_time(e1) * 1000 / 5)
    except Exception as e:
        print(f"{head} FAILED {msg(e)}", flush=True)
        return None
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(f"{head} T={T} S={S} H={heads} topk={topk} us={statistics.median(per):.1f} "
          f"first_s={first:.1f} peak_MB={peak:.0f}", flush=True)
    if REPEAT:  # a burst from an idle GPU, then sustained back-to-back calls (power cap)
        for name, n, idle in (("burst", 10, 3.0), ("sustained", REPEAT, 0.0)):
            time.sleep(idle)
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            e1.synchronize()
            print(f"{head} {name}: {n} calls, {e0.elapsed_time(e1) / n:.3f} ms per call "
                  "(events)", flush=True)
    return out


def random_distribution(idx, g):
    """Softmax of random values over each token's valid entries, 0 at -1 entries."""
    x = torch.randn(idx.shape, generator=g, device="cuda").masked_fill(idx < 0, float("-inf"))
    return torch.nan_to_num(x.softmax(-1), nan=0.0).contiguous()


@torch.no_grad()
def reference_attention(q, kv, idx, sink, scale, chunk=128):
    """(out [T, H, 512] bf16, KV-only natural-log lse [T, H] fp32) of sparse attention with a
    sink in the softmax's denominator; every entry of idx is valid here."""
    out = torch.empty((T, q.shape[1], 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    for a in range(0, T, chunk):
        rows, s = chunk_scores(q[a:a + chunk], kv, idx[a:a + chunk], scale)
        lse[a:a + chunk] = torch.logsumexp(s, -1)
        denom = torch.logaddexp(lse[a:a + chunk], sink[None, :])
        p = torch.exp(s - denom[..., None])
        out[a:a + chunk] = torch.einsum("thk,tkd->thd", p, rows[..., :512]).bfloat16()
    return out, lse


def attention_backward(label, H, topk, idx, g):
    """The layer's attention backward on the peer: both pools as one buffer (raw rows, then
    the compressed rows from S on), window + compressed top-k lists."""
    scale = D ** -0.5
    q = (torch.randn((T, H, D), generator=g, device="cuda") * 0.5).bfloat16()
    kv = torch.randn((S + ROWS, D), generator=g, device="cuda").bfloat16()
    t = torch.arange(T, device="cuda")[:, None]
    window = (S - T) + t - 127 + torch.arange(128, device="cuda")[None]
    assert bool((idx[0] >= 0).all()), "every token sees more than topk compressed rows here"
    lists = torch.cat([window, idx[0].long() + S], 1).int().contiguous()
    sink = torch.randn((H,), generator=g, device="cuda")
    dout = torch.randn((T, H, 512), generator=g, device="cuda").bfloat16()
    out, lse = reference_attention(q, kv, lists, sink, scale)
    backward = dsa_fn("sparse_attention_backward_wrapper")
    res = bench("attn_bwd", label, H, 128 + topk, [
        ("sparse_attention_backward_wrapper(q, kv, out, dout, lse, sink, idx, softmax_scale=)",
         lambda: backward(q, kv, out, dout, lse, sink, lists, softmax_scale=scale)),
    ])
    if res is not None:
        fin = all(bool(torch.isfinite(res[k]).all()) for k in ("dq", "dkv"))
        print(f"CHECK cudnn attn_bwd {label}: finite={fin}", flush=True)
    del q, kv, lists, sink, dout, out, lse, res
    torch.cuda.empty_cache()


def score_recompute(label, H, topk, idx, g):
    """The indexer's KL target on the peer (one pool: the compressed rows)."""
    scale = D ** -0.5
    q = torch.randn((1, T, H, D), generator=g, device="cuda").bfloat16()
    kv = torch.randn((1, ROWS, D), generator=g, device="cuda").bfloat16()
    lse, ref = reference_lse(q, kv, idx, scale)
    # (the package's 3-D `sparse_attention_score_recompute` convenience form is SM100-only)
    wrapper = dsa_fn("sparse_attn_score_recompute_wrapper")
    out = bench("score_recompute", label, H, topk, [
        ("sparse_attn_score_recompute_wrapper(..., softmax_scale=, qhead_per_kv_head=)",
         lambda: wrapper(q, kv, lse, idx, softmax_scale=scale, qhead_per_kv_head=H)),
        ("sparse_attn_score_recompute_wrapper(q, k, lse, idx, scale)",
         lambda: wrapper(q, kv, lse, idx, scale)),
    ])
    if out is not None:
        tgt = out["target"].reshape(T, topk)[:N_CHECK]
        print(f"CHECK cudnn score_recompute {label} first {N_CHECK} tokens: "
              f"max_abs_err={(tgt - ref).abs().max().item():.2e} "
              f"max_target={ref.max().item():.2e}", flush=True)
    del q, kv, lse, ref, out
    torch.cuda.empty_cache()


def indexer_backward(label, topk, idx, g):
    """The gradients of the indexer's KL loss on the peer."""
    iq = torch.randn((1, T, HI, DI), generator=g, device="cuda").bfloat16()
    w = (torch.randn((1, T, HI), generator=g, device="cuda") * HI ** -0.5).bfloat16()
    ik = torch.randn((1, ROWS, DI), generator=g, device="cuda").bfloat16()
    attn, pred = random_distribution(idx, g), random_distribution(idx, g)
    grad_loss = torch.ones((1,), dtype=torch.float32, device="cuda")
    backward = dsa_fn("indexer_backward_wrapper")
    out = bench("indexer_bwd", label, HI, topk, [
        ("indexer_backward_wrapper(..., grad_loss=, sm_scale=, loss_coeff=)",
         lambda: backward(iq, w, ik, attn, pred, idx, grad_loss=grad_loss,
                          sm_scale=DI ** -0.5, loss_coeff=1.0)),
        ("indexer_backward_wrapper(..., sm_scale=) (grad_loss defaulted)",
         lambda: backward(iq, w, ik, attn, pred, idx, sm_scale=DI ** -0.5)),
    ])
    if out is not None:
        fin = all(bool(torch.isfinite(out[k]).all()) for k in ("d_index_q", "d_weights",
                                                                "d_index_k"))
        print(f"CHECK cudnn indexer_bwd {label}: finite={fin}", flush=True)
    del iq, w, ik, attn, pred, out
    torch.cuda.empty_cache()


def run_shape(label, H, topk, g, pieces, lists_dir=None):
    path = os.path.join(lists_dir, f"{label}.npy") if lists_dir else None
    if path and os.path.isfile(path):  # the lists our layer benchmark selected (--save-lists)
        idx = torch.from_numpy(np.load(path)).to(device="cuda", dtype=torch.int32).contiguous()
        assert idx.shape == (1, T, topk), (path, idx.shape)
        print(f"NOTE lists of {label} from {path}", flush=True)
    else:
        idx = make_indices(topk, g)
    if "score_recompute" in pieces:
        score_recompute(label, H, topk, idx, g)
    if "indexer_bwd" in pieces:
        indexer_backward(label, topk, idx, g)
    if "attn_bwd" in pieces:
        attention_backward(label, H, topk, idx, g)
    del idx
    torch.cuda.empty_cache()


def main():
    only = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "all" else None
    pieces = set((sys.argv[2] if len(sys.argv) > 2 else
                  "score_recompute,indexer_bwd,attn_bwd").split(","))
    lists_dir = sys.argv[3] if len(sys.argv) > 3 else None
    global REPEAT
    REPEAT = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"NOTE torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for label, H, topk in SHAPES:
        if only and only not in label:
            continue
        run_shape(label, H, topk, g, pieces, lists_dir)


if __name__ == "__main__":
    main()
