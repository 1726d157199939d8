#!/usr/bin/env python
"""GPU sanity check and timing of the AOT-built sparse MLA forward (jax_dsa/_lib must be built).

    python tools/gpu_smoke_fwd.py [--skip-timing] [--impl {ws2,ws,smallh2,smallh,simt,<candidate>,all}]

--impl all runs every variant in its own process (the handler reads JAX_DSA_FWD_IMPL once).

Compares jax_dsa._native.sparse_mla_fwd under jax.jit with a float32 dense reference written
here (independent of jax_dsa.reference), prints max errors and PASS/FAIL per case, then times
H=64/128, K=640, T=S=4096 (median over batches of 20 back-to-back calls, after warm-up).
"""
import argparse
import os
import statistics
import sys
import time

# The FFI handler reads JAX_DSA_FWD_IMPL once, on its first call: set it before anything runs.
if "--impl" in sys.argv and sys.argv[sys.argv.index("--impl") + 1] != "all":
    os.environ["JAX_DSA_FWD_IMPL"] = sys.argv[sys.argv.index("--impl") + 1]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa import _native  # noqa: E402

D_V = 512
IMPLS = ["ws2", "ws", "smallh2", "smallh", "simt"]  # exported by default; candidates by tag


@jax.jit
def reference(q, kv, idx, topk_length, sink, scale):
    """float32 reference: o [B,T,H,512], lse [B,T,H] (lse excludes the sink; dead rows 0/-inf)."""
    q = q.astype(jnp.float32)
    kv = kv.astype(jnp.float32)
    B, T, H, D = q.shape
    S, K = kv.shape[1], idx.shape[2]
    valid = (idx >= 0) & (idx < S) & (jnp.arange(K)[None, None, :] < topk_length[:, :, None])
    safe = jnp.where(valid, idx, 0)
    g = jax.vmap(lambda kvb, ib: kvb[ib])(kv, safe)  # [B, T, K, D]
    s = jnp.einsum("bthd,btkd->bthk", q, g, precision="highest") * scale
    s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    l = jnp.sum(p, axis=-1, keepdims=True)
    denom = l + jnp.exp(sink[None, None, :, None] - m_safe)
    o = jnp.einsum("bthk,btkd->bthd", p, g[..., :D_V], precision="highest")
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    lse = jnp.where(l[..., 0] > 0, m_safe[..., 0] + jnp.log(l[..., 0]), -jnp.inf)
    return o, lse


def make_inputs(key, B, T, S, H, D, K, dtype, *, invalid_frac, tl_mode, sink_on, dup):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).astype(dtype)
    kv = jax.random.normal(ks[1], (B, S, D), jnp.float32).astype(dtype)
    idx = jax.random.randint(ks[2], (B, T, K), 0, S, jnp.int32)
    if dup:  # duplicated indices count each time
        idx = idx.at[..., 1::3].set(idx[..., ::3][..., : idx[..., 1::3].shape[-1]])
    if invalid_frac > 0:
        r = jax.random.uniform(ks[3], (B, T, K))
        idx = jnp.where(r < invalid_frac / 2, -1, idx)
        idx = jnp.where((r >= invalid_frac / 2) & (r < invalid_frac), S + 7, idx)
    if tl_mode == "full":
        tl = jnp.full((B, T), K, jnp.int32)
    elif tl_mode == "partial":
        tl = jax.random.randint(ks[4], (B, T), 0, K + 1, jnp.int32)
        tl = tl.at[0, 0].set(0)  # a dead row
    else:
        raise ValueError(tl_mode)
    sink = (jax.random.normal(ks[5], (H,), jnp.float32) if sink_on
            else jnp.full((H,), -jnp.inf, jnp.float32))
    return q, kv, idx, tl, sink


def check_case(i, B, T, S, H, D, K, dtype=jnp.bfloat16, invalid_frac=0.2, tl_mode="partial",
               sink_on=True, dup=False):
    q, kv, idx, tl, sink = make_inputs(jax.random.PRNGKey(i), B, T, S, H, D, K, dtype,
                                       invalid_frac=invalid_frac, tl_mode=tl_mode,
                                       sink_on=sink_on, dup=dup)
    scale = D ** -0.5
    fn = jax.jit(lambda *a: _native.sparse_mla_fwd(*a, scale=scale))
    o, lse = jax.block_until_ready(fn(q, kv, idx, tl, sink))
    o_ref, lse_ref = reference(q, kv, idx, tl, sink, scale)
    o = np.asarray(o.astype(jnp.float32))
    lse = np.asarray(lse)
    o_ref = np.asarray(o_ref)
    lse_ref = np.asarray(lse_ref)
    finite = np.isfinite(lse_ref)
    nan = bool(np.isnan(o).any() or np.isnan(lse).any())
    dead_ok = bool(np.all(lse[~finite] == -np.inf) and np.all(o[~finite] == 0))
    e_o = float(np.max(np.abs(o - o_ref))) if o.size else 0.0
    e_lse = float(np.max(np.abs(lse[finite] - lse_ref[finite]))) if finite.any() else 0.0
    ok = (not nan) and dead_ok and e_o < 3e-2 and e_lse < 1e-2
    desc = (f"B={B} T={T} S={S} H={H} D={D} K={K} {jnp.dtype(dtype).name} inv={invalid_frac} "
            f"tl={tl_mode} sink={'on' if sink_on else 'off'}{' dup' if dup else ''}")
    print(f"[{'PASS' if ok else 'FAIL'}] {desc}: max|do|={e_o:.3e} max|dlse|={e_lse:.3e} "
          f"nan={nan} dead_rows={int((~finite).sum())} dead_ok={dead_ok}", flush=True)
    return ok


