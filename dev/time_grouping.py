#!/usr/bin/env python
"""Where the grouped backward's time goes (the default at H = 32, 16 and 8: G = 2, 4, 8): the
list union by XLA and by its kernel against the grouped kernel, on the benchmark's problem at that
H (T = S = 4096, window 128 + 512 picks).

    python tools/time_grouping.py [--heads 32|16|8]

Prints, median over replays (examples/benchmark.py's timer): the union alone by XLA
(jax_dsa.grouping.group_lists + pack_entries) and by its kernel (_native.group_union, which _core
uses unless JAX_DSA_GROUP_UNION=xla), the union kernel again as 20 dependent calls in one jitted
program (a single call is shorter than its dispatch), the grouped kernel alone on precomputed
packed lists (the FFI call of _core._grouped_kernel_backward), and the whole backward (vjp, as
the benchmark times it), plus how many 64-row blocks the union has against the plain lists.
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import benchmark  # noqa: E402
from jax_dsa import _core, _native, grouping  # noqa: E402

TOPK = 512


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--heads", type=int, default=16, choices=(32, 16, 8))
  H = ap.parse_args().heads
  GROUP = 64 // H
  q, kv, idx, sink, _ = benchmark.make_inputs(H, TOPK, 4096)
  b, t, h, d = q.shape
  s_rows, k = kv.shape[1], idx.shape[-1]
  if _core._backward_group(q.shape, k, s_rows, False) != GROUP:
    sys.exit(f"the backward does not group H={H} by {GROUP} here (JAX_DSA_BWD_IMPL set, or a "
             "library without the grouped kernels)")
  topk_length = jnp.full((b, t), k, jnp.int32)

  def union(idx, topk_length):
    rows, member, length = grouping.group_lists(idx, topk_length, s_rows, GROUP)
    return grouping.pack_entries(rows, member), length

  union_jit = jax.jit(union)
  packed, length = union_jit(idx, topk_length)
  t_union = benchmark.time_call(union_jit, (idx, topk_length), 5, 3)
  union_kernel = ""
  if _native.has_group_union():
    kernel_union = jax.jit(lambda i, l: _native.group_union(i, l, s_rows, GROUP))
    got, got_length = map(np.asarray, kernel_union(idx, topk_length))
    # The kernel's entries come in hash-slot order: compare each group's multiset.
    same = bool(np.array_equal(got_length, np.asarray(length))) and bool(
        np.array_equal(np.sort(got, axis=-1), np.sort(np.asarray(packed), axis=-1)))
    t_ku = benchmark.time_call(kernel_union, (idx, topk_length), 5, 3)

    @jax.jit
    def union_20(idx, topk_length):  # each call's input depends on the last one's output
      def body(_, carry):
        lengths, total = carry
        _, length = _native.group_union(idx, lengths, s_rows, GROUP)
        # total >= 0 always, but XLA cannot know: the next call waits for this one.
        return jnp.where(total < 0, 0, topk_length), jnp.sum(length)
      return jax.lax.fori_loop(0, 20, body, (topk_length, jnp.int32(0)))[1]

    t_k20 = benchmark.time_call(union_20, (idx, topk_length), 5, 3) / 20
    union_kernel = (f", union (kernel) {t_ku * 1e6:.0f} us, in a loop {t_k20 * 1e6:.1f} us "
                    f"(identical: {same})")

  fwd, bwd_args = benchmark.make_fn("cute", "bwd")
  vjp_fn, cot = bwd_args(q, kv, idx, sink)
  t_total = benchmark.time_call(fwd, (vjp_fn, cot), 5, 3)

  o, lse = jax_dsa_forward(q, kv, idx, sink)
  do = jax.random.normal(jax.random.PRNGKey(7), o.shape, jnp.float32).astype(o.dtype)
  coef = jnp.stack([jnp.full(lse.shape, 0.5, jnp.float32), jnp.zeros_like(lse)], axis=-1)
  n = t // GROUP

  def view(x):
    return x.reshape(b, n, GROUP * h, *x.shape[3:])

  def kernel(q, kv, packed, length, lse, do, o, coef):
    return _native.sparse_mla_bwd(view(q), kv, packed, length, view(lse), view(do), view(o),
                                  view(coef), scale=d ** -0.5, group=GROUP)

  kernel_jit = jax.jit(kernel)
  t_kernel = benchmark.time_call(kernel_jit, (q, kv, packed, length, lse, do, o, coef), 5, 3)
  blocks_union = int(np.sum(-(-np.asarray(length) // 64)))
  blocks_plain = b * t * (-(-k // 64))  # ceil(K / 64) blocks per token
  print(f"H={H} K={k} T=S={t}: union (XLA) {t_union * 1e6:.0f} us{union_kernel}, grouped kernel alone "
        f"{t_kernel * 1e6:.0f} us, whole backward {t_total * 1e6:.0f} us; "
        f"union blocks {blocks_union} (of {GROUP} tokens each) vs {blocks_plain} plain")


def jax_dsa_forward(q, kv, idx, sink):
  import jax_dsa
  return jax.jit(lambda q, kv, idx, sink: jax_dsa.sparse_mla(
      q, kv, idx, sink=sink, return_lse=True, implementation="cute"))(q, kv, idx, sink)


if __name__ == "__main__":
  main()
