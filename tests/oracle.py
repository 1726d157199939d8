"""Independent float64 oracles for the tests, written from the math (docs/design.md, the contract).

`numpy_forward` loops over tokens in NumPy. `dense_forward` is the same math as a dense
softmax over all S rows of kv with per-row multiplicities (how often each row is listed), in
float64 JAX, so that `jax.grad` of it gives reference gradients that share no code with the
package (no gather, no custom_vjp).
"""
import jax
import jax.numpy as jnp
import numpy as np


def valid_entries(idx, topk_length, s):
    k = idx.shape[-1]
    slot = np.arange(k)
    return (idx >= 0) & (idx < s) & (slot < topk_length[..., None])


def _valid_list(idx, lengths, s, bi, ti):
    """[(slot, row)] of token (bi, ti)'s valid entries."""
    mask = valid_entries(np.asarray(idx[bi, ti]), np.asarray(lengths[bi, ti]), s)
    return [(int(j), int(idx[bi, ti, j])) for j in np.flatnonzero(mask)]


def numpy_forward(q, kv, idx, topk_length, sink, scale, d_v):
    """o [B, T, H, d_v] float64, lse [B, T, H] float64 by an explicit loop over tokens."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    b_, t_, h_, _ = q.shape
    s_ = kv.shape[1]
    valid = valid_entries(np.asarray(idx), np.asarray(topk_length), s_)
    o = np.zeros((b_, t_, h_, d_v))
    lse = np.full((b_, t_, h_), -np.inf)
    for b in range(b_):
        for t in range(t_):
            rows = kv[b, idx[b, t][valid[b, t]]]
            if rows.shape[0] == 0:
                continue
            s = scale * q[b, t] @ rows.T  # [H, n]
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            denom = e.sum(axis=1, keepdims=True)
            lse[b, t] = (m + np.log(denom))[:, 0]
            if sink is not None:
                denom = denom + np.exp(np.asarray(sink, np.float64)[:, None] - m)
            o[b, t] = (e / denom) @ rows[:, :d_v]
    return o, lse


def multiplicity(idx, topk_length, s):
    """[B, T, S] float64: how many valid slots of token t name each row of kv."""
    valid = valid_entries(np.asarray(idx), np.asarray(topk_length), s)
    b_, t_, _ = idx.shape
    counts = np.zeros((b_, t_, s))
    bb, tt, _ = np.nonzero(valid)
    np.add.at(counts, (bb, tt, np.asarray(idx)[valid]), 1.0)
    return counts


def dense_forward(q, kv, counts, sink, scale, d_v):
    """Differentiable float64 o, lse over all rows, each weighted by its multiplicity."""
    s = scale * jnp.einsum("bthd,bsd->bths", q, kv)
    present = counts[:, :, None, :] > 0
    live = jnp.any(present, axis=-1)
    m = jnp.max(jnp.where(present, s, -jnp.inf), axis=-1)
    m = jax.lax.stop_gradient(jnp.where(live, m, 0.0))
    w = counts[:, :, None, :] * jnp.exp(jnp.where(present, s, 0.0) - m[..., None])
    w = jnp.where(present, w, 0.0)
    l = jnp.sum(w, axis=-1)
    denom = l if sink is None else l + jnp.exp(sink[None, None, :] - m)
    # (a dead row has w = 0, so o = 0; its denominator is 0 without a sink or with sink -inf)
    o = jnp.einsum("bths,bsd->bthd", w, kv[..., :d_v]) / jnp.where(denom > 0, denom,
                                                                    1.0)[..., None]
    lse = jnp.where(live, m + jnp.log(jnp.where(live, l, 1.0)), -jnp.inf)
    return o, lse


def dense_grads(q, kv, idx, topk_length, sink, scale, d_v, w_o, w_lse):
    """float64 gradients of sum(o * w_o) + sum(finite lse * w_lse) w.r.t. q, kv (and sink)."""
    counts = multiplicity(idx, topk_length, kv.shape[1])
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, kv)]
        if sink is not None:
            args.append(jnp.asarray(np.asarray(sink, np.float64)))
        wo, wl, c = (jnp.asarray(np.asarray(x, np.float64)) for x in (w_o, w_lse, counts))

        def loss(*a):
            o, lse = dense_forward(a[0], a[1], c, a[2] if sink is not None else None, scale, d_v)
            return jnp.sum(o * wo) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)

        grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
        return [np.asarray(g) for g in grads]


def indexer_scores(q, k, w, scale, ratio, start):
    """The lightning indexer's scores, float64 [B, T, S], -inf where not visible."""
    q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
    dots = np.einsum("bthd,bsd->bths", q, k)
    s = np.einsum("bths,bth->bts", np.maximum(scale * dots, 0.0), w)
    t, n = q.shape[1], k.shape[1]
    pos = start + np.arange(t)[:, None]
    visible = (np.arange(n)[None, :] + 1) * ratio <= pos + 1
    return np.where(visible[None], s, -np.inf)


def indexer_topk(scores, topk):
    """idx [B, T, topk] by (score desc, row asc), -1 past the visible rows; and their scores."""
    b, t, n = scores.shape
    idx = np.full((b, t, topk), -1, np.int64)
    val = np.full((b, t, topk), -np.inf)
    for bi in range(b):
        for ti in range(t):
            row = scores[bi, ti]
            order = np.lexsort((np.arange(n), -row))  # primary: -score, then row
            order = [j for j in order if np.isfinite(row[j])][:topk]
            idx[bi, ti, :len(order)] = order
            val[bi, ti, :len(order)] = row[order]
    return idx, val


