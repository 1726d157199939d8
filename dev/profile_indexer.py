"""One indexer selection (T 4096 at the end of S, Hi 64, Di 128), run twice, for ncu:

    ncu --metrics gpu__time_duration.sum python dev/profile_indexer.py S K [RATIO]

The second call's kernels are the ones to read (the first compiles and warms up)."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_dsa  # noqa: E402

s, k = int(sys.argv[1]), int(sys.argv[2])
ratio = int(sys.argv[3]) if len(sys.argv) > 3 else 1
t, hi, di = 4096, 64, 128
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, t, hi, di), np.float32), jnp.bfloat16)
kk = jnp.asarray(rng.standard_normal((1, s // ratio, di), np.float32), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((1, t, hi), np.float32))
f = jax.jit(lambda q, kk, w: jax_dsa.indexer_topk(q, kk, w, k, scale=di ** -0.5, ratio=ratio,
                                                  start=s - t))
for _ in range(2):
    jax.block_until_ready(f(q, kk, w))
print("done")
