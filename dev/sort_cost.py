"""What sorting each token's list costs in XLA on the GPU (BwdConfig.sort_rows), per form:

    python dev/sort_cost.py

[1, T, K] int32 rows of [0, S) at the issue-26 shapes; back-to-back jitted calls
(examples/benchmark.py's timing), median of 5 batches of 20:
  rows_ascending   jax_dsa.cute.kernel.rows_ascending (masks, jnp.sort along K, the count);
  jnp.sort         the sort alone (stable);
  lax.sort         lax.sort along K, is_stable=False;
  flat             one 1-D sort of token * 2^bits(S) + row (int32 while it fits), unpacked.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsa.cute.kernel import rows_ascending

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import benchmark  # noqa: E402


def us(fn, x):
    """Per call of back-to-back jitted calls (examples/benchmark.py's timing), median of 5."""
    return benchmark.time_call(fn, (x,), 20, 5) * 1e6


def main():
    print(jax.devices()[0].device_kind)
    for t, k, s in ((4096, 2048, 131072), (4096, 1152, 65536), (4096, 640, 65536)):
        x = jnp.asarray(np.random.default_rng(0).integers(0, s, (1, t, k)), jnp.int32)
        n = jnp.full((1, t), k, jnp.int32)
        bits = int(s - 1).bit_length()
        forms = {
            "rows_ascending": jax.jit(lambda x: rows_ascending(x, n, s)),
            "jnp.sort": jax.jit(lambda x: jnp.sort(x, axis=-1)),
            "lax.sort": jax.jit(lambda x: lax.sort(x, dimension=2, is_stable=False)),
        }
        if t.bit_length() + bits <= 31:
            tok = (jnp.arange(t, dtype=jnp.int32) << bits)[None, :, None]
            forms["flat"] = jax.jit(
                lambda x: (jnp.sort((x + tok).reshape(-1)).reshape(x.shape) & ((1 << bits) - 1)))
        ref = np.sort(np.asarray(x), axis=-1)
        for name, fn in forms.items():
            got = fn(x)
            got = got[0] if isinstance(got, tuple) else got
            ok = np.array_equal(np.asarray(got), ref)
            print(f"T {t} K {k} S {s}: {name:15s} {us(fn, x):8.1f} us  "
                  f"{'same' if ok else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
