#!/usr/bin/env python
"""Run one benchmark shape a few times, for a profiler (jax_dsa/_lib must be built):

    python dev/profile_case.py fwd|bwd H TOPK [S] [--given]
    python dev/profile_case.py decode B          # B tokens, one per sequence of S = 64K
    ncu --clock-control none --launch-skip 1 --launch-count 1 --kernel-name regex:SparseMlaFwd \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python dev/profile_case.py fwd 64 512

Inputs are examples/benchmark.py's (T = S = 4096, D = 512, window 128 + TOPK random rows, so
K = 128 + TOPK; with S, the 4096 queries are the last positions of a sequence of S). "bwd" runs
jax.grad, i.e. the forward and then the backward kernel (its class name contains SparseMlaBwd;
the forward's SparseMlaFwd). "decode" runs examples/benchmark.py --decode's inputs (H 128,
Dqk 576, K 2048, a sink) through the default forward: the split kernel and its combine when B
tokens leave the GPU empty. A kernel other than the default: edit the call to pass config=
(jax_dsa.cute.Config). `--given`: the backward walks the lists as given
(BwdConfig(sort_rows=False)), where the default orders them past the L2.
`bash dev/gpu_validate.sh profile` profiles the default shapes with the sections that matter.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_dsa  # noqa: E402
from jax_dsa.cute import BwdConfig, Config  # noqa: E402
from benchmark import DECODE, make_inputs  # noqa: E402


def main():
    given = "--given" in sys.argv
    argv = [a for a in sys.argv if a != "--given"]
    config = Config(bwd=BwdConfig(sort_rows=False)) if given else None
    which = argv[1]
    if which == "decode":  # benchmark.py --decode's shape (H 128, Dqk 576, a sink), B tokens
        _, heads, topk, tokens, seq, d, _ = DECODE[0]
        batch = int(argv[2])
        q, kv, idx, sink, _ = make_inputs(heads, topk, tokens, seq, d=d, batch=batch)
        label = (batch,)
    else:
        heads, topk = int(argv[2]), int(argv[3])
        seq = int(argv[4]) if len(argv) > 4 else None
        q, kv, idx, sink, _ = make_inputs(heads, topk, 4096, seq)
        label = (heads, topk)
    if which in ("fwd", "decode"):
        fn = jax.jit(lambda q, kv, sink: jax_dsa.sparse_mla(q, kv, idx, sink=sink))
    elif which == "bwd":
        w = jax.random.normal(jax.random.PRNGKey(1), q.shape[:3] + (512,), jnp.float32)

        def loss(q, kv, sink):
            o = jax_dsa.sparse_mla(q, kv, idx, sink=sink, config=config)
            return jnp.sum(o.astype(jnp.float32) * w)

        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    else:
        raise SystemExit(f"profile_case: first argument must be fwd, bwd or decode, got {which!r}")
    for _ in range(3):
        jax.block_until_ready(fn(q, kv, sink))
    print("profile_case done", which, *label)


if __name__ == "__main__":
    main()
