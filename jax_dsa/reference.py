"""Pure-JAX sparse MLA: the CPU/TPU fallback and the oracle for the GPU kernels.

All functions here take the canonical batched layout
  q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K] int32, topk_length [B, T] int32,
  sink [H] float32 (-inf where the caller has no sink)
and work on chunks of tokens, so that peak memory is O(chunk * K * Dqk), never O(T * K * Dqk).
The backward is written out explicitly (docs/design.md) rather than obtained by
differentiating through the gather: dkv is a scatter-add that drops invalid entries.
Accumulation is in float32, or in float64 for float64 inputs (`acc_dtype`); lse, dkv and dsink
come out in that dtype. A NaN anywhere (a sink included) reaches every output it touches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST
# Element budget for one chunk's gathered rows plus its score block (about 128 MiB in fp32).
_CHUNK_ELEMENTS = 1 << 25


def chunk_tokens(t: int, k: int, d: int, h: int, budget: int = _CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's K*D gather and H*K scores stay within `budget`."""
    return int(max(1, min(t, budget // max(1, k * (d + h)))))


def acc_dtype(dtype):
    """The accumulation dtype for inputs of `dtype`: float32, or float64 for float64."""
    return jnp.promote_types(dtype, jnp.float32)


def valid_mask(idx, topk_length, num_kv_rows: int):
    """[B, T, K] bool: entry is used iff 0 <= idx < S and its slot is below topk_length."""
    slot = lax.broadcasted_iota(jnp.int32, idx.shape, 2)
    return (idx >= 0) & (idx < num_kv_rows) & (slot < topk_length[..., None])


def _gather_rows(kv, idx, valid):
    """kv [B, S, D], idx [B, c, K] -> [B, c, K, D], zero at invalid slots (as the kernels'
    zero-filled rows), so a NaN or inf in a row no valid entry uses cannot reach the result."""
    safe = jnp.where(valid, idx, 0)
    rows = jax.vmap(lambda rows, i: rows[i])(kv, safe)
    return jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype))


def _scores(q, rows, valid, scale):
    """Scores [B, c, H, K] in acc_dtype, -inf at invalid slots."""
    s = jnp.einsum("bthd,btkd->bthk", q, rows, precision=_HIGHEST,
                   preferred_element_type=acc_dtype(q.dtype)) * scale
    return jnp.where(valid[:, :, None, :], s, -jnp.inf)


def _chunked(chunk: int, *arrays):
    """Split arrays shaped [B, T, ...] into [n, B, chunk, ...] (T zero-padded to n * chunk)."""
    t = arrays[0].shape[1]
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x):
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

    return [split(x) for x in arrays], pad


def _merge(x, pad):
    """[n, B, chunk, ...] -> [B, T, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    x = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    return x[:, : x.shape[1] - pad] if pad else x


def _scatter_add_rows(acc, rows, updates):
    """acc[rows[i]] += updates[i] for every slot; rows >= acc.shape[0] are dropped, not written."""
    d = acc.shape[-1]
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,))
    return lax.scatter_add(acc, rows.reshape(-1, 1), updates.reshape(-1, d), dnums,
                           mode=lax.GatherScatterMode.FILL_OR_DROP)


def _scatter_add_rows_in_order(acc, rows, updates):
    """_scatter_add_rows with a fixed fp32 summation order (deterministic=True): the slots are
    sorted by row (stable), each run of equal rows is summed by a segmented scan (a fixed tree of
    adds), and each distinct row then receives exactly one addition, so the order in which a
    GPU's scatter atomics land cannot change the result."""
    d = acc.shape[-1]
    rows = rows.reshape(-1)
    updates = updates.reshape(-1, d)
    order = jnp.argsort(rows, stable=True)
    rows, updates = rows[order], updates[order]
    new_run = jnp.concatenate([jnp.ones((1,), bool), rows[1:] != rows[:-1]])
    run_ends = jnp.concatenate([rows[1:] != rows[:-1], jnp.ones((1,), bool)])

    def combine(a, b):
        (starts_a, sum_a), (starts_b, sum_b) = a, b
        return starts_a | starts_b, jnp.where(starts_b[..., None], sum_b, sum_a + sum_b)

    _, sums = lax.associative_scan(combine, (new_run, updates))
    return _scatter_add_rows(acc, jnp.where(run_ends, rows, acc.shape[0]), sums)


