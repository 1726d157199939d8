"""Sparse MLA (DSA) forward for sm_90a, written in CuTe DSL.

For every (b, t, h): s_j = scale * q[b,t,h,:] . kv[b, idx[b,t,j], :] over the valid j
(j < min(K, topk_length[b,t]) and 0 <= idx < S), online softmax, and

    o   = sum_j exp(s_j - m) v_j / (exp(sink_h - m) + sum_j exp(s_j - m)),  v = kv[..., :512]
    lse = m + log(sum_j exp(s_j - m))                      (natural log, sink excluded)

A row without any valid entry gets o = 0 and lse = -inf.

Design (v1, warp-level tensor cores):
  * grid = (T, ceil(H / 64), B): one CTA per (token, block of up to 64 heads). Tokens are on
    grid x so T can reach 2^31 - 1; the head block is on y, batch on z.
  * 256 threads = 2 groups of 4 warps. Each warp owns 16 head rows. Both groups compute the
    same S = Q K^T (64 x 64 per block, mma.sync m16n8k16, fp32 accumulate); group g then
    accumulates O[:, 256 g : 256 g + 256] += P V_g, so the 64 x 512 fp32 accumulator is split
    over the two groups (128 fp32 registers per thread).
  * Q (64 x Dqk) is loaded once into shared memory; missing heads (h >= H) are zero-filled and
    never stored. KV rows are gathered by index with 16-byte cp.async into a 2-stage ring
    (64 rows x Dqk per stage); V is the first 512 columns of the same rows. Invalid entries are
    never read: their rows are zero-filled and their scores masked to -inf.
  * Shared memory (Dqk = 576): Q 72 KB + 2 x 72 KB KV = 216 KB, one CTA per SM.
Inputs are flattened on the host side: q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,),
topk_length (B*T,), sink (H,), o (B*T*H, 512), lse (B*T*H,). All row offsets are 64-bit.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.common import LN_2, LOG2_E, fwd_fake_args



class SparseMlaFwdSm90:
    def __init__(self, dtype, d_qk: int, d_v: int = 512):
        assert d_qk % 64 == 0 and d_v % 64 == 0 and d_v <= d_qk
        self.dtype = dtype
        self.d_qk = d_qk
        self.d_v = d_v
        self.bm = 64  # head rows per CTA
        self.bn = 64  # gathered KV rows per block
        self.groups = 2  # d_v split
        self.dv_g = d_v // self.groups
        self.threads = 128 * self.groups
        self.chunks = d_qk // 8  # 16-byte chunks per row
        self.tpr = self.threads // self.bm  # threads per row in the row copies (4)
        assert self.chunks % self.tpr == 0 and (d_v // 8) % self.tpr == 0

    # ---------------------------------------------------------------- host side
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
        # 8 rows x 64 columns (128 B) swizzle atom: conflict-free ldmatrix and 16 B cp.async.
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sQ_layout = cute.tile_to_shape(atom, (self.bm, self.d_qk), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (self.bn, self.d_qk), (0, 1))
        # One group's half of V (first 512 columns): 256 columns = 4 whole atom columns, so a
        # half starts at a multiple of the swizzle period and can be addressed by pointer offset.
        sVg_layout = cute.tile_to_shape(atom, (self.bn, self.dv_g), (0, 1))
        sO_layout = cute.tile_to_shape(atom, (self.bm, self.d_v), (0, 1))
        sOg_layout = cute.tile_to_shape(atom, (self.bm, self.dv_g), (0, 1))

        stage_elems = cute.cosize(sKV_layout)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, 2 * stage_elems], 1024]
            sValid: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (4, 1, 1),
            permutation_mnk=(64, 16, 16),
        )
        n_head_blocks = (H + self.bm - 1) // self.bm
        self.kernel(
            mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K,
            scale * LOG2_E,
            sQ_layout, sKV_layout, sVg_layout, sO_layout, sOg_layout,
            tiled_mma, SharedStorage,
        ).launch(
            grid=[T, n_head_blocks, B],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _mn_view(t: cute.Tensor) -> cute.Tensor:
        """View an mma.sync accumulator ((2 cols, 2 rows), MMA_M, MMA_N) as (rows, cols)."""
        c = cute.make_layout(t.layout.shape)
        mn = cute.make_layout(
            ((c.shape[0][1], c.shape[1]), (c.shape[0][0], c.shape[2])),
            stride=((c.stride[0][1], c.stride[1]), (c.stride[0][0], c.stride[2])),
        )
        return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))

    @staticmethod
    def _stage(base, layout, stage) -> cute.Tensor:
        """Tensor `layout` at base + stage * cosize(layout) elements. Offsets are multiples of the
        512-element (1 KB) swizzle period, so the swizzle phase is unchanged."""
        off = cute.assume(stage * cute.cosize(layout), divby=512)
        return cute.make_tensor(base + off, layout)

    @staticmethod
    def _chunk(t: cute.Tensor, row, c) -> cute.Tensor:
        """The 8 contiguous elements (16 B) t[row, 8c : 8c + 8] as a rank-1 tensor."""
        return cute.local_tile(t, (1, 8), (row, c))[0, None]

    @staticmethod
    def _quad_allreduce(x, op):
        # The 4 threads of a quad hold the same accumulator rows.
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
        return x

    @cute.jit
    def _load_block(self, mKV: cute.Tensor, mIdx: cute.Tensor, sValid: cute.Tensor,
                    sKs: cute.Tensor, cp_atom: cute.CopyAtom,
                    blk: cutlass.Int32, stage: cutlass.Int32, k_eff: cutlass.Int32,
                    S: cutlass.Int32, idx_base: cutlass.Int64, kv_batch: cutlass.Int64,
                    crow: cutlass.Int32, csub: cutlass.Int32):
        """Gather the 64 rows of block `blk` into `stage`. Invalid slots are never read: their
        rows are zero-filled (so that P = 0 times V stays finite) and flagged in sValid for the
        score mask."""
        bn = self.bn
        j = blk * bn + crow
        row = cutlass.Int32(-1)
        if j < k_eff:
            row = mIdx[idx_base + cutlass.Int64(j)]
        ok = row >= 0 and row < S
        if csub == 0:
            sValid[stage * bn + crow] = cutlass.Int32(1) if ok else cutlass.Int32(0)
        if ok:
            g_row = kv_batch + cutlass.Int64(row)
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                cute.copy(
                    cp_atom,
                    self._chunk(mKV, g_row, c),
                    self._chunk(sKs, crow, c),
                )
        else:
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                self._chunk(sKs, crow, c).fill(0)

    # ---------------------------------------------------------------- kernel
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
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sVg_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sOg_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bm, bn = self.bm, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, b = cute.arch.block_idx()
        grp = tidx // 128
        gtid = tidx % 128
        h0 = hb * bm
        bt = cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)

        # Number of index slots this token may use and the number of 64-slot blocks.
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + bn - 1) // bn

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        kv_base = storage.sKV.data_ptr()
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * bn))
        stage_elems = cute.cosize(sKV_layout)

        # ---- row copies (gmem -> smem, 16 B cp.async); thread tidx serves row tidx // 4 ------
        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        crow = tidx // self.tpr
        csub = tidx % self.tpr

        # Q: row crow is head h0 + crow; missing heads are zero-filled.
        q_ok = h0 + crow < H
        if q_ok:
            q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                cute.copy(
                    cp_atom,
                    self._chunk(mQ, q_row, c),
                    self._chunk(sQ, crow, c),
                )
        else:
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                self._chunk(sQ, crow, c).fill(0)

        idx_base = bt * cutlass.Int64(K)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)

        # ---- MMA partitions -------------------------------------------------------------
        thr_mma = tiled_mma.get_slice(gtid)
        sK0 = cute.make_tensor(kv_base, sKV_layout)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK0))
        # V^T view of one group's half: (d_v / 2, bn).
        sVt0 = cute.composition(
            cute.make_tensor(kv_base, sVg_layout),
            cute.make_layout((self.dv_g, bn), stride=(bn, 1)),
        )
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt0))
        acc_O = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((bm, self.dv_g)), cutlass.Float32
        )
        acc_O.fill(0.0)

        ldsm_atom = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        ldsm_t_atom = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        s2r_Q = cute.make_tiled_copy_A(ldsm_atom, tiled_mma).get_slice(gtid)
        s2r_K = cute.make_tiled_copy_B(ldsm_atom, tiled_mma).get_slice(gtid)
        s2r_V = cute.make_tiled_copy_B(ldsm_t_atom, tiled_mma).get_slice(gtid)
        tSsQ = s2r_Q.partition_S(sQ)
        tSrQ_v = s2r_Q.retile(tSrQ)
        tSrK_v = s2r_K.retile(tSrK)
        tOrVt_v = s2r_V.retile(tOrVt)

        # Column coordinates of this thread's S entries (for the validity mask) and row
        # coordinates of its O rows (for the epilogue).
        tScS = self._mn_view(thr_mma.partition_C(cute.make_identity_tensor((bm, bn))))
        acc_S_proto = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((bm, bn)), cutlass.Float32
        )
        n_rows = cute.size(self._mn_view(acc_S_proto), mode=[0])
        row_max = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)

        # ---- prologue: Q and block 0 in one group --------------------------------------------
        if n_blocks > 0:
            self._load_block(mKV, mIdx, sValid, self._stage(kv_base, sKV_layout, 0), cp_atom,
                             0, 0, k_eff, S, idx_base, kv_batch, crow, csub)
        cute.arch.cp_async_commit_group()

        # ---- main loop --------------------------------------------------------------------
        for blk in range(n_blocks):
            stage = blk % 2
            # Prefetch the next block into the other stage (freed by last iteration's barrier).
            if blk + 1 < n_blocks:
                self._load_block(mKV, mIdx, sValid, self._stage(kv_base, sKV_layout, 1 - stage),
                                 cp_atom, blk + 1, 1 - stage, k_eff, S, idx_base, kv_batch,
                                 crow, csub)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()

            sKs = self._stage(kv_base, sKV_layout, stage)
            # S = Q K^T
            acc_S = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((bm, bn)), cutlass.Float32
            )
            acc_S.fill(0.0)
            tSsK = s2r_K.partition_S(sKs)
            n_k = cute.size(tSsQ.shape[2])
            cute.copy(s2r_Q, tSsQ[None, None, 0], tSrQ_v[None, None, 0])
            cute.copy(s2r_K, tSsK[None, None, 0], tSrK_v[None, None, 0])
            for k in cutlass.range_constexpr(n_k):
                if k + 1 < n_k:
                    cute.copy(s2r_Q, tSsQ[None, None, k + 1], tSrQ_v[None, None, k + 1])
                    cute.copy(s2r_K, tSsK[None, None, k + 1], tSrK_v[None, None, k + 1])
                cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

            # Mask invalid slots, then online softmax in the log2 domain.
            S_mn = self._mn_view(acc_S)
            O_mn = self._mn_view(acc_O)
            for c in cutlass.range_constexpr(cute.size(S_mn, mode=[1])):
                if sValid[stage * bn + tScS[0, c][1]] == 0:
                    for r in cutlass.range_constexpr(n_rows):
                        S_mn[r, c] = -cutlass.Float32.inf
            for r in cutlass.range_constexpr(n_rows):
                s_row = S_mn[r, None].load() * scale_log2
                m_blk = self._quad_allreduce(
                    s_row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0),
                    cute.arch.fmax,
                )
                m_prev = row_max[r]
                m_new = cute.arch.fmax(m_prev, m_blk)
                # A row with nothing valid so far keeps m = -inf; subtract 0 instead so that
                # exp2(-inf - (-inf)) never produces NaN.
                m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                p_row = cute.math.exp2(s_row - m_use, fastmath=True)
                corr = cute.math.exp2(m_prev - m_use, fastmath=True)
                row_sum[r] = row_sum[r] * corr + p_row.reduce(
                    cute.ReductionOp.ADD, cutlass.Float32.zero, 0
                )
                row_max[r] = m_new
                O_mn[r, None] = O_mn[r, None].load() * corr
                S_mn[r, None] = p_row

            # O_g += P V_g, P re-used from the S accumulator as the A operand.
            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            # (4, MMA_M, MMA_N) -> ((4, 2), MMA_M, MMA_N / 2): two n8 accumulators form one k16 A.
            pl = cute.logical_divide(rP.layout, (None, None, 2))
            tOrP = cute.make_tensor(
                rP.iterator,
                cute.make_layout(
                    ((pl.shape[0], pl.shape[2][0]), pl.shape[1], pl.shape[2][1]),
                    stride=((pl.stride[0], pl.stride[2][0]), pl.stride[1], pl.stride[2][1]),
                ),
            )
            sVt = cute.composition(
                cute.make_tensor(
                    kv_base + cute.assume(stage * stage_elems + grp * (bn * self.dv_g), divby=512),
                    sVg_layout,
                ),
                cute.make_layout((self.dv_g, bn), stride=(bn, 1)),
            )
            tOsVt = s2r_V.partition_S(sVt)
            n_kv = cute.size(tOrP.shape[2])
            cute.copy(s2r_V, tOsVt[None, None, 0], tOrVt_v[None, None, 0])
            for k in cutlass.range_constexpr(n_kv):
                if k + 1 < n_kv:
                    cute.copy(s2r_V, tOsVt[None, None, k + 1], tOrVt_v[None, None, k + 1])
                cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)
            # All warps are done with this stage before the next prefetch overwrites it.
            cute.arch.sync_threads()

        # ---- epilogue ---------------------------------------------------------------------
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # Q smem is reused for O staging
        O_mn = self._mn_view(acc_O)
        for r in cutlass.range_constexpr(n_rows):
            l = self._quad_allreduce(row_sum[r], lambda a, c: a + c)
            m = row_max[r]
            m_use = 0.0 if m == -cutlass.Float32.inf else m
            row = tScS[r, 0][0]
            h = h0 + row
            denom = l
            if h < H:
                # exp(sink - m) in the denominator only; sink = -inf contributes exactly 0.
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
        sO = cute.make_tensor(sQ.iterator, sO_layout)
        sOg = cute.make_tensor(
            sQ.iterator + cute.assume(grp * (bm * self.dv_g), divby=512), sOg_layout
        )
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
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


# -------------------------------------------------------------------- AOT compile entry
def compile_fwd(dtype, d_qk: int, d_v: int = 512):
    """Compile one specialization with fake (shape-only) tensors; no GPU needed."""
    return cute.compile(SparseMlaFwdSm90(dtype, d_qk, d_v), *fwd_fake_args(dtype, d_qk, d_v))
