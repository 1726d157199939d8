"""The Hopper indexer-loss kernels (jax_dsa.cute.indexer_loss, ffi/kernels/sm90/indexer_loss.py:
the per-token KL and its gradients) against the float64 oracles (GPU only), directly and through
jax_dsa.indexer_loss."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa

from cases import rel_err
from oracle import indexer_loss_grads, indexer_kl, indexer_signal

pytestmark = pytest.mark.gpu


def _kernel_or_skip():
    from jax_dsa.cute import indexer_loss
    problem = indexer_loss.shape_problem(jnp.zeros((1, 1, 1, 128), jnp.bfloat16),
                                         jnp.zeros((1, 1, 128), jnp.bfloat16),
                                         jnp.zeros((1, 1, 1), jnp.int32))
    if problem:
        pytest.skip(problem)


def _problem(rng, b, t, h, s, k, dtype):
    q = np.asarray(jnp.asarray(rng.standard_normal((b, t, h, 128)), dtype).astype(jnp.float32))
    kk = np.asarray(jnp.asarray(rng.standard_normal((b, s, 128)), dtype).astype(jnp.float32))
    w = rng.standard_normal((b, t, h)).astype(np.float32)
    idx = rng.integers(-3, s + 3, (b, t, k)).astype(np.int32)  # some invalid on both sides
    if k > 1:
        idx[..., 1] = idx[..., 0]  # a duplicate: its dk row gets both contributions
    idx[0, 0] = -1  # a dead token
    lengths = rng.integers(0, k + 1, (b, t)).astype(np.int32)
    lengths.flat[-1] = k
    target = rng.random((b, t, k)).astype(np.float32)
    target[..., 2:5] = 0.0  # zero targets
    target /= target.sum(-1, keepdims=True)
    g = rng.standard_normal((b, t)).astype(np.float32)
    return q, kk, w, idx, lengths, target, g


# (B, T, Hi, S, K, scale): Hi below / at 64, K below / above / not a multiple of the 64-entry
# block, lists longer than S, a negative scale, the largest K.
CASES = [
    (1, 4, 1, 50, 37, 1.0),
    (2, 5, 16, 300, 130, 128 ** -0.5),
    (1, 6, 48, 1000, 64, -0.3),
    (1, 3, 64, 5000, 2048, 128 ** -0.5),
    (1, 2, 64, 100, 4096, 0.1),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}S{}K{}".format(*c[:5]))
def test_indexer_loss_kernel_matches_the_oracle(case, dtype):
    _kernel_or_skip()
    from jax_dsa.cute import indexer_loss
    b, t, h, s, k, scale = case
    q, kk, w, idx, lengths, target, g = _problem(np.random.default_rng(h + k), b, t, h, s, k,
                                                 dtype)
    args = (jnp.asarray(q, dtype), jnp.asarray(kk, dtype), jnp.asarray(w), jnp.asarray(idx),
            jnp.asarray(lengths), jnp.asarray(target))
    kl, signal = indexer_loss.forward(*args, scale)
    dq, dk, dw = indexer_loss.backward(*args[:5], signal, jnp.asarray(g), scale)
    want_dq, want_dk, want_dw = indexer_loss_grads(q, kk, w, idx, lengths, target, g, scale)
    # dq, dk in the inputs' dtype: one rounding of an fp32-accurate result
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-3
    assert rel_err(dq, want_dq) < tol, rel_err(dq, want_dq)
    assert rel_err(dk, want_dk) < tol, rel_err(dk, want_dk)
    assert rel_err(dw, want_dw) < 1e-3, rel_err(dw, want_dw)
    np.testing.assert_array_equal(np.asarray(dq)[0, 0], 0)  # the dead token
    np.testing.assert_array_equal(np.asarray(dw)[0, 0], 0)
    listed = np.zeros((b, s), bool)  # rows of k no valid entry points at: exactly 0
    for bi in range(b):
        for ti in range(t):
            for j in range(lengths[bi, ti]):
                if 0 <= idx[bi, ti, j] < s:
                    listed[bi, idx[bi, ti, j]] = True
    np.testing.assert_array_equal(np.asarray(dk, np.float32)[~listed], 0)
    kl = np.asarray(kl)
    # the signal d KL / d score_j = p_j sum(target) - target_j (oracle in float64), exactly 0
    # at every invalid entry and past topk_length
    sig = np.asarray(signal)
    assert sig.shape == idx.shape
    want_sig = indexer_signal(q, kk, w, idx, lengths, target, scale)
    for bi in range(b):
        for ti in range(t):
            ok = [j for j in range(min(lengths[bi, ti], k)) if 0 <= idx[bi, ti, j] < s]
            rest = np.setdiff1d(np.arange(k), ok)
            np.testing.assert_array_equal(sig[bi, ti, rest], 0)
            if not ok:
                continue
            np.testing.assert_allclose(sig[bi, ti, ok], want_sig[bi, ti, ok], rtol=1e-3,
                                       atol=1e-5)
    want_kl = indexer_kl(q, kk, w, idx, lengths, target, scale)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-3, atol=1e-5)
    assert kl[0, 0] == 0  # the dead token


def test_public_indexer_loss_runs_the_kernels():
    """jax_dsa.indexer_loss (default and implementation="cute") on bf16 inputs: the KL and the
    gradients of sum_t g_t KL_t are the oracles'; deterministic=True (the reference's backward)
    agrees and repeats bitwise."""
    _kernel_or_skip()
    b, t, h, s, k, scale = 2, 7, 64, 3000, 512, 128 ** -0.5
    q, kk, w, idx, lengths, target, g = _problem(np.random.default_rng(21), b, t, h, s, k,
                                                 jnp.bfloat16)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(kk, jnp.bfloat16), jnp.asarray(w))

    def run(impl, deterministic=False):
        def f(q, k, w):
            kl = jax_dsa.indexer_loss(q, k, w, jnp.asarray(idx), jnp.asarray(target),
                                      scale=scale, topk_length=jnp.asarray(lengths),
                                      reduction="none", deterministic=deterministic,
                                      implementation=impl)
            return jnp.sum(jnp.asarray(g) * kl), kl
        (_, kl), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*args)
        return kl, grads

    want_dq, want_dk, want_dw = indexer_loss_grads(q, kk, w, idx, lengths, target, g, scale)
    want_kl = indexer_kl(q, kk, w, idx, lengths, target, scale)
    for impl, det in ((None, False), ("cute", False), ("cute", True)):
        kl, (dq, dk, dw) = run(impl, det)
        np.testing.assert_allclose(np.asarray(kl), want_kl, rtol=1e-3, atol=1e-5)
        assert rel_err(dq, want_dq) < 1e-2, (impl, det, rel_err(dq, want_dq))
        assert rel_err(dk, want_dk) < 1e-2, (impl, det, rel_err(dk, want_dk))
        assert rel_err(dw, want_dw) < 1e-3, (impl, det, rel_err(dw, want_dw))
    again = run("cute", True)[1][1]
    assert np.asarray(again).tobytes() == np.asarray(dk).tobytes()


def test_key_rows_no_valid_entry_selects_may_hold_nan():
    """Invalid entries read nothing: NaN in key rows that only invalid slots name leaves the KL
    and the gradients as with those rows finite, and their dk rows 0."""
    _kernel_or_skip()
    b, t, h, s, k = 1, 6, 64, 400, 256
    q, kk, w, idx, lengths, target, g = _problem(np.random.default_rng(5), b, t, h, s, k,
                                                 jnp.bfloat16)
    idx[idx == 0] = 1
    idx[0, 1, 0], lengths[0, 1] = 0, 0  # row 0: only past topk_length (and out of range)

    def run(keys):
        def f(q, k, w):
            kl = jax_dsa.indexer_loss(q, k, w, jnp.asarray(idx), jnp.asarray(target),
                                      topk_length=jnp.asarray(lengths), reduction="none",
                                      implementation="cute")
            return jnp.sum(jnp.asarray(g) * kl), kl
        args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(keys, jnp.bfloat16), jnp.asarray(w))
        (_, kl), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*args)
        return [np.asarray(x, np.float32) for x in (kl, *grads)]

    bad_keys = kk.copy()
    bad_keys[:, 0] = np.nan
    bad = run(bad_keys)
    for name, c, x in zip(("kl", "dq", "dk", "dweights"), run(kk), bad):
        assert not np.isnan(x).any(), f"{name}: NaN from a key row no valid entry names"
        assert rel_err(x, c) < 1e-2, name
    assert np.all(bad[2][:, 0] == 0), "dk of the unnamed row"