def varying_like(x, *refs):
    """x with the shard_map variance (vma) of refs, so that a scan carry keeps its type.

    Adds an exact 0.0 computed from each ref (a sum over an empty slice): version-independent,
    and a no-op outside shard_map.
    """
    zero = sum(jnp.sum(r[..., :0].astype(x.dtype), dtype=x.dtype) for r in refs)
    return x + jnp.asarray(zero, x.dtype)  # x's dtype even where x64 widens int32 sums


def forward(q, kv, idx, topk_length, sink, *, scale: float, d_v: int, chunk: int | None = None):
    """Returns (o [B, T, H, d_v] in q.dtype, lse [B, T, H] in acc_dtype)."""
    b, t, h, d = q.shape
    s_rows = kv.shape[1]
    k = idx.shape[2]
    acc = acc_dtype(q.dtype)
    chunk = chunk or chunk_tokens(t, k, d, h)
    (qc, ic, lc), pad = _chunked(chunk, q, idx, topk_length)
    sink = sink.astype(acc)

    def one_chunk(args):
        q_, i_, l_ = args
        valid = valid_mask(i_, l_, s_rows)
        rows = _gather_rows(kv, i_, valid)
        s = _scores(q_, rows, valid, scale)
        m = jnp.max(s, axis=-1)
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # dead rows: every s is -inf, p becomes 0
        p = jnp.exp(s - m[..., None])
        l = jnp.sum(p, axis=-1)
        denom = l + jnp.exp(sink[None, None, :] - m)
        o = jnp.einsum("bthk,btkd->bthd", p, rows[..., :d_v], precision=_HIGHEST,
                       preferred_element_type=acc)
        o = o / jnp.where(denom == 0, 1.0, denom)[..., None]  # a NaN denominator stays NaN
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return o.astype(q.dtype), lse

    o, lse = lax.map(one_chunk, (qc, ic, lc))
    return _merge(o, pad), _merge(lse, pad)


def combine_partials(o_parts, lse_parts, sink, *, axis: int):
    """The attention over a list from its parts: o_parts [..., n, ..., d_v] and lse_parts (o's
    shape without d_v) hold each part's softmax output and lse along `axis`, computed without
    the sink; sink broadcasts against lse_parts without that axis (-inf: none). Returns (o in
    acc_dtype, lse) as one forward over the whole list gives them: lse = logsumexp of the
    parts' (sink excluded, -inf if every part is dead), o = sum_i e^(lse_i) o_i / (e^lse +
    e^sink), 0 where that denominator is 0; a NaN sink gives NaN."""
    acc = acc_dtype(o_parts.dtype)
    lse_parts = lse_parts.astype(acc)
    m = jnp.max(lse_parts, axis=axis)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # every part dead: weights 0
    w = jnp.exp(lse_parts - jnp.expand_dims(m, axis))  # 0 for a dead part
    l = jnp.sum(w, axis=axis)
    o = jnp.sum(w[..., None] * o_parts.astype(acc), axis=axis)
    denom = l + jnp.exp(sink.astype(acc) - m)
    o = o / jnp.where(denom == 0, 1.0, denom)[..., None]  # a NaN denominator stays NaN
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o, lse


def split_forward(forward_fn, q, kv, idx, topk_length, sink, *, splits: int):
    """A forward over each token's list as `splits` contiguous parts of ceil(K / splits)
    entries, each part a token of its own for `forward_fn(q, kv, idx, topk_length, sink) ->
    (o, lse)` (q repeated; the last part padded with -1; a part's topk_length is what of the
    token's falls in it), run without the sink and combined by lse with it (combine_partials).
    The result is the unsplit forward's, up to rounding the parts' o to q.dtype. The kernels'
    decode path (jax_dsa.cute.config.FwdConfig.splits)."""
    b, t, h, _ = q.shape
    k = idx.shape[-1]
    part = -(-k // splits)
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, splits * part - k)), constant_values=-1)
    lengths = jnp.clip(topk_length[..., None] - part * jnp.arange(splits, dtype=jnp.int32), 0,
                       part)
    o, lse = forward_fn(jnp.repeat(q, splits, axis=1), kv, idx.reshape(b, t * splits, part),
                        lengths.reshape(b, t * splits), jnp.full_like(sink, -jnp.inf))
    o, lse = combine_partials(o.reshape(b, t, splits, h, -1), lse.reshape(b, t, splits, h),
                              sink, axis=2)
    return o.astype(q.dtype), lse