def time_case(B, T, S, H, D, K, n=20, batches=7):
    """Median over `batches` of the mean time of n back-to-back (asynchronously dispatched) calls."""
    q, kv, idx, tl, sink = make_inputs(jax.random.PRNGKey(0), B, T, S, H, D, K, jnp.bfloat16,
                                       invalid_frac=0.0, tl_mode="full", sink_on=True, dup=False)
    fn = jax.jit(lambda *a: _native.sparse_mla_fwd(*a, scale=D ** -0.5))
    for _ in range(3):
        jax.block_until_ready(fn(q, kv, idx, tl, sink))
    ts = []
    for _ in range(batches):
        t0 = time.perf_counter()
        outs = [fn(q, kv, idx, tl, sink) for _ in range(n)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / n)
        del outs
    med = statistics.median(ts)
    flops = 2 * B * T * H * K * (D + D_V)
    print(f"[TIME] B={B} T={T} S={S} H={H} D={D} K={K}: median {med * 1e6:.0f} us, "
          f"{flops / med / 1e12:.0f} TFLOP/s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--max-heads", type=int, default=128, help="skip cases with more heads")
    ap.add_argument("--time-heads", default="64,128", help="head counts timed at D=512")
    ap.add_argument("--time-ks", default="640",
                    help="list lengths K timed for each timed head count (per-block vs fixed cost)")
    ap.add_argument("--only", default="", help="comma-separated case ids to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated case ids to leave out")
    ap.add_argument("--impl", default="default",
                    help="kernel variant (sets JAX_DSA_FWD_IMPL): " + ", ".join(IMPLS) +
                    ", a candidate tag built with --experimental, all or default")
    args = ap.parse_args()
    if args.impl == "all":
        import subprocess

        rcs = {}
        for impl in IMPLS:
            cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl]
            if impl == "smallh":  # the small-H kernel takes H <= 32 only
                cmd += ["--max-heads", "32"]
            if args.skip_timing or impl == "simt":  # the SIMT kernel is only a cross-check
                cmd.append("--skip-timing")
            print(f"===== impl={impl}", flush=True)
            rcs[impl] = subprocess.call(cmd)
        print("summary:", {k: ("PASS" if v == 0 else "FAIL") for k, v in rcs.items()})
        sys.exit(0 if all(v == 0 for v in rcs.values()) else 1)
    print("devices:", jax.devices(), "library:", _native.LIB_PATH, _native.is_available(),
          "impl:", args.impl)
    cases = []
    i = 0
    for D in (512, 576):
        for H in (1, 16, 24, 64, 100, 128):
            for K in (1, 63, 640):
                i += 1
                cases.append(dict(i=i, B=2, T=5, S=300, H=H, D=D, K=K,
                                  sink_on=(i % 2 == 0), tl_mode="partial" if i % 3 else "full"))
    cases += [
        dict(i=900, B=1, T=3, S=50, H=64, D=576, K=640, invalid_frac=0.0, tl_mode="full",
             sink_on=False, dup=True),  # K > S: many duplicates
        dict(i=901, B=2, T=4, S=1000, H=128, D=576, K=200, dtype=jnp.float16),
        dict(i=902, B=2, T=4, S=1000, H=24, D=512, K=200, dtype=jnp.float16, sink_on=False),
        dict(i=903, B=1, T=2, S=10, H=16, D=512, K=64, invalid_frac=1.0),  # all invalid
        dict(i=904, B=3, T=33, S=4096, H=64, D=512, K=640, invalid_frac=0.05),
    ]
    # Small-H kernel edges: N padding (7, 9, 17, 25), a token stream crossing CTA boundaries.
    for j, H in enumerate((7, 8, 9, 17, 25, 32)):
        cases.append(dict(i=950 + j, B=2, T=5, S=300, H=H, D=(512, 576)[j % 2], K=(63, 200)[j % 2],
                          sink_on=bool(j % 2), tl_mode="partial"))
    cases.append(dict(i=960, B=3, T=700, S=2000, H=16, D=576, K=130, invalid_frac=0.1,
                      tl_mode="partial"))
    # NP 32 at Dqk 512 (H 25..32: smallh2's NP 32 two-consumer case), a long stream and K = 640.
    cases.append(dict(i=961, B=3, T=700, S=2000, H=32, D=512, K=130, invalid_frac=0.1,
                      tl_mode="partial", sink_on=True))
    cases.append(dict(i=962, B=2, T=9, S=900, H=28, D=512, K=640, tl_mode="full"))
    # Many tokens through the 64-head kernels (dead rows, invalid entries, odd block counts).
    cases.append(dict(i=970, B=2, T=1100, S=2000, H=64, D=512, K=200, invalid_frac=0.1))
    cases.append(dict(i=971, B=1, T=4200, S=3000, H=100, D=576, K=130, invalid_frac=0.1,
                      sink_on=False))
    cases = [c for c in cases if c["H"] <= args.max_heads]
    if args.only:
        cases = [c for c in cases if str(c["i"]) in args.only.split(",")]
    if args.skip:
        cases = [c for c in cases if str(c["i"]) not in args.skip.split(",")]
    results = []
    for c in cases:
        t0 = time.perf_counter()
        results.append(check_case(**c))
        print(f"  case {c['i']} took {time.perf_counter() - t0:.1f}s", flush=True)
    print(f"{sum(results)}/{len(results)} cases passed")
    if not args.skip_timing:
        heads = [int(h) for h in args.time_heads.split(",")]
        ks = [int(k) for k in args.time_ks.split(",")]
        for H in heads:
            for K in ks:
                time_case(1, 4096, 4096, H, 512, K)
        if 128 in heads and 1152 not in ks:
            time_case(1, 4096, 4096, 128, 512, 1152)
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
