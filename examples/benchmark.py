"""Benchmark sparse MLA: the Hopper kernel against the pure-JAX reference, in one run.

    python examples/benchmark.py [--quick | --small] [--out DIR] [--impls cute,xla]
                                 [--passes fwd,bwd,fwdbwd]

--small is a CPU-sized run (T = S = 256, two head counts, few calls): it checks the script and
the reference in a minute, it measures nothing of interest.

--impls takes cute (the kernels), cute-det (the kernels with deterministic=True, which only
changes the backward) and xla (the reference).

For each shape (docs/performance.md: D = 512, window 128 + top-k, T = S = 4096 and the head
counts of tensor-parallel shards; --long: the last 4096 positions of sequences of 8K-128K at
the DeepSeek shapes; --decode: B sequences of 64K with one new token each) it prints the median time per call, TFLOP/s, TB/s, the
compiled program's device memory (arguments + outputs + XLA temporaries) and the reference's
time from the same run as a ratio; writes DIR/benchmark.md and DIR/benchmark.png.

Timing: a jitted call is dispatched back to back and the device is synchronised once; the time
per call of such a batch is recorded, and the median over `--batches` batches is reported, after
warm-up. A batch has `--calls` calls, or more for short calls: enough for about `--batch-ms`
milliseconds, so that the host's dispatch of the first call and the final synchronisation
(~0.1-0.2 ms together) are not charged to a 0.5 ms kernel at 1/5 each.

Inputs are random normal (never zeros); each token's list is its 128 most recent rows (-1 before
the start) followed by top-k distinct random rows of [0, S).
Passes: fwd (sparse_mla with lse), bwd (the backward alone: the VJP of a forward computed
beforehand, applied under jit to a random bf16 dO and dlse = 0, as in training where only o feeds
the loss) and fwdbwd (jax.value_and_grad of sum(o^2) under jit: forward, the loss's own
elementwise work and the backward).
FLOPs: fwd = 2*B*T*H*K*(Dqk + d_v), K = valid entries; bwd = 2.5 x fwd; fwd+bwd = 3.5 x fwd.
Bytes (TB/s = bytes / time; what the op must move at least once, whatever the kernel): fwd =
the gathered rows (K * Dqk bf16 per token) + q + o; bwd = the gathered rows + one fp32 add of
each entry's dkv row (K * Dqk * 4 per token) + q, o, dO, dq; fwd+bwd = both. A dash in the
table: not measured (no reference in the run).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_dsa  # noqa: E402
from jax_dsa import api  # noqa: E402

D_V, WINDOW = 512, 128
# (label, H, top-k, T, S, Dqk, B); T None: --tokens, S None: S = T.
SHAPES = [("V4-Flash H=64", 64, 512, None, None, 512, 1),
          ("V4-Pro H=128 k512", 128, 512, None, None, 512, 1),
          ("V4-Pro H=128", 128, 1024, None, None, 512, 1),
          ("TP shard H=16", 16, 512, None, None, 512, 1),
          ("TP shard H=8", 8, 512, None, None, 512, 1)] + [
          (f"H={h}", h, 512, None, None, 512, 1) for h in (1, 24, 32, 48, 96, 100)]
QUICK = ["V4-Flash H=64", "V4-Pro H=128 k512", "V4-Pro H=128", "TP shard H=16", "TP shard H=8"]
# --long: the last T = 4096 positions of a sequence of S (DeepSeek's long-context prefill).
LONG = [("V3.2 S=8K", 128, 1920, 4096, 8192, 576, 1),
        ("V3.2 S=128K", 128, 1920, 4096, 131072, 576, 1),
        ("V4-Pro S=8K", 128, 1024, 4096, 8192, 512, 1),
        ("V4-Pro S=64K", 128, 1024, 4096, 65536, 512, 1),
        ("V4-Flash S=8K", 64, 512, 4096, 8192, 512, 1),
        ("V4-Flash S=64K", 64, 512, 4096, 65536, 512, 1),
        ("TP shard H=16 S=64K", 16, 512, 4096, 65536, 512, 1)]
# --decode: B sequences of S, one new token each (T = 1).
DECODE = [("decode B=8", 128, 1920, 1, 65536, 576, 8),
          ("decode B=64", 128, 1920, 1, 65536, 576, 64),
          ("decode V4-Flash B=32", 64, 512, 1, 65536, 512, 32)]


def make_lists(rng, topk, tokens, seq, batch=1):
    """idx [B, T, WINDOW + topk] int32 (NumPy): make_inputs' lists, drawn from `rng`."""
    pos = (seq - tokens + np.arange(tokens))[None, :, None]
    window = pos - (WINDOW - 1) + np.arange(WINDOW)[None, None, :]
    window = np.broadcast_to(np.where(window >= 0, window, -1), (batch, tokens, WINDOW))
    if seq == tokens <= 8192 and batch == 1:
        picks = np.argsort(rng.random((tokens, tokens)), axis=1)[None, :, :topk]
    else:
        picks = rng.integers(0, seq, (batch, tokens, topk))
    return np.concatenate([window, picks], axis=2).astype(np.int32)


