"""The indexer loss for sm_90a: the per-token KL(target || softmax_j score_j) and each entry's
gradient signal (forward), and dq, dweights and dk from the signal (backward), from q, k, w and
the selection (no [B, T, Hi, K] array in HBM).

    a[h, j]  = scale * q[b, t, h] . k[b, idx_j]          score_j = sum_h w_h ReLU(a[h, j])
    signal_j = p_j sum_i target_i - target_j             p = softmax over the valid entries
    dw_h     = g_t sum_j signal_j ReLU(a[h, j])          (g_t: the KL's cotangent)
    dd[h, j] = g_t scale [a[h, j] > 0] signal_j w_h
    dq[h]    = sum_j dd[h, j] k[idx_j]                   dk[idx_j] += sum_h dd[h, j] q[h]

An entry is valid when j < min(K, topk_length) and 0 <= idx_j < S; invalid entries take no
part and their rows of k are never read or written. Layouts (flattened row-major): q
(B*T*Hi, 128), k (B*S, 128), w (B*T*Hi,) f32, idx (B*T*K,) int32, topk_length (B*T,) int32,
target and signal (B*T*K,) f32, kl and g (B*T,) f32; backward outputs dq (B*T*Hi*128,) f32, dw
(B*T*Hi,) f32 and dk (B*S, 128) f32, which the kernel adds to (the handler zero-fills it).

Grid (B*T): one CTA per token, 128 threads = one warpgroup; K <= INDEXER_LOSS_MAX_K. Q (the
token's Hi <= 64 head rows, zero rows above Hi) goes to shared memory once; the list is walked
once in blocks of 64 entries, each block's rows of k gathered by 16-byte cp.async through a
two-stage ring (invalid entries: zero rows that read nothing).
  * Forward (IndexerLossFwdSm90): S = Q K^T (wgmma 64 x 64 x 16), score_j summed over the heads
    (each thread's two rows, the 8 lanes holding the same columns, the 4 warps through shared
    memory) into a shared-memory row of K scores (-inf at invalid entries); then the softmax
    statistics (block reductions), the token's KL and the signal of all K slots.
  * Backward (IndexerLossBwdSm90): the token's signal row is copied into shared memory with
    Q (no scores, no softmax: the forward's signal carries them); per block, S again, dw in
    registers, dd rounded once to the inputs' dtype into a shared-memory tile (as the
    attention backward rounds dS), dq += dd K_blk (A = the dd tile, B = an MN-major view of
    the gathered rows) in registers for the whole list, and drow = dd^T Q (A = an MN-major
    view of the dd tile, B = an MN-major view of Q) staged in shared memory (rows of 544 B)
    and added to dk[idx_j] by one 512-byte bulk reduction per valid entry
    (cp.reduce.async.bulk add.f32, issued by thread j of the block, never at an invalid
    entry; whole rows: narrow REDs straight from the accumulator, 32 bytes of 8 rows per
    warp instruction, bound the kernel), waited for before the next block rewrites the
    staging tile.
Shared memory: Q 16 KB + 2 x 16 KB ring + 4 x K bytes of scores or signal (+ the backward's
8 KB dd tile and 34 KB dk staging: ~106 KB at K = 4096, two CTAs per SM).

Entry points: compile_indexer_loss_fwd(dtype) / compile_indexer_loss_bwd(dtype); ffi/build.py
exports them as jax_dsa_indexer_loss_{fwd,bwd}_<dtype> (ffi/indexer_loss.cc).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from jax_dsa.cute.constants import INDEXER_DIM as D, INDEXER_LOSS_MAX_K as KMAX
from .common import (LN_2, LOG2_E, ROW_COPY_THREADS as THREADS, ROW_COPY_TPR as TPR,
                     acc_mn_view, bulk_commit_group, bulk_reduce_add_f32_if, bulk_wait_group,
                     cp_async_4_zfill, gather_rows_sw128, head_sums, load_rows_sw128)

BM = 64  # head rows (Hi <= 64, padded)
BN = 64  # entries per block
TILE_BYTES = BN * D * 2  # one 64-row tile of k (or of Q): 16 KB
DK_LD = D + 8  # floats per row of the dk staging tile (544 B: two-way bank conflicts at most)


class IndexerLossBwdSm90:
    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor,
                 mLen: cute.Tensor, mSig: cute.Tensor, mG: cute.Tensor, mDQ: cute.Tensor,
                 mDW: cute.Tensor, mDK: cute.Tensor, B: cutlass.Int32, T: cutlass.Int32,
                 Hi: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        dt = self.dtype
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        # K-major tiles: Q and a block of k (64 rows x 128), dd (64 heads x 64 entries).
        row_layout = cute.tile_to_shape(k_atom, (BM, D), (0, 1))
        dd_layout = cute.tile_to_shape(k_atom, (BM, BN), (0, 1))
        # MN-major views of the same bytes: (the contiguous dim, the rows).
        rowt_layout = cute.tile_to_shape(mn_atom, (D, BN), (1, 0))  # 128 x 64
        ddt_layout = cute.tile_to_shape(mn_atom, (BN, BM), (1, 0))  # 64 x 64

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, BM * D], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, 2 * BN * D], 1024]
            sDD: cute.struct.Align[cute.struct.MemRange[dt, BM * BN], 1024]
            sScore: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, KMAX], 16]
            sRow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * BN], 16]
            sDK: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BN * DK_LD], 128]

        self.kernel(mQ, mK, mW, mIdx, mLen, mSig, mG, mDQ, mDW, mDK, T, Hi, S, K, scale,
                    k_atom.inner, row_layout.outer, dd_layout.outer, rowt_layout.outer,
                    ddt_layout.outer, SharedStorage).launch(
            grid=[B * T, 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor,
               mLen: cute.Tensor, mSig: cute.Tensor, mG: cute.Tensor, mDQ: cute.Tensor,
               mDW: cute.Tensor, mDK: cute.Tensor, T: cutlass.Int32, Hi: cutlass.Int32,
               S: cutlass.Int32, K: cutlass.Int32, scale: cutlass.Float32, swz: cute.Swizzle,
               row_layout: cute.Layout, dd_layout: cute.Layout, rowt_layout: cute.Layout,
               ddt_layout: cute.Layout, SharedStorage: cutlass.Constexpr):
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bt32, _, _ = cute.arch.block_idx()
        bt = cutlass.Int64(bt32)
        b = bt32 // T
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + BN - 1) // BN
        idx_base = bt * cutlass.Int64(K)
        k_batch = cutlass.Int64(b) * cutlass.Int64(S)
        g = mG[bt]

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sScore = storage.sScore.get_tensor(cute.make_layout(KMAX))
        sRow = storage.sRow.get_tensor(cute.make_layout(2 * BN))
        q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
        k_sw = cute.recast_ptr(storage.sK.data_ptr(), swizzle_=swz)
        dd_sw = cute.recast_ptr(storage.sDD.data_ptr(), swizzle_=swz)
        k_smem = storage.sK.data_ptr().toint()

        row = tidx // TPR
        sub = tidx % TPR
        thr_s = self._mma("s").get_slice(tidx)
        tScS = acc_mn_view(thr_s.partition_C(cute.make_identity_tensor((BM, BN))))
        nc = cute.size(tScS, mode=[1])
        k_addr = mK.iterator.toint()
        n_pad = n_blocks * BN
        # ---- Q, the head weights, the signal row (into sScore, zeros past the list; the
        # forward wrote 0 at its invalid entries) and block 0's gather, all by cp.async ----
        w_r = self._token_start(mQ, mW, bt, Hi, storage.sQ.data_ptr().toint(), tScS, tidx)
        coef = cute.make_rmem_tensor(2, cutlass.Float32)  # dd = [a > 0] signal_j coef_h
        for r in cutlass.range_constexpr(2):
            coef[r] = g * scale * w_r[r]
        sig_addr = mSig.iterator.toint() + idx_base * 4
        score_smem = storage.sScore.data_ptr().toint()
        for j in cutlass.range(tidx, n_pad, THREADS, unroll=1):
            ok = j < k_eff
            cp_async_4_zfill(score_smem + j * 4,
                             sig_addr + cutlass.Int64(cutlass.select_(ok, j, 0)) * 4,
                             cutlass.Int32(cutlass.select_(ok, 4, 0)))
        self._first_block(mIdx, k_addr, k_smem, sRow, n_blocks, k_eff, idx_base, k_batch, S,
                          row, sub)  # (its group holds the signal's copies)

        # ---- one pass over the list: dw, dq and dk ----
        thr_dq = self._mma("dq").get_slice(tidx)
        thr_dk = self._mma("dk").get_slice(tidx)
        sDD = cute.make_tensor(dd_sw, dd_layout)
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((BM, D)))
        acc_dq.fill(0.0)
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt),
                                     self._mma("s")).get_slice(tidx)
        tCcK = acc_mn_view(thr_dk.partition_C(cute.make_identity_tensor((BN, D))))
        dw_acc = cute.make_rmem_tensor(2, cutlass.Float32)
        dw_acc.fill(0.0)
        dk_addr = mDK.iterator.toint()
        sDK = storage.sDK.get_tensor(cute.make_layout(BN * DK_LD))
        dk_smem = storage.sDK.data_ptr().toint()

        for blk in cutlass.range(n_blocks, unroll=1):
            st = blk % 2
            acc = self._scores_block(mIdx, k_addr, k_smem, sRow, blk, n_blocks, k_eff,
                                     idx_base, k_batch, S, row, sub, q_sw, k_sw, row_layout,
                                     tidx)
            S_mn = acc_mn_view(acc)
            for c in cutlass.range_constexpr(nc):
                sg = sScore[blk * BN + tScS[0, c][1]]
                for r in cutlass.range_constexpr(2):
                    a = S_mn[r, c] * scale
                    dw_acc[r] = dw_acc[r] + sg * cute.arch.fmax(a, 0.0)
                    S_mn[r, c] = cutlass.Float32(cutlass.select_(
                        a > 0.0, sg * coef[r], cutlass.Float32(0.0)))
            r_dd = cute.make_fragment_like(acc, dt)
            r_dd.store(acc.load().to(dt))
            cute.copy(r2s, r2s.retile(r_dd), r2s.partition_D(sDD))
            cute.arch.fence_proxy("async.shared", space="cta")
            if tidx < BN:  # the previous block's dk reductions have read the staging tile
                bulk_wait_group(0, True)
            cute.arch.barrier()

            # dq += dd K_blk; drow = dd^T Q (tiled MMAs of this iteration: their accumulate
            # flags are set inside the loop)
            dq_mma = self._mma("dq")
            dk_mma = self._mma("dk")
            tq = dq_mma.get_slice(tidx)
            tk = dk_mma.get_slice(tidx)
            tQrDD = tq.make_fragment_A(tq.partition_A(sDD))
            sKt = cute.make_tensor(k_sw + cute.assume(st * (BN * D), divby=4096), rowt_layout)
            tQrK = tq.make_fragment_B(tq.partition_B(sKt))
            tKrDD = tk.make_fragment_A(tk.partition_A(cute.make_tensor(dd_sw, ddt_layout)))
            tKrQ = tk.make_fragment_B(tk.partition_B(cute.make_tensor(q_sw, rowt_layout)))
            acc_dk = tk.make_fragment_C(tk.partition_shape_C((BN, D)))
            warpgroup.fence()
            dq_mma.set(warpgroup.Field.ACCUMULATE, True)
            for kk in cutlass.range_constexpr(BN // 16):
                cute.gemm(dq_mma, acc_dq, tQrDD[None, None, kk], tQrK[None, None, kk], acc_dq)
            for kk in cutlass.range_constexpr(BM // 16):
                dk_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
                cute.gemm(dk_mma, acc_dk, tKrDD[None, None, kk], tKrQ[None, None, kk], acc_dk)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # dk[idx_j] += drow_j: the rows staged in shared memory, then one 512-byte bulk
            # reduction per valid entry (thread j < 64 issues entry j's; never at an invalid one)
            K_mn = acc_mn_view(acc_dk)
            for r in cutlass.range_constexpr(cute.size(tCcK, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(tCcK, mode=[1])):
                    sDK[tCcK[r, c][0] * DK_LD + tCcK[r, c][1]] = K_mn[r, c]
            cute.arch.fence_proxy("async.shared", space="cta")
            entry = cutlass.Int32(-1)
            if tidx < BN:
                entry = sRow[st * BN + tidx]
            cute.arch.barrier()  # the staging tile is written; the dd tile, the stage, sRow free
            if tidx < BN:
                bulk_reduce_add_f32_if(
                    cutlass.Int32(entry >= 0),
                    dk_addr + (k_batch + cutlass.Int64(cutlass.max(entry, 0))) * (D * 4),
                    dk_smem + tidx * (DK_LD * 4), D * 4)
                bulk_commit_group()
        cute.arch.cp_async_wait_group(0)
        if tidx < BN:
            bulk_wait_group(0, False)

        # ---- dw (the quad's four partial sums) and dq ----
        for r in cutlass.range_constexpr(2):
            v = dw_acc[r]
            v = v + cute.arch.shuffle_sync_bfly(v, offset=2)
            v = v + cute.arch.shuffle_sync_bfly(v, offset=1)
            h = tScS[r, 0][0]
            if tidx % 4 == 0 and h < Hi:
                mDW[bt * cutlass.Int64(Hi) + cutlass.Int64(h)] = g * v
        tCcQ = acc_mn_view(thr_dq.partition_C(cute.make_identity_tensor((BM, D))))
        Q_mn = acc_mn_view(acc_dq)
        for r in cutlass.range_constexpr(cute.size(tCcQ, mode=[0])):
            h = tCcQ[r, 0][0]
            if h < Hi:
                out = (bt * cutlass.Int64(Hi) + cutlass.Int64(h)) * cutlass.Int64(D)
                for c in cutlass.range_constexpr(cute.size(tCcQ, mode=[1])):
                    mDQ[out + cutlass.Int64(tCcQ[r, c][1])] = Q_mn[r, c]

    @cute.jit
    def _row_softmax(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor,
                     mIdx: cute.Tensor, mTarget: cute.Tensor, bt: cutlass.Int64,
                     Hi: cutlass.Int32, S: cutlass.Int32, k_eff: cutlass.Int32, n_blocks,
                     idx_base: cutlass.Int64, k_batch: cutlass.Int64, scale: cutlass.Float32,
                     q_smem: cutlass.Int32, k_smem: cutlass.Int32, q_sw, k_sw,
                     sScore: cute.Tensor, sPart: cute.Tensor, sRed: cute.Tensor,
                     sRow: cute.Tensor, row_layout: cute.Layout, tidx):
        """Q to shared memory, pass 1 (sScore: the valid entries' scores, -inf at the others,
        up to n_blocks * 64) and the row's softmax statistics: (w of the thread's two head
        rows, the max m (0 when no entry is valid), z = sum exp(score - m), the targets' sum
        over the valid entries)."""
        row = tidx // TPR
        sub = tidx % TPR
        thr_s = self._mma("s").get_slice(tidx)
        tScS = acc_mn_view(thr_s.partition_C(cute.make_identity_tensor((BM, BN))))
        nc = cute.size(tScS, mode=[1])
        vals = cute.make_rmem_tensor(nc, cutlass.Float32)
        w_r = self._token_start(mQ, mW, bt, Hi, q_smem, tScS, tidx)
        k_addr = mK.iterator.toint()

        # ---- pass 1: the scores of the valid entries ----
        self._first_block(mIdx, k_addr, k_smem, sRow, n_blocks, k_eff, idx_base, k_batch, S,
                          row, sub)
        for blk in cutlass.range(n_blocks, unroll=1):
            st = blk % 2
            acc = self._scores_block(mIdx, k_addr, k_smem, sRow, blk, n_blocks, k_eff,
                                     idx_base, k_batch, S, row, sub, q_sw, k_sw, row_layout,
                                     tidx)
            S_mn = acc_mn_view(acc)
            for c in cutlass.range_constexpr(nc):
                vals[c] = (cute.arch.fmax(S_mn[0, c] * scale, 0.0) * w_r[0]
                           + cute.arch.fmax(S_mn[1, c] * scale, 0.0) * w_r[1])
            tot = head_sums(vals, tScS, sPart, tidx, BN)
            if tidx < BN:
                sScore[blk * BN + tidx] = cutlass.Float32(cutlass.select_(
                    sRow[st * BN + tidx] >= 0, tot, -cutlass.Float32.inf))
            cute.arch.barrier()  # sPart, the stage and sRow are free again
        cute.arch.cp_async_wait_group(0)

        # ---- the row's softmax statistics ----
        n_pad = n_blocks * BN
        m = -cutlass.Float32.inf
        for j in cutlass.range(tidx, n_pad, THREADS, unroll=1):
            m = cute.arch.fmax(m, sScore[j])
        m = self._block_reduce(m, sRed, True)
        m = cutlass.Float32(cutlass.select_(m == -cutlass.Float32.inf, cutlass.Float32(0.0),
                                            m))
        z = cutlass.Float32(0.0)
        tsum = cutlass.Float32(0.0)
        for j in cutlass.range(tidx, n_pad, THREADS, unroll=1):
            sc = sScore[j]
            ok = sc > -cutlass.Float32.inf
            e = cute.math.exp2((sc - m) * LOG2_E, fastmath=True)
            z = z + cutlass.Float32(cutlass.select_(ok, e, cutlass.Float32(0.0)))
            if ok:  # (slots past the list: nothing read)
                tsum = tsum + mTarget[idx_base + cutlass.Int64(j)]
        z = self._block_reduce(z, sRed, False)
        tsum = self._block_reduce(tsum, sRed, False)
        return w_r, m, z, tsum

    @cute.jit
    def _token_start(self, mQ: cute.Tensor, mW: cute.Tensor, bt: cutlass.Int64,
                     Hi: cutlass.Int32, q_smem: cutlass.Int32, tScS: cute.Tensor, tidx):
        """Q's head rows to shared memory (rows >= Hi: zeros, nothing read; one cp.async
        group) and w of this thread's two head rows (0 above Hi), returned."""
        load_rows_sw128(mQ.iterator.toint(), bt * cutlass.Int64(Hi), Hi, q_smem, tidx // TPR,
                        tidx % TPR, BM, D * 2)
        cute.arch.cp_async_commit_group()
        w_r = cute.make_rmem_tensor(2, cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            h = tScS[r, 0][0]
            v = cutlass.Float32(0.0)
            if h < Hi:
                v = mW[bt * cutlass.Int64(Hi) + cutlass.Int64(h)]
            w_r[r] = v
        return w_r

    @cute.jit
    def _first_block(self, mIdx: cute.Tensor, k_addr: cutlass.Int64, k_smem: cutlass.Int32,
                     sRow: cute.Tensor, n_blocks, k_eff: cutlass.Int32, idx_base: cutlass.Int64,
                     k_batch: cutlass.Int64, S: cutlass.Int32, row, sub):
        """A pass over the list starts: block 0's gather into stage 0, committed as a group
        (an empty group when the list is empty), which _scores_block(0) waits for."""
        if n_blocks > 0:
            gather_rows_sw128(mIdx, k_addr, k_smem, sRow, 0, 0, k_eff, idx_base, k_batch, S,
                              row, sub, BN, D * 2)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _scores_block(self, mIdx: cute.Tensor, k_addr: cutlass.Int64, k_smem: cutlass.Int32,
                      sRow: cute.Tensor, blk, n_blocks, k_eff: cutlass.Int32,
                      idx_base: cutlass.Int64, k_batch: cutlass.Int64, S: cutlass.Int32, row,
                      sub, q_sw, k_sw, row_layout: cute.Layout, tidx):
        """Block blk's S = Q K^T (fp32, unscaled) once its rows have landed, with block
        blk + 1's gather issued first into the other stage."""
        st = blk % 2
        if blk + 1 < n_blocks:
            gather_rows_sw128(mIdx, k_addr, k_smem + (1 - st) * TILE_BYTES, sRow, 1 - st,
                              blk + 1, k_eff, idx_base, k_batch, S, row, sub, BN, D * 2)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(1)  # this thread's copies of block blk (and Q)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()
        s_mma = self._mma("s")  # its own: the accumulate flag is set inside a staged loop
        thr_s = s_mma.get_slice(tidx)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(cute.make_tensor(q_sw, row_layout)))
        sKb = cute.make_tensor(k_sw + cute.assume(st * (BN * D), divby=4096), row_layout)
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sKb))
        acc = thr_s.make_fragment_C(thr_s.partition_shape_C((BM, BN)))
        warpgroup.fence()
        for kk in cutlass.range_constexpr(D // 16):
            s_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
            cute.gemm(s_mma, acc, tSrQ[None, None, kk], tSrK[None, None, kk], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        return acc

    def _mma(self, which: str):
        """The tiled MMAs: "s" S = Q K^T (64 x 64, both K-major), "dq" dd K_blk (64 x 128,
        B MN-major), "dk" dd^T Q (64 x 128, both MN-major)."""
        K_, MN_ = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        a, b, n = {"s": (K_, K_, BN), "dq": (K_, MN_, D), "dk": (MN_, MN_, D)}[which]
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a, b, cutlass.Float32,
                                                 (1, 1, 1), (BM, n))

    @cute.jit
    def _block_reduce(self, v, sRed: cute.Tensor, is_max: cutlass.Constexpr):
        """max (is_max) or sum of v over the CTA's 128 threads, returned to every thread."""
        for m in (16, 8, 4, 2, 1):
            o = cute.arch.shuffle_sync_bfly(v, offset=m)
            if cutlass.const_expr(is_max):
                v = cute.arch.fmax(v, o)
            else:
                v = v + o
        tidx, _, _ = cute.arch.thread_idx()
        cute.arch.barrier()  # the previous reduction's readers are done with sRed
        if tidx % 32 == 0:
            sRed[tidx // 32] = v
        cute.arch.barrier()
        if cutlass.const_expr(is_max):
            v = cute.arch.fmax(cute.arch.fmax(sRed[0], sRed[1]), cute.arch.fmax(sRed[2], sRed[3]))
        else:
            v = (sRed[0] + sRed[1]) + (sRed[2] + sRed[3])
        return v


def fake_args(dtype):
    """q (B*T*Hi, 128), k (B*S, 128), w (B*T*Hi,) f32, idx (B*T*K,), topk_length (B*T,),
    signal (B*T*K,) f32, g (B*T,) f32, dq (B*T*Hi*128,) f32, dw (B*T*Hi,) f32, dk (B*S, 128)
    f32, then B, T, Hi, S, K, scale and the stream."""
    rows_q, rows_k, n_idx, n_tok, n_dq = (cute.sym_int64() for _ in range(5))
    i32 = cutlass.Int32(1)
    f32 = cutlass.Float32
    return (
        make_fake_compact_tensor(dtype, (rows_q, D), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(dtype, (rows_k, D), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(f32, (rows_q,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4),
        make_fake_compact_tensor(f32, (n_idx,), assumed_align=4),
        make_fake_compact_tensor(f32, (n_tok,), assumed_align=4),
        make_fake_compact_tensor(f32, (n_dq,), assumed_align=16),
        make_fake_compact_tensor(f32, (rows_q,), assumed_align=4),
        make_fake_compact_tensor(f32, (rows_k, D), stride_order=(1, 0), assumed_align=16),
        i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream(),
    )


def compile_indexer_loss_bwd(dtype):
    """Compile with shape-only tensors (fake_args)."""
    return cute.compile(IndexerLossBwdSm90(dtype), *fake_args(dtype))


class IndexerLossFwdSm90(IndexerLossBwdSm90):
    """The loss's forward: the selected scores and their softmax statistics (_row_softmax),
    then KL_t = sum_j target_j (log target_j - log p_j) over the valid entries (0 for a token
    without one), one float32 per token, and the signal p_j sum(target) - target_j of each of
    the token's K slots (0 at the invalid ones), which the backward takes."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor,
                 mLen: cute.Tensor, mTarget: cute.Tensor, mKL: cute.Tensor,
                 mSig: cute.Tensor, B: cutlass.Int32,
                 T: cutlass.Int32, Hi: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        dt = self.dtype
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        row_layout = cute.tile_to_shape(k_atom, (BM, D), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, BM * D], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, 2 * BN * D], 1024]
            sScore: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, KMAX], 16]
            sPart: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * BN], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 8], 16]
            sRow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * BN], 16]

        self.kernel(mQ, mK, mW, mIdx, mLen, mTarget, mKL, mSig, T, Hi, S, K, scale,
                    k_atom.inner,
                    row_layout.outer, SharedStorage).launch(
            grid=[B * T, 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor,
               mLen: cute.Tensor, mTarget: cute.Tensor, mKL: cute.Tensor, mSig: cute.Tensor,
               T: cutlass.Int32,
               Hi: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32, scale: cutlass.Float32,
               swz: cute.Swizzle, row_layout: cute.Layout, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bt32, _, _ = cute.arch.block_idx()
        bt = cutlass.Int64(bt32)
        b = bt32 // T
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + BN - 1) // BN
        idx_base = bt * cutlass.Int64(K)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sScore = storage.sScore.get_tensor(cute.make_layout(KMAX))
        sRed = storage.sRed.get_tensor(cute.make_layout(8))
        _, m, z, tsum = self._row_softmax(
            mQ, mK, mW, mIdx, mTarget, bt, Hi, S, k_eff, n_blocks, idx_base,
            cutlass.Int64(b) * cutlass.Int64(S), scale, storage.sQ.data_ptr().toint(),
            storage.sK.data_ptr().toint(), cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz),
            cute.recast_ptr(storage.sK.data_ptr(), swizzle_=swz), sScore,
            storage.sPart.get_tensor(cute.make_layout(4 * BN)), sRed,
            storage.sRow.get_tensor(cute.make_layout(2 * BN)), row_layout, tidx)
        # KL = sum t log t - sum t (score - m) + (sum t) log z over the valid entries, and
        # each entry's signal p_j sum t - t_j (0 at the invalid ones and past the list)
        xlogx = cutlass.Float32(0.0)
        tdot = cutlass.Float32(0.0)
        inv_z = cutlass.Float32(cutlass.select_(z > 0.0, 1.0 / z, cutlass.Float32(0.0)))
        n_pad = n_blocks * BN
        for j in cutlass.range(tidx, K, THREADS, unroll=1):
            sig = cutlass.Float32(0.0)
            if j < n_pad:
                sc = sScore[j]
                if sc > -cutlass.Float32.inf:  # (slots past the list: nothing read)
                    tg = mTarget[idx_base + cutlass.Int64(j)]
                    lg = cute.math.log2(cute.arch.fmax(tg, 1e-30), fastmath=True) * LN_2
                    xlogx = xlogx + cutlass.Float32(cutlass.select_(tg > 0.0, tg * lg,
                                                                    cutlass.Float32(0.0)))
                    tdot = tdot + tg * (sc - m)
                    p = cute.math.exp2((sc - m) * LOG2_E, fastmath=True) * inv_z
                    sig = p * tsum - tg
            mSig[idx_base + cutlass.Int64(j)] = sig
        xlogx = self._block_reduce(xlogx, sRed, False)
        tdot = self._block_reduce(tdot, sRed, False)
        log_z = cute.math.log2(cute.arch.fmax(z, 1e-30), fastmath=True) * LN_2
        kl = cutlass.Float32(cutlass.select_(z > 0.0, xlogx - tdot + tsum * log_z,
                                             cutlass.Float32(0.0)))
        if tidx == 0:
            mKL[bt] = kl


def fwd_fake_args(dtype):
    """q (B*T*Hi, 128), k (B*S, 128), w (B*T*Hi,) f32, idx (B*T*K,), topk_length (B*T,),
    target (B*T*K,) f32, kl (B*T,) f32, signal (B*T*K,) f32, then B, T, Hi, S, K, scale and
    the stream."""
    rows_q, rows_k, n_idx, n_tok = (cute.sym_int64() for _ in range(4))
    i32 = cutlass.Int32(1)
    f32 = cutlass.Float32
    return (
        make_fake_compact_tensor(dtype, (rows_q, D), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(dtype, (rows_k, D), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(f32, (rows_q,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4),
        make_fake_compact_tensor(f32, (n_idx,), assumed_align=4),
        make_fake_compact_tensor(f32, (n_tok,), assumed_align=4),
        make_fake_compact_tensor(f32, (n_idx,), assumed_align=4),
        i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream(),
    )


def compile_indexer_loss_fwd(dtype):
    """Compile with shape-only tensors (fwd_fake_args)."""
    return cute.compile(IndexerLossFwdSm90(dtype), *fwd_fake_args(dtype))
