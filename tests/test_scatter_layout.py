"""CPU check of the backward's dKV scatter index arithmetic (ffi/kernels/sm90/scatter_layout.py):
the row-pair exchange into the permuted column layout (_scatter): every value lands once, at
its permuted column, each warp instruction covers 4 rows x 128 bytes, and the wrapper's
un-permutation restores the logical order. The GPU tests check the kernel itself; this pins the
index arithmetic, which a wrong shuffle would break silently (only speed or some rows)."""
import numpy as np
import pytest

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "ffi", "kernels", "sm90", "scatter_layout.py")
_spec = importlib.util.spec_from_file_location("scatter_layout", _PATH)
bwd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bwd)  # plain Python: no CuTe DSL needed


def _accumulator_value(row, col):
    return 1000 * row + col  # a unique tag per element of the warp's 16 x 64 chunk


def test_row_pair_exchange_into_the_permuted_layout():
    lane = np.arange(32)
    q, s = lane // 4, lane % 4
    v = []  # the warp's accumulator, vectorized over lanes, tagged with (row, logical column)
    for i in range(32):
        rho, j, c = i >> 4, (i & 15) >> 1, i & 1
        v.append(_accumulator_value(q + 8 * rho, 8 * j + 2 * s + c))
    out = bwd.pair_rows_exchange(v, (lane & 4) != 0, np.where, lambda x: x[lane ^ 4])
    chunk = {}
    for (rho, second, g2), vals in out.items():
        row = 2 * (lane // 8) + second + 8 * rho
        lines = set()
        for k, val in enumerate(vals):
            pos = 32 * g2 + 4 * (lane % 8) + k
            for ln in range(32):
                assert (row[ln], pos[ln]) not in chunk
                chunk[(row[ln], pos[ln])] = val[ln]
                lines.add((row[ln], pos[ln] // 32))
        assert len(lines) == 4, "one warp instruction: 4 rows x 128 bytes"
    assert len(chunk) == 16 * 64
    for (row, pos), val in chunk.items():
        col = val - 1000 * row
        assert 0 <= col < 64 and bwd.permuted_column(col) == pos


@pytest.mark.parametrize("d", [512, 576])
def test_the_wrapper_restores_the_logical_columns(d):
    jax = pytest.importorskip("jax")
    from jax_dsa.cute import ffi
    from jax_dsa.cute.constants import PERMUTED_DKV_DIMS

    assert d in PERMUTED_DKV_DIMS  # every backward kernel writes the permuted layout
    cols = np.arange(d)
    perm = np.array([bwd.permuted_column(c) for c in cols])
    assert sorted(perm) == list(cols)
    stored = np.zeros((1, 3, d), np.float32)
    logical = np.random.default_rng().standard_normal((1, 3, d)).astype(np.float32)
    stored[..., perm] = logical
    np.testing.assert_array_equal(np.asarray(ffi._dkv_logical(jax.numpy.asarray(stored))), logical)