def make_inputs(h, topk, tokens, seq=None, d=512, batch=1, seed=0):
    """q [B, T, H, d], kv [B, S, d] (bf16, random normal), idx [B, T, WINDOW + topk], sink [H]
    and the number of valid entries. Token t sits at position S - T + t: its list is the WINDOW
    positions ending at it (-1 before the start), then topk random rows of [0, S) (distinct when
    S = T <= 8192, uniform with repeats otherwise)."""
    rng = np.random.default_rng(seed)
    seq = tokens if seq is None else seq
    q = jnp.asarray(rng.standard_normal((batch, tokens, h, d), np.float32), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((batch, seq, d), np.float32), jnp.bfloat16)
    idx = make_lists(rng, topk, tokens, seq, batch)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    valid = int((idx >= 0).sum())  # fewer than T * (WINDOW + topk) when T < topk or T < WINDOW
    return q, kv, jnp.asarray(idx), sink, valid


def time_call(fn, args, calls, batches, batch_ms=0.0):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = time.perf_counter() - start  # an upper bound of one call (includes the dispatch)
    calls = min(max(calls, math.ceil(batch_ms * 1e-3 / single)), 200)
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call)


def device_bytes(fn, args):
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    except Exception:  # memory_analysis is optional in some backends
        return float("nan")


