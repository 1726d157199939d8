"""A small forward with invalid indices and an odd head count, to run under memcheck (GPU):

    compute-sanitizer --tool memcheck --leak-check no python tests/gpu_memcheck_case.py

XLA's own allocator is disabled (preallocation off, platform allocator) so that every buffer is
a separate cudaMalloc and out-of-bounds accesses past an output are caught.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_dsa  # noqa: E402

rng = np.random.default_rng(0)
for h, d in ((3, 576), (17, 512), (29, 512), (100, 576)):  # 29: NP 32, two consumers
    b, t, s, k = 2, 5, 37, 70
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.bfloat16)
    idx = rng.integers(-40, 80, (b, t, k)).astype(np.int32)  # many < 0 and >= S
    idx[0, 0] = -1
    tl = rng.integers(0, k + 1, (b, t)).astype(np.int32)
    o, lse = jax_dsa.sparse_mla(q, kv, jnp.asarray(idx), topk_length=jnp.asarray(tl),
                                sink=jnp.zeros(h), return_lse=True, implementation="cute")
    jax.block_until_ready((o, lse))
    assert not np.isnan(np.asarray(o, np.float32)).any()
    print(f"H={h} Dqk={d}: ok")
print("memcheck case done")

# The decode path: each token's list split into parts (ragged last part, parts past
# topk_length), by default (B = 4 tokens, H = 128, K = 600 -> 2 parts) and pinned (3 parts).
from jax_dsa.cute import BwdConfig, Config, FwdConfig  # noqa: E402
for h, d, splits, k in ((128, 576, None, 600), (100, 512, 3, 600), (17, 576, 3, 600),
                        (64, 512, 8, 5)):  # 8 parts of one entry, 3 of them empty
    b, s = 4, 37
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-40, 80, (b, 1, k)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, k + 1, (b, 1)).astype(np.int32))
    config = None if splits is None else Config(fwd=FwdConfig(
        "small_heads" if h <= 32 else "pingpong", splits))
    o = jax_dsa.sparse_mla(q, kv, idx, topk_length=tl, sink=jnp.zeros(h), implementation="cute",
                           config=config)
    assert not np.isnan(np.asarray(o, np.float32)).any()
    print(f"split H={h} Dqk={d} splits={splits}: ok")
print("split memcheck case done")

# The two-pool forward kernel: each pool's invalid entries on both sides of its range, partial
# lengths, pool 1's list not a multiple of 64, padded heads.
from jax_dsa.cute import ffi as cute_ffi  # noqa: E402
for h, d, k1 in ((100, 576, 100), (64, 512, 1)):
    b, t, s1, s2, k2 = 2, 5, 37, 23, 150
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    kv1 = jnp.asarray(rng.standard_normal((b, s1, d)), jnp.bfloat16)
    kv2 = jnp.asarray(rng.standard_normal((b, s2, d)), jnp.bfloat16)
    idx1 = jnp.asarray(rng.integers(-40, 80, (b, t, k1)).astype(np.int32))
    idx2 = jnp.asarray(rng.integers(-40, 80, (b, t, k2)).astype(np.int32))
    tl1 = jnp.asarray(rng.integers(0, k1 + 1, (b, t)).astype(np.int32))
    tl2 = jnp.asarray(rng.integers(0, k2 + 1, (b, t)).astype(np.int32))
    o, lse = cute_ffi.sparse_mla_fwd_two_pool(q, kv1, idx1, tl1, kv2, idx2, tl2, jnp.zeros(h),
                                              scale=d ** -0.5)
    assert not np.isnan(np.asarray(o, np.float32)).any()
    print(f"two pools H={h} Dqk={d} K1={k1}: ok")
print("two-pool memcheck case done")

# The two-pool backward kernel, called directly: a list over both pools' rows [0, S1 + S2) with
# entries on both sides of that range and at the boundary between the pools, partial lengths,
# padded heads, heads with and without a sink, B = 2 (pool 2's batch offset differs from pool
# 1's, and so does dsink's row). With S1 + S2 = 33000 the fp32 dkv passes LONG_DKV_MIN_BYTES:
# the `_long` builds, whose token pairs (H 65..128) run as 2-CTA clusters; fp16 too.
for h, d, s1, s2, dtype in ((100, 576, 37, 23, jnp.bfloat16), (64, 512, 37, 23, jnp.bfloat16),
                            (128, 576, 30000, 3000, jnp.bfloat16),
                            (100, 512, 30000, 3000, jnp.float16)):
    b, t, k = 2, 5, 150
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    kv1 = jnp.asarray(rng.standard_normal((b, s1, d)), dtype)
    kv2 = jnp.asarray(rng.standard_normal((b, s2, d)), dtype)
    idx = jnp.asarray(rng.integers(-40, s1 + s2 + 40, (b, t, k)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, k + 1, (b, t)).astype(np.int32))
    lse = jnp.asarray(rng.standard_normal((b, t, h)) + 5.0, jnp.float32)
    do = jnp.asarray(rng.standard_normal((b, t, h, 512)), dtype)
    o = jnp.asarray(rng.standard_normal((b, t, h, 512)), dtype)
    sink = jnp.asarray(np.where(np.arange(h) % 3 == 0, -np.inf, rng.standard_normal(h)),
                       jnp.float32)
    dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    dq, dkv, dsink = cute_ffi.sparse_mla_bwd_two_pool(q, kv1, kv2, idx, tl, lse, do, o, sink,
                                                      dlse, scale=d ** -0.5)
    assert dkv.shape == (b, s1 + s2, d) and np.isfinite(np.asarray(dkv)).all()
    assert dsink.shape == (b, h) and np.isfinite(np.asarray(dsink)).all()
    print(f"two-pool backward H={h} Dqk={d} S1+S2={s1 + s2} {jnp.dtype(dtype).name}: ok")
print("two-pool backward memcheck case done")

# Backward through the kernels on the same kind of problem, atomic and deterministic; H = 32, 16
# and 8 with T = 8 run grouped (the list-union kernel, then 2, 4 or 8 tokens per 64-row token).
for h, d, det, t in ((100, 576, False, 5), (100, 512, False, 5), (17, 512, False, 5),
                     (100, 576, True, 5), (3, 512, True, 5), (32, 576, False, 8),
                     (16, 512, False, 8), (8, 576, False, 8)):
    q = jnp.asarray(rng.standard_normal((2, t, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, 37, d)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-40, 80, (2, t, 70)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, 71, (2, t)).astype(np.int32))
    grads = jax.grad(lambda q, kv: jnp.sum(jax_dsa.sparse_mla(
        q, kv, idx, sink=jnp.zeros(h), topk_length=tl, implementation="cute",
        deterministic=det).astype(jnp.float32) ** 2), argnums=(0, 1))(q, kv)
    jax.block_until_ready(grads)
    print(f"backward H={h} Dqk={d} deterministic={det}: ok")
# dkv past LONG_DKV_MIN_BYTES: the long-context builds (plain and grouped), rows on both sides
# of [0, S); the plain ones sort each token's rows first by default (BwdConfig.sort_rows), the
# last bf16 one runs them as given; fp16 at H 100 (a token pair as one cluster)
bf, f16 = jnp.bfloat16, jnp.float16
for h, t, d, sort_rows, dtype in ((64, 5, 512, None, bf), (100, 3, 512, None, bf),
                                  (16, 8, 512, None, bf), (128, 3, 576, None, bf),
                                  (16, 8, 576, None, bf), (64, 5, 512, False, bf),
                                  (100, 3, 576, None, f16)):
    s = 33000
    config = None if sort_rows is None else Config(bwd=BwdConfig(sort_rows=sort_rows))
    q = jnp.asarray(rng.standard_normal((1, t, h, d)), dtype)
    kv = jnp.asarray(rng.standard_normal((1, s, d)), dtype)
    idx = jnp.asarray(rng.integers(-40, s + 40, (1, t, 70)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, 71, (1, t)).astype(np.int32))
    grads = jax.grad(lambda q, kv: jnp.sum(jax_dsa.sparse_mla(
        q, kv, idx, sink=jnp.zeros(h), topk_length=tl, implementation="cute",
        config=config).astype(jnp.float32) ** 2), argnums=(0, 1))(q, kv)
    jax.block_until_ready(grads)
    print(f"backward H={h} Dqk={d} S={s} sort_rows={sort_rows} {jnp.dtype(dtype).name} "
          "(long-context build): ok")
# the row-order kernel alone (the step before those backwards): rows on both sides of [0, S),
# lengths 0 .. K + 2, all ascending and with every other token's wave descending
for b, t, k, s, ctas in ((2, 5, 70, 33000, 0), (1, 3, 1, 7, 0), (1, 4, 3000, 500, 0),
                         (2, 300, 70, 33000, 2), (1, 9, 3000, 500, 1000)):
    idx = jnp.asarray(rng.integers(-40, s + 40, (b, t, k)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, k + 3, (b, t)).astype(np.int32))
    jax.block_until_ready(cute_ffi.rows_order(idx, tl, s, ctas))
    print(f"rows_order B={b} T={t} K={k} S={s} ctas_per_token={ctas}: ok")
print("backward memcheck case done")

# The indexer's score kernel: S not a multiple of the 256-row tile, Hi < 64, tokens before the
# causal edge, compressed rows; then the selection built on it.
for b, t, h, s, ratio, start in ((2, 37, 7, 300, 1, 250), (1, 70, 64, 513, 4, 1000),
                                  (1, 300, 16, 700, 1, 500)):
    q = jnp.asarray(rng.standard_normal((b, t, h, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    sc = jax_dsa.indexer_scores(q, k, w, ratio=ratio, start=start, implementation="cute")
    idx = jax_dsa.indexer_topk(q, k, w, 64, ratio=ratio, start=start, implementation="cute")
    jax.block_until_ready((sc, idx))
    assert not np.isnan(np.asarray(sc)).any()
    print(f"indexer B={b} T={t} Hi={h} S={s} ratio={ratio}: ok")
# The top-k kernel of each candidate-buffer size (the smallest that holds topk), on rows with
# more columns than topk, fewer, and one repeated value (the fallback passes).
from jax_dsa.cute import ffi as _ffi  # noqa: E402
for topk in (300, 1000, 2000, 4000):
    sc = rng.standard_normal((1, 4, 2 * topk + 300)).astype(np.float32)
    sc[0, 1, topk // 2:] = -np.inf
    sc[0, 2] = 0.5
    val, idx = jax.jit(_ffi.indexer_topk, static_argnums=1)(jnp.asarray(sc), topk)
    jax.block_until_ready((val, idx))
    print(f"indexer top-k {topk} over {sc.shape[-1]} columns: ok")
print("indexer memcheck case done")

# The attention-target kernel: padded heads, invalid entries (both sides of [0, S)), partial
# lists, K not a multiple of the 64-entry block.

for h, d in ((100, 576), (5, 512)):
    t, s = 6, 90
    q = jnp.asarray(rng.standard_normal((2, t, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, s, d)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-40, s + 40, (2, t, 70)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, 71, (2, t)).astype(np.int32))
    tg = jax_dsa.attention_target(q, kv, idx, sink=jnp.zeros(h), topk_length=tl,
                                  implementation="cute")
    jax.block_until_ready(tg)
    assert np.isfinite(np.asarray(tg)).all()
    print(f"target H={h} Dqk={d}: ok")
print("target memcheck case done")

# The indexer-loss kernels (the KL and its backward): Hi < 64, invalid entries on both sides of
# [0, S), partial lists, K not a multiple of the 64-entry block.
from jax_dsa.cute import indexer_loss  # noqa: E402

for h, k_, s in ((7, 70, 90), (64, 200, 3000)):
    t = 5
    q = jnp.asarray(rng.standard_normal((2, t, h, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, s, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, t, h)), jnp.float32)
    idx = jnp.asarray(rng.integers(-40, s + 40, (2, t, k_)).astype(np.int32))
    tl = jnp.asarray(rng.integers(0, k_ + 1, (2, t)).astype(np.int32))
    tgt = jnp.asarray(rng.random((2, t, k_)), jnp.float32)
    kl, signal = indexer_loss.forward(q, k, w, idx, tl, tgt, 0.1)
    grads = indexer_loss.backward(q, k, w, idx, tl, signal, jnp.ones((2, t), jnp.float32),
                                  0.1)
    jax.block_until_ready((grads, kl))
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in grads + (kl,))
    print(f"indexer loss H={h} K={k_} S={s}: ok")
print("indexer loss memcheck case done")
