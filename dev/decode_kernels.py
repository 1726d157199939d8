"""One decode forward per configuration, for `ncu --metrics gpu__time_duration.sum` (the
device time of each kernel the call launches, XLA's included):

    ncu --metrics gpu__time_duration.sum python dev/decode_kernels.py 8 1,8
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/examples")
import benchmark  # noqa: E402

import jax_dsa  # noqa: E402
from jax_dsa.cute import Config, FwdConfig  # noqa: E402

b = int(sys.argv[1])
q, kv, idx, sink, _ = benchmark.make_inputs(128, 1920, 1, 65536, 576, batch=b)
for s in map(int, sys.argv[2].split(",")):
    f = jax.jit(lambda q, kv, idx, s=s: jax_dsa.sparse_mla(
        q, kv, idx, sink=sink, return_lse=True, implementation="cute",
        config=Config(fwd=FwdConfig("pingpong", s))))
    jax.block_until_ready(f(q, kv, idx))
    print(f"=== splits {s}", flush=True)
    jax.block_until_ready(f(q, kv, idx))
