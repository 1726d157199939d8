"""The deterministic backward's host-side bookkeeping (pure JAX, runs on the CPU): the per-chunk
sort of entries by destination kv row and the workspace chunk size."""
import numpy as np
import pytest

import jax.numpy as jnp

from jax_dsa.cute import deterministic
from jax_dsa.cute.config import DET_WORKSPACE_BYTES


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
def test_entry_order_lists_each_rows_entries_in_order(chunk):
    """Per chunk, every valid entry appears in exactly one run, runs hold the entries of one kv row
    (b * S + idx) in increasing entry order, and invalid / beyond-topk_length entries are in none."""
    rng = np.random.default_rng(chunk)
    b, t, k, s = 2, 5, 7, 6
    idx = rng.integers(-2, s + 2, (b, t, k)).astype(np.int32)
    tl = rng.integers(0, k + 1, (b, t)).astype(np.int32)
    order, seg_end, rows = map(np.asarray, deterministic.entry_order(
        jnp.asarray(idx), jnp.asarray(tl), s, chunk))
    width = chunk * k
    n_chunks = -(-(b * t) // chunk)
    assert order.shape == seg_end.shape == rows.shape == (n_chunks * width,)
    for c in range(n_chunks):
        o, e, r = (x[c * width:(c + 1) * width] for x in (order, seg_end, rows))
        got = {int(r[p]): [int(v) for v in o[p:e[p]]] for p in range(width) if e[p] > p}
        want = {}
        for local in range(width):
            bt, j = c * chunk + local // k, local % k
            if bt >= b * t:
                continue
            bb, tt = divmod(bt, t)
            v = idx[bb, tt, j]
            if 0 <= v < s and j < tl[bb, tt]:
                want.setdefault(int(bb * s + v), []).append(local)
        assert got == want, c


def test_chunk_tokens_fit_the_workspace_budget():
    # H = 64, Dqk 576, K = 640: 1.47 MB per token -> 364 tokens in 512 MiB, rounded to 2 waves of
    # 132; H = 128 needs two head blocks per entry.
    assert deterministic.chunk_tokens(4096, 640, 576, 64, DET_WORKSPACE_BYTES) == 264
    assert deterministic.chunk_tokens(4096, 640, 576, 128, DET_WORKSPACE_BYTES) == 132
    assert deterministic.chunk_tokens(10, 640, 576, 64, DET_WORKSPACE_BYTES) == 10
    assert deterministic.chunk_tokens(4096, 640, 576, 64, 1) == 1
    for h in (1, 64, 100, 128):
        tc = deterministic.chunk_tokens(1 << 20, 2048, 576, h, DET_WORKSPACE_BYTES)
        assert tc * 2048 * (-(-h // 64)) * 576 * 4 <= DET_WORKSPACE_BYTES
