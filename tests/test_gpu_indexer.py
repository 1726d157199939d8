"""The Hopper indexer score kernel and the selection built on it, against the float64 oracle
(GPU only). The kernel's scores are poisoned (NaN-filled before the launch), so an element it
fails to write shows."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import indexer
from oracle import indexer_scores as oracle_scores, indexer_topk as oracle_topk

pytestmark = pytest.mark.gpu


def _kernel_or_skip():
    problem = indexer.kernel_problem(jnp.zeros((1, 1, 1, 128), jnp.bfloat16),
                                     jnp.zeros((1, 1, 128), jnp.bfloat16))
    if problem:
        pytest.skip(problem)


def _inputs(rng, b, t, h, s, dtype, integer=False):
    if integer:  # small integers: exact scores in fp32, and many ties
        q = rng.integers(-2, 3, (b, t, h, 128))
        k = rng.integers(-2, 3, (b, s, 128))
        w = rng.integers(-1, 3, (b, t, h)).astype(np.float32)
    else:
        q = rng.standard_normal((b, t, h, 128))
        k = rng.standard_normal((b, s, 128))
        w = rng.standard_normal((b, t, h)).astype(np.float32)
    q, k = jnp.asarray(q, dtype), jnp.asarray(k, dtype)
    return q, k, jnp.asarray(w)


def _kernel_scores(q, k, w, scale, ratio, start):
    from jax_dsa.cute import ffi
    f = jax.jit(functools.partial(ffi.indexer_scores, scale=scale, ratio=ratio,
                                  poison_outputs=True))
    return np.asarray(f(q, k, w, jnp.int32(start)))


# (B, T, Hi, S, ratio, start, scale): S not a multiple of the 256-row tile, Hi 1..64, tokens
# before / past the causal edge, compressed rows, a negative scale, more than one token group
# (the kernel's CTAs take 256 tokens each: the last case has three groups, the last partial).
SCORE_CASES = [
    (1, 16, 64, 300, 1, 284, 1.0),
    (2, 9, 7, 1000, 1, 500, 0.25),
    (1, 70, 64, 513, 1, 0, -0.5),
    (1, 130, 16, 256, 4, 900, 1.0),
    (2, 33, 1, 2048, 4, 7000, 0.1),
    (1, 5, 64, 1, 1, 0, 1.0),
    (1, 200, 32, 700, 1, 550, 1.0),
    (1, 600, 48, 900, 1, 250, 1.0),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: "B{}T{}H{}S{}r{}s{}".format(*c[:6]))
def test_kernel_scores_match_the_float64_oracle(case, dtype):
    _kernel_or_skip()
    b, t, h, s, ratio, start, scale = case
    q, k, w = _inputs(np.random.default_rng(sum(case[:6])), b, t, h, s, dtype)
    got = _kernel_scores(q, k, w, scale, ratio, start)
    want = oracle_scores(np.asarray(q, np.float32), np.asarray(k, np.float32), w, scale, ratio,
                         start)
    assert not np.isnan(got).any(), "unwritten or NaN scores"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    if fin.any():
        tol = 1e-5 * max(1.0, float(np.max(np.abs(want[fin]))))
        assert np.max(np.abs(got[fin] - want[fin])) < tol


@pytest.mark.parametrize("ratio,start,topk", [(1, 0, 8), (1, 300, 64), (4, 2000, 100),
                                               (1, 10, 600)])
def test_kernel_selection_is_exact_with_ties(ratio, start, topk):
    """Integer inputs: exact scores with many ties, so the selection (order, ties to the smaller
    row, -1 past the visible rows, k > visible) must be the oracle's exactly."""
    _kernel_or_skip()
    q, k, w = _inputs(np.random.default_rng(start + topk), 2, 40, 64, 520, jnp.bfloat16,
                      integer=True)
    idx, val = jax_dsa.indexer_topk(q, k, w, topk, ratio=ratio, start=start,
                                    return_scores=True, implementation="cute")
    want_idx, want_val = oracle_topk(oracle_scores(np.asarray(q, np.float32),
                                                   np.asarray(k, np.float32), w, 1.0, ratio,
                                                   start), topk)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val), want_val)


