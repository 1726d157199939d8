"""Sparse MLA forward for sm_90a, few heads (H <= 32, a tensor-parallel shard): heads on wgmma's N.

Same math, flattened arguments and compiled-callable signature as sparse_mla_fwd_wgmma (so the FFI
handler launches it unchanged); see sparse_mla_fwd.py for the contract. At H <= 32 the 64-head
kernels compute 2-8x padded MMA work and the problem is bound by the row gather, so this kernel
transposes both products to put the (padded) heads on the N side:

    S^T (64 keys x NP heads)  = K (64 x Dqk, smem)  . Q^T        wgmma 64 x NP x 16, A and B in smem
    O^T (512 x NP)           += V^T (512 x 64 keys) . P^T         wgmma 64 x NP x 16, V^T = MN-major
                                                                  view of the same gathered bytes

NP (8, 16, 24 or 32) is chosen at run time from H: one kernel per NP lives in the module and the
host function launches the smallest that holds H. Heads h >= H are zero rows of Q (scores 0,
finite), never stored.

Layout of the work:
  * A CTA runs a contiguous range of `tpc` tokens (flattened b*T + t on grid x; tpc =
    ceil(B*T / 528), i.e. about 4 CTAs per SM of an H200 in total) as one flat stream of
    64-key blocks, so the gather of the next token's first block (and its Q, double-buffered)
    is in flight while the current token finishes: no pipeline drain per token. A token whose
    index list is empty still gets one (all-invalid) block, which yields o = 0, lse = -inf.
  * 256 threads = 2 warpgroups, all of them issue the 16-byte cp.async row gathers (4 threads per
    row, as in sparse_mla_fwd) into a 2-stage ring of 64 rows x Dqk; invalid slots are never read,
    their rows are zero-filled and flagged in sValid.
  * S^T: warpgroup g multiplies its half of Dqk (k-steps [g*ks/2, (g+1)*ks/2)); warpgroup 1 hands its
    fp32 partial to warpgroup 0 through shared memory. Warpgroup 0 adds, masks invalid keys (rows)
    to -inf, takes the per-head (column) max over the 64 keys (3 warp shuffles + the 4 warps'
    maxima through smem), exponentiates, keeps per-thread partial column sums (reduced once per
    token), writes P^T (16 bit, NP x 64, K-major, 128 B swizzle) and the per-head rescale factors.
  * O^T: warpgroup g owns d rows [256 g, 256 g + 256) (4 m-tiles): accumulator 256 x NP fp32 =
    NP / 2 * 4 registers per thread (64 at NP = 32). Both read P^T from smem.
  * Epilogue per token: column sums reduced through smem, sink in the denominator only, natural-log
    lse, O^T staged transposed in the just-consumed KV stage (row pitch 520 elements), then stored
    with 16-byte stores for h < H only.
  * Generic-proxy smem writes (cp.async, zero fills, P^T) are published to wgmma with
    fence.proxy.async before the barrier that precedes the wgmma.
Shared memory at Dqk = 576, NP = 32: Q 2 x 36 KB + KV 2 x 72 KB + 8 KB exchange/P/sCorr/sM + 1 KB
(225 KB dynamic + 1 KB static, limit 227 KB); one CTA per SM.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.sparse_mla_fwd import LN_2, LOG2_E, SparseMlaFwdSm90

# Tokens per CTA = ceil(B*T / CTA_TARGET): about 4 waves of 1-CTA-per-SM work on 132 SMs.
CTA_TARGET = 528
O_PITCH = 8  # extra elements per staged O row (bank spread)


class _SmallHKernel(SparseMlaFwdSm90):
    """One kernel specialization for NP padded heads."""

    def __init__(self, dtype, d_qk: int, d_v: int, n_pad: int):
        super().__init__(dtype, d_qk, d_v)  # bn = 64, 256 threads, 4 threads per gathered row
        assert d_v == 512 and n_pad % 8 == 0 and 8 <= n_pad <= 32
        self.np_ = n_pad
        self.ks = d_qk // 16  # k-steps of S^T
        assert self.ks % 2 == 0
        self.ks_half = self.ks // 2
        self.nv = n_pad // 2  # S^T accumulator values per thread (64 * NP / 128)
        self.nc = n_pad // 4  # head columns per thread
        self.dv_g = d_v // 2  # d rows of O^T per warpgroup

    def layouts(self):
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, self.dtype)
        sQ_layout = cute.tile_to_shape(k_atom, (self.np_, self.d_qk), (0, 1))
        sKV_layout = cute.tile_to_shape(k_atom, (self.bn, self.d_qk), (0, 1))
        sVt_layout = cute.tile_to_shape(mn_atom, (self.dv_g, self.bn), (1, 0))
        sP_layout = cute.tile_to_shape(k_atom, (self.np_, self.bn), (0, 1))
        return k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout

    def storage(self, sQ_layout, sKV_layout):
        np_ = self.np_

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sQ_layout)], 1024
            ]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sKV_layout)], 1024
            ]
            # fp32 S^T partial of warpgroup 1 (nv x 128 = 256 NP bytes), later aliased by P^T
            # (NP x 64, 16 bit: the first 128 NP bytes) and, behind it, sCorr[NP] and sM[NP].
            sXP: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 128 * self.nv], 1024]
            sValid: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]
            sMax: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * np_], 16]

        return SharedStorage

    def mmas(self):
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (self.bn, self.np_),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (64, self.np_),
        )
        return qk_mma, pv_mma

    @cute.jit
    def launch(self, mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, BT, tpc, scale_log2,
               n_cta, stream):
        k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout = self.layouts()
        SharedStorage = self.storage(sQ_layout, sKV_layout)
        qk_mma, pv_mma = self.mmas()
        self.kernel(
            mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, BT, tpc, scale_log2,
            k_atom.inner, sQ_layout.outer, sKV_layout.outer, sVt_layout.outer, sP_layout.outer,
            qk_mma, pv_mma, SharedStorage,
        ).launch(
            grid=[n_cta, 1, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @staticmethod
    def _acc_mn_view(t: cute.Tensor) -> cute.Tensor:
        """View a wgmma 64xN accumulator ((2 cols, 2 rows, N/8), MMA_M, MMA_N) as (rows, cols)."""
        c = cute.make_layout(t.layout.shape)
        if cutlass.const_expr(len(c.shape[0]) == 3):
            cols = ((c.shape[0][0], c.shape[0][2]), c.shape[2])
            cols_st = ((c.stride[0][0], c.stride[0][2]), c.stride[2])
        else:  # N = 8: ((2 cols, 2 rows), MMA_M, MMA_N)
            cols = (c.shape[0][0], c.shape[2])
            cols_st = (c.stride[0][0], c.stride[2])
        mn = cute.make_layout(
            ((c.shape[0][1], c.shape[1]), cols),
            stride=((c.stride[0][1], c.stride[1]), cols_st),
        )
        return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))

    @cute.jit
    def _issue(self, mQ, mKV, mIdx, sValid, q_sw, kv_sw, sQ_layout, sKV_layout, cp_atom,
               tok, blk, keff, qsel, stage, T, H, S, K, tidx, crow, csub):
        """Gather block `blk` of token `tok` into `stage` (and its Q into buffer qsel when blk = 0)."""
        tok64 = cutlass.Int64(tok)
        if blk == 0:
            sQb = cute.make_tensor(
                q_sw + cute.assume(qsel * cute.cosize(sQ_layout), divby=512), sQ_layout
            )
            n_q = self.np_ * self.chunks
            for i in cutlass.range_constexpr((n_q + self.threads - 1) // self.threads):
                flat = tidx + self.threads * i
                if flat < n_q:
                    h = flat // self.chunks
                    c = flat - h * self.chunks
                    if h < H:
                        q_row = tok64 * cutlass.Int64(H) + cutlass.Int64(h)
                        cute.copy(cp_atom, self._chunk(mQ, q_row, c), self._chunk(sQb, h, c))
                    else:
                        self._chunk(sQb, h, c).fill(0)
        kv_batch = cutlass.Int64(tok // T) * cutlass.Int64(S)
        self._load_block(mKV, mIdx, sValid, self._stage(kv_sw, sKV_layout, stage), cp_atom,
                         blk, stage, keff, S, tok64 * cutlass.Int64(K), kv_batch, crow, csub)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        BT: cutlass.Int32,
        tpc: cutlass.Int32,
        scale_log2: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sVt_layout: cute.Layout,
        sP_layout: cute.Layout,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bn, np_, nc = self.bn, self.np_, self.nc
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        wg = tidx // 128
        gtid = tidx % 128
        warp = gtid // 32
        lane = tidx % 32
        crow = tidx // self.tpr
        csub = tidx % self.tpr

        tok_begin = bx * tpc
        tok_end = cutlass.min(tok_begin + tpc, BT)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
        kv_raw = storage.sKV.data_ptr()
        kv_sw = cute.recast_ptr(kv_raw, swizzle_=swz)
        stage_elems = cute.cosize(sKV_layout)
        q_elems = cute.cosize(sQ_layout)
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * bn))
        sX = storage.sXP.get_tensor(cute.make_layout((self.nv, 128), stride=(128, 1)))
        sP = cute.make_tensor(
            cute.recast_ptr(storage.sXP.data_ptr(), swizzle_=swz, dtype=self.dtype), sP_layout
        )
        sMax = storage.sMax.get_tensor(cute.make_layout((4, np_), stride=(np_, 1)))
        p_floats = np_ * self.bn // 2  # P^T's bytes in fp32 units
        sCorr = cute.make_tensor(storage.sXP.data_ptr() + p_floats, cute.make_layout(np_))
        # Per-warp column sums of the epilogue; sMax is dead by then (read before the pre-PV barrier).
        sL = storage.sMax.get_tensor(cute.make_layout((4, np_), stride=(np_, 1)))
        sM = cute.make_tensor(storage.sXP.data_ptr() + (p_floats + np_), cute.make_layout(np_))

        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        st_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )

        thr_qk = qk_mma.get_slice(gtid)
        thr_pv = pv_mma.get_slice(gtid)
        acc_S_shape = thr_qk.partition_shape_C((bn, np_))
        # (key, head) of this thread's S^T values; (d, head) of its O^T values.
        tScS = self._acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((bn, np_))))
        tOcO = self._acc_mn_view(
            thr_pv.partition_C(cute.make_identity_tensor((self.dv_g, np_)))
        )
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.dv_g, np_)))
        acc_O.fill(0.0)
        O_mn = self._acc_mn_view(acc_O)
        n_orows = cute.size(O_mn, mode=[0])
        col_max = cute.make_rmem_tensor(nc, cutlass.Float32)
        col_sum = cute.make_rmem_tensor(nc, cutlass.Float32)
        corr_r = cute.make_rmem_tensor(nc, cutlass.Float32)
        col_max.fill(-cutlass.Float32.inf)
        col_sum.fill(0.0)

        # ---- stream cursor: current block (c_*) and the block being prefetched (p_*) ----------
        c_tok = tok_begin
        c_blk = cutlass.Int32(0)
        c_keff = cutlass.min(K, cutlass.max(mLen[c_tok], 0))
        c_nb = cutlass.max((c_keff + bn - 1) // bn, 1)
        c_q = cutlass.Int32(0)
        stage = cutlass.Int32(0)

        self._issue(mQ, mKV, mIdx, sValid, q_sw, kv_sw, sQ_layout, sKV_layout, cp_atom,
                    c_tok, c_blk, c_keff, c_q, stage, T, H, S, K, tidx, crow, csub)
        cute.arch.cp_async_commit_group()

        # Next block after the current one.
        p_tok = c_tok
        p_blk = c_blk + 1
        p_keff = c_keff
        p_nb = c_nb
        p_q = c_q
        if p_blk == c_nb:
            p_tok = c_tok + 1
            p_blk = cutlass.Int32(0)
            p_q = 1 - c_q
            p_keff = cutlass.Int32(0)
            p_nb = cutlass.Int32(1)
            if p_tok < tok_end:
                p_keff = cutlass.min(K, cutlass.max(mLen[p_tok], 0))
                p_nb = cutlass.max((p_keff + bn - 1) // bn, 1)

        while c_tok < tok_end:
            if p_tok < tok_end:
                self._issue(mQ, mKV, mIdx, sValid, q_sw, kv_sw, sQ_layout, sKV_layout, cp_atom,
                            p_tok, p_blk, p_keff, p_q, 1 - stage, T, H, S, K, tidx, crow, csub)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            # Generic-proxy writes (cp.async, zero fills) -> visible to wgmma (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # ---- S^T partial = K . Q^T over this warpgroup's half of Dqk ------------------------
            sKs = cute.make_tensor(
                kv_sw + cute.assume(stage * stage_elems, divby=512), sKV_layout
            )
            sQs = cute.make_tensor(q_sw + cute.assume(c_q * q_elems, divby=512), sQ_layout)
            tSrK = thr_qk.make_fragment_A(thr_qk.partition_A(sKs))
            tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(sQs))
            acc_S = thr_qk.make_fragment_C(acc_S_shape)
            warpgroup.fence()
            k0 = wg * self.ks_half
            for kk in cutlass.range_constexpr(self.ks_half):
                qk_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
                cute.gemm(qk_mma, acc_S, tSrK[None, None, k0 + kk], tSrQ[None, None, k0 + kk],
                          acc_S)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            if wg == 1:
                for i in cutlass.range_constexpr(self.nv):
                    sX[i, gtid] = acc_S[i]
            cute.arch.sync_threads()

            if wg == 0:
                # ---- full S^T, mask, online softmax over keys (rows) per head (column) -------
                for i in cutlass.range_constexpr(self.nv):
                    acc_S[i] = acc_S[i] + sX[i, gtid]
                S_mn = self._acc_mn_view(acc_S)
                for r in cutlass.range_constexpr(2):
                    if sValid[stage * bn + tScS[r, 0][0]] == 0:
                        for c in cutlass.range_constexpr(nc):
                            S_mn[r, c] = -cutlass.Float32.inf
                for c in cutlass.range_constexpr(nc):
                    S_mn[0, c] = S_mn[0, c] * scale_log2
                    S_mn[1, c] = S_mn[1, c] * scale_log2
                    v = cute.arch.fmax(S_mn[0, c], S_mn[1, c])
                    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=4))
                    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=8))
                    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=16))
                    if lane < 4:
                        sMax[warp, tScS[0, c][1]] = v
                # All of warpgroup 0 has read sX (aliased by sP) and written sMax.
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                for c in cutlass.range_constexpr(nc):
                    col = tScS[0, c][1]
                    m_blk = cute.arch.fmax(
                        cute.arch.fmax(sMax[0, col], sMax[1, col]),
                        cute.arch.fmax(sMax[2, col], sMax[3, col]),
                    )
                    m_prev = col_max[c]
                    m_new = cute.arch.fmax(m_prev, m_blk)
                    # Nothing valid so far: subtract 0 so exp2(-inf - (-inf)) never yields NaN.
                    m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                    corr = cute.math.exp2(m_prev - m_use, fastmath=True)
                    p0 = cute.math.exp2(S_mn[0, c] - m_use, fastmath=True)
                    p1 = cute.math.exp2(S_mn[1, c] - m_use, fastmath=True)
                    col_sum[c] = col_sum[c] * corr + (p0 + p1)
                    col_max[c] = m_new
                    corr_r[c] = corr
                    sP[col, tScS[0, c][0]] = p0.to(self.dtype)
                    sP[col, tScS[1, c][0]] = p1.to(self.dtype)
                    if warp == 0 and lane < 4:
                        sCorr[col] = corr
            # P^T (generic stores) -> wgmma.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if wg == 1:
                for c in cutlass.range_constexpr(nc):
                    corr_r[c] = sCorr[tOcO[0, c][1]]
            for c in cutlass.range_constexpr(nc):
                for r in cutlass.range_constexpr(n_orows):
                    O_mn[r, c] = O_mn[r, c] * corr_r[c]

            # ---- O^T[256 wg : 256 wg + 256] += V^T . P^T ---------------------------------------
            sVt = cute.make_tensor(
                kv_sw + cute.assume(stage * stage_elems + wg * (bn * self.dv_g), divby=512),
                sVt_layout,
            )
            tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(sVt))
            tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(sP))
            warpgroup.fence()
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            for k in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                cute.gemm(pv_mma, acc_O, tOrV[None, None, k], tOrP[None, None, k], acc_O)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            if c_blk == c_nb - 1:
                # ---- epilogue of token c_tok -------------------------------------------------
                if wg == 0:
                    for c in cutlass.range_constexpr(nc):
                        v = col_sum[c]
                        v = v + cute.arch.shuffle_sync_bfly(v, offset=4)
                        v = v + cute.arch.shuffle_sync_bfly(v, offset=8)
                        v = v + cute.arch.shuffle_sync_bfly(v, offset=16)
                        if lane < 4:
                            sL[warp, tScS[0, c][1]] = v
                            if warp == 0:
                                sM[tScS[0, c][1]] = col_max[c]
                # Also: both warpgroups' wgmmas on this stage are complete (reused for O below).
                cute.arch.sync_threads()
                tok64 = cutlass.Int64(c_tok)
                for c in cutlass.range_constexpr(nc):
                    h = tOcO[0, c][1]
                    l = (sL[0, h] + sL[1, h]) + (sL[2, h] + sL[3, h])
                    m = sM[h]
                    m_use = 0.0 if m == -cutlass.Float32.inf else m
                    denom = l
                    if h < H:
                        # exp(sink - m) in the denominator only; sink = -inf adds exactly 0.
                        denom = l + cute.math.exp2(mSink[h] * LOG2_E - m_use, fastmath=True)
                    inv = 0.0 if denom <= 0.0 else 1.0 / denom
                    for r in cutlass.range_constexpr(n_orows):
                        O_mn[r, c] = O_mn[r, c] * inv
                    if wg == 0 and warp == 0 and lane < 4 and h < H:
                        lse = -cutlass.Float32.inf
                        if l > 0.0:
                            lse = (m_use + cute.math.log2(l)) * LN_2
                        mLse[tok64 * cutlass.Int64(H) + cutlass.Int64(h)] = lse
                # O^T -> O (NP x 512, row pitch 512 + O_PITCH) in the consumed stage.
                sO = cute.make_tensor(
                    kv_raw + cute.assume(stage * stage_elems, divby=512),
                    cute.make_layout((np_, self.d_v), stride=(self.d_v + O_PITCH, 1)),
                )
                for c in cutlass.range_constexpr(nc):
                    for r in cutlass.range_constexpr(n_orows):
                        sO[tOcO[r, c][1], wg * self.dv_g + tOcO[r, c][0]] = O_mn[r, c].to(
                            self.dtype
                        )
                cute.arch.sync_threads()
                n_ch = self.d_v // 8
                for i in cutlass.range_constexpr(np_ * n_ch // self.threads):
                    flat = tidx + self.threads * i
                    h = flat // n_ch
                    ch = flat - h * n_ch
                    if h < H:
                        o_row = tok64 * cutlass.Int64(H) + cutlass.Int64(h)
                        cute.copy(st_atom, self._chunk(sO, h, ch), self._chunk(mO, o_row, ch))
                acc_O.fill(0.0)
                col_max.fill(-cutlass.Float32.inf)
                col_sum.fill(0.0)
            # This stage, sP/sX, sCorr, sL, sM may now be overwritten.
            cute.arch.sync_threads()

            # ---- advance: current <- prefetched, prefetched <- its successor ----------------
            c_tok = p_tok
            c_blk = p_blk
            c_keff = p_keff
            c_nb = p_nb
            c_q = p_q
            stage = 1 - stage
            p_blk = p_blk + 1
            if p_blk == c_nb:
                p_tok = p_tok + 1
                p_blk = cutlass.Int32(0)
                p_q = 1 - p_q
                p_keff = cutlass.Int32(0)
                p_nb = cutlass.Int32(1)
                if p_tok < tok_end:
                    p_keff = cutlass.min(K, cutlass.max(mLen[p_tok], 0))
                    p_nb = cutlass.max((p_keff + bn - 1) // bn, 1)

        cute.arch.cp_async_wait_group(0)


class SparseMlaFwdSmallHSm90:
    """Host entry: picks NP in (8, 16, 24, 32) from H at run time (H must be <= 32)."""

    NPS = (8, 16, 24, 32)

    def __init__(self, dtype, d_qk: int, d_v: int = 512, nps=NPS):
        nps = sorted(nps)
        self.variants = [_SmallHKernel(dtype, d_qk, d_v, n) for n in nps]
        self.hi = list(nps)
        self.lo = [0] + list(nps[:-1])

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        B: cutlass.Int32,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        BT = B * T
        tpc = cutlass.max((BT + CTA_TARGET - 1) // CTA_TARGET, 1)
        n_cta = (BT + tpc - 1) // tpc
        scale_log2 = scale * LOG2_E
        for i in cutlass.range_constexpr(len(self.variants)):
            if H > self.lo[i] and H <= self.hi[i]:
                self.variants[i].launch(mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, BT,
                                        tpc, scale_log2, n_cta, stream)


def compile_fwd_smallh(dtype, d_qk: int, d_v: int = 512, nps=SparseMlaFwdSmallHSm90.NPS):
    """Compile with shape-only tensors (same argument list as sparse_mla_fwd_wgmma.compile_fwd_wgmma).
    Valid for 1 <= H <= max(nps); other H launch nothing."""
    rows_q, rows_kv, n_idx, n_tok, n_head = (cute.sym_int64() for _ in range(5))
    q = make_fake_compact_tensor(dtype, (rows_q, d_qk), stride_order=(1, 0), assumed_align=16)
    kv = make_fake_compact_tensor(dtype, (rows_kv, d_qk), stride_order=(1, 0), assumed_align=16)
    idx = make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4)
    tl = make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4)
    sink = make_fake_compact_tensor(cutlass.Float32, (n_head,), assumed_align=4)
    o = make_fake_compact_tensor(dtype, (rows_q, d_v), stride_order=(1, 0), assumed_align=16)
    lse = make_fake_compact_tensor(cutlass.Float32, (rows_q,), assumed_align=4)
    i32 = cutlass.Int32(1)
    return cute.compile(SparseMlaFwdSmallHSm90(dtype, d_qk, d_v, nps), q, kv, idx, tl, sink, o,
                        lse, i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream())
