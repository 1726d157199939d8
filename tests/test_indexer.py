"""jax_dsa.indexer_topk / indexer_scores (the pure-JAX reference) against a float64 NumPy oracle:
scores, the selected set and its order, ties, positions before the start, compressed
visibility, k > visible, dead tokens, dtypes, jit / vmap, and the argument checks."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import indexer
from oracle import indexer_scores as oracle_scores, indexer_topk as oracle_topk


def _inputs(rng, b, t, h, d, s, dtype=np.float32, integer=False):
    if integer:  # small integers: every score is exact in fp32, and ties are frequent
        q = rng.integers(-2, 3, (b, t, h, d)).astype(dtype)
        k = rng.integers(-2, 3, (b, s, d)).astype(dtype)
        w = rng.integers(-1, 3, (b, t, h)).astype(np.float32)
    else:
        q = rng.standard_normal((b, t, h, d)).astype(dtype)
        k = rng.standard_normal((b, s, d)).astype(dtype)
        w = rng.standard_normal((b, t, h)).astype(np.float32)
    return q, k, w


@pytest.mark.parametrize("ratio,start", [(1, 0), (1, 7), (4, 0), (4, 13)])
def test_scores_match_the_float64_oracle(ratio, start):
    rng = np.random.default_rng(ratio * 100 + start)
    q, k, w = _inputs(rng, 2, 9, 4, 16, 20)
    got = np.asarray(jax_dsa.indexer_scores(q, k, w, scale=0.3, ratio=ratio, start=start))
    want = oracle_scores(q, k, w, 0.3, ratio, start)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_elements", [None, 100, 7])
@pytest.mark.parametrize("ratio,start,topk", [(1, 0, 6), (1, 5, 3), (4, 2, 4), (2, 0, 30)])
def test_topk_is_exact_with_ties_across_row_chunks(ratio, start, topk, chunk_elements,
                                                   monkeypatch):
    """Integer inputs make scores exact and ties common: the indices must equal the oracle's
    (score desc, ties to the smaller row), also when the rows are walked in many small chunks
    (chunk_elements: the running top-k merged over chunks of 1 or 3 rows)."""
    if chunk_elements:
        monkeypatch.setattr(indexer, "_CHUNK_ELEMENTS", chunk_elements)
    rng = np.random.default_rng(topk * 10 + ratio)
    q, k, w = _inputs(rng, 2, 11, 3, 4, 23, integer=True)
    idx, scores = jax_dsa.indexer_topk(q, k, w, topk, ratio=ratio, start=start,
                                       return_scores=True)
    want_idx, want_val = oracle_topk(oracle_scores(q, k, w, 1.0, ratio, start), topk)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(scores), want_val)
    assert idx.dtype == jnp.int32 and scores.dtype == jnp.float32


def test_more_slots_than_visible_rows_and_dead_tokens():
    """ratio 4 from position 0: tokens 0..2 see no row (all -1 / -inf); token t sees
    (t + 1) // 4 rows, the rest of its topk slots are -1; topk > S too."""
    rng = np.random.default_rng(3)
    q, k, w = _inputs(rng, 1, 12, 2, 8, 3)
    idx, scores = jax_dsa.indexer_topk(q, k, w, 5, ratio=4, return_scores=True)
    idx, scores = np.asarray(idx), np.asarray(scores)
    for t in range(12):
        n = min(3, (t + 1) // 4)
        assert np.all(idx[0, t, n:] == -1) and np.all(np.isneginf(scores[0, t, n:]))
        assert sorted(idx[0, t, :n]) == list(range(n))
        assert np.all(np.isfinite(scores[0, t, :n]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs_select_the_oracles_top_scores(dtype):
    """bf16 / fp16 inputs (fp32 accumulation): the selected rows' oracle scores are the oracle's
    top-k scores (near-ties may swap rows, never the values beyond rounding)."""
    rng = np.random.default_rng(4)
    q, k, w = _inputs(rng, 1, 16, 8, 32, 64)
    q, k = jnp.asarray(q, dtype), jnp.asarray(k, dtype)
    idx = np.asarray(jax_dsa.indexer_topk(q, k, w, 8, scale=0.2, start=40))
    dense = oracle_scores(np.asarray(q, np.float32), np.asarray(k, np.float32), w, 0.2, 1, 40)
    _, want_val = oracle_topk(dense, 8)
    got_val = np.take_along_axis(dense, np.where(idx >= 0, idx, 0), axis=-1)
    got_val = np.where(idx >= 0, got_val, -np.inf)
    np.testing.assert_allclose(np.sort(got_val, -1), np.sort(want_val, -1), rtol=1e-2, atol=1e-2)


def test_three_dim_layout_jit_and_vmap():
    rng = np.random.default_rng(5)
    q, k, w = _inputs(rng, 3, 6, 2, 8, 10)
    want = np.asarray(jax_dsa.indexer_topk(q, k, w, 4, start=3))
    got3 = np.stack([np.asarray(jax_dsa.indexer_topk(q[i], k[i], w[i], 4, start=3))
                     for i in range(3)])
    np.testing.assert_array_equal(got3, want)
    jitted = jax.jit(lambda q, k, w: jax_dsa.indexer_topk(q, k, w, 4, start=3))
    np.testing.assert_array_equal(np.asarray(jitted(q, k, w)), want)
    mapped = jax.vmap(lambda q, k, w: jax_dsa.indexer_topk(q, k, w, 4, start=3))
    np.testing.assert_array_equal(np.asarray(mapped(q, k, w)), want)
    nested = jax.vmap(mapped)(q[None], k[None], w[None])  # two vmapped axes
    np.testing.assert_array_equal(np.asarray(nested[0]), want)


def test_selection_feeds_sparse_mla():
    """The indices go straight into sparse_mla as its idx (each token's own visible rows)."""
    rng = np.random.default_rng(6)
    q_i, k_i, w = _inputs(rng, 1, 8, 2, 8, 8)
    idx = jax_dsa.indexer_topk(q_i, k_i, w, 4)
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 32)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 8, 32)), jnp.float32)
    o = jax_dsa.sparse_mla(q, kv, idx)
    assert o.shape == (1, 8, 2, 32) and np.all(np.isfinite(np.asarray(o)))
    assert np.all(np.asarray(idx)[0] <= np.arange(8)[:, None])  # causal


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(topk=0), ValueError, "topk"), (dict(topk=2.0), TypeError, "topk"),
    (dict(ratio=0), ValueError, "ratio"), (dict(start=-1), ValueError, "start"),
    (dict(scale="1"), TypeError, "scale"), (dict(scale=float("inf")), ValueError, "scale"),
    (dict(return_scores=1), TypeError, "return_scores"),
    (dict(implementation="triton"), ValueError, "implementation"),
    (dict(implementation="cute"), NotImplementedError, "cannot run here"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    rng = np.random.default_rng(7)
    q, k, w = _inputs(rng, 1, 4, 2, 8, 6)
    args = dict(topk=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        jax_dsa.indexer_topk(q, k, w, **args)


@pytest.mark.parametrize("shapes,match", [
    (((1, 4, 2, 8), (1, 6, 4), (1, 4, 2)), "k must be"),
    (((1, 4, 2, 8), (1, 6, 8), (1, 4, 3)), "weights must be"),
    (((1, 4, 2, 8), (2, 6, 8), (1, 4, 2)), "k must be"),
    (((4, 2, 8), (1, 6, 8), (4, 2)), "k must be"),
])
def test_bad_shapes_name_the_argument(shapes, match):
    q, k, w = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        jax_dsa.indexer_topk(q, k, w, 2)


def test_implementation_sequence_falls_back_to_the_reference():
    rng = np.random.default_rng(8)
    q, k, w = _inputs(rng, 1, 4, 2, 8, 6)
    np.testing.assert_array_equal(
        np.asarray(jax_dsa.indexer_topk(q, k, w, 3, implementation=("cute", "xla"))),
        np.asarray(jax_dsa.indexer_topk(q, k, w, 3)))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_batch_and_token_sharded_inputs_give_the_same_selection():
    """Under jit with q / weights sharded over batch and tokens (k replicated over tokens), and
    inside shard_map per token shard (each with its own start), the selection is the
    unsharded one."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:  # older jax
        from jax.experimental.shard_map import shard_map
    rng = np.random.default_rng(9)
    q, k, w = _inputs(rng, 2, 16, 2, 8, 24)
    want = np.asarray(jax_dsa.indexer_topk(q, k, w, 5, start=8))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tokens"))
    qs = jax.device_put(q, NamedSharding(mesh, P("data", "tokens")))
    ws = jax.device_put(w, NamedSharding(mesh, P("data", "tokens")))
    ks = jax.device_put(k, NamedSharding(mesh, P("data")))
    got = jax.jit(lambda q, k, w: jax_dsa.indexer_topk(q, k, w, 5, start=8))(qs, ks, ws)
    np.testing.assert_array_equal(np.asarray(got), want)

    def per_shard(q, k, w):  # 4 tokens per shard: shard i starts at 8 + 4 i
        start = 8 + 4 * jax.lax.axis_index("tokens")
        outs = [jax_dsa.indexer_topk(q, k, w, 5, start=8 + 4 * i) for i in range(4)]
        return jnp.select([start == 8 + 4 * i for i in range(4)], outs)

    sm = shard_map(per_shard, mesh=mesh, in_specs=(P("data", "tokens"), P("data"),
                                                   P("data", "tokens")),
                   out_specs=P("data", "tokens"))
    np.testing.assert_array_equal(np.asarray(jax.jit(sm)(q, k, w)), want)


def _emulated_scores_kernel(q, k, w, start, *, scale, ratio, poison_outputs=False):
    """jax_dsa.cute.ffi.indexer_scores's contract in jnp (start may be traced)."""
    dots = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), k.astype(jnp.float32))
    s = jnp.einsum("bths,bth->bts", jnp.maximum(dots * scale, 0), w)
    pos = start + jnp.arange(q.shape[1])
    vis = (jnp.arange(k.shape[1])[None, :] + 1) * ratio <= pos[:, None] + 1
    return jnp.where(vis[None], s, -jnp.inf)


