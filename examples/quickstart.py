"""Quickstart: one sparse MLA call on an embedded DeepSeek-V4-like problem.

Prints the shapes, which implementation ran (the Hopper kernel on an sm_90 GPU, the pure-JAX
reference elsewhere), the median time of repeated calls and the error against the float32
reference.   python examples/quickstart.py [--tokens T] [--heads H]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dsa
from jax_dsa import api, indices


def default_problem(tokens, heads, head_dim=576, window=64, ratio=4, topk=128, seed=0):
    """q, kv buffer [window KV | compressed KV], idx = window ++ (top-k compressed + offset)."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k1, (1, tokens, heads, head_dim), jnp.bfloat16)
    n_c = indices.num_compressed(tokens, ratio)
    kv = jax.random.normal(k2, (1, tokens + n_c, head_dim), jnp.bfloat16)
    scores = jax.random.normal(k3, (tokens, n_c))
    idx = indices.concat_window_compressed(indices.sliding_window(tokens, window),
                                           indices.causal_topk(scores, topk, ratio), offset=tokens)
    sink = jax.random.normal(k4, (heads,), jnp.float32)
    return q, kv, idx[None], sink


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    q, kv, idx, sink = default_problem(args.tokens, args.heads)
    problem = api.kernel_shape_problem(q, kv, 512) or api.kernel_runtime_problem()
    used = "Hopper CuTe DSL kernel" if problem is None else f"pure-JAX reference ({problem})"
    run = jax.jit(lambda q, kv, idx, sink: jax_dsa.sparse_mla(q, kv, idx, sink=sink,
                                                              return_lse=True))
    o, lse = jax.block_until_ready(run(q, kv, idx, sink))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(q, kv, idx, sink))
        times.append(time.perf_counter() - start)

    o_ref, lse_ref = jax_dsa.sparse_mla(q.astype(jnp.float32), kv.astype(jnp.float32), idx,
                                        sink=sink, return_lse=True, implementation="xla")
    err_o = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref)))
    live = jnp.isfinite(lse_ref)
    err_lse = float(jnp.max(jnp.where(live, jnp.abs(lse - lse_ref), 0.0)))
    print(f"device       : {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"implementation: {used}")
    print(f"q {q.shape} {q.dtype}, kv {kv.shape}, idx {idx.shape} (window 64 ++ top-128 of ratio-4"
          f" compressed), sink {sink.shape}")
    print(f"o {o.shape} {o.dtype}, lse {lse.shape} {lse.dtype}")
    print(f"time         : {np.median(times) * 1e3:.3f} ms (median of {args.repeats}, wall clock)")
    print(f"max |o - ref|: {err_o:.3e}   max |lse - ref|: {err_lse:.3e}  (ref: float32 inputs)")
    assert np.isfinite(err_o) and err_o < 5e-2, "output disagrees with the reference"
    return err_o, err_lse


if __name__ == "__main__":
    main()
