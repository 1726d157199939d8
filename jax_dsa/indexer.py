"""The lightning indexer of DeepSeek Sparse Attention: scores and top-k selection.

    score[b, t, s] = sum_h weights[b, t, h] * ReLU(scale * q[b, t, h] . k[b, s])

for the rows s of k visible to token t, -inf elsewhere. Row s is visible to token t iff
(s + 1) * ratio <= start + t + 1: ratio 1 is causal attention over positions (token t at
position start + t), ratio 4 DeepSeek-V4's compressed rows (row s summarises positions
s * ratio .. s * ratio + ratio - 1 and is visible once complete), the rule `jax_dsa.indices`
uses. `indexer_topk` keeps the `topk` highest-scoring visible rows per token, highest first,
ties to the smaller row, -1 in the slots beyond the visible rows: ready for `sparse_mla`
(with `jax_dsa.indices.concat_window_compressed` for V4's two pools in one buffer).

Two implementations: the Hopper score and top-k kernels per chunk of tokens
(jax_dsa/cute/indexer.py; bf16/fp16, Di = 128, Hi <= 64), and the pure-JAX reference here (the
CPU/TPU path and the oracle of the kernels), which walks tokens in chunks and, per token chunk,
the visible rows of k in chunks, keeping a running top-k that it merges with each chunk's
scores, so that no [T, S] score matrix ever exists (memory O(chunk_t * chunk_s * H)). Scores
are accumulated in float32 (float64 for float64 inputs). Under jit with sharded inputs the
selection runs per batch / token shard (jax_dsa.sharding.make_indexer_topk).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsa import api, reference, sharding
from jax_dsa.reference import varying_like

_HIGHEST = lax.Precision.HIGHEST
# Elements of one chunk's [chunk_t, H, chunk_s] product (about 128 MiB in fp32).
_CHUNK_ELEMENTS = 1 << 25


def indexer_topk(q, k, weights, topk, *, scale=1.0, ratio=1, start=0, return_scores=False,
                 implementation=None):
    """Top-k rows of k per token by the lightning indexer's score.

    Args:
      q: [B, T, Hi, Di] (or [T, Hi, Di]) indexer queries, bf16 / fp16 / fp32.
      k: [B, S, Di] (or [S, Di]) the indexer keys (one head shared by all Hi), q's dtype.
      weights: [B, T, Hi] (or [T, Hi]) per-token head weights, any float dtype.
      topk: entries per token (a Python int >= 1).
      scale: multiplies q . k inside the ReLU (a finite real number).
      ratio: positions per row of k (1: one row per position; 4: V4's compressed rows).
      start: position of token 0 (a chunk of T queries continuing a sequence).
      return_scores: also return the selected scores.
      implementation: None (the Hopper kernel where it can run, else the reference), "xla"
        (the pure-JAX reference), "cute" (the Hopper kernel; raises NotImplementedError with
        the reason where it cannot run), or a sequence of "xla" / "cute" tried in order.

    Returns:
      idx [B, T, topk] int32, sorted by score (highest first, ties to the smaller row), -1 in
      the slots beyond the token's visible rows; with return_scores also scores [B, T, topk]
      float32 (float64 for float64 inputs), -inf where idx is -1. The selection is not
      differentiated: the returned scores carry no gradient to q, k or weights (the indexer
      trains through `jax_dsa.indexer_loss`, which recomputes its scores).
    """
    call = _prepare(q, k, weights, scale, ratio, start)
    topk = api._check_int(topk, "topk", 1)
    api._check_flag(return_scores, "return_scores")
    impl = _resolve(implementation, call["q"], call["k"])
    q, k, weights = (jax.lax.stop_gradient(call[n]) for n in ("q", "k", "weights"))
    b, t = q.shape[:2]
    if b * t == 0:  # no tokens: nothing to select (the selection's slices need one)
        shape = (b, t, topk)
        scores = jnp.full(shape, -jnp.inf, reference.acc_dtype(q.dtype))
        idx = jnp.full(shape, -1, jnp.int32)
        if call["unbatched"]:
            scores, idx = scores[0], idx[0]
        return (idx, scores) if return_scores else idx
    # Each token's position travels with it, so a token shard knows where it starts.
    positions = jnp.broadcast_to(call["start"] + jnp.arange(t, dtype=jnp.int32), (b, t))
    scores, idx = _topk_op(topk, call["scale"], call["ratio"], impl)(q, k, weights, positions)
    if call["unbatched"]:
        scores, idx = scores[0], idx[0]
    return (idx, scores) if return_scores else idx


def indexer_scores(q, k, weights, *, scale=1.0, ratio=1, start=0, implementation=None):
    """The dense scores [B, T, S] (float32; float64 for float64 inputs), -inf where row s is not
    visible to token t. For short sequences and tests: it materialises [T, S].
    `implementation` as for indexer_topk."""
    call = _prepare(q, k, weights, scale, ratio, start)
    impl = _resolve(implementation, call["q"], call["k"])
    op = _scores_op(call["scale"], call["ratio"], call["start"], impl)
    out = op(call["q"], call["k"], call["weights"])
    return out[0] if call["unbatched"] else out


@functools.lru_cache(maxsize=None)
def _scores_op(scale, ratio, start, impl):
    """The dense scores of (q, k, weights), jitted once per static arguments."""
    def ref(q, k, w):
        return _scores_jit(q, k, w, scale, ratio, start)

    def kernel(q, k, w):
        from jax_dsa.cute import indexer as cute_indexer
        return cute_indexer.scores(q, k, w, scale=scale, ratio=ratio, start=start)

    return jax.jit(lambda q, k, w: api.dispatch(impl, ref, kernel, q, k, w))


@functools.lru_cache(maxsize=None)
def _topk_op(topk, scale, ratio, impl):
    """(scores, idx) of (q, k, weights, positions [B, T] int32), jitted and partitioned: batch
    and tokens shard, k and the heads are replicated (jax_dsa.sharding.make_indexer_topk)."""
    def local(q, k, w, positions):
        start = jnp.sum(positions[:1, :1])  # the shard's first position (0 when empty)
        ct, cs = _chunks(q.shape[1], k.shape[1], q.shape[2])

        def ref(q, k, w, start):
            return _topk_jit(q, k, w, start, topk, scale, ratio, ct, cs)

        def kernel(q, k, w, start):
            from jax_dsa.cute import indexer as cute_indexer
            return cute_indexer.topk(q, k, w, start, topk, scale, ratio)

        return api.dispatch(impl, ref, kernel, q, k, w, start)

    return jax.jit(sharding.make_indexer_topk(local))


# ------------------------------------------------------------------------------ checks
def _prepare(q, k, weights, scale, ratio, start):
    q, k, weights = (api._as_array(x, n) for x, n in ((q, "q"), (k, "k"), (weights, "weights")))
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [B, T, Hi, Di] or [T, Hi, Di]; got shape {q.shape}")
    unbatched = q.ndim == 3
    want_k, want_w = ("[S, Di]", "[T, Hi]") if unbatched else ("[B, S, Di]", "[B, T, Hi]")
    if k.ndim != q.ndim - 1:
        raise ValueError(f"k must be {want_k} for this q; got shape {k.shape}")
    if weights.ndim != q.ndim - 1:
        raise ValueError(f"weights must be {want_w} for this q; got shape {weights.shape}")
    if unbatched:
        q, k, weights = q[None], k[None], weights[None]
    b, t, h, d = q.shape
    api._check_float(q, "q")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}; got {k.dtype}")
    api._check_float(weights, "weights")
    if k.shape[0] != b or k.shape[2] != d:
        raise ValueError(f"k must be [B, S, Di] = [{b}, S, {d}]; got shape {k.shape}")
    if weights.shape != (b, t, h):
        raise ValueError(f"weights must be [B, T, Hi] = [{b}, {t}, {h}]; got shape "
                         f"{weights.shape}")
    if h < 1 or d < 1:
        raise ValueError(f"q must have Hi >= 1 heads of Di >= 1; got shape {q.shape}")
    if k.shape[1] < 1:
        raise ValueError("k must have at least one row (S >= 1)")
    if scale is None:
        raise TypeError("scale must be a real number; got None")
    scale = api._check_scale(scale, d)
    ratio = api._check_int(ratio, "ratio", 1)
    start = api._check_int(start, "start", 0)
    return dict(q=q, k=k, weights=weights, scale=scale, ratio=ratio, start=start,
                unbatched=unbatched)


def kernel_problem(q, k) -> str | None:
    """Why the Hopper indexer kernel cannot take canonical q [B, T, Hi, Di], k [B, S, Di] here
    (None when it can)."""
    from jax_dsa.cute import indexer as cute_indexer
    return api.op_kernel_problem(lambda: cute_indexer.shape_problem(q, k), q, k)


_warn_fallback = api.warn_op_fallback  # (its cache is the one the tests clear)


def _resolve(implementation, q, k) -> str:
    """"xla", "cute" or "auto" (the kernel when lowered for CUDA, else the reference)."""
    return api.choose(implementation, kernel_problem(q, k), "indexer_topk", q)


# ------------------------------------------------------------------------------ reference
def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _chunk_scores(q, k_rows, w, scale):
    """Scores [B, ct, cs] of q [B, ct, H, D] against k_rows [B, cs, D], visible or not."""
    acc = _acc_dtype(q.dtype)
    dots = jnp.einsum("bthd,bsd->bths", q, k_rows, precision=_HIGHEST,
                      preferred_element_type=acc)
    return jnp.einsum("bths,bth->bts", jnp.maximum(dots * scale, 0), w.astype(acc),
                      precision=_HIGHEST)


def _visible(rows, pos, ratio, num_rows):
    """[ct, cs] bool: row `rows` of k visible to the token at position `pos`."""
    return (rows[None, :] >= 0) & (rows[None, :] < num_rows) & (
        (rows[None, :] + 1) * ratio <= pos[:, None] + 1)


def _chunks(t, s, h):
    """(tokens, rows) per chunk: the [ct, H, cs] product within _CHUNK_ELEMENTS."""
    ct = int(max(1, min(t, 256)))
    cs = int(max(1, min(s, _CHUNK_ELEMENTS // max(1, ct * h))))
    return ct, cs


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _scores_jit(q, k, w, scale, ratio, start):
    b, t, h, _ = q.shape
    s_rows = k.shape[1]
    pos = start + jnp.arange(t)
    s = _chunk_scores(q, k, w, scale)
    return jnp.where(_visible(jnp.arange(s_rows), pos, ratio, s_rows)[None], s, -jnp.inf)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8))
def _topk_jit(q, k, w, start, topk, scale, ratio, ct, cs):
    """(scores, idx) [B, T, topk]: a running top-k over chunks of cs visible rows, per chunk of
    ct tokens; start (the position of token 0) may be traced."""
    b, t, h, d = q.shape
    s_rows = k.shape[1]
    acc = _acc_dtype(q.dtype)
    n_t, n_s = -(-t // ct), -(-s_rows // cs)
    q_pad = jnp.pad(q, [(0, 0), (0, n_t * ct - t), (0, 0), (0, 0)])
    w_pad = jnp.pad(w, [(0, 0), (0, n_t * ct - t), (0, 0)])
    k_pad = jnp.pad(k, [(0, 0), (0, n_s * cs - s_rows), (0, 0)])

    def token_chunk(i):
        q_c = lax.dynamic_slice_in_dim(q_pad, i * ct, ct, axis=1)
        w_c = lax.dynamic_slice_in_dim(w_pad, i * ct, ct, axis=1)
        pos = start + i * ct + jnp.arange(ct)
        # Rows visible to the chunk's last token: (row + 1) * ratio <= pos_last + 1.
        n_vis = jnp.clip((start + i * ct + ct) // ratio, 0, s_rows)
        n_chunks = (n_vis + cs - 1) // cs

        def merge(j, carry):
            best, best_idx = carry
            k_c = lax.dynamic_slice_in_dim(k_pad, j * cs, cs, axis=1)
            rows = j * cs + jnp.arange(cs)
            s = _chunk_scores(q_c, k_c, w_c, scale)
            s = jnp.where(_visible(rows, pos, ratio, s_rows)[None], s, -jnp.inf)
            # The running list (rows of earlier chunks, sorted by score then row) comes first and
            # the chunk's rows follow in ascending order, so top_k's lower-position-first tie
            # rule keeps ties on the smaller row.
            vals = jnp.concatenate([best, s], axis=-1)
            ids = jnp.concatenate([best_idx, jnp.broadcast_to(rows, s.shape).astype(jnp.int32)],
                                  axis=-1)
            best, pick = lax.top_k(vals, topk)
            return best, jnp.take_along_axis(ids, pick, axis=-1)

        # (inside shard_map the carry must vary over the mesh axes its updates vary over)
        init = (varying_like(jnp.full((b, ct, topk), -jnp.inf, acc), q_c, k_pad, w_c),
                varying_like(jnp.full((b, ct, topk), -1, jnp.int32), q_c, k_pad, w_c))
        best, best_idx = lax.fori_loop(0, n_chunks, merge, init)
        return best, jnp.where(jnp.isneginf(best), -1, best_idx)

    best, idx = lax.map(token_chunk, jnp.arange(n_t))
    best = jnp.moveaxis(best, 0, 1).reshape(b, n_t * ct, topk)[:, :t]
    idx = jnp.moveaxis(idx, 0, 1).reshape(b, n_t * ct, topk)[:, :t]
    return best, idx
