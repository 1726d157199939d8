"""Sparse MLA forward for sm_90a with Hopper warpgroup MMA (wgmma). Experimental.

Same math, grid, gather and flattened arguments as sparse_mla_fwd.SparseMlaFwdSm90 (whose row
copies and helpers it reuses); only the MMAs differ (selected with JAX_DSA_FWD_IMPL=wgmma):
  * 2 warpgroups; each runs S = Q K^T as wgmma 64x64x16 with both operands in shared memory
    (redundantly, like the mma.sync kernel) and O_g += P V_g as wgmma 64x256x16 with P taken
    from registers (the S accumulator converted to 16 bit) and V_g = this group's 256 columns.
  * Shared memory uses the canonical 128-byte-swizzle wgmma layouts (swizzle on the byte
    address). The gathered tile is stored K-major (rows = keys, contiguous head dim); the V
    operand is the MN-major view of the same bytes: both layouts place (key, d) at
    (d // 64) * 4096 + (key // 8) * 512 + swz((key % 8) * 64 + d % 64) elements.
  * Tiles written by cp.async / st.shared are published to the async proxy with
    fence.proxy.async before the barrier that precedes the wgmmas.
  * split_qk=True (export tag "wgmmasplit") removes the redundant Q K^T: group g computes the
    scores of keys [32 g, 32 g + 32) only (wgmma 64x32x16); the row maxima are exchanged through
    shared memory, both groups write their half of P (16 bit) to a shared 64x64 tile, and
    O_g += P V_g runs with P from shared memory. Costs 8.5 KB more shared memory and two more
    barriers per block, saves about a third of the MMA work.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.common import LN_2, LOG2_E, fwd_fake_args
from jax_dsa.kernels.sm90.sparse_mla_fwd import SparseMlaFwdSm90


class SparseMlaFwdWgmmaSm90(SparseMlaFwdSm90):
    def __init__(self, dtype, d_qk: int, d_v: int = 512, split_qk: bool = False):
        super().__init__(dtype, d_qk, d_v)
        self.split_qk = split_qk
        self.bn_g = self.bn // 2 if split_qk else self.bn  # score columns per group

    def _smem_layouts(self):
        """Shared-memory layouts of the 64-head tile kernels (this one, ws, ws2): the 128 B
        K-major swizzle atom, then the outer layouts of Q, a KV stage, V^T (MN-major view of the
        same bytes), a P tile (the swizzle goes on the pointers: byte-address swizzle), and the
        software-swizzled O staging tile (element-unit 128 B swizzle), whole and per group."""
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, self.dtype)
        sQ_layout = cute.tile_to_shape(k_atom, (self.bm, self.d_qk), (0, 1))
        sKV_layout = cute.tile_to_shape(k_atom, (self.bn, self.d_qk), (0, 1))
        sVt_layout = cute.tile_to_shape(mn_atom, (self.dv_g, self.bn), (1, 0))
        sP_layout = cute.tile_to_shape(k_atom, (self.bm, self.bn), (0, 1))
        o_atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sO_layout = cute.tile_to_shape(o_atom, (self.bm, self.d_v), (0, 1))
        sOg_layout = cute.tile_to_shape(o_atom, (self.bm, self.dv_g), (0, 1))
        return k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout, sO_layout, sOg_layout

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

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sKV_layout)], 1024
            ]
            sValid: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]
            # split_qk only: P tile and the per-group row max / row sum exchange.
            sP: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sP_layout) if self.split_qk else 8],
                1024,
            ]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.bm], 16]

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (self.bm, self.bn_g),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (self.bm, self.dv_g),
            warpgroup.OperandSource.SMEM if self.split_qk else warpgroup.OperandSource.RMEM,
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
            stream=stream,
        )

    @staticmethod
    def _acc_mn_view(t: cute.Tensor) -> cute.Tensor:
        """View a wgmma 64xN accumulator ((2 cols, 2 rows, N/8), 1, 1) as (rows, cols)."""
        c = cute.make_layout(t.layout.shape)
        mn = cute.make_layout(
            ((c.shape[0][1], c.shape[1]), ((c.shape[0][0], c.shape[0][2]), c.shape[2])),
            stride=(
                (c.stride[0][1], c.stride[1]),
                ((c.stride[0][0], c.stride[0][2]), c.stride[2]),
            ),
        )
        return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))

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
        grp = tidx // 128
        gtid = tidx % 128
        h0 = hb * bm
        bt = cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + bn - 1) // bn

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_base = storage.sQ.data_ptr()
        sQ = cute.make_tensor(cute.recast_ptr(q_base, swizzle_=swz), sQ_layout)
        kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * bn))
        stage_elems = cute.cosize(sKV_layout)

        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        crow = tidx // self.tpr
        csub = tidx % self.tpr

        q_ok = h0 + crow < H
        if q_ok:
            q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                cute.copy(cp_atom, self._chunk(mQ, q_row, c), self._chunk(sQ, crow, c))
        else:
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                self._chunk(sQ, crow, csub + self.tpr * i).fill(0)

        idx_base = bt * cutlass.Int64(K)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)

        thr_qk = qk_mma.get_slice(gtid)
        thr_pv = pv_mma.get_slice(gtid)
        split = self.split_qk
        bn_g = self.bn_g
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((bm, self.dv_g)))
        acc_O.fill(0.0)
        # (row, column) of this thread's scores; columns are local to the group when split.
        tScS = self._acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((bm, bn_g))))
        acc_S_shape = thr_qk.partition_shape_C((bm, bn_g))
        n_rows = cute.size(tScS, mode=[0])
        row_max = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        col0 = grp * bn_g if cutlass.const_expr(split) else 0  # first score column of the group
        sRed = storage.sRed.get_tensor(cute.make_layout(2 * bm))
        # Layout of the group's rows of a gathered tile (rows col0 .. col0 + bn_g).
        sK_rows_layout = cute.local_tile(
            cute.make_tensor(kv_sw, sKV_layout), (bn_g, self.d_qk), (0, 0)
        ).layout
        sP = None
        tOrP_s = None
        if cutlass.const_expr(split):
            sP = cute.make_tensor(cute.recast_ptr(storage.sP.data_ptr(), swizzle_=swz), sP_layout)
            tOrP_s = thr_pv.make_fragment_A(thr_pv.partition_A(sP))

        if n_blocks > 0:
            self._load_block(mKV, mIdx, sValid, self._stage(kv_sw, sKV_layout, 0), cp_atom,
                             0, 0, k_eff, S, idx_base, kv_batch, crow, csub)
        cute.arch.cp_async_commit_group()

        for blk in range(n_blocks):
            stage = blk % 2
            if blk + 1 < n_blocks:
                self._load_block(mKV, mIdx, sValid, self._stage(kv_sw, sKV_layout, 1 - stage),
                                 cp_atom, blk + 1, 1 - stage, k_eff, S, idx_base, kv_batch,
                                 crow, csub)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            # Generic-proxy writes (cp.async, zero fills) -> visible to wgmma (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # S = Q K^T (64 x bn_g, fp32), both operands from shared memory. Row offsets of
            # whole 8-row atoms (512 elements) keep the swizzle phase.
            sKs = cute.make_tensor(
                kv_sw + cute.assume(stage * stage_elems + col0 * 64, divby=512), sK_rows_layout
            )
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKs))
            acc_S = thr_qk.make_fragment_C(acc_S_shape)
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            S_mn = self._acc_mn_view(acc_S)
            O_mn = self._acc_mn_view(acc_O)
            for c in cutlass.range_constexpr(cute.size(S_mn, mode=[1])):
                if sValid[stage * bn + col0 + tScS[0, c][1]] == 0:
                    for r in cutlass.range_constexpr(n_rows):
                        S_mn[r, c] = -cutlass.Float32.inf
            m_blk = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            for r in cutlass.range_constexpr(n_rows):
                S_mn[r, None] = S_mn[r, None].load() * scale_log2
                m_blk[r] = self._quad_allreduce(
                    S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0),
                    cute.arch.fmax,
                )
            if cutlass.const_expr(split):
                # Row max over both groups' columns.
                if gtid % 4 == 0:
                    for r in cutlass.range_constexpr(n_rows):
                        sRed[grp * bm + tScS[r, 0][0]] = m_blk[r]
                cute.arch.sync_threads()
                for r in cutlass.range_constexpr(n_rows):
                    row = tScS[r, 0][0]
                    m_blk[r] = cute.arch.fmax(sRed[row], sRed[bm + row])
            for r in cutlass.range_constexpr(n_rows):
                m_prev = row_max[r]
                m_new = cute.arch.fmax(m_prev, m_blk[r])
                # Nothing valid so far: subtract 0 so exp2(-inf - (-inf)) never yields NaN.
                m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                p_row = cute.math.exp2(S_mn[r, None].load() - m_use, fastmath=True)
                corr = cute.math.exp2(m_prev - m_use, fastmath=True)
                row_sum[r] = row_sum[r] * corr + p_row.reduce(
                    cute.ReductionOp.ADD, cutlass.Float32.zero, 0
                )
                row_max[r] = m_new
                O_mn[r, None] = O_mn[r, None].load() * corr
                S_mn[r, None] = p_row

            if cutlass.const_expr(split):
                # Both halves of P into the shared 64 x 64 tile, then O_g += P V_g (SS).
                for r in cutlass.range_constexpr(n_rows):
                    for c in cutlass.range_constexpr(cute.size(S_mn, mode=[1])):
                        sP[tScS[r, c][0], col0 + tScS[r, c][1]] = S_mn[r, c].to(self.dtype)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
            sVt = cute.make_tensor(
                kv_sw + cute.assume(stage * stage_elems + grp * (bn * self.dv_g), divby=512),
                sVt_layout,
            )
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            if cutlass.const_expr(split):
                warpgroup.fence()
                pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP_s, mode=[2])):
                    cute.gemm(pv_mma, acc_O, tOrP_s[None, None, k], tOrV[None, None, k], acc_O)
            else:
                # P as the register A operand: for 16-bit types the per-thread order of a
                # 64x64 accumulator equals that of the four k16 A fragments (reinterpretation).
                tOrP = cute.make_rmem_tensor(thr_pv.partition_shape_A((bm, bn)), self.dtype)
                cute.make_tensor(tOrP.iterator, acc_S.layout).store(acc_S.load().to(self.dtype))
                warpgroup.fence()
                pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(pv_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # this stage (and sP, sRed) may now be overwritten

        # ---- epilogue (as in the mma.sync kernel) ----------------------------------------
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        l_all = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(n_rows):
            l_all[r] = self._quad_allreduce(row_sum[r], lambda a, c: a + c)
        if cutlass.const_expr(split):
            # Each group summed only its own columns (with the same running max).
            if gtid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows):
                    sRed[grp * bm + tScS[r, 0][0]] = l_all[r]
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(n_rows):
                row = tScS[r, 0][0]
                l_all[r] = sRed[row] + sRed[bm + row]
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
            if grp == 0 and gtid % 4 == 0 and h < H:
                lse = -cutlass.Float32.inf
                if l > 0.0:
                    lse = (m_use + cute.math.log2(l)) * LN_2
                mLse[bt * cutlass.Int64(H) + cutlass.Int64(h)] = lse

        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        sO = cute.make_tensor(q_base, sO_layout)
        sOg = cute.make_tensor(q_base + cute.assume(grp * (bm * self.dv_g), divby=512), sOg_layout)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), pv_mma
        ).get_slice(gtid)
        cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sOg))
        cute.arch.sync_threads()

        st_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )
        if q_ok:
            o_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
            for i in cutlass.range_constexpr(self.d_v // 8 // self.tpr):
                c = csub + self.tpr * i
                cute.copy(st_atom, self._chunk(sO, crow, c), self._chunk(mO, o_row, c))


def compile_fwd_wgmma(dtype, d_qk: int, d_v: int = 512, split_qk: bool = False):
    """Compile with shape-only tensors (common.fwd_fake_args)."""
    return cute.compile(SparseMlaFwdWgmmaSm90(dtype, d_qk, d_v, split_qk),
                        *fwd_fake_args(dtype, d_qk, d_v))


def compile_fwd_wgmma_split(dtype, d_qk: int, d_v: int = 512):
    return compile_fwd_wgmma(dtype, d_qk, d_v, split_qk=True)
