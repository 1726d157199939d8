"""NumPy model of a filtered radix select: the planned next version of the indexer's top-k kernel.

    python dev/topk_model.py        (checks the model against a lexsort oracle on random rows)

ffi/kernels/sm90/indexer_topk.py reads each row five times (four 8-bit histogram passes and the
collection). The plan reads it twice: pass A counts the top 13 bits of the order-preserving key
(8192 bins) and picks the bin b0 holding the k-th largest; pass B sends keys above b0 straight
to the candidates and copies the keys of bin b0 (at most BUF of them, usually a few thousand)
into shared memory, where the remaining 19 bits are resolved (10 + 9) without touching global
memory again. Ties at the threshold are resolved by putting every tied key into the final
bitonic sort (key descending, column ascending) when they fit in CAP, and by nothing at all
when the threshold is -inf (those slots are (-inf, -1) anyway); a bin larger than BUF or more
ties than CAP fall back to the present five-pass path (`None` here).
"""
import numpy as np

INT32_MIN = -2**31
BUF = 4096
CAP = 8192

def key(bits):
    """int32 float bits -> signed key in the floats' order."""
    bits = bits.astype(np.int64)
    k = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return k

def ukey(k):
    """signed key -> its unsigned view (0 .. 2^32 - 1)."""
    return (k - INT32_MIN) & 0xFFFFFFFF

NEG_INF_KEY = int(key(np.array([np.float32(-np.inf)]).view(np.int32))[0])

def select_digit(hist, need):
    """The bin b (scanning down) with count(bins > b) < need <= count(bins >= b), and what of
    `need` is left for it."""
    above = 0
    for b in range(len(hist) - 1, -1, -1):
        if above + hist[b] >= need:
            return b, need - above
        above += hist[b]
    raise AssertionError

def topk_row(scores, K):
    """(idx, values) of one row's top K as the kernel would give them, or None (fallback)."""
    S = len(scores)
    k_eff = min(K, S)
    keys = key(scores.astype(np.float32).view(np.int32))
    u = ukey(keys)
    # pass A: top 13 bits
    hist = np.bincount(u >> 19, minlength=8192)
    b0, need = select_digit(hist, k_eff)
    n_bin = hist[b0]
    above = (u >> 19) > b0
    cand = list(zip(keys[above], np.nonzero(above)[0]))
    n_above = len(cand)
    assert n_above == k_eff - need
    if n_bin <= BUF:
        inbin = np.nonzero((u >> 19) == b0)[0]
        buf_u = u[inbin]
        prefix, mask = b0 << 19, 0xFFF80000
        for shift, bits in ((9, 10), (0, 9)):
            m = (buf_u & mask) == prefix
            h = np.bincount((buf_u[m] >> shift) & ((1 << bits) - 1), minlength=1 << bits)
            d, need = select_digit(h, need)
            prefix |= d << shift
            mask |= ((1 << bits) - 1) << shift
        theta_u = prefix
        gt = buf_u > theta_u
        eq = buf_u == theta_u
        cand += list(zip(keys[inbin[gt]], inbin[gt]))
        theta_key = theta_u + INT32_MIN
        if theta_key == NEG_INF_KEY:
            pass  # the ties are -inf: the remaining slots are (-inf, -1) anyway
        elif len(cand) + eq.sum() <= CAP:
            cand += list(zip(keys[inbin[eq]], inbin[eq]))
        else:
            return None  # fallback
    else:
        return None  # fallback
    cand.sort(key=lambda kc: (-kc[0], kc[1]))
    out_idx = np.full(K, -1); out_val = np.full(K, -np.inf, np.float32)
    for i, (k_, c) in enumerate(cand[:k_eff]):
        if k_ != NEG_INF_KEY:
            out_idx[i] = c; out_val[i] = scores[c]
    return out_idx, out_val

def oracle(scores, K):
    """The contract: highest first, ties to the smaller column, (-1, -inf) past the finite."""
    order = np.lexsort((np.arange(len(scores)), -scores.astype(np.float64)))
    order = [j for j in order if np.isfinite(scores[j])][:K]
    idx = np.full(K, -1); val = np.full(K, -np.inf, np.float32)
    idx[:len(order)] = order; val[:len(order)] = scores[order]
    return idx, val

def main():
    rng = np.random.default_rng(0)
    fallbacks = 0
    for trial in range(300):
        S = int(rng.choice([1, 7, 300, 5000, 20000]))
        K = int(rng.choice([1, 8, 512, 2048, 4096]))
        kind = trial % 5
        if kind == 0: sc = rng.standard_normal(S).astype(np.float32)
        elif kind == 1: sc = (rng.integers(-20, 20, S) * 0.5).astype(np.float32)
        elif kind == 2: sc = np.maximum(rng.standard_normal(S), 0).astype(np.float32)
        elif kind == 3: sc = np.ones(S, np.float32)
        else: sc = rng.standard_normal(S).astype(np.float32) * 1e-3 + 5
        sc[rng.random(S) < 0.3] = -np.inf
        got = topk_row(sc, K)
        if got is None:
            fallbacks += 1; continue
        want = oracle(sc, K)
        assert np.array_equal(got[0], want[0]), (trial, S, K, kind)
        assert np.array_equal(got[1], want[1])
    print("ok, fallbacks", fallbacks, "of 300")


if __name__ == "__main__":
    main()
