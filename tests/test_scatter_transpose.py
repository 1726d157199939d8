"""CPU check of the backward's dKV scatter index arithmetic: the shared-memory transpose
(_scatter_smem, Dqk 512): every lane reads back exactly the row segment its RED adds, and
neither the writes nor the reads have shared-memory bank conflicts; the row-pair exchange into
the permuted column layout (_scatter, Dqk 576): every value lands once, at its permuted column,
each warp instruction covers 4 rows x 128 bytes, and the wrapper's un-permutation restores it.
The GPU tests check the kernel itself; this pins the index arithmetic, which a wrong XOR would
break silently (only speed or some rows)."""
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


def _wavefronts(lane_addrs, group):
    """Shared-memory wavefronts of one warp instruction: lanes are served in groups (16 for
    8-byte, 8 for 16-byte accesses); a group needs as many wavefronts as the largest number of
    distinct 4-byte words that fall in one bank."""
    total = 0
    for g0 in range(0, 32, group):
        banks = {}
        for lane in range(g0, g0 + group):
            for word in lane_addrs[lane]:
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


@pytest.mark.parametrize("half", [0, 1])
def test_transpose_round_trip_and_banks(half):
    scratch = {}
    # writes: lane l = 4 q + s holds rows q + 8 rho, columns 8 j + 2 s + {0, 1} (j = 4 half + jj)
    for rho in range(2):
        for jj in range(4):
            addrs = []
            for lane in range(32):
                q, s = lane // 4, lane % 4
                row, col = q + 8 * rho, 8 * jj + 2 * s
                off = bwd.scratch_offset(row, col)
                assert off % 2 == 0
                for c in range(2):
                    assert bwd.scratch_offset(row, col + c) == off + c
                    assert off + c not in scratch or scratch[off + c][0] != (rho, jj)
                    scratch[off + c] = (rho, jj, _accumulator_value(row, 32 * half + col + c))
                addrs.append([off, off + 1])
            assert _wavefronts(addrs, 16) == 2, "8-byte writes: 2 wavefronts at best (256 B)"
    assert sorted(scratch) == list(range(bwd.SCRATCH_WARP_FLOATS))
    # reads: lane l reads columns 4 (l % 8) + [0, 4) of row 2 (l // 8) + q0 + 8 rho
    for rho in range(2):
        for q0 in range(2):
            addrs = []
            for lane in range(32):
                row, col = 2 * (lane // 8) + q0 + 8 * rho, 4 * (lane % 8)
                off = bwd.scratch_offset(row, col)
                assert off % 4 == 0
                got = [scratch[off + k][2] for k in range(4)]
                assert got == [_accumulator_value(row, 32 * half + col + k) for k in range(4)]
                addrs.append(list(range(off, off + 4)))
            assert _wavefronts(addrs, 8) == 4, "16-byte reads: 4 wavefronts at best (512 B)"


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


def test_the_wrapper_restores_the_logical_columns():
    jax = pytest.importorskip("jax")
    from jax_dsa.cute import ffi

    cols = np.arange(576)
    perm = np.array([bwd.permuted_column(c) for c in cols])
    assert sorted(perm) == list(cols)
    stored = np.zeros((1, 3, 576), np.float32)
    logical = np.random.default_rng().standard_normal((1, 3, 576)).astype(np.float32)
    stored[..., perm] = logical
    np.testing.assert_array_equal(np.asarray(ffi._dkv_logical(jax.numpy.asarray(stored))), logical)
    flat = np.random.default_rng().standard_normal((1, 3, 512)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(ffi._dkv_logical(jax.numpy.asarray(flat))), flat)