def _emulated_topk_kernel(sc, n):
    """jax_dsa.cute.ffi.indexer_topk's contract in jnp."""
    pad = max(0, n - sc.shape[-1])
    sc = jnp.pad(sc, [(0, 0), (0, 0), (0, pad)], constant_values=-jnp.inf)
    val, idx = jax.lax.top_k(sc, n)
    return val, jnp.where(jnp.isneginf(val), -1, idx)


def test_kernel_path_plumbing_with_emulated_kernels(monkeypatch):
    """jax_dsa.cute.indexer.topk (token chunks, the traced start of each chunk, T padding, the
    top-k kernel up to INDEXER_MAX_TOPK and XLA's top_k above it) with the two kernels replaced
    by jnp emulations of their contracts: the oracle's selection exactly (integer inputs)."""
    from jax_dsa.cute import ffi, indexer as cute_indexer

    monkeypatch.setattr(ffi, "indexer_scores", _emulated_scores_kernel)
    monkeypatch.setattr(ffi, "indexer_topk", _emulated_topk_kernel)
    monkeypatch.setattr(cute_indexer, "_CHUNK_BYTES", 4 * 2 * 30 * 7)  # 7 tokens a chunk
    monkeypatch.setattr(cute_indexer, "MAX_TOPK", 16)
    rng = np.random.default_rng(11)
    q, k, w = _inputs(rng, 2, 23, 3, 16, 30, integer=True)
    for ratio, start, n in [(1, 5, 8), (4, 90, 12), (1, 0, 40)]:  # 40 > MAX_TOPK and > S
        jax.clear_caches()
        val, idx = cute_indexer.topk(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w),
                                     jnp.int32(start), n, 1.0, ratio)
        want_idx, want_val = oracle_topk(oracle_scores(q, k, w, 1.0, ratio, start), n)
        np.testing.assert_array_equal(np.asarray(idx), want_idx)
        np.testing.assert_array_equal(np.asarray(val), want_val)


