"""The list-union kernel (in the default build, for the grouped backward) against
jax_dsa.cute.grouping's XLA formulation, which tests/test_grouping.py checks on the CPU: the lengths
must be identical and, per group, the packed entries the same multiset (GPU only)."""
import zlib

import numpy as np
import pytest

import jax.numpy as jnp

from jax_dsa import api
from jax_dsa.cute import ffi
from jax_dsa.cute.grouping import group_lists, pack_entries

pytestmark = pytest.mark.gpu

# (B, T, K, S, group, lists)
CASES = [
    (1, 8, 1, 300, 4, "random"),
    (2, 12, 40, 50, 4, "random"),  # K close to S: duplicates inside and across tokens
    (1, 8, 640, 100, 4, "random"),  # K >> S: long runs of one row
    (1, 64, 640, 4096, 4, "benchmark"),  # window 128 + 512 distinct random rows
    (3, 8, 1536, 5000, 4, "random"),  # G * K = 6144: the kernel's capacity
    (1, 16, 640, 100000, 8, "random"),  # S > the hash table: rows collide modulo its size
    (1, 4, 100, 7, 4, "random"),  # S < K / G: every row in every list several times
    (2, 10, 640, 4096, 2, "benchmark"),  # G = 2 (H = 32)
    (1, 6, 3072, 3000, 2, "random"),  # G * K = 6144 at G = 2
    # the smaller tables (S <= the table) at their capacity (3/4 full), and just beyond it
    (1, 8, 384, 2000, 4, "random"),  # G * K = 1536: the 2048-slot table
    (1, 8, 768, 4000, 4, "random"),  # 3072: the 4096-slot table
    (1, 8, 769, 4000, 4, "random"),  # 3076: the 8192-slot one
    (1, 8, 100, 3000, 4, "random"),  # S > 2048: the 4096-slot table
]


def _lists(rng, b, t, k, s, kind):
    if kind == "benchmark":
        tok = np.arange(t)[:, None] + 1000
        window = tok - 127 + np.arange(128)[None, :]
        picks = np.stack([rng.choice(s, k - 128, replace=False) for _ in range(t)])
        idx = np.concatenate([window, picks], axis=1)[None].repeat(b, axis=0)
        lengths = np.full((b, t), k)
    else:
        idx = rng.integers(-3, s + 3, (b, t, k))  # includes -1.. and >= S: not used
        lengths = rng.integers(-1, k + 2, (b, t))  # includes < 1 and > K
    return jnp.asarray(idx, jnp.int32), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_union_kernel_matches_group_lists(case):
    problem = api.kernel_runtime_problem()
    if problem:
        pytest.skip(problem)
    if not ffi.has_group_union():
        pytest.skip("the library was built without the list-union kernels")
    b, t, k, s, group, kind = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    idx, lengths = _lists(rng, b, t, k, s, kind)
    rows, member, want_length = group_lists(idx, lengths, s, group)
    want = np.asarray(pack_entries(rows, member))
    got, got_length = map(np.asarray, ffi.group_union(idx, lengths, s, group))
    np.testing.assert_array_equal(got_length, np.asarray(want_length))
    assert got_length.max() > 0
    for bi in range(b):
        for gi in range(t // group):
            n = got_length[bi, gi]
            np.testing.assert_array_equal(np.sort(got[bi, gi, :n]), np.sort(want[bi, gi, :n]))
            assert np.all(got[bi, gi, n:] == -1)