def one_pool(kv1, idx1, lengths1, kv2, idx2, lengths2):
    """A two-pool problem as one pool: kv2 after kv1, the second list's valid entries shifted by
    S1 (invalid entries and those past either topk_length set to -1, the lists concatenated;
    every slot is then within the lengths)."""
    s1, s2 = kv1.shape[1], kv2.shape[1]
    v1 = valid_entries(np.asarray(idx1), np.asarray(lengths1), s1)
    v2 = valid_entries(np.asarray(idx2), np.asarray(lengths2), s2)
    idx = np.concatenate([np.where(v1, idx1, -1), np.where(v2, np.asarray(idx2) + s1, -1)], axis=2)
    return np.concatenate([np.asarray(kv1, np.float32), np.asarray(kv2, np.float32)], axis=1), \
        idx.astype(np.int32)


def attention_target(p, scale):
    """float64: softmax probabilities (sink in the denominator) summed over heads, normalised
    over the token's entries; 0 at invalid entries and on dead tokens."""
    q, kv, idx = (np.asarray(x, np.float64) for x in (p.q, p.kv, p.idx))
    b, t, h, _ = q.shape
    k = idx.shape[2]
    s_rows = kv.shape[1]
    sink = np.full(h, -np.inf) if p.sink is None else np.asarray(p.sink, np.float64)
    out = np.zeros((b, t, k))
    for bi in range(b):
        for ti in range(t):
            valid = _valid_list(p.idx, p.lengths, s_rows, bi, ti)
            if not valid:
                continue
            mass = np.zeros(k)
            for hi in range(h):
                s = np.array([scale * q[bi, ti, hi] @ kv[bi, r] for _, r in valid])
                m = s.max()
                den = np.exp(s - m).sum() + np.exp(sink[hi] - m)
                for (j, _), sj in zip(valid, s):
                    mass[j] += np.exp(sj - m) / den
            out[bi, ti] = mass / mass.sum()
    return out


def _indexer_token(q, k, w, idx, lengths, scale, bi, ti):
    """float64 pieces of token (bi, ti)'s indexer softmax over its valid entries: (slots, rows,
    a = scale q k^T [h, nv], p = softmax of sum_h w ReLU(a) [nv]), or None without valid ones."""
    valid = _valid_list(idx, lengths, k.shape[1], bi, ti)
    if not valid:
        return None
    slots = [j for j, _ in valid]
    rows = np.array([r for _, r in valid])
    a = scale * q[bi, ti] @ k[bi, rows].T
    score = (w[bi, ti][:, None] * np.maximum(a, 0)).sum(0)
    p = np.exp(score - score.max())
    return slots, rows, a, p / p.sum()


def indexer_loss_grads(q, k, w, idx, lengths, target, g, scale):
    """float64 (dq, dk, dw) of sum_t g[b, t] KL(target || softmax of the indexer scores over
    the valid entries), from the formulas: dscore = g (p sum(target) - target),
    dw = sum_j dscore_j ReLU(a_hj), dd = scale [a > 0] dscore w, dq = dd rows, dk += dd^T q."""
    q, k, w, target, g = (np.asarray(x, np.float64) for x in (q, k, w, target, g))
    b, t, h, d = q.shape
    dq, dk, dw = np.zeros_like(q), np.zeros_like(k), np.zeros_like(w)
    for bi in range(b):
        for ti in range(t):
            token = _indexer_token(q, k, w, idx, lengths, scale, bi, ti)
            if token is None:
                continue
            slots, rows, a, p = token
            kr = k[bi, rows]  # [nv, d]
            tg = target[bi, ti, slots]
            ds = g[bi, ti] * (p * tg.sum() - tg)
            dw[bi, ti] = np.maximum(a, 0) @ ds
            dd = scale * (a > 0) * ds[None, :] * w[bi, ti][:, None]
            dq[bi, ti] = dd @ kr
            np.add.at(dk[bi], rows, dd.T @ q[bi, ti])
    return dq, dk, dw


def indexer_signal(q, k, w, idx, lengths, target, scale):
    """float64 [B, T, K]: d KL / d score_j = p_j sum(target) - target_j over each token's valid
    entries (p: the softmax of the indexer scores over them), 0 at every other slot."""
    q, k, w, target = (np.asarray(x, np.float64) for x in (q, k, w, target))
    b, t = q.shape[:2]
    out = np.zeros(np.asarray(idx).shape)
    for bi in range(b):
        for ti in range(t):
            token = _indexer_token(q, k, w, idx, lengths, scale, bi, ti)
            if token is None:
                continue
            slots, _, _, p = token
            tg = target[bi, ti, slots]
            out[bi, ti, slots] = p * tg.sum() - tg
    return out


def indexer_kl(q, k, w, idx, lengths, target, scale):
    """float64 per-token KL(target || softmax of the indexer scores over the valid entries)."""
    b, t, h, _ = q.shape
    out = np.zeros((b, t))
    for bi in range(b):
        for ti in range(t):
            valid = _valid_list(idx, lengths, k.shape[1], bi, ti)
            if not valid:
                continue
            z = np.array([np.sum(w[bi, ti] * np.maximum(scale * q[bi, ti] @ k[bi, r], 0))
                          for _, r in valid])
            log_p = z - z.max() - np.log(np.exp(z - z.max()).sum())
            tg = np.array([target[bi, ti, j] for j, _ in valid])
            out[bi, ti] = np.sum(np.where(tg > 0, tg * np.log(np.where(tg > 0, tg, 1)), 0)
                                 - tg * log_p)
    return out
