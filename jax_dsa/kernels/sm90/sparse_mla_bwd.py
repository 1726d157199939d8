"""Sparse MLA (DSA) backward for sm_90a (CuTe DSL), version 2; version 1 (scalar dkv atomics, no
skipping of padded head groups) is in git history, commit 31e49c8. Launched by
ffi/sparse_mla_bwd.cc.

Per row (b, t, h), with the forward's natural-log lse (sink excluded, -inf on dead rows) and the
caller-prepared coef[..., 0] = c = 1 / (1 + exp(sink_h - lse)) and coef[..., 1] = D' =
c * rowsum(dO * o) - dlse:

    s_j  = scale * q . k_j,    p~_j = exp(s_j - lse)   (0 for invalid entries and dead rows)
    dP_j = dO . v_j,           dS_j = p~_j * (c * dP_j - D')
    dq                  = scale * sum_j dS_j k_j
    dkv[b, idx_j, :]   += scale * sum_h dS_j q_h
    dkv[b, idx_j, :512]+= sum_h (c p~_j) dO_h

Entry j of token t is valid when j < min(K, topk_length[b, t]) and 0 <= idx < S. Invalid entries
are never read (their shared-memory rows are zero-filled) and never written.

v2 keeps v1's proven skeleton (mma.sync m16n8k16, one CTA per (token, 64 heads), 256 threads =
2 groups of 4 warps, Q / dO resident in smem, one 64-row KV stage whose refill overlaps the dKV
step, 224.5 KB smem) and changes what v1 measured to be expensive:
  1. dkv atomics: each dKV accumulator n8 tile is re-paired inside a quad with one butterfly
     shuffle per value pair (lane 2i takes row r, lane 2i+1 row r+8, 4 consecutive columns
     each) and added with one red.global.add.v4.f32 (16 B aligned: columns 8n + {0, 4}, row
     strides 512 / 576 floats) -- 4x fewer RED instructions than v1's scalar ones, and every
     32-byte L2 sector a RED touches is now fully used (v1's quad covered 4 x 4 B of 32 B per
     instruction), i.e. half the L2 atomic sector operations. Rows with an invalid index issue
     nothing (the shuffles are unconditional, the RED is predicated per thread on its row).
  2. padded heads cost nothing in the MMAs: with hl = min(64, H - h0) live heads, a warp whose
     16 head rows are all padding skips its S / dP / dQ MMAs, and the dKV MMAs (K dimension =
     heads) run ceil(hl / 16) k-steps instead of 4 (H = 16: 1 of 4).
  3. bf16: scale is folded into dS before it is rounded to 16 bits (dq and the dS^T Q half of
     dkv are both scaled by it): no per-chunk rescale of the dKV accumulators, no epilogue
     multiply. fp16 keeps v1's unscaled dS (range) and scales the fp32 accumulators.
  4. the next block's indices are loaded at the top of the current block (register prefetch),
     so the gather issued after the dQ step does not wait for an index load.

Per block of 64 gathered rows (Dqk = 576): S 4.7 + dP 4.2 + dQ 4.7 + dKV 8.9 = 22.5 MFLOP for
64 live heads; ldmatrix traffic about 1.8 MB per block per SM (the real limit of a 16-row-per-warp
mma.sync design: ~14k clocks at 128 B/clock), the gather 72 KB, the dkv scatter 147 KB
(36 864 fp32, 4 608 full 32-byte sectors).

Inputs are flattened on the host side: q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,),
topk_length (B*T,), lse (B*T*H,), do (B*T*H, 512), coef (B*T*H*2,), dq (B*T*H, Dqk),
dkv (B*S, Dqk) float32 (zero-filled by the caller). All row offsets are 64-bit. A launch covers
the n_tok flattened tokens bt = b*T + t from t_begin on (grid x), 64 heads each (grid y).

Deterministic variant (deterministic=True): no atomics. The dkv argument is a workspace of
n_tok * K * n_hb rows (n_hb = ceil(H / 64)); the contribution of entry j of token bt from head
block hb is stored, all Dqk columns, at row ((bt - t_begin) * K + j) * n_hb + hb. Invalid entries
store nothing. sparse_mla_dkv_reduce.py then sums each kv row's contributions in a fixed order.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.common import (LOG2_E, bwd_fake_args, compile_options,
                                         red_add_v4_f32, st_global_v4_f32)

# Unroll factor of the runtime k-loops. They are runtime loops on purpose: fully unrolled
# (range_constexpr) k-loops let the compiler hoist every loop-invariant shared-memory address out
# of the token loop, which spilled the dQ accumulator (~800 B of local memory per thread).
GEMM_UNROLL = 2


class SparseMlaBwdSm90:
    def __init__(self, dtype, d_qk: int, d_v: int = 512, deterministic: bool = False):
        assert d_v == 512 and d_qk in (512, 576)
        # deterministic: store each entry's dkv contribution as a workspace row instead of
        # adding it atomically (sparse_mla_dkv_reduce.py sums them in a fixed order).
        self.deterministic = deterministic
        self.dtype = dtype
        self.d_qk = d_qk
        self.d_v = d_v
        self.rope = d_qk - d_v  # 0 or 64 extra columns (q/k only)
        # Fold scale into dS before the 16-bit rounding only for bf16 (fp32's exponent range);
        # fp16 keeps v1's unscaled dS (scale * dS would sink ~Dqk**0.5 times closer to fp16's
        # subnormals) and applies scale to the fp32 accumulators as v1 does.
        self.fold_scale = dtype is cutlass.BFloat16
        self.bm = 64  # head rows per CTA
        self.bn = 64  # gathered KV rows per block
        self.groups = 2
        self.threads = 128 * self.groups
        self.half_n = self.bn // self.groups  # KV columns of S / dP per group (32)
        self.dv_g = d_v // self.groups  # dQ columns per group (256)
        self.chunks = d_qk // 8  # 16-byte chunks per row
        self.tpr = self.threads // self.bm  # threads per row in the row copies (4)
        self.n_col_chunks_g = d_v // 64 // self.groups  # dKV 64-column chunks per group (4)
        assert self.chunks % self.tpr == 0 and (d_v // 8) % self.tpr == 0

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mLse: cute.Tensor,
        mDO: cute.Tensor,
        mCoef: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        B: cutlass.Int32,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        t_begin: cutlass.Int32,
        n_tok: cutlass.Int32,
        scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        # 8 rows x 64 columns (128 B) swizzle atom: conflict-free ldmatrix and 16 B cp.async.
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sQ_layout = cute.tile_to_shape(atom, (self.bm, self.d_qk), (0, 1))
        sDO_layout = cute.tile_to_shape(atom, (self.bm, self.d_v), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (self.bn, self.d_qk), (0, 1))
        # 64 rows x 256 columns: one group's dQ half / K^T half (4 whole atom columns).
        sHalf_layout = cute.tile_to_shape(atom, (self.bn, self.dv_g), (0, 1))
        # 64 x 64: dS, c*P~, and one 64-column chunk of Q / dO / K.
        sT_layout = cute.tile_to_shape(atom, (64, 64), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sDO_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sT_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sT_layout)], 1024]
            sRow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (4, 1, 1),
            permutation_mnk=(64, 16, 16),
        )
        n_head_blocks = (H + self.bm - 1) // self.bm
        self.kernel(
            mQ, mKV, mIdx, mLen, mLse, mDO, mCoef, mDQ, mDKV, T, H, S, K, t_begin,
            scale,
            sQ_layout, sDO_layout, sKV_layout, sHalf_layout, sT_layout,
            tiled_mma, SharedStorage,
        ).launch(
            grid=[n_tok, n_head_blocks, 1],
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
    def _at(base, layout, off) -> cute.Tensor:
        """Tensor `layout` at base + off elements; off is a multiple of the 512-element (1 KB)
        swizzle period, so the swizzle phase is unchanged."""
        return cute.make_tensor(base + cute.assume(off, divby=512), layout)

    @staticmethod
    def _t(t: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
        """Transposed view (cols x rows) of a (rows x cols) tensor."""
        return cute.composition(t, cute.make_layout((cols, rows), stride=(rows, 1)))

    @staticmethod
    def _rows(t: cute.Tensor, rows: int, cols: int, ld: int) -> cute.Tensor:
        """The first `rows` rows and `cols` columns of a tensor with `ld` rows."""
        return cute.composition(t, cute.make_layout((rows, cols), stride=(1, ld)))

    @staticmethod
    def _chunk(t: cute.Tensor, row, c) -> cute.Tensor:
        """The 8 contiguous elements (16 B) t[row, 8c : 8c + 8] as a rank-1 tensor."""
        return cute.local_tile(t, (1, 8), (row, c))[0, None]

    @cute.jit
    def _gemm(self, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor,
              sA: cute.Tensor, sB: cute.Tensor, s2r_A: cute.TiledCopy, s2r_B: cute.TiledCopy,
              n_k_dyn=None):
        """acc += sA sB^T with sA (M x K) and sB (N x K) in shared memory, both read with
        ldmatrix (s2r_A / s2r_B say whether transposed). The k-loop is a runtime loop (unrolled
        by 2) over one-k-step register fragments, which keeps the operand registers few."""
        tCsA = s2r_A.partition_S(sA)
        tCsB = s2r_B.partition_S(sB)
        # Full-K fragments, of which only k-slice 0 is used (the rest is never touched).
        tCrA_f = thr_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB_f = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCrA = tCrA_f[None, None, 0]
        tCrB = tCrB_f[None, None, 0]
        tCrA_v = s2r_A.retile(tCrA_f)[None, None, 0]
        tCrB_v = s2r_B.retile(tCrB_f)[None, None, 0]
        n_k = cute.size(tCsA.shape[2])
        # One ldmatrix copy step of A and of B per MMA k-step.
        assert n_k == cute.size(tCsB.shape[2]) == cute.size(tCrA_f.shape[2])
        assert n_k == cute.size(tCrB_f.shape[2])
        if cutlass.const_expr(n_k_dyn is not None):
            n_k = n_k_dyn  # runtime k-step count (<= the static one): skipped padded heads
        for k in cutlass.range(n_k, unroll=GEMM_UNROLL):
            cute.copy(s2r_A, tCsA[None, None, k], tCrA_v)
            cute.copy(s2r_B, tCsB[None, None, k], tCrB_v)
            cute.gemm(tiled_mma, acc, tCrA, tCrB, acc)

    @cute.jit
    def _load_rows(self, mSrc: cute.Tensor, sDst: cute.Tensor, cp_atom: cute.CopyAtom,
                   ok: cutlass.Boolean, g_row: cutlass.Int64, crow: cutlass.Int32,
                   csub: cutlass.Int32, n_chunks: cutlass.Constexpr):
        """Row crow of sDst <- row g_row of mSrc (16 B cp.async per chunk, this thread's
        chunks csub, csub + tpr, ...), or zeros when not ok (the source is then never read)."""
        if ok:
            for i in cutlass.range_constexpr(n_chunks // self.tpr):
                c = csub + self.tpr * i
                cute.copy(cp_atom, self._chunk(mSrc, g_row, c), self._chunk(sDst, crow, c))
        else:
            for i in cutlass.range_constexpr(n_chunks // self.tpr):
                c = csub + self.tpr * i
                self._chunk(sDst, crow, c).fill(0)

    @cute.jit
    def _fetch_idx(self, mIdx: cute.Tensor, blk, k_eff: cutlass.Int32,
                   idx_base: cutlass.Int64, crow: cutlass.Int32) -> cutlass.Int32:
        """The index of entry blk * 64 + crow, or -1 past the valid length (idx not read)."""
        j = blk * self.bn + crow
        row = cutlass.Int32(-1)
        if j < k_eff:
            row = mIdx[idx_base + cutlass.Int64(j)]
        return row

    @cute.jit
    def _load_block(self, mKV: cute.Tensor, sRow: cute.Tensor, sKV: cute.Tensor,
                    cp_atom: cute.CopyAtom, row: cutlass.Int32, slot: cutlass.Int32,
                    S: cutlass.Int32, kv_batch: cutlass.Int64,
                    crow: cutlass.Int32, csub: cutlass.Int32):
        """Gather one block's KV row `row` (from _fetch_idx) into stage row crow.
        sRow[slot * 64 + crow] gets the row's index in kv[b] or -1 when the entry is invalid
        (its smem row is then zero-filled, never read from global memory)."""
        ok = row >= 0 and row < S
        if csub == 0:
            sRow[slot * self.bn + crow] = row if ok else cutlass.Int32(-1)
        self._load_rows(mKV, sKV, cp_atom, ok, kv_batch + cutlass.Int64(row), crow, csub,
                        self.chunks)

    # ---------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mLse: cute.Tensor,
        mDO: cute.Tensor,
        mCoef: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        t_begin: cutlass.Int32,
        scale: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sDO_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sHalf_layout: cute.ComposedLayout,
        sT_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bm, bn, hn = self.bm, self.bn, self.half_n
        d_qk, d_v = self.d_qk, self.d_v
        tidx, _, _ = cute.arch.thread_idx()
        t_loc, hb, _ = cute.arch.block_idx()
        grp = tidx // 128
        gtid = tidx % 128
        h0 = hb * bm
        # Flattened token b * T + t: this launch covers tokens t_begin .. t_begin + n_tok - 1.
        bt = cutlass.Int64(t_begin) + cutlass.Int64(t_loc)
        b = bt // cutlass.Int64(T)
        scale_log2 = scale * LOG2_E

        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + bn - 1) // bn

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sDO = storage.sDO.get_tensor(sDO_layout)
        sKV = storage.sKV.get_tensor(sKV_layout)
        sDS = storage.sDS.get_tensor(sT_layout)
        sP = storage.sP.get_tensor(sT_layout)
        sRow = storage.sRow.get_tensor(cute.make_layout(2 * bn))
        q_base = storage.sQ.data_ptr()
        do_base = storage.sDO.data_ptr()
        kv_base = storage.sKV.data_ptr()

        # ---- row copies (gmem -> smem, 16 B cp.async); thread tidx serves row tidx // 4 ------
        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        crow = tidx // self.tpr
        csub = tidx % self.tpr
        q_ok = h0 + crow < H
        q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
        # Missing heads (h >= H) are zero-filled and never read from global memory.
        self._load_rows(mQ, sQ, cp_atom, q_ok, q_row, crow, csub, self.chunks)
        self._load_rows(mDO, sDO, cp_atom, q_ok, q_row, crow, csub, d_v // 8)

        idx_base = bt * cutlass.Int64(K)
        kv_batch = b * cutlass.Int64(S)
        # Deterministic mode: entry j's workspace row is (t_loc * K + j) * n_hb + hb.
        n_hb = (H + bm - 1) // bm
        ws_tok = cutlass.Int64(t_loc) * cutlass.Int64(K)
        if n_blocks > 0:
            row0 = self._fetch_idx(mIdx, 0, k_eff, idx_base, crow)
            self._load_block(mKV, sRow, sKV, cp_atom, row0, 0, S, kv_batch, crow, csub)
        cute.arch.cp_async_commit_group()

        # ---- MMA set-up -----------------------------------------------------------------
        thr_mma = tiled_mma.get_slice(gtid)
        ldsm = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        ldsm_t = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        s2r_A = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(gtid)
        s2r_At = cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(gtid)
        s2r_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(gtid)
        s2r_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(gtid)

        # Operand views that do not change over the loop.
        # Phase 1: this group's 32 KV rows as the B operand (N = KV rows, K = features).
        sKV_g = self._at(kv_base, sKV_layout, grp * (hn * 64))
        sK_g = self._rows(sKV_g, hn, d_qk, bn)
        sV_g = self._rows(sKV_g, hn, d_v, bn)
        # Phase 2: K^T for this group's 256 dQ columns (N = features, K = KV rows) and the rope.
        sKt_g = self._t(self._at(kv_base, sHalf_layout, grp * (bn * self.dv_g)), bn, self.dv_g)
        sKt_r = self._t(self._at(kv_base, sT_layout, bn * d_v), bn, 64)
        # Phase 4: dS^T and (c P~)^T as A operands (M = KV rows, K = heads).
        sDSt = self._t(sDS, bm, bn)
        sPt = self._t(sP, bm, bn)

        acc_dQ = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, self.dv_g)), cutlass.Float32)
        acc_dQ.fill(0.0)
        acc_dQr = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, 64)), cutlass.Float32)
        acc_dQr.fill(0.0)

        # Coordinates of this thread's accumulator entries: S / dP (64 x 32) and dKV chunks.
        tScS = self._mn_view(thr_mma.partition_C(cute.make_identity_tensor((bm, hn))))
        tCcC = self._mn_view(thr_mma.partition_C(cute.make_identity_tensor((bn, 64))))
        acc_S_proto = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, hn)), cutlass.Float32)
        n_rows = cute.size(self._mn_view(acc_S_proto), mode=[0])
        n_cols = cute.size(self._mn_view(acc_S_proto), mode=[1])

        # Per-row constants: lse * log2(e) (+inf for dead / missing rows so that P~ = 0), c, D'.
        row_lse = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        row_c = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        row_d = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(n_rows):
            h = h0 + tScS[r, 0][0]
            lse2 = cutlass.Float32.inf
            cc = cutlass.Float32(0.0)
            dd = cutlass.Float32(0.0)
            if h < H:
                rq = bt * cutlass.Int64(H) + cutlass.Int64(h)
                lse = mLse[rq]
                if lse > -cutlass.Float32.inf:
                    lse2 = lse * LOG2_E
                    cc = mCoef[rq * 2]
                    dd = mCoef[rq * 2 + 1]
            row_lse[r] = lse2
            row_c[r] = cc
            row_d[r] = dd

        # Live heads of this CTA and which of this group's warps own at least one of them
        # (warp w of a group owns head rows 16 w .. 16 w + 15 of S / dP / dQ). Padded heads
        # (rows >= hl) have zero Q / dO and p~ = 0, so their dS / P rows are zero; warps with
        # only padded rows skip their MMAs, and the dKV MMAs (K = heads) stop at kh k-steps.
        hl = cutlass.min(H - h0, bm)
        kh = (hl + 15) // 16
        warp_live = (gtid // 32) * 16 < hl
        # dKV stores: lane 2i keeps row r of a quad pair, lane 2i + 1 row r + 8 (see _dkv_chunk).
        odd = (gtid % 2) == 1
        kr_mine = cutlass.Int32(cutlass.select_(odd, tCcC[1, 0][0], tCcC[0, 0][0]))

        # ---- main loop --------------------------------------------------------------------
        for blk in range(n_blocks):
            slot = blk % 2
            # Index of the next block's row crow, loaded now so that the gather issued after
            # the dQ step does not wait for it.
            nxt_row = self._fetch_idx(mIdx, blk + 1, k_eff, idx_base, crow)
            cute.arch.cp_async_wait_group(0)
            # Block blk is in sKV / sRow[slot]; the previous block's dKV step is done with
            # sDS / sP.
            cute.arch.sync_threads()

            # 1. S and dP for KV columns 32 grp .. 32 grp + 31.
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, hn)), cutlass.Float32)
            acc_S.fill(0.0)
            acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, hn)), cutlass.Float32)
            acc_dP.fill(0.0)
            if warp_live:
                self._gemm(tiled_mma, thr_mma, acc_S, sQ, sK_g, s2r_A, s2r_B)
                self._gemm(tiled_mma, thr_mma, acc_dP, sDO, sV_g, s2r_A, s2r_B)

            S_mn = self._mn_view(acc_S)
            dP_mn = self._mn_view(acc_dP)
            for c in cutlass.range_constexpr(n_cols):
                kvc = grp * hn + tScS[0, c][1]
                valid = sRow[slot * bn + kvc] >= 0
                for r in cutlass.range_constexpr(n_rows):
                    p = cutlass.Float32(0.0)
                    if valid:
                        p = cute.math.exp2(S_mn[r, c] * scale_log2 - row_lse[r], fastmath=True)
                    # bf16: scale folded into dS (dq and the dS^T Q half of dkv both carry it).
                    ds = p * (row_c[r] * dP_mn[r, c] - row_d[r])
                    if cutlass.const_expr(self.fold_scale):
                        ds = (p * scale) * (row_c[r] * dP_mn[r, c] - row_d[r])
                    row = tScS[r, c][0]
                    sDS[row, kvc] = ds.to(self.dtype)
                    sP[row, kvc] = (row_c[r] * p).to(self.dtype)
            cute.arch.sync_threads()

            # 2. dQ += dS K (this group's 256 columns; group 1 also the rope columns).
            if warp_live:
                self._gemm(tiled_mma, thr_mma, acc_dQ, sDS, sKt_g, s2r_A, s2r_Bt)
                if cutlass.const_expr(self.rope > 0):
                    if grp == 1:
                        self._gemm(tiled_mma, thr_mma, acc_dQr, sDS, sKt_r, s2r_A, s2r_Bt)
            # Everyone is done with the KV stage.
            cute.arch.sync_threads()

            # 3. Gather the next block; it lands while the dKV step below runs.
            if blk + 1 < n_blocks:
                self._load_block(mKV, sRow, sKV, cp_atom, nxt_row, 1 - slot, S, kv_batch,
                                 crow, csub)
            cute.arch.cp_async_commit_group()

            # 4. dKV for this block, 64 columns at a time.
            dst_base = kv_batch  # atomic mode: row b * S + idx
            if cutlass.const_expr(self.deterministic):
                dst_base = (ws_tok + cutlass.Int64(blk * bn)) * cutlass.Int64(n_hb) + \
                    cutlass.Int64(hb)
            for i in cutlass.range_constexpr(self.n_col_chunks_g):
                ch = grp * self.n_col_chunks_g + i
                self._dkv_chunk(tiled_mma, thr_mma, s2r_At, s2r_Bt, sDSt, sPt,
                                q_base, do_base, sT_layout, ch, True, kh, scale,
                                mDKV, sRow, slot, dst_base, n_hb, tCcC, odd, kr_mine)
            if cutlass.const_expr(self.rope > 0):
                if grp == 0:
                    self._dkv_chunk(tiled_mma, thr_mma, s2r_At, s2r_Bt, sDSt, sPt,
                                    q_base, do_base, sT_layout, d_v // 64, False, kh, scale,
                                    mDKV, sRow, slot, dst_base, n_hb, tCcC, odd, kr_mine)

        # ---- epilogue: dQ = acc (bf16: scale already in dS), staged through the Q buffer --
        dq_scale = cutlass.Float32(1.0)
        if cutlass.const_expr(not self.fold_scale):
            dq_scale = scale
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        ).get_slice(gtid)
        rdQ = cute.make_fragment_like(acc_dQ, self.dtype)
        rdQ.store((acc_dQ.load() * dq_scale).to(self.dtype))
        sdQ_g = self._at(q_base, sHalf_layout, grp * (bm * self.dv_g))
        cute.copy(r2s, r2s.retile(rdQ), r2s.partition_D(sdQ_g))
        if cutlass.const_expr(self.rope > 0):
            if grp == 1:
                rdQr = cute.make_fragment_like(acc_dQr, self.dtype)
                rdQr.store((acc_dQr.load() * dq_scale).to(self.dtype))
                sdQ_r = self._at(q_base, sT_layout, bm * d_v)
                cute.copy(r2s, r2s.retile(rdQr), r2s.partition_D(sdQ_r))
        cute.arch.sync_threads()

        st_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )
        if q_ok:
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                c = csub + self.tpr * i
                cute.copy(st_atom, self._chunk(sQ, crow, c), self._chunk(mDQ, q_row, c))

    @cute.jit
    def _dkv_chunk(self, tiled_mma: cute.TiledMma, thr_mma, s2r_At, s2r_Bt,
                   sDSt: cute.Tensor, sPt: cute.Tensor, q_base, do_base,
                   sT_layout: cute.ComposedLayout, ch: cutlass.Int32,
                   with_do: cutlass.Constexpr, kh: cutlass.Int32, scale: cutlass.Float32,
                   mDKV: cute.Tensor, sRow: cute.Tensor, slot: cutlass.Int32,
                   dst_base: cutlass.Int64, n_hb: cutlass.Int32, tCcC: cute.Tensor,
                   odd: cutlass.Boolean, kr_mine: cutlass.Int32):
        """dkv[rows of this block, 64 ch : 64 ch + 64] += (scale dS)^T Q[:, chunk]
        (+ (c P~)^T dO[:, chunk] when with_do), over the first kh 16-head k-steps only,
        valid rows only, with 16-byte vector atomics at row dst_base + idx (deterministic
        mode: 16-byte stores at workspace row dst_base + block row * n_hb)."""
        bm, bn = self.bm, self.bn
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bn, 64)), cutlass.Float32)
        acc.fill(0.0)
        sQt = self._t(self._at(q_base, sT_layout, ch * (bm * 64)), bm, 64)
        self._gemm(tiled_mma, thr_mma, acc, sDSt, sQt, s2r_At, s2r_Bt, kh)
        if cutlass.const_expr(not self.fold_scale):
            acc.store(acc.load() * scale)  # fp16: dS is stored unscaled
        if cutlass.const_expr(with_do):
            sDOt = self._t(self._at(do_base, sT_layout, ch * (bm * 64)), bm, 64)
            self._gemm(tiled_mma, thr_mma, acc, sPt, sDOt, s2r_At, s2r_Bt, kh)
        acc_mn = self._mn_view(acc)
        # m16n8 accumulator: lane l holds rows r = l // 4 and r + 8, columns 8 n + 2 (l % 4)
        # + {0, 1}. One butterfly shuffle (xor 1) per value pair gives lane 2i row r, columns
        # 8 n + 4 (i % 2) .. + 3, and lane 2i + 1 row r + 8, the same columns.
        assert cute.size(acc_mn, mode=[0]) == 2 and cute.size(acc_mn, mode=[1]) == 16
        row = sRow[slot * bn + kr_mine]
        dst_row = dst_base + cutlass.Int64(row)
        if cutlass.const_expr(self.deterministic):
            dst_row = dst_base + cutlass.Int64(kr_mine) * cutlass.Int64(n_hb)
        g_row = dst_row * cutlass.Int64(self.d_qk) + cutlass.Int64(ch * 64)
        for n in cutlass.range_constexpr(8):
            a00 = acc_mn[0, 2 * n]
            a01 = acc_mn[0, 2 * n + 1]
            a10 = acc_mn[1, 2 * n]
            a11 = acc_mn[1, 2 * n + 1]
            # even lanes send their row r + 8 pair, odd lanes their row r pair
            s0 = cutlass.Float32(cutlass.select_(odd, a00, a10))
            s1 = cutlass.Float32(cutlass.select_(odd, a01, a11))
            r0 = cute.arch.shuffle_sync_bfly(s0, offset=1)
            r1 = cute.arch.shuffle_sync_bfly(s1, offset=1)
            v0 = cutlass.Float32(cutlass.select_(odd, r0, a00))
            v1 = cutlass.Float32(cutlass.select_(odd, r1, a01))
            v2 = cutlass.Float32(cutlass.select_(odd, a10, r0))
            v3 = cutlass.Float32(cutlass.select_(odd, a11, r1))
            # first column of the 4: own column for even lanes, the partner's for odd ones
            col = tCcC[0, 2 * n][1] - cutlass.select_(odd, cutlass.Int32(2), cutlass.Int32(0))
            if row >= 0:
                if cutlass.const_expr(self.deterministic):
                    st_global_v4_f32(mDKV.iterator + (g_row + cutlass.Int64(col)), v0, v1, v2, v3)
                else:
                    red_add_v4_f32(mDKV.iterator + (g_row + cutlass.Int64(col)), v0, v1, v2, v3)


# -------------------------------------------------------------------- AOT compile entry
def compile_bwd(dtype, d_qk: int, d_v: int = 512, options: str | None = None,
                deterministic: bool = False):
    """Compile one specialization with fake (shape-only) tensors (common.bwd_fake_args); no GPU
    needed. `options`: extra cute.compile options, e.g. "--ptxas-options '-v'" to print
    registers / spills. deterministic: the dkv argument is the workspace (see __init__)."""
    return cute.compile(SparseMlaBwdSm90(dtype, d_qk, d_v, deterministic),
                        *bwd_fake_args(dtype, d_qk, d_v), **compile_options(options))