def sink_split(sink, lse):
    """(c, 1 - c) with c = 1 / (1 + exp(sink - lse)), the share of probability left to the KV.

    1 - c is computed directly (not by subtraction), which keeps dsink accurate when the sink
    holds a small share. Dead rows (lse = -inf) give c = 0 with a sink and c = 1 without one
    (sink = -inf); neither is NaN. A NaN sink gives NaN.
    """
    gap = sink.astype(lse.dtype) - lse
    no_sink_dead_row = jnp.isneginf(sink) & jnp.isneginf(lse)  # -inf - (-inf)
    gap = jnp.where(no_sink_dead_row, -jnp.inf, gap)
    return 1.0 / (1.0 + jnp.exp(gap)), 1.0 / (1.0 + jnp.exp(-gap))


def backward(q, kv, idx, topk_length, sink, o, lse, do, dlse, *, scale: float, d_v: int,
             chunk: int | None = None, deterministic: bool = False):
    """Gradients of (o, lse) -> (dq [q.dtype], dkv, dsink per batch [B, H]; both in acc_dtype).

    dkv stays in acc_dtype so that sharded callers can sum partial dkv across shards before the cast.
    deterministic: sum each kv row's contributions in a fixed order (XLA's GPU scatter-add uses
    atomics otherwise).
    """
    scatter = _scatter_add_rows_in_order if deterministic else _scatter_add_rows
    b, t, h, d = q.shape
    s_rows = kv.shape[1]
    k = idx.shape[2]
    acc = acc_dtype(q.dtype)
    chunk = chunk or chunk_tokens(t, k, d, h)
    sink = sink.astype(acc)
    (qc, ic, lc, oc, lsec, doc, dlsec), pad = _chunked(
        chunk, q, idx, topk_length, o, lse, do, dlse)
    # Rows that were padded on get valid=False through topk_length=0, so they scatter nothing.

    def one_chunk(dkv_acc, args):
        q_, i_, l_, o_, lse_, do_, dlse_ = args
        valid = valid_mask(i_, l_, s_rows)
        rows = _gather_rows(kv, i_, valid)
        s = _scores(q_, rows, valid, scale)
        live = jnp.isfinite(lse_)
        p_kv = jnp.where(live[..., None], jnp.exp(s - jnp.where(live, lse_, 0.0)[..., None]), 0.0)
        c, sink_share = sink_split(sink[None, None, :], lse_)
        do32 = do_.astype(acc)
        delta = jnp.sum(do32 * o_.astype(acc), axis=-1)
        dp = jnp.einsum("bthd,btkd->bthk", do32, rows[..., :d_v], precision=_HIGHEST,
                        preferred_element_type=acc)
        ds = p_kv * (c[..., None] * (dp - delta[..., None]) + dlse_.astype(acc)[..., None])
        dq = scale * jnp.einsum("bthk,btkd->bthd", ds, rows, precision=_HIGHEST,
                                preferred_element_type=acc)
        # Per gathered slot: K part scale * dS^T q, V part p^T dO on the first d_v columns.
        drow = scale * jnp.einsum("bthk,bthd->btkd", ds, q_, precision=_HIGHEST,
                                  preferred_element_type=acc)
        dv = jnp.einsum("bthk,bthd->btkd", c[..., None] * p_kv, do32, precision=_HIGHEST,
                        preferred_element_type=acc)
        drow = jnp.concatenate([drow[..., :d_v] + dv, drow[..., d_v:]], axis=-1)
        # Invalid slots point past the end and are dropped: nothing is ever written there.
        target = jnp.where(valid, i_, s_rows)
        dkv_acc = jax.vmap(scatter)(dkv_acc, target, drow)
        dsink = -jnp.sum(sink_share * delta, axis=1)  # [B, H]
        return dkv_acc, (dq.astype(q.dtype), dsink)

    dkv0 = varying_like(jnp.zeros((b, s_rows, d), acc), q, idx, do, dlse)
    dkv, (dq, dsink) = lax.scan(one_chunk, dkv0, (qc, ic, lc, oc, lsec, doc, dlsec))
    dsink = jnp.where(jnp.isneginf(sink)[None, :], 0.0, jnp.sum(dsink, axis=0))
    return _merge(dq, pad), dkv, dsink
