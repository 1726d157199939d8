"""The Hopper backward kernel (dq, dkv) against the float64 oracle and the reference (GPU only)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import api
from cases import make_problem, rel_err
import oracle

pytestmark = pytest.mark.gpu

# (B, T, H, Dqk, S, K, sink, topk_length)
CASES = [
    (1, 8, 1, 512, 300, 1, False, "none"),
    (3, 4, 8, 576, 500, 200, True, "partial"),
    (1, 16, 16, 512, 4096, 640, True, "partial"),
    (2, 4, 24, 576, 700, 63, False, "full"),
    (1, 8, 64, 576, 2000, 640, True, "partial"),
    (2, 4, 100, 512, 900, 1152, True, "none"),
    (1, 4, 128, 576, 3000, 2048, True, "partial"),
    (1, 8, 128, 512, 100, 640, False, "partial"),  # many duplicates: K >> S
]


def _kernel_or_skip():
  from jax_dsa import _native
  problem = api.kernel_runtime_problem()
  if problem:
    pytest.skip(problem)
  if not _native.has_backward():
    pytest.skip("the library was built without the backward kernels")


def _grads(p, dtype, impl, w_o, w_lse):
  q, kv = jnp.asarray(p.q, dtype), jnp.asarray(p.kv, dtype)
  idx = jnp.asarray(p.idx)
  tl = None if p.topk_length is None else jnp.asarray(p.topk_length)

  def loss(q, kv, sink):
    o, lse = jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, return_lse=True,
                                implementation=impl)
    return (jnp.sum(o.astype(jnp.float32) * w_o)
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse))

  sink = None if p.sink is None else jnp.asarray(p.sink)
  argnums = (0, 1) if sink is None else (0, 1, 2)
  return q, kv, jax.jit(jax.grad(loss, argnums=argnums))(q, kv, sink)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}D{}S{}K{}{}-{}".format(
    *c[:6], "-sink" if c[6] else "", c[7]))
def test_backward_kernel_matches_oracle_and_reference(case):
  _kernel_or_skip()
  b, t, h, d, s, k, sink, topk = case
  rng = np.random.default_rng(abs(hash(case)) % 2**32)
  p = make_problem(rng, b, t, h, d, s, k, sink=sink, topk=topk)
  w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
  w_lse = rng.standard_normal((b, t, h)).astype(np.float32)
  q, kv, got = _grads(p, jnp.bfloat16, "cute", w_o, w_lse)
  _, _, ref = _grads(p, jnp.bfloat16, "xla", w_o, w_lse)
  want = oracle.dense_grads(np.asarray(q, np.float32), np.asarray(kv, np.float32), p.idx,
                            p.lengths, p.sink, p.scale, 512, w_o, w_lse)
  for name, g, r, w in zip(("dq", "dkv", "dsink"), got, ref, want):
    g = np.asarray(g, np.float32)
    assert np.all(np.isfinite(g)), name
    assert rel_err(g, w) < 2e-2, (name, "vs oracle", rel_err(g, w))
    assert rel_err(g, r) < 2e-2, (name, "vs reference", rel_err(g, r))
  np.testing.assert_array_equal(np.asarray(got[0], np.float32)[0, 0], 0.0)  # dead row


def test_backward_never_writes_outside_valid_rows():
  """Batches 0 and 2 select nothing, batch 1 lists -1, -S, S, S + 7 next to valid rows: a write
  at an invalid row of batch 1 would land in batch 0's last or batch 2's first rows (flat
  layout), which must stay exactly zero; rows of batch 1 never listed must stay zero too."""
  _kernel_or_skip()
  rng = np.random.default_rng(5)
  b, t, h, d, s, k = 3, 6, 24, 576, 40, 70
  p = make_problem(rng, b, t, h, d, s, k, sink=True, topk="full", dead_row=False)
  p.idx[1] = rng.integers(10, 30, (t, k))
  p.idx[1, :, ::3] = -1
  p.idx[1, :, 1::7] = s
  p.idx[1, :, 2::11] = s + 7
  p.idx[1, :, 4::13] = -s
  p.topk_length[0] = 0
  p.topk_length[2] = 0
  w_o = rng.standard_normal((b, t, h, 512)).astype(np.float32)
  _, _, (dq, dkv, _) = _grads(p, jnp.bfloat16, "cute", w_o, np.zeros((b, t, h), np.float32))
  dkv = np.asarray(dkv, np.float32)
  assert np.all(dkv[0] == 0) and np.all(dkv[2] == 0)
  untouched = np.setdiff1d(np.arange(s), p.idx[1][(p.idx[1] >= 0) & (p.idx[1] < s)])
  assert np.all(dkv[1, untouched] == 0) and np.any(dkv[1] != 0)
  assert np.all(np.asarray(dq, np.float32)[[0, 2]] == 0)
