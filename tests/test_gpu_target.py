"""The Hopper attention-target kernel (jax_dsa.cute.target, ffi/kernels/sm90/attention_target.py)
against the float64 oracle (GPU only), through jax_dsa.attention_target(implementation="cute")
and directly with its output poisoned (NaN-filled before the launch), so an element it fails to
write shows."""
import dataclasses

import numpy as np
import pytest

import jax.numpy as jnp

import jax_dsa
from cases import make_problem, rel_err
from oracle import attention_target as oracle_target

pytestmark = pytest.mark.gpu


def _kernel_or_skip():
    from jax_dsa.cute import target
    problem = target.shape_problem(jnp.zeros((1, 1, 1, 512), jnp.bfloat16),
                                   jnp.zeros((1, 1, 512), jnp.bfloat16))
    if problem:
        pytest.skip(problem)


# (B, T, H, Dqk, S, K, sink, topk): heads below, at and above one 64-head block (padded heads),
# K not a multiple of the 64-entry block, partial lists, lists longer than S, and lists of more
# than the kernel's 8 blocks of row flags (K 700: 11 blocks, the flag ring wraps).
CASES = [
    (1, 6, 3, 512, 300, 100, False, "none"),
    (2, 5, 64, 576, 200, 64, True, "partial"),
    (1, 4, 100, 512, 1000, 300, True, "partial"),
    (1, 3, 128, 576, 150, 257, False, "full"),
    (2, 3, 17, 576, 40, 130, True, "none"),
    (1, 4, 128, 576, 900, 700, True, "partial"),
    (1, 3, 64, 512, 2000, 700, False, "full"),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}".format(*c[:6]))
def test_target_kernel_matches_the_oracle(case, dtype):
    _kernel_or_skip()
    from jax_dsa.cute import target
    b, t, h, d, s, k, sink, topk = case
    p = make_problem(np.random.default_rng(h * 1000 + k), b, t, h, d, s, k, sink=sink,
                     topk=topk)
    # The oracle sees the inputs as the kernel does (rounded to dtype).
    q = np.asarray(jnp.asarray(p.q, dtype).astype(jnp.float32))
    kv = np.asarray(jnp.asarray(p.kv, dtype).astype(jnp.float32))
    p = dataclasses.replace(p, q=q, kv=kv)
    tl = None if p.topk_length is None else jnp.asarray(p.topk_length)
    sink_arg = None if p.sink is None else jnp.asarray(p.sink)
    args = (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(p.idx))
    kw = dict(scale=p.scale, sink=sink_arg, topk_length=tl)
    got = np.asarray(jax_dsa.attention_target(*args, **kw, implementation="cute"))
    want = oracle_target(p, p.scale)
    assert np.all(np.isfinite(got))
    assert rel_err(got, want) < 2e-4, rel_err(got, want)
    np.testing.assert_array_equal(got[0, 0], 0.0)  # the dead token
    assert np.asarray(jax_dsa.attention_target(*args, **kw)).tobytes() == got.tobytes()  # default
    # The kernel itself, its output poisoned: every element written, the same masses.
    from jax_dsa.training import offsets
    _, lse = jax_dsa.sparse_mla(*args, **kw, return_lse=True)
    sink_c = jnp.full((h,), -jnp.inf) if sink_arg is None else sink_arg
    tl_c = jnp.full((b, t), k, jnp.int32) if tl is None else tl
    off = offsets(lse, sink_c)
    mass = [np.asarray(target.mass(*args, tl_c, off, p.scale, poison_outputs=poison))
            for poison in (True, False)]
    assert np.all(np.isfinite(mass[0]))
    np.testing.assert_array_equal(mass[0], mass[1])
    # The public reference on the same inputs (float32) agrees as closely.
    ref = np.asarray(jax_dsa.attention_target(jnp.asarray(q), jnp.asarray(kv),
                                              jnp.asarray(p.idx), **kw))
    assert rel_err(got, ref) < 2e-4


def test_target_kernel_with_the_forward_kernels_lse():
    """lse given (from the forward kernel) or computed inside: the same target."""
    _kernel_or_skip()
    p = make_problem(np.random.default_rng(5), 1, 8, 128, 576, 500, 200, sink=True,
                     topk="partial")
    q, kv = jnp.asarray(p.q, jnp.bfloat16), jnp.asarray(p.kv, jnp.bfloat16)
    idx, tl, sink = jnp.asarray(p.idx), jnp.asarray(p.topk_length), jnp.asarray(p.sink)
    _, lse = jax_dsa.sparse_mla(q, kv, idx, scale=p.scale, sink=sink, topk_length=tl,
                                return_lse=True)
    a = jax_dsa.attention_target(q, kv, idx, scale=p.scale, sink=sink, topk_length=tl, lse=lse,
                                 implementation="cute")
    b = jax_dsa.attention_target(q, kv, idx, scale=p.scale, sink=sink, topk_length=tl,
                                 implementation="cute")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