def test_kernel_path_shards_over_batch_and_tokens_with_emulated_kernels(monkeypatch):
    """The kernel path under jit with q / weights sharded over batch and tokens: each token
    shard runs the (emulated) kernels on its own tokens from its own start, and the selection
    is the oracle's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_dsa.cute import ffi
    calls = []

    def scores(q, k, w, start, **kw):
        calls.append(q.shape)
        return _emulated_scores_kernel(q, k, w, start, **kw)

    monkeypatch.setattr(ffi, "indexer_scores", scores)
    monkeypatch.setattr(ffi, "indexer_topk", _emulated_topk_kernel)
    indexer._topk_op.cache_clear()
    jax.clear_caches()
    rng = np.random.default_rng(12)
    q, k, w = _inputs(rng, 2, 16, 3, 8, 40, integer=True)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tokens"))
    qs = jax.device_put(q, NamedSharding(mesh, P("data", "tokens")))
    ws = jax.device_put(w, NamedSharding(mesh, P("data", "tokens")))
    ks = jax.device_put(k, NamedSharding(mesh, P("data")))
    positions = jnp.broadcast_to(20 + jnp.arange(16, dtype=jnp.int32), (2, 16))
    op = indexer._topk_op(6, 1.0, 1, "cute")
    val, idx = op(qs, ks, ws, jax.device_put(positions, NamedSharding(mesh, P("data", "tokens"))))
    want_idx, want_val = oracle_topk(oracle_scores(q, k, w, 1.0, 1, 20), 6)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val), want_val)
    # The partition lowers the kernels on a shard's shapes (one batch entry, 4 tokens); the
    # global-shape trace is custom_partitioning's shape inference.
    assert (1, 4, 3, 8) in calls, calls
    indexer._topk_op.cache_clear()