def make_fn(impl, passes, config=None):
    """(jitted function, how to get its arguments from (q, kv, idx, sink)); `config` pins the
    kernels (jax_dsa.cute.Config; None: the defaults)."""
    deterministic = impl == "cute-det"
    impl = "cute" if deterministic else impl

    def fwd(q, kv, idx, sink):
        return jax_dsa.sparse_mla(q, kv, idx, sink=sink, return_lse=True, implementation=impl,
                                  deterministic=deterministic, config=config)

    if passes == "fwd":
        return jax.jit(fwd), lambda *inputs: inputs
    if passes == "bwd":
        def bwd_args(q, kv, idx, sink):
            (o, lse), vjp_fn = jax.vjp(lambda q, kv, sink: fwd(q, kv, idx, sink), q, kv, sink)
            do = jax.random.normal(jax.random.PRNGKey(7), o.shape, jnp.float32).astype(o.dtype)
            return vjp_fn, (do, jnp.zeros_like(lse))

        # vjp_fn is a pytree holding the residuals (q, kv, idx, o, lse, ...): jit takes them as
        # arguments, so only the backward runs.
        return jax.jit(lambda vjp_fn, cotangents: vjp_fn(cotangents)), bwd_args

    def loss(q, kv, sink, idx):
        o, _ = fwd(q, kv, idx, sink)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(lambda q, kv, idx, sink: grad(q, kv, sink, idx)), lambda *inputs: inputs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the V4 and TP-shard shapes")
    parser.add_argument("--small", action="store_true",
                        help="CPU-sized: T = S = 256, H in {16, 64}, 2 batches of 2 calls")
    parser.add_argument("--long", action="store_true",
                        help="long context: the last 4096 positions of sequences of 8K-128K")
    parser.add_argument("--decode", action="store_true",
                        help="decode: B sequences of 64K, one token each")
    parser.add_argument("--deterministic-long", action="store_true",
                        help="with --long: also the deterministic backward (cute-det)")
    parser.add_argument("--heads", default="", help="comma-separated head counts to keep (default: all)")
    parser.add_argument("--shapes", default="",
                        help="comma-separated label prefixes to keep, e.g. 'V4-Pro,V4-Flash S=8K'")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--impls", default=None,
                        help="comma-separated: cute, cute-det, xla (default: cute,xla, or xla "
                             "alone where the kernels cannot run)")
    parser.add_argument("--passes", default="fwd,bwd,fwdbwd")
    parser.add_argument("--calls", type=int, default=10, help="calls per batch (at least)")
    parser.add_argument("--batch-ms", type=float, default=25.0,
                        help="more calls per batch until a batch lasts about this long")
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--replot", metavar="MD",
                        help="no timing: redraw DIR/benchmark.png from a benchmark.md (or a log "
                             "holding its table) written by an earlier run")
    args = parser.parse_args(argv)
    if args.replot:
        head, rows = read_report(args.replot)
        plot_report(rows, head, args.out)
        return rows

    if args.small:
        args.tokens, args.calls, args.batches, args.batch_ms = 256, 2, 2, 0.0
    problem = api.kernel_runtime_problem()
    if args.impls is None:
        impls = ["cute", "xla"]
        if problem:
            print(f"kernels unavailable ({problem}): timing the reference only")
            impls = ["xla"]
    else:
        impls = args.impls.split(",")
        unknown = [i for i in impls if i not in ("cute", "cute-det", "xla")]
        if unknown:
            raise SystemExit(f"benchmark: unknown --impls {unknown}; use cute, cute-det, xla")
        if problem and any(i.startswith("cute") for i in impls):
            raise SystemExit(f"benchmark: --impls {args.impls} asks for the kernels, which "
                             f"cannot run here: {problem}")
    shapes = [s for s in SHAPES if not args.quick or s[0] in QUICK]
    if args.small:
        shapes = [s for s in SHAPES if s[0] in ("V4-Flash H=64", "TP shard H=16")]
    if args.long or args.decode:
        shapes = (LONG if args.long else []) + (DECODE if args.decode else [])
        if args.deterministic_long and "cute" in impls and "cute-det" not in impls:
            impls.append("cute-det")
    if args.heads:
        shapes = [s for s in shapes if str(s[1]) in args.heads.split(",")]
    if args.shapes:
        shapes = [s for s in shapes if any(s[0].startswith(p) for p in args.shapes.split(","))]
    rows = []
    passes_list = args.passes.split(",")
    total, done = len(shapes) * len(passes_list) * len(impls), 0
    for label, h, topk, tokens, seq, d, batch in shapes:
        tokens = tokens or args.tokens
        seq = seq or tokens
        q, kv, idx, sink, valid = make_inputs(h, topk, tokens, seq, d, batch)
        k_mean = valid / (batch * tokens)  # valid entries per token: the K of the FLOP count
        flops_fwd = 2.0 * h * valid * (d + D_V)
        bytes_fwd = 2.0 * (valid * d + q.size + q.size // d * D_V)
        bytes_bwd = 6.0 * valid * d + 2.0 * (2 * q.size + 2 * (q.size // d) * D_V)
        nbytes = {"fwd": bytes_fwd, "bwd": bytes_bwd, "fwdbwd": bytes_fwd + bytes_bwd}
        for passes in passes_list:
            if passes != "fwd" and tokens == 1:
                continue  # decode has no backward
            flops = flops_fwd * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[passes]
            times = {}
            for impl in impls:
                done += 1
                print(f"[{done}/{total}] {label} {passes} {impl} ...", flush=True)
                fn, make_args = make_fn(impl, passes)
                fn_args = make_args(q, kv, idx, sink)
                t = time_call(fn, fn_args, args.calls, args.batches, args.batch_ms)
                times[impl] = t
                rows.append(dict(shape=label, h=h, k=round(k_mean), t=tokens, s=seq, d=d, b=batch,
                                 passes=passes,
                                 impl=impl, us=t * 1e6, tflops=flops / t / 1e12,
                                 tbs=nbytes[passes] / t / 1e12,
                                 mem_mb=device_bytes(fn, fn_args) / 2**20))
                del fn_args
                print(f"{label:20s} {passes:6s} {impl:8s} {t * 1e6:10.1f} us {rows[-1]['tflops']:7.1f} "
                      f"TFLOP/s {rows[-1]['tbs']:6.2f} TB/s {rows[-1]['mem_mb']:9.1f} MB", flush=True)
            if "xla" in times:
                for r in rows[-len(impls):]:
                    r["vs_ref"] = times["xla"] / times[r["impl"]]
    write_report(rows, args)
    return rows


def write_report(rows, args):
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    head = (f"GPU/device: {dev.device_kind}; jax {jax.__version__}; jax_dsa "
            f"{jax_dsa.__version__}; {datetime.date.today().isoformat()}; bf16, d_v = {D_V}, "
            f"window {WINDOW} + top-k random rows; median of {args.batches} batches of "
            f">= {args.calls} calls (about {args.batch_ms:g} ms per batch)")
    lines = [head, "", "| shape | H | K | B | T | S | Dqk | pass | impl | µs | TFLOP/s | TB/s | "
             "device MB | speed-up vs reference |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['h']} | {r['k']} | {r['b']} | {r['t']} | {r['s']} | "
                     f"{r['d']} | {r['passes']} | {r['impl']} | "
                     f"{r['us']:.0f} | {r['tflops']:.1f} | {r['tbs']:.2f} | "
                     f"{_cell(r['mem_mb'], 0)} | {_cell(r.get('vs_ref'), 2)} |")
    with open(os.path.join(args.out, "benchmark.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_report(rows, head, args.out)


def _cell(x, digits):
    """A table cell: the number, or a dash where it was not measured."""
    return "—" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def read_report(path):
    """(header line, rows) of a table written by write_report (other lines are skipped)."""
    head, rows = "", []
    with open(path) as f:
        for line in f:
            if line.startswith("GPU/device:"):
                head = line.strip()
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|") and len(cells) == 14 and cells[1].isdigit():
                rows.append(dict(shape=cells[0], h=int(cells[1]), k=int(cells[2]), passes=cells[7],
                                 impl=cells[8], us=float(cells[9])))
    return head, rows


def plot_report(rows, head, out):
    """DIR/benchmark.png: µs per shape, one bar per (pass, implementation); needs matplotlib."""
    os.makedirs(out, exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    keys = sorted({(r["passes"], r["impl"]) for r in rows})
    labels = list(dict.fromkeys(r["shape"] for r in rows))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        vals = [next((r["us"] for r in rows if r["shape"] == s and (r["passes"], r["impl"]) == key),
                     0) for s in labels]
        ax.bar(np.arange(len(labels)) + i * width, vals, width, label=f"{key[1]} {key[0]}")
    ax.set_xticks(np.arange(len(labels)) + width * (len(keys) - 1) / 2, labels, rotation=30,
                  ha="right")
    ax.set_ylabel("µs per call (lower is better)")
    ax.set_yscale("log")
    ax.set_title(head, fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "benchmark.png"), dpi=120)


if __name__ == "__main__":
    main()