def test_kernel_selection_matches_the_reference_over_token_chunks(monkeypatch):
    """Random bf16 inputs, several token chunks (a small chunk budget): the kernel path selects
    rows whose oracle scores are the oracle's top-k scores (up to fp32 rounding), and the
    default implementation on the GPU is the kernel."""
    _kernel_or_skip()
    from jax_dsa.cute import indexer as cute_indexer
    monkeypatch.setattr(cute_indexer, "_CHUNK_BYTES", 4 * 2 * 1100 * 37)  # 37 tokens a chunk
    q, k, w = _inputs(np.random.default_rng(3), 2, 100, 48, 1100, jnp.bfloat16)
    jax.clear_caches()
    idx = np.asarray(jax_dsa.indexer_topk(q, k, w, 256, scale=0.5, start=1000))
    scores = oracle_scores(np.asarray(q, np.float32), np.asarray(k, np.float32), w, 0.5, 1, 1000)
    _, want_val = oracle_topk(scores, 256)
    got_val = np.take_along_axis(scores, np.maximum(idx, 0), axis=-1)
    got_val = np.where(idx >= 0, got_val, -np.inf)
    np.testing.assert_array_equal(idx < 0, np.isneginf(want_val))
    fin = np.isfinite(want_val)
    np.testing.assert_allclose(got_val[fin], want_val[fin], rtol=1e-5, atol=1e-4)
    for bi in range(2):  # each list distinct
        for ti in range(100):
            row = idx[bi, ti][idx[bi, ti] >= 0]
            assert len(set(row.tolist())) == len(row)


@pytest.mark.parametrize("s,topk", [(1, 1), (300, 300), (300, 512), (5000, 2048), (131072, 2048),
                                    (20000, 4096), (777, 1)])
def test_topk_kernel_matches_the_oracle_with_ties_and_dead_columns(s, topk):
    """The radix-select kernel alone on float scores with many exact ties, negative scores,
    -inf columns (not visible) and rows that are all -inf: values and columns exactly the
    oracle's (highest first, ties to the smaller column, (-inf, -1) past the finite ones)."""
    _kernel_or_skip()
    from jax_dsa.cute import ffi
    rng = np.random.default_rng(s + topk)
    b, t = 2, 3
    sc = rng.integers(-20, 20, (b, t, s)).astype(np.float32) * 0.5  # ties everywhere
    sc[0, 1] = rng.standard_normal(s).astype(np.float32)  # a row of distinct values
    sc[rng.random((b, t, s)) < 0.3] = -np.inf
    sc[1, 2] = -np.inf  # a dead token
    val, idx = jax.jit(ffi.indexer_topk, static_argnums=1)(jnp.asarray(sc), topk)
    want_idx, want_val = oracle_topk(sc.astype(np.float64), topk)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val), want_val.astype(np.float32))


@pytest.mark.parametrize("topk", [1, 511, 512, 513, 1024, 1025, 2048, 2049, 4096])
def test_topk_kernel_sizes_at_their_limits(topk):
    """Each candidate-buffer size of the top-k kernel (INDEXER_TOPK_SIZES; the call runs the
    smallest that holds topk) at and just past its limit, on rows of distinct values, rows with
    ties everywhere, a row shorter than topk and a row of one repeated value (more ties than the
    buffer holds, or a first-digit bin larger than the shared-memory buffer: the fallback):
    values and columns exactly the oracle's."""
    _kernel_or_skip()
    from jax_dsa.cute import ffi
    rng = np.random.default_rng(topk)
    s = 2 * topk + 500
    sc = rng.standard_normal((1, 5, s)).astype(np.float32)  # row 0: distinct values
    sc[0, 1] = rng.integers(-6, 6, s).astype(np.float32)  # ties everywhere
    sc[0, 2, topk // 2:] = -np.inf  # fewer visible columns than topk
    sc[0, 3] = 1.5  # one value: ties beyond the candidate buffer
    sc[0, 4, rng.random(s) < 0.5] = -np.inf  # half the columns dead
    val, idx = jax.jit(ffi.indexer_topk, static_argnums=1)(jnp.asarray(sc), topk)
    want_idx, want_val = oracle_topk(sc.astype(np.float64), topk)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val), want_val.astype(np.float32))


def test_selection_above_the_kernels_topk_limit_uses_xla_top_k():
    _kernel_or_skip()
    from jax_dsa.cute.constants import INDEXER_MAX_TOPK
    q, k, w = _inputs(np.random.default_rng(5), 1, 4, 8, INDEXER_MAX_TOPK + 300, jnp.bfloat16,
                      integer=True)
    topk = INDEXER_MAX_TOPK + 10
    idx = jax_dsa.indexer_topk(q, k, w, topk, start=INDEXER_MAX_TOPK, implementation="cute")
    want_idx, _ = oracle_topk(oracle_scores(np.asarray(q, np.float32), np.asarray(k, np.float32),
                                            w, 1.0, 1, INDEXER_MAX_TOPK), topk)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
