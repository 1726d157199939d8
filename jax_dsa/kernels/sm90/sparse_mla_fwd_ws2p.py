"""Sparse MLA forward for sm_90a: ws2 made persistent, so that a token's start overlaps the end of
the previous token (experimental "ws2p"; CPU-built, not yet run on a GPU).

Same math, arguments and contract as sparse_mla_fwd_ws2 (read its docstring first: the pair
ping-pong, the ring halves and their barriers are unchanged). What is new:

  * Grid: min(B*T*ceil(H/64), 132) CTAs. CTA c takes the work items w = c, c + grid, ... with
    token bt = w // n_hb and head block hb = w % n_hb (the two head blocks of a token run side
    by side, so their gathers meet in L2). Each warpgroup runs the same item sequence.
  * Why: ws2 pays ~4.4-5.6 us per token on top of ~2.2 us per 64-key block (K sweep, kernel
    log). Running several tokens per CTA alone (ws2m) gained nothing: the cost is the serial
    chain at each token boundary, i.e. Q load -> first Q K^T -> ... -> last P V -> epilogue with
    nothing overlapping it. Here:
      - the producer loads Q (cp.async, 2 threads per row) once both consumer groups have
        finished their last Q K^T of the previous item (Q_EMPTY, arrived as early as that),
        so the load overlaps the previous item's last pair and epilogue (Q_FULL);
      - WG0 issues the next item's first Q K^T before its epilogue and waits for it after, so
        the epilogue hides under 1 kclk of tensor work;
      - O is stored from registers (16-bit pairs; no staging through the Q tile, which by then
        holds the next item's Q).
  * The ring barriers keep their phases across items: stage 0 is used once per pair, stage 1
    once per pair that has its odd block, so both sides count uses per stage (u0, u1) and
    derive the parities from them. WG0 now also releases stage 1 L after an item's last pair.
  * The row-sum exchange buffer sRed is double-buffered by item parity (an item without blocks
    has no barrier between one epilogue's read and the next one's write).
  * Predicted (not measured): most of the per-token cost that is not the epilogue itself, i.e.
    H=64, K=640 ~0.75-0.78 ms (ws2 0.84), H=128 ~1.5-1.55 ms (1.65).

Items are counted in int32: B*T*ceil(H/64) < 2^31. tools/ws2p_protocol_model.py runs this
kernel's barrier protocol as a model under random interleavings and item sequences (CPU: no hang,
no parity wait on a barrier two phases ahead, no named barrier arrived twice); keep it in step.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.common import LOG2_E, fwd_fake_args
from jax_dsa.kernels.sm90.sparse_mla_fwd_ws2 import (
    BAR_M0, BAR_M1, BAR_P0, BAR_P1, CONSUMER_BAR, EMPTY_0L, EMPTY_0R, EMPTY_1L, EMPTY_1R,
    FULL_0L, FULL_0R, FULL_1L, FULL_1R, SparseMlaFwdWs2Sm90)

Q_FULL = 8  # the item's Q tile is in shared memory (producer: 128 cp.async + 128 plain)
Q_EMPTY = 9  # both consumer groups are done with the item's Q K^T (256 arrivals)
N_CTAS = 132  # persistent CTAs (H100 / H200 SXM SM count; any GPU runs it correctly)


class SparseMlaFwdWs2pSm90(SparseMlaFwdWs2Sm90):
    def __init__(self, dtype, d_qk: int, d_v: int = 512):
        super().__init__(dtype, d_qk, d_v)
        self.q_tpr = 2  # producer threads per Q row
        assert self.chunks % self.q_tpr == 0

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
        k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout, _, _ = self._smem_layouts()
        # sRed double-buffered by item parity; + Q_FULL / Q_EMPTY
        SharedStorage, qk_mma, pv_rs, pv_ss = self._storage_and_mmas(
            sQ_layout, sKV_layout, sP_layout, red_floats=4 * self.bm, n_mbar=10)
        n_hb = (H + self.bm - 1) // self.bm
        n_items = B * T * n_hb
        self.kernel(
            mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, n_hb, n_items, scale * LOG2_E,
            k_atom.inner, sQ_layout.outer, sKV_layout.outer, sVt_layout.outer, sP_layout.outer,
            qk_mma, pv_rs, pv_ss, SharedStorage,
        ).launch(
            grid=[cutlass.min(n_items, N_CTAS), 1, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ shared pieces
    @cute.jit
    def _item_k(self, w, n_hb: cutlass.Int32, K: cutlass.Int32, mLen: cute.Tensor):
        """Valid entries of work item w's token (each agent loads the next item's at the start of
        the current one, so the load's latency is not at the item boundary)."""
        return cutlass.min(K, cutlass.max(mLen[cutlass.Int64(w // n_hb)], 0))

    @cute.jit
    def _item(self, w, n_hb: cutlass.Int32, k_eff: cutlass.Int32):
        """Work item w: (flattened token bt as int64, head block, 64-key blocks)."""
        bt32 = w // n_hb
        return cutlass.Int64(bt32), w - bt32 * n_hb, (k_eff + self.bn - 1) // self.bn

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _produce_items(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
                       mLen: cute.Tensor, sQ: cute.Tensor, sValid: cute.Tensor, kv_sw,
                       sKV_layout: cute.Layout, mbar, T: cutlass.Int32, H: cutlass.Int32,
                       S: cutlass.Int32, K: cutlass.Int32, n_hb: cutlass.Int32, cta, n_cta,
                       my_items, ptid: cutlass.Int32):
        """Per item: the Q tile (after Q_EMPTY of the previous item), then the pairs' fills as
        in ws2, each after the empty barrier of that slot's previous use (counted per stage)."""
        psub = ptid % self.p_tpr
        prow = ptid // self.p_tpr
        qrow = ptid // self.q_tpr
        qsub = ptid % self.q_tpr
        npass = self.p_passes
        hc = self.half_chunks
        n_l = hc // self.p_tpr
        n_r = (self.chunks - hc) // self.p_tpr
        n_min = min(n_l, n_r)
        n_max = max(n_l, n_r)
        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        cur0 = cute.make_rmem_tensor(npass, cutlass.Int32)
        cur1 = cute.make_rmem_tensor(npass, cutlass.Int32)
        u0 = cutlass.Int32(0)  # stage 0 fills so far (one per pair)
        u1 = cutlass.Int32(0)  # stage 1 fills so far (one per pair with an odd block)
        k_next = self._item_k(cta, n_hb, K, mLen)
        for i in range(my_items):
            k_eff = k_next
            bt, hb, n_blocks = self._item(cta + i * n_cta, n_hb, k_eff)
            if i + 1 < my_items:
                k_next = self._item_k(cta + (i + 1) * n_cta, n_hb, K, mLen)
            h0 = hb * self.bm
            idx_base = bt * cutlass.Int64(K)
            kv_batch = (bt // cutlass.Int64(T)) * cutlass.Int64(S)
            n_pairs = (n_blocks + 1) // 2
            # Q of this item (heads h >= H zero-filled)
            if i > 0:
                cute.arch.mbarrier_wait(mbar + Q_EMPTY, (i - 1) % 2)
            if h0 + qrow < H:
                q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + qrow)
                for j in cutlass.range_constexpr(self.chunks // self.q_tpr):
                    c = qsub + self.q_tpr * j
                    cute.copy(cp_atom, self._chunk(mQ, q_row, c), self._chunk(sQ, qrow, c))
            else:
                for j in cutlass.range_constexpr(self.chunks // self.q_tpr):
                    self._chunk(sQ, qrow, qsub + self.q_tpr * j).fill(0)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + Q_FULL)
            cute.arch.mbarrier_arrive(mbar + Q_FULL)
            for m in range(n_pairs):
                has1 = 2 * m + 1 < n_blocks
                self._load_idx(mIdx, cur0, 2 * m, k_eff, idx_base, prow)
                self._load_idx(mIdx, cur1, 2 * m + 1, k_eff, idx_base, prow)
                for q in range(4):
                    stage, is_r = self._fill_half(q)
                    if stage == 0 or has1:
                        slot = 2 * stage + is_r
                        n_use = u0 + m
                        if stage == 1:
                            n_use = u1 + m
                        if n_use > 0:
                            cute.arch.mbarrier_wait(mbar + 4 + slot, (n_use - 1) % 2)
                        sKs = self._stage(kv_sw, sKV_layout, stage)
                        self._fill_rows(mKV, sKs, sValid, cp_atom, cur0, cur1, stage, q,
                                        prow, self.p_rows, npass, S, kv_batch, psub, is_r * hc,
                                        n_l + is_r * (n_r - n_l), n_min, n_max)
                        cute.arch.cp_async_mbarrier_arrive_noinc(mbar + slot)
                        cute.arch.mbarrier_arrive(mbar + slot)
            u0 = u0 + n_pairs
            u1 = u1 + n_blocks // 2
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def _epilogue_direct(self, acc_O: cute.Tensor, row_sum: cute.Tensor, row_max: cute.Tensor,
                         tScS: cute.Tensor, tOcO: cute.Tensor, sRed: cute.Tensor, red_off,
                         mSink: cute.Tensor, mLse: cute.Tensor, mO: cute.Tensor,
                         bt: cutlass.Int64, h0: cutlass.Int32, H: cutlass.Int32,
                         cg: cutlass.Int32, gtid: cutlass.Int32):
        """ws's _normalize (row sums of both groups, sink in the denominator only, lse for live
        heads), then O stored straight from the accumulator registers in 16-bit pairs."""
        self._normalize(acc_O, row_sum, row_max, tScS, sRed, red_off, mSink, mLse, bt, h0, H,
                        cg, gtid)
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        rO_mn = self._acc_mn_view(rO)
        pair = cute.make_rmem_tensor(2, self.dtype)
        st2 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            h = h0 + tOcO[r, 0][0]
            if h < H:
                o_row = bt * cutlass.Int64(H) + cutlass.Int64(h)
                for c in cutlass.range_constexpr(0, cute.size(tOcO, mode=[1]), 2):
                    col = cg * self.dv_g + tOcO[r, c][1]  # even: columns col, col + 1
                    pair[0] = rO_mn[r, c]
                    pair[1] = rO_mn[r, c + 1]
                    cute.copy(st2, pair, cute.local_tile(mO, (1, 2), (o_row, col // 2))[0, None])

    # ------------------------------------------------------------------ kernel
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
        n_hb: cutlass.Int32,
        n_items: cutlass.Int32,
        scale_log2: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sVt_layout: cute.Layout,
        sP_layout: cute.Layout,
        qk_mma: cute.TiledMma,
        pv_rs: cute.TiledMma,
        pv_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bm, bn = self.bm, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_cta, _, _ = cute.arch.grid_dim()
        wg = tidx // 128
        my_items = (n_items - cta + n_cta - 1) // n_cta

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_base = storage.sQ.data_ptr()
        sQ = cute.make_tensor(cute.recast_ptr(q_base, swizzle_=swz), sQ_layout)
        kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * bn))
        sRed = storage.sRed.get_tensor(cute.make_layout(4 * bm))
        sM = storage.sM.get_tensor(cute.make_layout(2 * bm))
        mbar = storage.mbar.data_ptr()
        stage_elems = cute.cosize(sKV_layout)

        if tidx == 0:
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + i, 256)  # full: 128 cp.async + 128 plain
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + 4 + i, 128)  # empty: one consumer group
            cute.arch.mbarrier_init(mbar + Q_FULL, 256)
            cute.arch.mbarrier_init(mbar + Q_EMPTY, self.n_cons)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ================================ producer =================================
            cute.arch.setmaxregister_decrease(self.prod_regs)
            self._produce_items(mQ, mKV, mIdx, mLen, sQ, sValid, kv_sw, sKV_layout, mbar, T, H,
                                S, K, n_hb, cta, n_cta, my_items, tidx)
        else:
            # ================================ consumers ================================
            cute.arch.setmaxregister_increase(self.cons_regs)
            cg = wg - 1  # 0: even blocks, O columns 0..255; 1: odd blocks, O columns 256..511
            gtid = tidx % 128
            thr_qk = qk_mma.get_slice(gtid)
            thr_rs = pv_rs.get_slice(gtid)
            thr_ss = pv_ss.get_slice(gtid)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            n_k = cute.size(tSrQ, mode=[2])
            kh = self.k_half
            acc_O = thr_rs.make_fragment_C(thr_rs.partition_shape_C((bm, self.dv_g)))
            acc_O.fill(0.0)
            O_mn = self._acc_mn_view(acc_O)
            tScS = self._acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((bm, bn))))
            tOcO = self._acc_mn_view(
                thr_rs.partition_C(cute.make_identity_tensor((bm, self.dv_g))))
            acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((bm, bn)))
            S_mn = self._acc_mn_view(acc_S)
            tOrP = cute.make_rmem_tensor(thr_rs.partition_shape_A((bm, bn)), self.dtype)
            rP = cute.make_tensor(tOrP.iterator, acc_S.layout)  # same registers, C order
            n_rows = cute.size(tScS, mode=[0])
            row_max = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            mx = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            m_own = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            sK_own = self._stage(kv_sw, sKV_layout, cg)
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK_own))
            v_off = cg * (bn * self.dv_g)
            sV_own = cute.make_tensor(
                kv_sw + cute.assume(cg * stage_elems + v_off, divby=512), sVt_layout
            )
            sV_oth = cute.make_tensor(
                kv_sw + cute.assume((1 - cg) * stage_elems + v_off, divby=512), sVt_layout
            )
            tOrV_own = thr_rs.make_fragment_B(thr_rs.partition_B(sV_own))
            tOrV_oth = thr_ss.make_fragment_B(thr_ss.partition_B(sV_oth))
            p0_ptr = kv_sw + cute.assume(self.d_v * bn, divby=512)  # stage 0 rope columns
            p1_ptr = cute.recast_ptr(storage.sP.data_ptr(), swizzle_=swz)
            if cutlass.const_expr(not self.p_in_rope):
                p0_ptr = p1_ptr + cute.assume(cute.cosize(sP_layout), divby=512)
            sP0 = cute.make_tensor(p0_ptr, sP_layout)
            sP1 = cute.make_tensor(p1_ptr, sP_layout)
            r2s_p = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), qk_mma
            ).get_slice(gtid)
            n_kv = cute.size(tOrP, mode=[2])
            u0 = cutlass.Int32(0)  # stage 0 uses before this item (one per pair)
            u1 = cutlass.Int32(0)  # stage 1 uses before this item (pairs with an odd block)

            if cg == 0:
                # ---------------- WG0: even blocks, stage 0, O columns 0..255 ----------------
                tOrP_oth = thr_ss.make_fragment_A(thr_ss.partition_A(sP1))
                tPsP = r2s_p.partition_D(sP0)
                # the first item's first Q K^T (later ones are issued under the epilogue)
                k_next = self._item_k(cta, n_hb, K, mLen)
                if my_items > 0:
                    if k_next > 0:
                        cute.arch.mbarrier_wait(mbar + Q_FULL, 0)
                        # S = Q K0^T of stage 0 (left columns first), committed (inline: the ACCUMULATE
                        # field set inside a helper's region does not reach later regions)
                        cute.arch.mbarrier_wait(mbar + FULL_0L, 0)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        warpgroup.fence()
                        for k in cutlass.range_constexpr(0, kh):
                            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                        warpgroup.commit_group()
                        cute.arch.mbarrier_wait(mbar + FULL_0R, 0)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        warpgroup.fence()
                        for k in cutlass.range_constexpr(kh, n_k):
                            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
                            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                for i in range(my_items):
                    bt, hb, n_blocks = self._item(cta + i * n_cta, n_hb, k_next)
                    if i + 1 < my_items:
                        k_next = self._item_k(cta + (i + 1) * n_cta, n_hb, K, mLen)
                    n_pairs = (n_blocks + 1) // 2
                    cute.arch.mbarrier_wait(mbar + Q_FULL, i % 2)
                    if n_pairs <= 1:  # this item's only Q K^T (if any) is complete
                        cute.arch.mbarrier_arrive(mbar + Q_EMPTY)
                    for m in range(n_pairs):
                        has1 = 2 * m + 1 < n_blocks
                        self._mask_scale_max(S_mn, tScS, sValid, 0, scale_log2, mx)
                        for r in cutlass.range_constexpr(n_rows):
                            m_own[r] = cute.arch.fmax(row_max[r], mx[r])
                        if gtid % 4 == 0:
                            for r in cutlass.range_constexpr(n_rows):
                                sM[tScS[r, 0][0]] = m_own[r]
                        cute.arch.barrier_arrive(barrier_id=BAR_M0, number_of_threads=self.n_cons)
                        self._exp_rows(S_mn, O_mn, row_max, row_sum, m_own)
                        rP.store(acc_S.load().to(self.dtype))
                        warpgroup.fence()
                        pv_rs.set(warpgroup.Field.ACCUMULATE, True)
                        for k in cutlass.range_constexpr(n_kv):
                            cute.gemm(pv_rs, acc_O, tOrP[None, None, k], tOrV_own[None, None, k],
                                      acc_O)
                        warpgroup.commit_group()
                        cute.arch.barrier(barrier_id=BAR_M1, number_of_threads=self.n_cons)
                        for r in cutlass.range_constexpr(n_rows):
                            m1 = sM[bm + tScS[r, 0][0]]
                            mo = m_own[r]
                            m1_use = 0.0 if m1 == -cutlass.Float32.inf else m1
                            f = cute.math.exp2(mo - m1_use, fastmath=True)
                            mx[r] = 0.0 if mo == -cutlass.Float32.inf else f
                            row_max[r] = m1
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(mbar + EMPTY_0L)
                        for r in cutlass.range_constexpr(n_rows):
                            S_mn[r, None] = S_mn[r, None].load() * mx[r]
                            O_mn[r, None] = O_mn[r, None].load() * mx[r]
                            row_sum[r] = row_sum[r] * mx[r]
                        rP.store(acc_S.load().to(self.dtype))
                        cute.copy(r2s_p, r2s_p.retile(rP), tPsP)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier_arrive(barrier_id=BAR_P0, number_of_threads=self.n_cons)
                        cute.arch.barrier(barrier_id=BAR_P1, number_of_threads=self.n_cons)
                        if has1:
                            warpgroup.fence()
                            pv_ss.set(warpgroup.Field.ACCUMULATE, True)
                            for k in cutlass.range_constexpr(n_kv):
                                cute.gemm(pv_ss, acc_O, tOrP_oth[None, None, k],
                                          tOrV_oth[None, None, k], acc_O)
                            warpgroup.commit_group()
                        if m + 1 < n_pairs:
                            ph = (u0 + m + 1) % 2
                            cute.arch.mbarrier_wait(mbar + FULL_0L, ph)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            for k in cutlass.range_constexpr(0, kh):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                            warpgroup.commit_group()
                            warpgroup.wait_group(1)
                            cute.arch.mbarrier_arrive(mbar + EMPTY_1L)  # m + 1 < n_pairs: has1
                            cute.arch.mbarrier_wait(mbar + FULL_0R, ph)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            for k in cutlass.range_constexpr(kh, n_k):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, True)
                                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                            warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        if m + 2 == n_pairs:  # the item's last Q K^T just completed
                            cute.arch.mbarrier_arrive(mbar + Q_EMPTY)
                        if m + 1 == n_pairs and has1:  # stage 1 L: its last SS P V is done
                            cute.arch.mbarrier_arrive(mbar + EMPTY_1L)
                    u0 = u0 + n_pairs
                    u1 = u1 + n_blocks // 2
                    # the next item's first Q K^T runs under this item's epilogue
                    if i + 1 < my_items:
                        if k_next > 0:
                            cute.arch.mbarrier_wait(mbar + Q_FULL, (i + 1) % 2)
                            # S = Q K0^T of stage 0 (left columns first), committed (inline: the ACCUMULATE
                            # field set inside a helper's region does not reach later regions)
                            cute.arch.mbarrier_wait(mbar + FULL_0L, u0 % 2)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            for k in cutlass.range_constexpr(0, kh):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                            warpgroup.commit_group()
                            cute.arch.mbarrier_wait(mbar + FULL_0R, u0 % 2)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            for k in cutlass.range_constexpr(kh, n_k):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, True)
                                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                            warpgroup.commit_group()
                    self._epilogue_direct(acc_O, row_sum, row_max, tScS, tOcO, sRed,
                                          (i % 2) * (2 * bm), mSink, mLse, mO, bt, hb * bm, H,
                                          cg, gtid)
                    warpgroup.wait_group(0)
                    acc_O.fill(0.0)
                    row_max.fill(-cutlass.Float32.inf)
                    row_sum.fill(0.0)
            else:
                # ---------------- WG1: odd blocks, stage 1, O columns 256..511 ---------------
                tOrP_oth = thr_ss.make_fragment_A(thr_ss.partition_A(sP0))
                tPsP = r2s_p.partition_D(sP1)
                k_next = self._item_k(cta, n_hb, K, mLen)
                for i in range(my_items):
                    bt, hb, n_blocks = self._item(cta + i * n_cta, n_hb, k_next)
                    if i + 1 < my_items:
                        k_next = self._item_k(cta + (i + 1) * n_cta, n_hb, K, mLen)
                    n_pairs = (n_blocks + 1) // 2
                    cute.arch.mbarrier_wait(mbar + Q_FULL, i % 2)
                    if n_blocks < 2:  # no odd block: this group reads no Q in this item
                        cute.arch.mbarrier_arrive(mbar + Q_EMPTY)
                    for m in range(n_pairs):
                        ph = (u1 + m) % 2
                        has1 = 2 * m + 1 < n_blocks
                        if has1:
                            cute.arch.mbarrier_wait(mbar + FULL_1R, ph)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            for k in cutlass.range_constexpr(kh, n_k):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, k != kh)
                                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                            warpgroup.commit_group()
                            cute.arch.mbarrier_wait(mbar + FULL_1L, ph)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            for k in cutlass.range_constexpr(0, kh):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, True)
                                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            if m + 1 == n_blocks // 2:  # the item's last odd block
                                cute.arch.mbarrier_arrive(mbar + Q_EMPTY)
                            self._mask_scale_max(S_mn, tScS, sValid, 1, scale_log2, mx)
                        else:
                            acc_S.fill(-cutlass.Float32.inf)
                            mx.fill(-cutlass.Float32.inf)
                        cute.arch.barrier(barrier_id=BAR_M0, number_of_threads=self.n_cons)
                        for r in cutlass.range_constexpr(n_rows):
                            m_own[r] = cute.arch.fmax(sM[tScS[r, 0][0]], mx[r])
                        if gtid % 4 == 0:
                            for r in cutlass.range_constexpr(n_rows):
                                sM[bm + tScS[r, 0][0]] = m_own[r]
                        cute.arch.barrier_arrive(barrier_id=BAR_M1, number_of_threads=self.n_cons)
                        self._exp_rows(S_mn, O_mn, row_max, row_sum, m_own)
                        for r in cutlass.range_constexpr(n_rows):
                            row_max[r] = m_own[r]
                        if has1:
                            rP.store(acc_S.load().to(self.dtype))
                            cute.copy(r2s_p, r2s_p.retile(rP), tPsP)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            warpgroup.fence()
                            pv_rs.set(warpgroup.Field.ACCUMULATE, True)
                            for k in cutlass.range_constexpr(n_kv):
                                cute.gemm(pv_rs, acc_O, tOrP[None, None, k],
                                          tOrV_own[None, None, k], acc_O)
                            warpgroup.commit_group()
                        cute.arch.barrier_arrive(barrier_id=BAR_P1, number_of_threads=self.n_cons)
                        cute.arch.barrier(barrier_id=BAR_P0, number_of_threads=self.n_cons)
                        warpgroup.fence()
                        pv_ss.set(warpgroup.Field.ACCUMULATE, True)
                        for k in cutlass.range_constexpr(n_kv):
                            cute.gemm(pv_ss, acc_O, tOrP_oth[None, None, k], tOrV_oth[None, None, k],
                                      acc_O)
                        warpgroup.commit_group()
                        if has1:
                            warpgroup.wait_group(1)
                            cute.arch.mbarrier_arrive(mbar + EMPTY_1R)
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(mbar + EMPTY_0R)
                    u0 = u0 + n_pairs
                    u1 = u1 + n_blocks // 2
                    self._epilogue_direct(acc_O, row_sum, row_max, tScS, tOcO, sRed,
                                          (i % 2) * (2 * bm), mSink, mLse, mO, bt, hb * bm, H,
                                          cg, gtid)
                    acc_O.fill(0.0)
                    row_max.fill(-cutlass.Float32.inf)
                    row_sum.fill(0.0)


def compile_fwd_ws2p(dtype, d_qk: int, d_v: int = 512):
    """Compile with shape-only tensors (common.fwd_fake_args)."""
    return cute.compile(SparseMlaFwdWs2pSm90(dtype, d_qk, d_v), *fwd_fake_args(dtype, d_qk, d_v))
