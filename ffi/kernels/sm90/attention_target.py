"""The indexer's training target for sm_90a: each entry's attention mass summed over a block of
64 heads, from q, kv and the forward's log-sum-exp (no [B, T, H, K] array in HBM).

    mass[b, t, hb, j] = sum_{h in head block hb} exp(scale * q[b, t, h] . kv[b, idx[b, t, j]]
                                                      - off[b, t, h])
                        (0 for invalid entries: j >= min(K, topk_length), idx < 0, idx >= S)

with off = logaddexp(lse, sink) (+inf for dead heads: every term 0), so that each term is
sparse_mla's probability p[b, t, h, j] with the sink in its denominator. jax_dsa/cute/target.py
computes off, sums the head blocks and normalises over the entries.

Layouts (flattened row-major): q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,) int32,
topk_length (B*T,) int32, off (B*T*H,) float32, mass (B*T*n_hb*K,) float32 with
n_hb = ceil(H / 64); every element of mass is written.

Two variants (`heads`), one CTA per SM each:
- 64 heads per CTA (H <= 64): one CTA per token and 64-head block (a token's head blocks
  adjacent), one warpgroup. Q's 64 head rows stay in shared memory (the A operand, SS wgmma);
  the list is walked in blocks of BN = 64 entries through a two-stage ring (the gather of block
  n + 1 under block n's GEMM and epilogue). Shared memory: Q + 2 stages, 216 KB at Dqk 576.
- 128 heads per CTA (64 < H <= 128): one CTA per token, two warpgroups of 64 heads, so that
  each row is gathered once for all the token's heads. Q passes through shared memory into
  registers (A from registers, RS wgmma), leaving shared memory to a ring of six stages of
  BN = 32 entries that all threads fill five blocks ahead. Shared memory: the ring, 192 / 216
  KB at Dqk 512 / 576.
Each warpgroup computes S = Q K^T for its 64 heads (wgmma 64 x BN x 16, B = the gathered rows,
K-major with the 128-byte swizzle in shared memory, Dqk / 16 k-steps). Gathers: 16-byte
cp.async, 8 threads per row; invalid entries are zero-filled rows that read nothing; heads >= H
are zero rows of Q, never read from global. Epilogue: p = exp2(S scale log2(e) - off log2(e)),
masked to the valid entries, summed over each thread's two head rows, across the 8 lanes that
hold the same columns (shuffles) and across the warpgroup's 4 warps (shared memory); one store
per entry and head block.

Entry point: compile_attention_target(dtype, d_qk, heads); ffi/build.py exports it as
jax_dsa_attention_target_h<heads>_<dtype>_d<Dqk> (ffi/attention_target.cc picks by H).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from .common import (LOG2_E, ROW_COPY_THREADS as WG_THREADS, ROW_COPY_TPR as TPR,
                     acc_mn_view, gather_rows_sw128, head_sums, load_rows_sw128)

BM = 64  # heads per warpgroup
# heads per CTA -> (entries per block BN, ring stages NSTAGE, Q in registers); gathers run
# NSTAGE - 1 blocks ahead (docs/kernel_log.md, 2026-12-02 third session, for the measurements).
VARIANTS = {64: (64, 2, False), 128: (32, 6, True)}


class AttentionTargetSm90:
    def __init__(self, dtype, d_qk: int, heads: int = 64):
        assert d_qk in (512, 576) and heads in (64, 128)
        self.dtype = dtype
        self.d_qk = d_qk
        self.wgs = heads // BM  # warpgroups per CTA, one per 64 heads
        self.threads = WG_THREADS * self.wgs
        self.bn, self.nstage, self.q_regs = VARIANTS[heads]
        self.q_bytes = BM * d_qk * 2  # one warpgroup's Q tile
        self.stage_bytes = self.bn * d_qk * 2  # one ring stage
        # Q in registers passes through the ring
        assert not self.q_regs or self.wgs * self.q_bytes <= self.nstage * self.stage_bytes

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
                 mOff: cute.Tensor, mMass: cute.Tensor, B: cutlass.Int32, T: cutlass.Int32,
                 H: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        BN, NSTAGE = self.bn, self.nstage
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                 self.dtype)
        q_layout = cute.tile_to_shape(k_atom, (BM, self.d_qk), (0, 1))
        kv_layout = cute.tile_to_shape(k_atom, (BN, self.d_qk), (0, 1))

        @cute.struct
        class Ring:
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, NSTAGE * BN * self.d_qk],
                                   1024]
            sPart: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * self.wgs * BN],
                                     16]
            sRow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, NSTAGE * BN], 16]

        @cute.struct
        class QAndRing:  # Q's own tiles first
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, self.wgs * BM * self.d_qk],
                                  1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, NSTAGE * BN * self.d_qk],
                                   1024]
            sPart: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * self.wgs * BN],
                                     16]
            sRow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, NSTAGE * BN], 16]

        SharedStorage = Ring if self.q_regs else QAndRing
        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (BM, BN),
            warpgroup.OperandSource.RMEM if self.q_regs else warpgroup.OperandSource.SMEM)
        n_hb = (H + BM - 1) // BM
        self.kernel(mQ, mKV, mIdx, mLen, mOff, mMass, T, H, S, K, n_hb, scale, k_atom.inner,
                    q_layout.outer, kv_layout.outer, mma, SharedStorage).launch(
            grid=[B * T * (n_hb // self.wgs), 1, 1], block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
               mOff: cute.Tensor, mMass: cute.Tensor, T: cutlass.Int32, H: cutlass.Int32,
               S: cutlass.Int32, K: cutlass.Int32, n_hb: cutlass.Int32, scale: cutlass.Float32,
               swz: cute.Swizzle, q_layout: cute.Layout, kv_layout: cute.Layout,
               mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        BN, NSTAGE = self.bn, self.nstage
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wg = 0  # this thread's warpgroup, and the thread within it
        wtid = tidx
        hb = cta % n_hb
        bt32 = cta // n_hb
        if cutlass.const_expr(self.wgs > 1):  # n_hb = 2: one CTA per token
            wg = tidx // WG_THREADS
            wtid = tidx % WG_THREADS
            hb = wg
            bt32 = cta
        bt = cutlass.Int64(bt32)
        b = bt32 // T
        h0 = hb * BM
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + BN - 1) // BN
        idx_base = bt * cutlass.Int64(K)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)
        mass_base = (bt * cutlass.Int64(n_hb) + cutlass.Int64(hb)) * cutlass.Int64(K)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sPart = cute.make_tensor(storage.sPart.data_ptr() + wg * (4 * BN),
                                 cute.make_layout(4 * BN))
        sRow = storage.sRow.get_tensor(cute.make_layout(NSTAGE * BN))
        kv_smem = storage.sKV.data_ptr().toint()

        # ---- slots past the blocks the list fills: zero ----
        for j in cutlass.range(n_blocks * BN + wtid, K, WG_THREADS, unroll=1):
            mMass[mass_base + cutlass.Int64(j)] = cutlass.Float32(0.0)

        # ---- the warpgroup's 64 head rows of Q (heads >= H: zeros, nothing read): in Q's
        # tiles, or through the ring's memory into registers ----
        q_smem = kv_smem if cutlass.const_expr(self.q_regs) else storage.sQ.data_ptr().toint()
        load_rows_sw128(mQ.iterator.toint(), bt * cutlass.Int64(H) + cutlass.Int64(h0), H - h0,
                        q_smem + wg * self.q_bytes, wtid // TPR, wtid % TPR, BM,
                        self.d_qk * 2)
        if cutlass.const_expr(self.q_regs):
            cute.arch.cp_async_commit_group()
        thr = mma.get_slice(wtid)
        tScS = acc_mn_view(thr.partition_C(cute.make_identity_tensor((BM, BN))))
        scale_log2 = scale * LOG2_E
        off_r = cute.make_rmem_tensor(2, cutlass.Float32)  # off in log2 units (+inf: no head)
        for r in cutlass.range_constexpr(2):
            h = h0 + tScS[r, 0][0]
            v = cutlass.Float32.inf
            if h < H:
                v = mOff[bt * cutlass.Int64(H) + cutlass.Int64(h)] * LOG2_E
            off_r[r] = v
        if cutlass.const_expr(self.q_regs):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            sQ = cute.make_tensor(
                cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
                + cute.assume(wg * (BM * self.d_qk), divby=4096), q_layout)
            tSrQ = cute.make_rmem_tensor(thr.partition_shape_A((BM, self.d_qk)), self.dtype)
            cute.autovec_copy(thr.partition_A(sQ), tSrQ)
            cute.arch.barrier()  # every Q read before the ring's gathers overwrite it

        # ---- the ring: every thread of the CTA gathers, NSTAGE - 1 blocks ahead (Q's copies
        # in the first group when Q stays in shared memory) ----
        row = tidx // TPR
        sub = tidx % TPR
        kv_addr = mKV.iterator.toint()
        for p in cutlass.range_constexpr(NSTAGE - 1):
            if p < n_blocks:
                gather_rows_sw128(mIdx, kv_addr, kv_smem + p * self.stage_bytes, sRow, p, p,
                                  k_eff, idx_base, kv_batch, S, row, sub, BN, self.d_qk * 2,
                                  self.threads)
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(not self.q_regs):
            q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
            sQ = cute.make_tensor(q_sw + cute.assume(wg * (BM * self.d_qk), divby=4096),
                                  q_layout)
            tSrQ = thr.make_fragment_A(thr.partition_A(sQ))
        kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
        stage_align = 4096 if (BN * self.d_qk) % 4096 == 0 else 1024
        acc = thr.make_fragment_C(thr.partition_shape_C((BM, BN)))
        S_mn = acc_mn_view(acc)
        nc = cute.size(S_mn, mode=[1])
        vals = cute.make_rmem_tensor(nc, cutlass.Float32)
        for blk in cutlass.range(n_blocks, unroll=1):
            st = blk % NSTAGE
            # Block blk + NSTAGE - 1's gather into the stage block blk - 1's GEMMs read (every
            # warp waited for them before the previous iteration's last barrier).
            ahead = blk + NSTAGE - 1
            if ahead < n_blocks:
                # (1 - st) = ahead % 2: the two-stage form, as the 64-head kernel was validated
                sa = (1 - st) if cutlass.const_expr(NSTAGE == 2) else ahead % NSTAGE
                gather_rows_sw128(mIdx, kv_addr, kv_smem + sa * self.stage_bytes, sRow, sa,
                                  ahead, k_eff, idx_base, kv_batch, S, row, sub, BN,
                                  self.d_qk * 2, self.threads)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(NSTAGE - 1)  # this thread's copies of block blk
            # cp.async writes (generic proxy) -> wgmma reads (async proxy), then all threads'.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier()

            sK = cute.make_tensor(kv_sw + cute.assume(st * (BN * self.d_qk), divby=stage_align),
                                  kv_layout)
            tSrK = thr.make_fragment_B(thr.partition_B(sK))
            warpgroup.fence()
            for kk in cutlass.range_constexpr(self.d_qk // 16):
                mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
                cute.gemm(mma, acc, tSrQ[None, None, kk], tSrK[None, None, kk], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # p summed over the thread's two rows, then over the warpgroup's heads (head_sums;
            # its barrier is the whole CTA's)
            for c in cutlass.range_constexpr(nc):
                a = cute.math.exp2(S_mn[0, c] * scale_log2 - off_r[0], fastmath=True)
                a = a + cute.math.exp2(S_mn[1, c] * scale_log2 - off_r[1], fastmath=True)
                vals[c] = cutlass.select_(sRow[st * BN + tScS[0, c][1]] >= 0, a,
                                          cutlass.Float32(0.0))
            tot = head_sums(vals, tScS, sPart, wtid, BN)
            j = blk * BN + wtid
            if wtid < BN and j < K:
                mMass[mass_base + cutlass.Int64(j)] = tot
        cute.arch.cp_async_wait_group(0)


def fake_args(dtype, d_qk: int):
    """q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,), topk_length (B*T,), off (B*T*H,) f32,
    mass (B*T*n_hb*K,) f32, then B, T, H, S, K, scale and the stream."""
    rows_q, rows_kv, n_idx, n_tok, n_mass = (cute.sym_int64() for _ in range(5))
    i32 = cutlass.Int32(1)
    return (
        make_fake_compact_tensor(dtype, (rows_q, d_qk), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(dtype, (rows_kv, d_qk), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Float32, (rows_q,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Float32, (n_mass,), assumed_align=4),
        i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream(),
    )


def compile_attention_target(dtype, d_qk: int, heads: int = 64):
    """Compile with shape-only tensors (fake_args); heads: 64 or 128 per CTA."""
    return cute.compile(AttentionTargetSm90(dtype, d_qk, heads), *fake_args(dtype, d_qk))
