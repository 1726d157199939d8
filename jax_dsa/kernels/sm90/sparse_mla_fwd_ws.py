"""Sparse MLA forward for sm_90a: warp-specialized, no duplicated Q K^T (JAX_DSA_FWD_IMPL=ws).

Contract, grid and flattened arguments in sparse_mla_fwd.py (the FFI handler launches every
variant alike); export tag "ws".

  * 384 threads = 3 warpgroups, one CTA per SM (launched with min_blocks_per_mp=1):
      WG0  producer (setmaxnreg 56): gathers the 64-row KV blocks with 16-byte cp.async into a
           2-stage ring (8 threads per row, 128 contiguous bytes per row and instruction), loads
           the indices one block ahead, zero-fills invalid rows (never read) and publishes the
           per-row validity. Completion: every producer thread does
           cp.async.mbarrier.arrive.noinc (its copies) and a plain mbarrier.arrive (release of
           its st.shared zero fills / flags) on the stage's "full" barrier (256 arrivals).
      WG1, WG2  consumers (setmaxnreg 224), block after block (stage blk % 2): consumer c
           scores keys [32 c, 32 c + 32) of the block (wgmma 64x32x16 over the whole Dqk: no
           duplicated Q K^T), the two row maxima are exchanged through shared memory (named
           barrier of the 256 consumer threads), both apply the same running max, each writes
           its 32 columns of P (16 bit) into the block's 64 x 64 P tile, and after a second
           named barrier consumer g accumulates O[:, 256 g : 256 g + 256] += P V_g (wgmma
           64x256x16, both operands in shared memory). Each consumer thread then arrives on the
           stage's "empty" barrier (256 arrivals) and the producer refills it with block
           blk + 2 while block blk + 1 is computed.
  * P lives in the rope columns (512..575) of its own stage when Dqk = 576 (dead once both
    Q K^T of the block completed, i.e. after the first named barrier; exactly one 64x64 K-major
    128B-swizzle tile); with Dqk = 512 it has its own two
    8 KB tiles. Shared memory: Dqk 576: Q 72 KB + 2 x 72 KB = 216 KB (+1 KB);
    Dqk 512: 64 KB + 2 x 64 KB + 16 KB = 208 KB.
  * Writes by the generic proxy (cp.async, zero fills, P) are made visible to wgmma with
    fence.proxy.async: the consumer fences after its mbarrier wait, the P writers fence before
    the named barrier.
  * Heads h >= H are zero rows of Q (loaded by the consumers), never stored; sink/lse accesses
    guarded. Dead rows: o = 0, lse = -inf. Offsets are 64-bit.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.common import LN_2, LOG2_E, fwd_fake_args
from jax_dsa.kernels.sm90.sparse_mla_fwd import SparseMlaFwdTileSm90

CONSUMER_BAR = 1  # named barrier id for the 256 consumer threads (0 is __syncthreads)


class SparseMlaFwdWsSm90(SparseMlaFwdTileSm90):
    def __init__(self, dtype, d_qk: int, d_v: int = 512):
        super().__init__(dtype, d_qk, d_v)
        assert d_v == 512 and d_qk in (512, 576)
        self.bn_g = self.bn // 2  # keys scored per consumer group (32)
        self.threads = 384
        self.n_cons = 256  # consumer threads
        self.tpr = self.n_cons // self.bm  # consumer threads per row for the Q / O copies (4)
        self.p_tpr = 8  # producer threads per gathered row
        self.p_rows = 128 // self.p_tpr  # rows covered per pass (16)
        self.p_passes = self.bn // self.p_rows  # 4 rows per producer thread
        assert self.chunks % self.p_tpr == 0
        self.p_in_rope = d_qk == d_v + 64  # P tile stored in the dead rope columns
        self.prod_regs = 56
        self.cons_regs = 224

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
        k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout, sO_layout, sOg_layout = (
            self._smem_layouts())
        p_elems = 8 if self.p_in_rope else 2 * cute.cosize(sP_layout)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sKV_layout)], 1024
            ]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sValid: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.bm], 16]
            # full[0], full[1], empty[0], empty[1]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 4], 8]

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (self.bm, self.bn_g),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (self.bm, self.dv_g), warpgroup.OperandSource.SMEM,
        )
        n_head_blocks = (H + self.bm - 1) // self.bm
        self.kernel(
            mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, scale * LOG2_E,
            k_atom.inner, sQ_layout.outer, sKV_layout.outer, sVt_layout.outer, sP_layout.outer,
            sO_layout, sOg_layout, qk_mma, pv_mma, SharedStorage,
        ).launch(
            grid=[T, n_head_blocks, B],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _produce(self, mKV: cute.Tensor, mIdx: cute.Tensor, sValid: cute.Tensor, kv_sw,
                 sKV_layout: cute.Layout, mbar, n_blocks: cutlass.Int32, k_eff: cutlass.Int32,
                 S: cutlass.Int32, idx_base: cutlass.Int64, kv_batch: cutlass.Int64,
                 ptid: cutlass.Int32):
        bn = self.bn
        psub = ptid % self.p_tpr
        prow = ptid // self.p_tpr
        npass = self.p_passes
        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        idx_nxt = cute.make_rmem_tensor(npass, cutlass.Int32)
        idx_cur = cute.make_rmem_tensor(npass, cutlass.Int32)
        for p in cutlass.range_constexpr(npass):
            j = prow + self.p_rows * p
            v = cutlass.Int32(-1)
            if j < k_eff:
                v = mIdx[idx_base + cutlass.Int64(j)]
            idx_nxt[p] = v
        for blk in range(n_blocks):
            stage = blk % 2
            for p in cutlass.range_constexpr(npass):
                idx_cur[p] = idx_nxt[p]
            # Indices of the next block: their latency hides behind the empty wait below.
            for p in cutlass.range_constexpr(npass):
                j = (blk + 1) * bn + prow + self.p_rows * p
                v = cutlass.Int32(-1)
                if j < k_eff:
                    v = mIdx[idx_base + cutlass.Int64(j)]
                idx_nxt[p] = v
            if blk >= 2:
                cute.arch.mbarrier_wait(mbar + 2 + stage, ((blk // 2) + 1) % 2)
            sKs = self._stage(kv_sw, sKV_layout, stage)
            for p in cutlass.range_constexpr(npass):
                r = prow + self.p_rows * p
                row = idx_cur[p]
                ok = row >= 0 and row < S
                if psub == 0:
                    sValid[stage * bn + r] = cutlass.Int32(1) if ok else cutlass.Int32(0)
                if ok:
                    g_row = kv_batch + cutlass.Int64(row)
                    for i in cutlass.range_constexpr(self.chunks // self.p_tpr):
                        c = psub + self.p_tpr * i
                        cute.copy(cp_atom, self._chunk(mKV, g_row, c), self._chunk(sKs, r, c))
                else:
                    for i in cutlass.range_constexpr(self.chunks // self.p_tpr):
                        self._chunk(sKs, r, psub + self.p_tpr * i).fill(0)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + stage)
            cute.arch.mbarrier_arrive(mbar + stage)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    # ------------------------------------------------------------------ kernel
    @cute.jit
    def _issue_q(self, mQ: cute.Tensor, q_base, swz: cute.Swizzle, sQ_layout: cute.Layout,
                 bt: cutlass.Int64, h0: cutlass.Int32, H: cutlass.Int32, crow: cutlass.Int32,
                 csub: cutlass.Int32):
        """This consumer thread's share of the Q tile: cp.async of head h0 + crow's chunks
        csub + tpr i (zeros for heads h >= H), committed as one group. Returns h0 + crow < H."""
        sQ = cute.make_tensor(cute.recast_ptr(q_base, swizzle_=swz), sQ_layout)
        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        q_ok = h0 + crow < H
        if q_ok:
            q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                cute.copy(cp_atom, self._chunk(mQ, q_row, c), self._chunk(sQ, crow, c))
        else:
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                self._chunk(sQ, crow, csub + self.tpr * i).fill(0)
        cute.arch.cp_async_commit_group()
        return q_ok

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
        scale_log2: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sVt_layout: cute.Layout,
        sP_layout: cute.Layout,
        sO_layout: cute.ComposedLayout,
        sOg_layout: cute.ComposedLayout,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bm, bn = self.bm, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, b = cute.arch.block_idx()
        wg = tidx // 128
        h0 = hb * bm
        bt = cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + bn - 1) // bn

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_base = storage.sQ.data_ptr()
        kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * bn))
        sRed = storage.sRed.get_tensor(cute.make_layout(2 * bm))
        mbar = storage.mbar.data_ptr()
        stage_elems = cute.cosize(sKV_layout)
        idx_base = bt * cutlass.Int64(K)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)

        if tidx == 0:
            cute.arch.mbarrier_init(mbar + 0, 256)
            cute.arch.mbarrier_init(mbar + 1, 256)
            cute.arch.mbarrier_init(mbar + 2, 256)
            cute.arch.mbarrier_init(mbar + 3, 256)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ================================ producer =================================
            cute.arch.setmaxregister_decrease(self.prod_regs)
            self._produce(mKV, mIdx, sValid, kv_sw, sKV_layout, mbar, n_blocks, k_eff, S,
                          idx_base, kv_batch, tidx)
        else:
            # ================================ consumers ================================
            cute.arch.setmaxregister_increase(self.cons_regs)
            ctid = tidx - 128
            cg = wg - 1  # consumer group: 0 or 1
            gtid = tidx % 128
            crow = ctid // self.tpr
            csub = ctid % self.tpr
            sQ = cute.make_tensor(cute.recast_ptr(q_base, swizzle_=swz), sQ_layout)

            # Q (heads h >= H zero-filled).
            q_ok = self._issue_q(mQ, q_base, swz, sQ_layout, bt, h0, H, crow, csub)
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)

            thr_qk = qk_mma.get_slice(gtid)
            thr_pv = pv_mma.get_slice(gtid)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((bm, self.dv_g)))
            acc_O.fill(0.0)
            tScS = self._acc_mn_view(
                thr_qk.partition_C(cute.make_identity_tensor((bm, self.bn_g)))
            )
            acc_S_shape = thr_qk.partition_shape_C((bm, self.bn_g))
            # Layout of one group's rows of a gathered tile (32 keys x Dqk, whole 8-row atoms).
            sK_rows_layout = cute.local_tile(
                cute.make_tensor(kv_sw, sKV_layout), (self.bn_g, self.d_qk), (0, 0)
            ).layout
            n_rows = cute.size(tScS, mode=[0])
            row_max = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            # P tiles: stage s's P at p_base + s * p_stride elements.
            p_base = kv_sw + cute.assume(self.d_v * bn, divby=512)
            p_stride = stage_elems
            if cutlass.const_expr(not self.p_in_rope):
                p_base = cute.recast_ptr(storage.sP.data_ptr(), swizzle_=swz)
                p_stride = cute.cosize(sP_layout)
            r2s_p = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), qk_mma
            ).get_slice(gtid)

            bn_g = self.bn_g
            for blk in range(n_blocks):
                stage = blk % 2
                phase = (blk // 2) % 2
                stage_off = cute.assume(stage * stage_elems, divby=512)
                cute.arch.mbarrier_wait(mbar + stage, phase)
                cute.arch.fence_proxy("async.shared", space="cta")
                # S = Q K_c^T for this group's keys [32 cg, 32 cg + 32) of the block.
                sKs = cute.make_tensor(
                    kv_sw + stage_off + cute.assume(cg * (bn_g * 64), divby=512), sK_rows_layout
                )
                tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKs))
                acc_S = thr_qk.make_fragment_C(acc_S_shape)
                S_mn = self._acc_mn_view(acc_S)
                warpgroup.fence()
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                    cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                # Scale first, then mask: -inf * scale is NaN for scale 0, +inf for scale < 0.
                for r in cutlass.range_constexpr(n_rows):
                    S_mn[r, None] = S_mn[r, None].load() * scale_log2
                for c in cutlass.range_constexpr(cute.size(S_mn, mode=[1])):
                    if sValid[stage * bn + cg * bn_g + tScS[0, c][1]] == 0:
                        for r in cutlass.range_constexpr(n_rows):
                            S_mn[r, c] = -cutlass.Float32.inf
                m_blk = cute.make_rmem_tensor(n_rows, cutlass.Float32)
                for r in cutlass.range_constexpr(n_rows):
                    m_blk[r] = self._quad_allreduce(
                        S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0),
                        cute.arch.fmax,
                    )
                # Row max over both groups' keys. (Every Q K^T of this block is complete once
                # this barrier is passed: the rope tile may be overwritten with P below.)
                if gtid % 4 == 0:
                    for r in cutlass.range_constexpr(n_rows):
                        sRed[cg * bm + tScS[r, 0][0]] = m_blk[r]
                cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)
                O_mn = self._acc_mn_view(acc_O)
                for r in cutlass.range_constexpr(n_rows):
                    row = tScS[r, 0][0]
                    m_prev = row_max[r]
                    m_new = cute.arch.fmax(m_prev, cute.arch.fmax(sRed[row], sRed[bm + row]))
                    # Nothing valid so far: subtract 0 so exp2(-inf - (-inf)) never yields NaN.
                    m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                    corr = cute.math.exp2(m_prev - m_use, fastmath=True)
                    p_row = cute.math.exp2(S_mn[r, None].load() - m_use, fastmath=True)
                    row_sum[r] = row_sum[r] * corr + p_row.reduce(
                        cute.ReductionOp.ADD, cutlass.Float32.zero, 0
                    )
                    row_max[r] = m_new
                    O_mn[r, None] = O_mn[r, None].load() * corr
                    S_mn[r, None] = p_row
                # This group's 32 columns of the block's 64 x 64 P tile (16 bit).
                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                sP_full = cute.make_tensor(
                    p_base + cute.assume(stage * p_stride, divby=512), sP_layout
                )
                sPc = cute.local_tile(sP_full, (bm, bn_g), (0, cg))
                cute.copy(r2s_p, r2s_p.retile(rP), r2s_p.partition_D(sPc))
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)

                # O_g += P V_g (both operands in shared memory).
                tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sP_full))
                sVt = cute.make_tensor(
                    kv_sw + stage_off + cute.assume(cg * (bn * self.dv_g), divby=512),
                    sVt_layout,
                )
                tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
                warpgroup.fence()
                pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(pv_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(mbar + 2 + stage)

            # ---- epilogue ------------------------------------------------------------
            # Each consumer summed only its own blocks (with the shared running max). The
            # last in-loop barrier ordered every read of sRed before the epilogue's writes, and
            # every Q K^T before the O staging in the (dead) Q tile.
            self._epilogue(acc_O, row_sum, row_max, tScS, sRed, mSink, mLse, mO, q_base,
                           sO_layout, sOg_layout, pv_mma, bt, h0, H, cg, gtid, crow, csub, q_ok)

    @cute.jit
    def _normalize(self, acc_O: cute.Tensor, row_sum: cute.Tensor, row_max: cute.Tensor,
                   tScS: cute.Tensor, sRed: cute.Tensor, red_off, mSink: cute.Tensor,
                   mLse: cute.Tensor, bt: cutlass.Int64, h0: cutlass.Int32, H: cutlass.Int32,
                   cg: cutlass.Int32, gtid: cutlass.Int32):
        """Consumers, after the last block: add the two groups' row sums (through
        sRed[red_off:] and the consumer barrier), normalise O with the sink in the denominator
        only, write lse (natural log; -inf on dead rows) for live heads."""
        bm = self.bm
        n_rows = cute.size(tScS, mode=[0])
        l_all = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(n_rows):
            l_all[r] = self._quad_allreduce(row_sum[r], lambda a, c: a + c)
        if gtid % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                sRed[red_off + cg * bm + tScS[r, 0][0]] = l_all[r]
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)
        for r in cutlass.range_constexpr(n_rows):
            row = tScS[r, 0][0]
            l_all[r] = sRed[red_off + row] + sRed[red_off + bm + row]
        O_mn = self._acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(n_rows):
            l = l_all[r]
            m = row_max[r]
            m_use = 0.0 if m == -cutlass.Float32.inf else m
            h = h0 + tScS[r, 0][0]
            denom = l
            if h < H:
                denom = l + cute.math.exp2(mSink[h] * LOG2_E - m_use, fastmath=True)
            inv = 0.0 if denom <= 0.0 else 1.0 / denom
            O_mn[r, None] = O_mn[r, None].load() * inv
            if cg == 0 and gtid % 4 == 0 and h < H:
                lse = -cutlass.Float32.inf
                if l > 0.0:
                    lse = (m_use + cute.math.log2(l)) * LN_2
                mLse[bt * cutlass.Int64(H) + cutlass.Int64(h)] = lse

    @cute.jit
    def _epilogue(self, acc_O: cute.Tensor, row_sum: cute.Tensor, row_max: cute.Tensor,
                  tScS: cute.Tensor, sRed: cute.Tensor, mSink: cute.Tensor, mLse: cute.Tensor,
                  mO: cute.Tensor, q_base, sO_layout: cute.ComposedLayout,
                  sOg_layout: cute.ComposedLayout, o_mma: cute.TiledMma, bt: cutlass.Int64,
                  h0: cutlass.Int32, H: cutlass.Int32, cg: cutlass.Int32, gtid: cutlass.Int32,
                  crow: cutlass.Int32, csub: cutlass.Int32, q_ok: cutlass.Boolean):
        """_normalize, then O stored through shared memory (the Q tile) with 16-byte stores for
        live heads only. o_mma is the MMA whose C layout acc_O has."""
        bm = self.bm
        self._normalize(acc_O, row_sum, row_max, tScS, sRed, 0, mSink, mLse, bt, h0, H, cg, gtid)

        # O through shared memory (the Q tile is dead: every Q K^T completed before the
        # last in-loop barrier).
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        sO = cute.make_tensor(q_base, sO_layout)
        sOg = cute.make_tensor(
            q_base + cute.assume(cg * (bm * self.dv_g), divby=512), sOg_layout
        )
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), o_mma
        ).get_slice(gtid)
        cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sOg))
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )
        if q_ok:
            o_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
            for i in cutlass.range_constexpr(self.d_v // 8 // self.tpr):
                c = csub + self.tpr * i
                cute.copy(st_atom, self._chunk(sO, crow, c), self._chunk(mO, o_row, c))


def compile_fwd_ws(dtype, d_qk: int, d_v: int = 512):
    """Compile with shape-only tensors (common.fwd_fake_args)."""
    return cute.compile(SparseMlaFwdWsSm90(dtype, d_qk, d_v), *fwd_fake_args(dtype, d_qk, d_v))
