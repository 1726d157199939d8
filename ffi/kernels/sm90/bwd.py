"""Sparse MLA backward for sm_90a: dq, dkv and delta for 64 head rows per CTA, one KV stage.

Per row (b, t, h), from the forward's lse (natural log, sink excluded, -inf on dead rows) and o,
and coef = (c, dlse) with c = 1 / (1 + exp(sink_h - lse)):
    delta = sum_d dO_d o_d (fp32, written out for the sink gradient),  D' = c delta - dlse,
    p~_j = exp(scale q.k_j - lse) (0 for invalid entries, dead and padded rows),
    dS_j = p~_j (c dO.v_j - D'),   dq = scale sum_j dS_j k_j,
    dkv[row_j] += scale sum_h dS_j q_h  (+ sum_h c p~_j dO_h on the first 512 columns).
Forms (each an export of ffi/build.py; jax_dsa/cute/config.py picks one): plain (fp32
red.global.add into dkv, zero-filled by the caller); deterministic=True (the contribution of
entry j of token bt and head block hb is stored, all Dqk columns, at workspace row
((bt - t_begin) * K + j) * n_hb + hb, and dkv_reduce.py sums each kv row's run in a fixed
order); group = 2 / 4 / 8 (the 64 rows are `group` consecutive tokens of 64 / group heads over
their merged list, jax_dsa/cute/grouping.py; head row i sees an entry only if membership bit
MEMBER_SHIFT + i // (64 / group) is set); two pools (SparseMlaBwdTwoPoolSm90, plain form: the
list numbers kv's rows then kv2's from S1 on, dkv holds both, and only the gather's source
address depends on the pool, _kv_source; c and the sink's gradient computed in the kernel from
the sink and lse).

Grid (n_tok tokens from t_begin x ceil(H / 64) head blocks, a token's head blocks adjacent),
256 threads = 2 warpgroups, one CTA per SM (up to 255 registers a thread). With pair_lockstep
(the `_long` builds) a token's two head blocks (H 65..128) run as one 2-CTA cluster whose CTAs
pass a cluster barrier at the top of every block, so the pair's gathers and REDs of each row
stay close in time. Prologue: the loads
nothing waits for first (block 0's indices, WG0's lse / coef), Q and dO to shared memory, block 0
gathered; kv_full's first phase completes when all of it has landed. WG1 then computes delta =
rowsum(dO O) per row (O from global) while WG0 runs block 0's S and dP, and WG0 waits for it
(named barrier DELTA_BAR) only before its first dS. Per 64-row KV block n:
  * WG0: S = Q K^T and dP = dO V^T (wgmma 64x64x16), dS; the 16-bit P and dS tiles to shared
    memory (arrives ds_full); dQ[:, :256] += dS K with dS as the register A operand; refills
    columns [0, 256) with block n + 1; dKV chunks [0, wg0_chunks) (none at Dqk 512, 4 at 576).
  * WG1: dQ[:, 256:Dqk] += dS K (both operands in shared memory, rope part included); refills
    columns [256, Dqk); dKV chunks [wg0_chunks, n_ch); arrives ds_empty once the last chunk's
    MMA is done, before that chunk's scatter (after it in the Dqk 576 `_long` builds:
    early_release False, 3 chunks in WG0).
  Each column range is refilled by its last reader, so the single stage needs no "kv empty"
  barrier and block n + 1's gather runs under block n's dKV chunks. A dKV chunk (64 rows x 64
  columns) is a wgmma over MN-major views of the resident tiles with ceil(live heads / 16)
  k-steps (one of four straight-line sequences: a wgmma under a runtime condition would be
  serialized), then one shuffle per value pair inside the warp into a permuted column layout
  that the Python wrapper undoes (scatter_layout.py), so that each red.global.add.v4.f32
  (deterministic: st.global.v4.f32) of a warp covers 4 rows x 128 contiguous bytes. At Dqk 512
  the chunks form one rolling pipeline, chunk c + 1's MMA running under chunk c's scatter.
  At Dqk 512 the REDs are predicated on the entry's validity rather than branched around:
  ptxas then makes the `_long` builds' evict-last policy once and puts a row's two REDs under
  one branch (a policy and a branch per RED were ~9 instructions each).
L2 policies (ffi/build.py LONG_BWD_TUNING, the `_long` builds the handler runs once the fp32 dkv
outgrows the L2): at Dqk 512 the dKV REDs are evict-last, and Q, dO and O (read once) and dQ
(written once) evict-first, so that these streams do not push out the kv and dkv lines that
later blocks and CTAs reuse; at Dqk 576 WG0 prefetches the next block's rows into the L2 (one
bulk prefetch per row) right after issuing a block's S / dP, so its gather after the dQ half
finds them there. Every head block of a token prefetches: with head block 0 alone the whole
backward was 15-30 % slower (most likely the pair drifts apart; docs/kernel_log.md).
Epilogue: each warpgroup stages its dQ columns in the KV columns it last read and stores them
behind a barrier of its own 128 threads, so WG0's store runs under WG1's last dKV chunks.
Shared memory: Q 72 KB + dO 64 KB + one KV stage 72 KB + P and dS 16 KB + row slots = 224.5 KB
at Dqk 576, 208.5 KB at 512. No spills, no local memory and no serialized wgmma
(dev/check_kernel_build.py fails otherwise); no ACCUMULATE flag depends on a runtime condition.
Scaling: bf16 folds scale into dS before rounding; fp16 keeps dS unscaled, stores P as
c p~ / scale, and multiplies dQ and dKV by scale in fp32.
Invariants: heads h >= H are zero rows of Q / dO (never read from global, p~ = 0, never
stored); dead rows get zero gradients; invalid entries (j >= min(K, topk_length), idx < 0,
idx >= S) are zero-filled rows with p~ = 0 and no RED or store; all offsets are 64-bit.

Why one long file: the gather, both dQ halves, the dKV chunk pipeline, the scatter and the
plain, deterministic and grouped forms are one kernel body, specialized at compile time
(const_expr), so every export comes from one source and the forms cannot drift apart. The
pipeline derivation and the per-block cost model: docs/kernel_log.md, "Design notes moved from
the kernel modules". Entry point: compile_bwd(dtype, d_qk, deterministic=, group=, options=),
arguments common.bwd_fake_args; compile_bwd_two_pool(dtype, d_qk), arguments
common.bwd_two_pool_fake_args; launched by ffi/sparse_mla_bwd.cc.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
import cuda.bindings.driver as cuda

from jax_dsa.cute.constants import MEMBER_SHIFT as GROUP_SHIFT, PERMUTED_DKV_DIMS

from .common import (LOG2_E, acc_mn_view, bwd_fake_args, bwd_two_pool_fake_args, chunk16,
                     compile_options, cp_async_16_policy, cp_async_16_zfill, gather_source,
                     l2_evict_first_policy, lane_opaque, ld_global_v4_b32_policy,
                     load_block_indices, prefetch_l2_bulk, red_add_f32, red_add_v4_f32,
                     st_global_v4_b32_policy, st_global_v4_f32, sw128_offset)
from .scatter_layout import pair_rows_exchange


# mbarrier slots
KV_FULL = 0
DS_FULL = 1
DS_EMPTY = 2
# named barrier: WG1 arrives once sDelta is written, WG0 syncs before its first dS
DELTA_BAR = 1
# named barriers of one warpgroup each: its dQ half staged before the group stores it
EPI0_BAR = 2
EPI1_BAR = 3


class SparseMlaBwdSm90:
    def __init__(self, dtype, d_qk: int, d_v: int = 512, deterministic: bool = False,
                 group: int = 1, red_evict_last: bool = False, wg0_chunks: int | None = None,
                 early_release: bool = True, stream_evict_first: bool = False,
                 l2_prefetch: bool = False, pair_lockstep: bool = False):
        assert d_v == 512 and d_qk in (512, 576)
        assert dtype in (cutlass.BFloat16, cutlass.Float16)
        self.dtype = dtype
        self.d_qk = d_qk
        self.d_v = d_v
        self.rope = d_qk - d_v  # 0 or 64
        self.deterministic = deterministic
        # The dKV REDs with an L2 evict-last policy (the `_long` exports at Dqk 512, which the
        # handler runs when the fp32 dkv accumulator outgrows the L2: the lines of the rows in
        # flight then stay; docs/kernel_log.md, eleventh session).
        self.red_evict_last = red_evict_last
        # Q, dO, O (read once) and dQ (written once) under an L2 evict-first policy, so that
        # they do not push out the kv rows and dkv lines that later blocks and CTAs reuse (the
        # `_long` builds at Dqk 512; docs/kernel_log.md, twenty-second session)
        self.stream_evict_first = stream_evict_first
        # WG0 prefetches the next block's kv rows into the L2 (one bulk prefetch per row, in
        # every head block) right after issuing this block's S / dP, so that the gather after
        # its dQ half finds them there (the `_long` builds at Dqk 576; docs/kernel_log.md,
        # thirtieth session)
        self.l2_prefetch = l2_prefetch
        # With two head blocks (H 65..128) a token's two CTAs are launched as one 2-CTA cluster
        # and pass a cluster barrier at the top of every block (arrive, then wait one block
        # later), so they walk the list within one block of each other and each entry's second
        # RED finds the first's dkv line in the L2 (the `_long` builds;
        # docs/kernel_log.md, thirty-second session). Grouped kernels always have one
        # head block.
        self.pair_lockstep = pair_lockstep and group == 1
        self.fold_scale = dtype is cutlass.BFloat16
        self.bm = 64  # heads per CTA
        self.bn = 64  # gathered KV rows per block
        self.threads = 256
        self.chunks = d_qk // 8  # 16-byte chunks per row
        self.split_col = 256  # KV columns [0, 256) refilled by WG0, [256, Dqk) by WG1
        self.g_tpr = 8  # gather threads per row (128 contiguous bytes per instruction)
        self.g_rows = 128 // self.g_tpr  # rows per pass (16)
        self.g_passes = self.bn // self.g_rows  # 4 rows per gather thread
        self.c0_chunks = self.split_col // 8  # 32
        self.c1_chunks = self.chunks - self.c0_chunks  # 40 or 32
        assert self.c0_chunks % self.g_tpr == 0 and self.c1_chunks % self.g_tpr == 0
        self.io_tpr = self.threads // self.bm  # 4 threads per row for the Q / dO copies
        self.n_ch = d_qk // 64  # dKV 64-column chunks (9 or 8)
        self.skip_heads = True  # issue only ceil(live heads / 16) dKV k-steps
        # dKV chunks [0, wg0_chunks) are computed by WG0 (after its dQ half and its gather), the
        # rest by WG1, which releases P / dS before its last chunk's scatter. Default: all 8 in
        # WG1 at Dqk 512, 4 of 9 in WG0 at 576 (docs/kernel_log.md).
        self.wg0_chunks = (0 if d_qk == 512 else 4) if wg0_chunks is None else wg0_chunks
        assert 0 <= self.wg0_chunks < self.n_ch
        # Dqk 576: WG1 releases P / dS before its last chunk's scatter (that chunk peeled off
        # the runtime loop), or with False after it (the long-context build: docs/design.md)
        self.early_release = early_release
        # dkv is added in the permuted column layout (scatter_layout.permuted_column), which
        # the Python wrapper undoes
        assert d_qk in PERMUTED_DKV_DIMS
        # Grouped: the 64 head rows are `group` consecutive tokens of 64 / group
        # heads each, and idx is the group's merged list (jax_dsa.cute.grouping.group_lists) with
        # the membership bits from bit GROUP_SHIFT up (grouping.pack_entries): head row i sees an
        # entry only if bit i // (64 / group) is set. The caller views q / dO / o / lse / dq as
        # [B, T / group, 64, D] (contiguous) and keeps S < 2^GROUP_SHIFT.
        assert group in (1, 2, 4, 8)
        self.group = group
        # Dqk 512: _dkv_block is one unrolled rolling pipeline (chunk c + 1's MMA issued before
        # chunk c's scatter); Dqk 576 issues the chunks one at a time (pairs spill).
        self.rolling = self.rope == 0


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
        mO: cute.Tensor,
        mCoef: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        mDelta: cute.Tensor,
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
        n_hb = (H + self.bm - 1) // self.bm
        # Grid x runs (token, head block) with the head blocks of a token adjacent: a token's
        # CTAs add to the same dkv rows close in time, while those are in L2.
        consts, smem_bytes = self._setup()
        self._launch(self.kernel, (mQ, mKV, mIdx, mLen, mLse, mDO, mO, mCoef, mDQ, mDKV, mDelta,
                                   T, H, S, K, t_begin, n_hb, scale, *consts),
                     n_tok, n_hb, smem_bytes, stream)

    @cute.jit
    def _launch(self, kernel, args: tuple, n_tok: cutlass.Int32, n_hb: cutlass.Int32,
                smem_bytes: int, stream: cuda.CUstream):
        """kernel(*args), one CTA per (token, head block); with pair_lockstep and two head
        blocks, each token's pair as one 2-CTA cluster."""
        launch = dict(grid=[n_tok * n_hb, 1, 1], block=[self.threads, 1, 1], smem=smem_bytes,
                      min_blocks_per_mp=1, stream=stream)
        if cutlass.const_expr(self.pair_lockstep):
            if n_hb == 2:
                kernel(*args).launch(cluster=[2, 1, 1], **launch)
            else:
                kernel(*args).launch(**launch)
        else:
            kernel(*args).launch(**launch)

    def _setup(self):
        """The kernel's compile-time arguments after scale (swizzle, layouts, tiled MMAs,
        SharedStorage) and its dynamic shared memory size."""
        dt = self.dtype
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        # K-major tiles (rows, cols with contiguous cols): (row, col) lives at
        # (col // 64) * 64 * rows + (row // 8) * 512 + swz((row % 8) * 64 + col % 64).
        sQ_layout = cute.tile_to_shape(k_atom, (self.bm, self.d_qk), (0, 1))
        sDO_layout = cute.tile_to_shape(k_atom, (self.bm, self.d_v), (0, 1))  # also V = KV[:, :512]
        sKV_layout = cute.tile_to_shape(k_atom, (self.bn, self.d_qk), (0, 1))
        sT_layout = cute.tile_to_shape(k_atom, (64, 64), (0, 1))  # P / dS (heads x rows)
        # MN-major views of the same bytes: (N or M = the contiguous dim, K = the rows).
        sKt_layout = cute.tile_to_shape(mn_atom, (self.split_col, self.bn), (1, 0))  # 256 x 64
        sTt_layout = cute.tile_to_shape(mn_atom, (64, 64), (1, 0))  # 64 x 64 transposed tile
        # dQ staging (software only): element-unit 128 B swizzle.
        o_atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sO_layout = cute.tile_to_shape(o_atom, (self.bm, self.d_qk), (0, 1))
        sOh_layout = cute.tile_to_shape(o_atom, (self.bm, self.split_col), (0, 1))
        sOr_layout = cute.tile_to_shape(o_atom, (self.bm, 64), (0, 1))

        SharedStorage = self._shared_storage(sQ_layout, sDO_layout, sKV_layout, sT_layout)

        K_ = warpgroup.OperandMajorMode.K
        MN_ = warpgroup.OperandMajorMode.MN
        F32 = cutlass.Float32
        sdp_mma = sm90_utils.make_trivial_tiled_mma(dt, dt, K_, K_, F32, (1, 1, 1), (64, 64))
        dq0_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_, MN_, F32, (1, 1, 1), (64, self.split_col), warpgroup.OperandSource.RMEM
        )
        dq1_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_, MN_, F32, (1, 1, 1), (64, self.split_col)
        )
        dqr_mma = sm90_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, F32, (1, 1, 1), (64, 64))
        dkv_mma = sm90_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, F32, (1, 1, 1), (64, 64))

        smem_bytes = SharedStorage.size_in_bytes()
        return ((k_atom.inner, sQ_layout.outer, sDO_layout.outer, sKV_layout.outer,
                 sT_layout.outer, sKt_layout.outer, sTt_layout.outer, sO_layout, sOh_layout,
                 sOr_layout, sdp_mma, dq0_mma, dq1_mma, dqr_mma, dkv_mma, SharedStorage),
                smem_bytes)

    # ---------------------------------------------------------------- helpers
    def _shared_storage(self, sQ_layout, sDO_layout, sKV_layout, sT_layout):
        dt = self.dtype

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sDO_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sT_layout)], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sT_layout)], 1024]
            sRow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.bm], 16]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 4], 8]

        return SharedStorage

    @property
    def _idx_walk(self):
        """load_block_indices' (bn, step, passes) for this kernel's gather threads."""
        return self.bn, self.g_rows, self.g_passes

    def _gather_mapping(self, gtid):
        """Gather thread mapping: 8 threads per row, rows grow + 16 p; (grow, gsub, index
        registers)."""
        return (gtid // self.g_tpr, gtid % self.g_tpr,
                cute.make_rmem_tensor(self.g_passes, cutlass.Int32))

    @cute.jit
    def _entry_row(self, entry: cutlass.Int32, S: cutlass.Int32):
        """A list entry's kv row (grouped: the membership bits removed) and whether it is valid
        (entry >= 0 and row < S)."""
        row = entry
        if cutlass.const_expr(self.group > 1):
            row = entry & ((1 << GROUP_SHIFT) - 1)
        return row, entry >= 0 and row < S

    @cute.jit
    def _gather_row(self, idx_r: cute.Tensor, p: cutlass.Constexpr, S: cutlass.Int32,
                    grow: cutlass.Int32, gsub: cutlass.Int32, sRow: cute.Tensor, slot,
                    write_rows: cutlass.Constexpr):
        """Block row r = grow + 16 p of a gather: (r, its kv row, valid); with write_rows lane
        gsub 0 also records the entry (-1 if invalid) in sRow for the dKV scatter."""
        r = grow + self.g_rows * p
        entry = idx_r[p]
        row, ok = self._entry_row(entry, S)
        if cutlass.const_expr(write_rows):
            if gsub == 0:
                # (grouped: the whole entry, bits included; readers decode it)
                sRow[slot * self.bn + r] = entry if ok else cutlass.Int32(-1)
        return r, row, ok

    @cute.jit
    def _prefetch_rows(self, kv_src, idx_r: cute.Tensor, S: cutlass.Int32,
                       kv_batch: cutlass.Int64, gsub: cutlass.Int32):
        """L2 prefetch of the whole kv rows of this thread's gather entries (idx_r): of the 8
        threads of a row group, thread gsub = p takes entry p; invalid entries read nothing."""
        assert self.g_passes <= self.g_tpr
        for p in cutlass.range_constexpr(self.g_passes):
            row, ok = self._entry_row(idx_r[p], S)
            ok = ok and gsub == p
            src, _ = self._row_source(kv_src, kv_batch, row, ok, cutlass.Int64(0))
            prefetch_l2_bulk(src, self.d_qk * 2, cutlass.Int32(ok))

    @cute.jit
    def _row_source(self, kv_src, kv_batch: cutlass.Int64, row: cutlass.Int32, ok,
                    sub_bytes: cutlass.Int64):
        """(global address, cp.async src-size) of the 16-byte chunk at sub_bytes of kv row
        `row` (kv_src: _kv_source's tuple); an invalid entry's address is kv's own and its size
        0, so that a copy from it reads nothing."""
        if cutlass.const_expr(len(kv_src) == 1):
            src, nbytes = gather_source(kv_src[0], kv_batch, row, ok, self.d_qk * 2, sub_bytes)
        else:
            kv_addr, base1, base2, s1 = kv_src
            src, nbytes = gather_source(base1 if row < s1 else base2, kv_batch, row, ok,
                                        self.d_qk * 2, sub_bytes)
            src = src if ok else kv_addr
        return src, nbytes

    @cute.jit
    def _kv_source(self, mKV: cute.Tensor, pool2, b: cutlass.Int32, S: cutlass.Int32):
        """Where the gather reads a row of the list: (kv's address,) for one pool; for two
        pools (SparseMlaBwdTwoPoolSm90: rows [0, S1) of kv, rows [S1, S) of kv2, S = S1 + S2)
        (kv's address, base1, base2, S1) with base1 + (b S + row) * row_bytes = kv[b, row] and
        base2 + (b S + row) * row_bytes = kv2[b, row - S1], so that the row's address keeps
        the one-pool form (kv_batch = b S, the dkv rows' batch offset, as the scatter uses)."""
        kv_addr = mKV.iterator.toint()
        src = (kv_addr,)
        if cutlass.const_expr(pool2 is not None):
            mKV2, s1 = pool2[0], pool2[1]
            rb = cutlass.Int64(self.d_qk * 2)
            bb = cutlass.Int64(b)
            base1 = kv_addr - bb * cutlass.Int64(S - s1) * rb
            base2 = mKV2.iterator.toint() - (bb + 1) * cutlass.Int64(s1) * rb
            src = (kv_addr, base1, base2, s1)
        return src

    @cute.jit
    def _gather(self, kv_src, dbase: cutlass.Int32, idx_r: cute.Tensor,
                S: cutlass.Int32, kv_batch: cutlass.Int64, grow: cutlass.Int32,
                gsub: cutlass.Int32, c_lo: cutlass.Constexpr, n_chunks: cutlass.Constexpr,
                sRow: cute.Tensor, slot, write_rows: cutlass.Constexpr):
        """Columns [8 c_lo, 8 (c_lo + n_chunks)) of the block's rows grow + 16 p: 16-byte
        cp.async from kv[b, idx], or zeros for an invalid entry (src-size 0: nothing is read
        from global). Every copy is one cp.async at constant offsets, so a gather is a few
        instructions around its 16 LDGSTS rather than swizzled address arithmetic per copy:
        chunk gsub + 8 i of row grow + 16 p sits in column tile
        c_lo / 8 + i, at row offset 128 (grow + 16 p) and swizzle slot gsub ^ (grow % 8)
        (dbase: that slot of row grow in tile 0; kv_src: _kv_source's tuple)."""
        for p in cutlass.range_constexpr(self.g_passes):
            _, row, ok = self._gather_row(idx_r, p, S, grow, gsub, sRow, slot, write_rows)
            src, nbytes = self._row_source(kv_src, kv_batch, row, ok, cutlass.Int64(gsub * 16))
            for i in cutlass.range_constexpr(n_chunks // self.g_tpr):
                ct = c_lo // 8 + i
                cp_async_16_zfill(dbase, src, nbytes,
                                  ct * (self.bn * 128) + p * self.g_rows * 128, ct * 128)

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
        mO: cute.Tensor,
        mCoef: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        mDelta: cute.Tensor,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        t_begin: cutlass.Int32,
        n_hb: cutlass.Int32,
        scale: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sDO_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sT_layout: cute.Layout,
        sKt_layout: cute.Layout,
        sTt_layout: cute.Layout,
        sO_layout: cute.ComposedLayout,
        sOh_layout: cute.ComposedLayout,
        sOr_layout: cute.ComposedLayout,
        sdp_mma: cute.TiledMma,
        dq0_mma: cute.TiledMma,
        dq1_mma: cute.TiledMma,
        dqr_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        """The one-pool kernel."""
        self._body(mQ, mKV, mIdx, mLen, mLse, mDO, mO, mCoef, mDQ, mDKV, mDelta, T, H, S, K,
                   t_begin, n_hb, scale, swz, sQ_layout, sDO_layout, sKV_layout, sT_layout,
                   sKt_layout, sTt_layout, sO_layout, sOh_layout, sOr_layout, sdp_mma, dq0_mma,
                   dq1_mma, dqr_mma, dkv_mma, SharedStorage, None)

    @cute.jit
    def _body(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mLse: cute.Tensor,
        mDO: cute.Tensor,
        mO: cute.Tensor,
        mCoef: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        mDelta: cute.Tensor,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        t_begin: cutlass.Int32,
        n_hb: cutlass.Int32,
        scale: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sDO_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sT_layout: cute.Layout,
        sKt_layout: cute.Layout,
        sTt_layout: cute.Layout,
        sO_layout: cute.ComposedLayout,
        sOh_layout: cute.ComposedLayout,
        sOr_layout: cute.ComposedLayout,
        sdp_mma: cute.TiledMma,
        dq0_mma: cute.TiledMma,
        dq1_mma: cute.TiledMma,
        dqr_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        pool2,
    ):
        """The kernel body. pool2: None, or SparseMlaBwdTwoPoolSm90's (mKV2, S1, mSink, mDlse,
        mDsink), with mCoef and mDelta None (c and dsink come from the sink and lse here)."""
        bm, bn = self.bm, self.bn
        d_qk, d_v = self.d_qk, self.d_v
        tidx, _, _ = cute.arch.thread_idx()
        th, _, _ = cute.arch.block_idx()
        hb = th % n_hb
        tok = th // n_hb
        wg = tidx // 128
        gtid = tidx % 128
        h0 = hb * bm
        bt32 = t_begin + tok
        bt = cutlass.Int64(bt32)
        b = bt32 // T
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + bn - 1) // bn
        idx_base = bt * cutlass.Int64(K)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_base = storage.sQ.data_ptr()
        kv_base = storage.sKV.data_ptr()
        q_sw = cute.recast_ptr(q_base, swizzle_=swz)
        do_sw = cute.recast_ptr(storage.sDO.data_ptr(), swizzle_=swz)
        kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
        p_sw = cute.recast_ptr(storage.sP.data_ptr(), swizzle_=swz)
        ds_sw = cute.recast_ptr(storage.sDS.data_ptr(), swizzle_=swz)
        sQ = cute.make_tensor(q_sw, sQ_layout)
        sDO = cute.make_tensor(do_sw, sDO_layout)
        sKV = cute.make_tensor(kv_sw, sKV_layout)
        sV = cute.make_tensor(kv_sw, sDO_layout)
        sP = cute.make_tensor(p_sw, sT_layout)
        sDS = cute.make_tensor(ds_sw, sT_layout)
        sRow = storage.sRow.get_tensor(cute.make_layout(2 * bn))
        sDelta = storage.sDelta.get_tensor(cute.make_layout(bm))
        mbar = storage.mbar.data_ptr()

        # The prologue's global loads that nothing else waits for go first, so their latencies
        # overlap the Q / dO copies instead of following each other: block 0's indices (bounded
        # by K, not by the valid length, whose load they would otherwise wait for; masked below)
        # and the lse / coef of WG0's accumulator rows (used after delta).
        grow, gsub, idx_r = self._gather_mapping(gtid)
        load_block_indices(mIdx, idx_r, 0, K, idx_base, grow, *self._idx_walk)
        # (row, column) of each S / dP accumulator value of this thread (WG0's layout)
        tScS = acc_mn_view(
            sdp_mma.get_slice(gtid).partition_C(cute.make_identity_tensor((bm, bn))))
        n_rows = cute.size(tScS, mode=[0])
        pre_lse = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        pre_c = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        pre_dlse = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(n_rows):
            h = h0 + tScS[r, 0][0]
            pre_lse[r] = -cutlass.Float32.inf
            pre_c[r] = cutlass.Float32(0.0)
            pre_dlse[r] = cutlass.Float32(0.0)
            if h < H:
                rq = bt * cutlass.Int64(H) + cutlass.Int64(h)
                pre_lse[r] = mLse[rq]
                if cutlass.const_expr(pool2 is None):
                    pre_c[r] = mCoef[rq * 2]
                    pre_dlse[r] = mCoef[rq * 2 + 1]
                else:  # the sink for now: c once lse is known to be finite
                    pre_c[r] = pool2[2][h]
                    pre_dlse[r] = pool2[3][rq]

        if tidx == 0:
            cute.arch.mbarrier_init(mbar + KV_FULL, 2 * self.threads)
            cute.arch.mbarrier_init(mbar + DS_FULL, 128)
            cute.arch.mbarrier_init(mbar + DS_EMPTY, 128)
        cute.arch.mbarrier_init_fence()

        # ---- Q and dO (padded heads zero-filled, never read) -------------------------------
        crow = tidx // self.io_tpr
        csub = tidx % self.io_tpr
        q_ok = h0 + crow < H
        q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + crow)
        if cutlass.const_expr(self.stream_evict_first):
            # (here, where every lane is converged: lane_opaque is a warp shuffle)
            q_do_dst = self._q_do_dst(storage, crow, csub)
        if q_ok:
            if cutlass.const_expr(self.stream_evict_first):
                self._copy_q_do_policy(mQ, mDO, q_do_dst, q_row, csub)
            else:
                cp_atom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                    self.dtype,
                    num_bits_per_copy=128,
                )
                for i in cutlass.range_constexpr(self.chunks // self.io_tpr):
                    c = csub + self.io_tpr * i
                    cute.copy(cp_atom, chunk16(mQ, q_row, c), chunk16(sQ, crow, c))
                for i in cutlass.range_constexpr(d_v // 8 // self.io_tpr):
                    c = csub + self.io_tpr * i
                    cute.copy(cp_atom, chunk16(mDO, q_row, c), chunk16(sDO, crow, c))
        else:
            for i in cutlass.range_constexpr(self.chunks // self.io_tpr):
                chunk16(sQ, crow, csub + self.io_tpr * i).fill(0)
            for i in cutlass.range_constexpr(d_v // 8 // self.io_tpr):
                chunk16(sDO, crow, csub + self.io_tpr * i).fill(0)
        cute.arch.sync_threads()  # mbarrier inits visible before any arrive

        # ---- block 0's indices and gather --------------------------------------------------
        kv_src = self._kv_source(mKV, pool2, b, S)
        g_dbase = storage.sKV.data_ptr().toint() + grow * 128 + ((gsub ^ (grow % 8)) * 16)
        for p in cutlass.range_constexpr(self.g_passes):  # entries past the valid length
            if grow + self.g_rows * p >= k_eff:
                idx_r[p] = cutlass.Int32(-1)
        if n_blocks > 0:
            if wg == 0:
                self._gather(kv_src, g_dbase, idx_r, S, kv_batch, grow, gsub, 0,
                             self.c0_chunks, sRow, 0, True)
            else:
                self._gather(kv_src, g_dbase, idx_r, S, kv_batch, grow, gsub,
                             self.c0_chunks, self.c1_chunks, sRow, 0, False)
        # kv_full's phase 0 completes once every thread's Q / dO copies (and block 0's gather)
        # have landed, also with no block: WG1 waits on it before delta reads dO, WG0 before
        # its first S / dP.
        cute.arch.cp_async_mbarrier_arrive_noinc(mbar + KV_FULL)
        cute.arch.mbarrier_arrive(mbar + KV_FULL)

        # live heads of this CTA -> dKV k-steps (K = heads)
        hl = cutlass.min(H - h0, bm)
        kh = (hl + 15) // 16

        if wg == 0:
            # ===================================== WG0 =====================================
            thr_sdp = sdp_mma.get_slice(gtid)
            thr_dq = dq0_mma.get_slice(gtid)
            tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ))
            tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sKV))
            tSrDO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sDO))
            tSrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
            sKt0 = cute.make_tensor(kv_sw, sKt_layout)
            tQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKt0))
            acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((bm, self.split_col)))
            acc_dQ.fill(0.0)
            acc_shape = thr_sdp.partition_shape_C((bm, bn))
            n_cols = cute.size(tScS, mode=[1])
            # per-row constants: lse*log2e (+inf: p~ = 0 for dead / padded rows), c,
            # D' = c * delta - dlse (-dlse here; c * delta added once WG1 has delta, block 0)
            row_lse = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_c = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_d = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_pc = cute.make_rmem_tensor(n_rows, cutlass.Float32)  # P = p~ * row_pc
            # P scale: c (bf16) or c / scale (fp16; dkv is multiplied by scale afterwards)
            p_mul = cutlass.Float32(1.0)
            if cutlass.const_expr(not self.fold_scale):
                p_mul = 1.0 / scale
            for r in cutlass.range_constexpr(n_rows):
                lse2 = cutlass.Float32.inf
                cc = cutlass.Float32(0.0)
                dd = cutlass.Float32(0.0)
                if pre_lse[r] > -cutlass.Float32.inf:  # padded heads kept -inf
                    lse2 = pre_lse[r] * LOG2_E
                    cc = pre_c[r]
                    if cutlass.const_expr(pool2 is not None):  # c = 1 / (1 + e^(sink - lse))
                        cc = 1.0 / (1.0 + cute.math.exp2((pre_c[r] - pre_lse[r]) * LOG2_E,
                                                         fastmath=True))
                    dd = -pre_dlse[r]
                row_lse[r] = lse2
                row_c[r] = cc
                row_d[r] = dd
                row_pc[r] = cc * p_mul
                if cutlass.const_expr(self.fold_scale):
                    row_c[r] = cc * scale
                    row_d[r] = dd * scale
            scale_log2 = scale * LOG2_E
            if cutlass.const_expr(self.wg0_chunks > 0):
                dkv_mma.set(warpgroup.Field.ACCUMULATE, True)
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), sdp_mma
            ).get_slice(gtid)

            for blk in range(n_blocks):
                slot = blk % 2
                self._pair_step(blk, n_hb, True)
                # next block's indices now; their latency hides behind the MMAs
                load_block_indices(mIdx, idx_r, blk + 1, k_eff, idx_base, grow,
                                   *self._idx_walk)
                cute.arch.mbarrier_wait(mbar + KV_FULL, blk % 2)
                cute.arch.fence_proxy("async.shared", space="cta")

                acc_S = thr_sdp.make_fragment_C(acc_shape)
                acc_dP = thr_sdp.make_fragment_C(acc_shape)
                warpgroup.fence()
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    sdp_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                    cute.gemm(sdp_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                for k in cutlass.range_constexpr(cute.size(tSrDO, mode=[2])):
                    sdp_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                    cute.gemm(sdp_mma, acc_dP, tSrDO[None, None, k], tSrV[None, None, k],
                              acc_dP)
                warpgroup.commit_group()
                if cutlass.const_expr(self.l2_prefetch):
                    if blk + 1 < n_blocks:
                        self._prefetch_rows(kv_src, idx_r, S, kv_batch, gsub)
                warpgroup.wait_group(0)
                if blk == 0:  # D' += c delta (bf16: times scale), delta from WG1
                    cute.arch.barrier(barrier_id=DELTA_BAR, number_of_threads=self.threads)
                    for r in cutlass.range_constexpr(n_rows):
                        if row_lse[r] < cutlass.Float32.inf:
                            row_d[r] = row_d[r] + row_c[r] * sDelta[tScS[r, 0][0]]

                S_mn = acc_mn_view(acc_S)
                dP_mn = acc_mn_view(acc_dP)
                for c in cutlass.range_constexpr(n_cols):
                    entry = sRow[slot * bn + tScS[0, c][1]]
                    valid = entry >= 0
                    for r in cutlass.range_constexpr(n_rows):
                        if cutlass.const_expr(self.group > 1):
                            # this head row's token must have the entry in its own list
                            tok_bit = GROUP_SHIFT + tScS[r, 0][0] // (bm // self.group)
                            valid = entry >= 0 and ((entry >> tok_bit) & 1) != 0
                        e = cute.math.exp2(S_mn[r, c] * scale_log2 - row_lse[r], fastmath=True)
                        p = cutlass.Float32(cutlass.select_(valid, e, cutlass.Float32(0.0)))
                        # dS (bf16: times scale, folded into row_c / row_d)
                        dP_mn[r, c] = p * (row_c[r] * dP_mn[r, c] - row_d[r])
                        S_mn[r, c] = p * row_pc[r]
                # 16-bit fragments: P (for sP) and dS (register A operand of dQ, and sDS)
                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                tQrDS = cute.make_rmem_tensor(thr_dq.partition_shape_A((bm, bn)), self.dtype)
                rDS = cute.make_tensor(tQrDS.iterator, acc_dP.layout)
                rDS.store(acc_dP.load().to(self.dtype))
                # the previous block's dKV is done with sP / sDS (and its sRow slot)
                if blk > 0:
                    cute.arch.mbarrier_wait(mbar + DS_EMPTY, (blk - 1) % 2)
                cute.copy(r2s, r2s.retile(rP), r2s.partition_D(sP))
                cute.copy(r2s, r2s.retile(rDS), r2s.partition_D(sDS))
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(mbar + DS_FULL)

                # dQ[:, 0:256] += dS K[:, 0:256] (dS from registers)
                warpgroup.fence()
                dq0_mma.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tQrDS, mode=[2])):
                    cute.gemm(dq0_mma, acc_dQ, tQrDS[None, None, k], tQrK[None, None, k],
                              acc_dQ)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # refill columns [0, 256) with block blk + 1 (last reader of them: this dQ)
                if blk + 1 < n_blocks:
                    self._gather(kv_src, g_dbase, idx_r, S, kv_batch, grow, gsub, 0,
                                 self.c0_chunks, sRow, 1 - slot, True)
                    cute.arch.cp_async_mbarrier_arrive_noinc(mbar + KV_FULL)
                    cute.arch.mbarrier_arrive(mbar + KV_FULL)

                # dKV chunks [0, wg0_chunks) of this block (its own P / dS tiles: the next
                # block's are written only after this, in program order)
                if cutlass.const_expr(self.wg0_chunks > 0):
                    self._dkv_block(dkv_mma, gtid, ds_sw, p_sw, q_sw, do_sw, sTt_layout, sRow,
                                    slot, blk, bt32, t_begin, K, kv_batch, hb, n_hb, kh, scale,
                                    mDKV, 0, self.wg0_chunks)

            if n_blocks == 0:  # (WG1 arrives on it in every CTA)
                cute.arch.barrier(barrier_id=DELTA_BAR, number_of_threads=self.threads)
            # dQ[:, 0:256) staged in KV columns [0, 256) (their last reader was this group's
            # last dQ MMA) and stored by this group alone, under WG1's last dKV chunks
            if cutlass.const_expr(not self.fold_scale):
                acc_dQ.store(acc_dQ.load() * scale)
            r2s_o0 = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), dq0_mma
            ).get_slice(gtid)
            rdQ0 = cute.make_fragment_like(acc_dQ, self.dtype)
            rdQ0.store(acc_dQ.load().to(self.dtype))
            sdQ0 = cute.make_tensor(kv_base, sOh_layout)
            cute.copy(r2s_o0, r2s_o0.retile(rdQ0), r2s_o0.partition_D(sdQ0))
            self._pair_step(n_blocks, n_hb, False)
            self._store_dq(kv_base, sO_layout, mDQ, gtid, bt, h0, H, 0, self.c0_chunks,
                           EPI0_BAR)
        else:
            # ===================================== WG1 =====================================
            self._delta(gtid, mO, mLse, mDelta, sDO, sDelta, mbar, pool2, bt, b, h0, H)
            self._wg1(dq1_mma, dqr_mma, dkv_mma, gtid, sDS, kv_sw, sKt_layout, sTt_layout,
                      n_blocks, mIdx, idx_r, k_eff, idx_base, grow, mbar, kv_src, g_dbase, S,
                      kv_batch, gsub, sRow, ds_sw, p_sw, q_sw, do_sw, bt32, t_begin, K, hb,
                      n_hb, kh, scale, mDKV, kv_base, sOh_layout, sOr_layout)
            self._pair_step(n_blocks, n_hb, False)
            self._store_dq(kv_base, sO_layout, mDQ, gtid, bt, h0, H, self.c0_chunks,
                           self.c1_chunks, EPI1_BAR)

    @cute.jit
    def _pair_step(self, blk, n_hb: cutlass.Int32, arrive: cutlass.Constexpr):
        """pair_lockstep with two head blocks: wait for the pair's arrivals at block blk - 1,
        then (arrive) arrive at block blk. Every thread of both CTAs calls it at the top of
        each block of its loop and once after it (blk = n_blocks, no arrival), so the counts
        match (a token's two CTAs walk the same list)."""
        if cutlass.const_expr(self.pair_lockstep):
            if n_hb == 2:
                if blk > 0:
                    cute.arch.cluster_wait()
                if cutlass.const_expr(arrive):
                    cute.arch.cluster_arrive_relaxed()

    @cute.jit
    def _store_dq(self, o_base, sO_layout: cute.ComposedLayout, mDQ: cute.Tensor,
                  gtid: cutlass.Int32, bt: cutlass.Int64, h0: cutlass.Int32, H: cutlass.Int32,
                  c_lo: cutlass.Constexpr, n_chunks: cutlass.Constexpr, bar_id: cutlass.Constexpr):
        """One warpgroup's dQ columns [8 c_lo, 8 (c_lo + n_chunks)), staged by it at o_base
        (sO_layout), to global after a barrier of its own 128 threads: 8 threads per row, so a
        warp's 16-byte stores cover 128 contiguous bytes of 4 rows; live heads only."""
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
        sO = cute.make_tensor(o_base, sO_layout)
        pol = l2_evict_first_policy() if cutlass.const_expr(self.stream_evict_first) else None
        st_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )
        for p in cutlass.range_constexpr(self.bm // 16):
            row = gtid // 8 + 16 * p
            if h0 + row < H:
                q_row = bt * cutlass.Int64(H) + cutlass.Int64(h0 + row)
                for i in cutlass.range_constexpr(n_chunks // 8):
                    c = c_lo + gtid % 8 + 8 * i
                    if cutlass.const_expr(self.stream_evict_first):
                        r = cute.make_rmem_tensor(8, self.dtype)
                        cute.autovec_copy(chunk16(sO, row, c), r)
                        r32 = cute.recast_tensor(r, cutlass.Int32)
                        st_global_v4_b32_policy(
                            mDQ.iterator.toint() + (q_row * cutlass.Int64(self.d_qk) + c * 8) * 2,
                            [r32[j] for j in range(4)], pol)
                    else:
                        cute.copy(st_atom, chunk16(sO, row, c), chunk16(mDQ, q_row, c))

    @cute.jit
    def _q_do_dst(self, storage, crow: cutlass.Int32, csub: cutlass.Int32):
        """Shared addresses for _copy_q_do_policy: the copies place chunk c = csub + 4 i of
        head row crow as the default copies do (sw128 tiles of 64 columns), i.e. in column
        tile i // 2 at swizzle slot (csub + 4 (i % 2)) ^ (crow % 8). So two bases per buffer
        (even and odd i) and constant offsets, each base through lane_opaque (a warp shuffle:
        all lanes must be converged here)."""
        assert self.io_tpr == 4
        even = sw128_offset(self.bm, crow, csub)  # chunk csub; chunk csub + 4 (odd i) below
        odd = sw128_offset(self.bm, crow, csub + 4)
        q_base = storage.sQ.data_ptr().toint()
        do_base = storage.sDO.data_ptr().toint()
        return (lane_opaque(q_base + even), lane_opaque(q_base + odd),
                lane_opaque(do_base + even), lane_opaque(do_base + odd))

    @cute.jit
    def _copy_q_do_policy(self, mQ: cute.Tensor, mDO: cute.Tensor, dst, q_row: cutlass.Int64,
                          csub: cutlass.Int32):
        """This thread's Q and dO chunks of global row q_row into shared memory at dst
        (_q_do_dst) under an L2 evict-first policy: one cp.async each, a register plus
        immediates on both sides."""
        pol = l2_evict_first_policy()
        q_src = mQ.iterator.toint() + (q_row * cutlass.Int64(self.d_qk) + csub * 8) * 2
        do_src = mDO.iterator.toint() + (q_row * cutlass.Int64(self.d_v) + csub * 8) * 2
        for src, d_even, d_odd, n in ((q_src, dst[0], dst[1], self.chunks // 4),
                                      (do_src, dst[2], dst[3], self.d_v // 8 // 4)):
            for i in cutlass.range_constexpr(n):
                cp_async_16_policy(d_odd if i % 2 else d_even, src, pol,
                                   (i // 2) * self.bm * 128, 64 * i)

    @cute.jit
    def _delta(self, gtid: cutlass.Int32, mO: cute.Tensor, mLse: cute.Tensor, mDelta,
               sDO: cute.Tensor, sDelta: cute.Tensor, mbar, pool2, bt: cutlass.Int64,
               b: cutlass.Int32, h0: cutlass.Int32, H: cutlass.Int32):
        """WG1, before its block loop (while WG0 computes block 0's S and dP): delta =
        rowsum(dO O) in fp32, two threads per head row, each over every other 16-byte chunk,
        O from global (issued before the wait for the copies) and dO from shared memory;
        written to sDelta for WG0 (then arrives on DELTA_BAR), and to mDelta for the sink
        gradient (one pool, live heads), or as each row's -(1 - c) delta RED into dsink (two
        pools)."""
        row = gtid // 2
        half = gtid % 2
        h = h0 + row
        q_row = bt * cutlass.Int64(H) + cutlass.Int64(h)
        n_ld = self.d_v // 8 // 2
        rO = cute.make_rmem_tensor((8, n_ld), self.dtype)
        rO.fill(0)
        rO32 = cute.recast_tensor(rO, cutlass.Int32)  # (4, n_ld): the evict-first loads' view
        # two pools: this row's sink and lse for its dsink term (-inf: none)
        d_sink = -cutlass.Float32.inf
        d_lse = -cutlass.Float32.inf
        if h < H:
            if cutlass.const_expr(pool2 is not None):
                if half == 0:
                    d_sink = pool2[2][h]
                    d_lse = mLse[q_row]
            if cutlass.const_expr(self.stream_evict_first):
                pol = l2_evict_first_policy()
                o_src = mO.iterator.toint() + q_row * cutlass.Int64(self.d_v * 2)
                for i in cutlass.range_constexpr(n_ld):
                    v = ld_global_v4_b32_policy(o_src + cutlass.Int64((2 * i + half) * 16), pol)
                    for j in cutlass.range_constexpr(4):
                        rO32[j, i] = v[j]
            else:
                ld_atom = cute.make_copy_atom(
                    cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
                )
                for i in cutlass.range_constexpr(n_ld):
                    cute.copy(ld_atom, chunk16(mO, q_row, 2 * i + half), rO[None, i])
        cute.arch.mbarrier_wait(mbar + KV_FULL, 0)  # every thread's dO copies have landed
        prod = cute.make_rmem_tensor(8, cutlass.Float32)
        prod.fill(0.0)
        for i in cutlass.range_constexpr(n_ld):
            d8 = chunk16(sDO, row, 2 * i + half).load().to(cutlass.Float32)
            prod.store(prod.load() + d8 * rO[None, i].load().to(cutlass.Float32))
        delta = prod.load().reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
        delta = delta + cute.arch.shuffle_sync_bfly(delta, offset=1)  # the row's two lanes
        if half == 0:
            sDelta[row] = delta
            if cutlass.const_expr(pool2 is None):
                if h < H:
                    mDelta[q_row] = delta
            else:
                # dsink[b, h] -= (1 - c) delta, 1 - c = 1 / (1 + e^(lse - sink)) (rows with a
                # sink and a finite lse only: none for "no sink", none on dead rows)
                if d_sink > -cutlass.Float32.inf and d_lse > -cutlass.Float32.inf:
                    share = 1.0 / (1.0 + cute.math.exp2((d_lse - d_sink) * LOG2_E,
                                                        fastmath=True))
                    red_add_f32(pool2[4].iterator + (cutlass.Int64(b) * cutlass.Int64(H)
                                                     + cutlass.Int64(h)),
                                -share * delta)
        cute.arch.barrier_arrive(barrier_id=DELTA_BAR, number_of_threads=self.threads)

    @cute.jit
    def _wg1(self, dq1_mma, dqr_mma, dkv_mma, gtid, sDS, kv_sw, sKt_layout, sTt_layout,
             n_blocks, mIdx, idx_r, k_eff, idx_base, grow, mbar, kv_src, g_dbase, S, kv_batch,
             gsub, sRow, ds_sw, p_sw, q_sw, do_sw, bt32, t_begin, K, hb, n_hb, kh, scale, mDKV,
             o_base, sOh_layout, sOr_layout):
        """WG1's block loop: per block the dQ half on KV columns [256, Dqk), the refill of those
        columns with the next block, this block's dKV chunks [wg0_chunks, n_ch); then its dQ
        half staged in KV columns [256, Dqk) (their last reader was its last dQ MMA)."""
        bm, bn, d_v = self.bm, self.bn, self.d_v
        thr_dq = dq1_mma.get_slice(gtid)
        thr_dqr = dqr_mma.get_slice(gtid)
        tQrDS = thr_dq.make_fragment_A(thr_dq.partition_A(sDS))
        sKt1 = cute.make_tensor(kv_sw + cute.assume(bn * self.split_col, divby=512),
                                sKt_layout)
        tQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKt1))
        acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((bm, self.split_col)))
        acc_dQ.fill(0.0)
        acc_dQr = None
        tRrDS = None
        tRrK = None
        if cutlass.const_expr(self.rope > 0):
            tRrDS = thr_dqr.make_fragment_A(thr_dqr.partition_A(sDS))
            sKtr = cute.make_tensor(kv_sw + cute.assume(bn * d_v, divby=512), sTt_layout)
            tRrK = thr_dqr.make_fragment_B(thr_dqr.partition_B(sKtr))
            acc_dQr = thr_dqr.make_fragment_C(thr_dqr.partition_shape_C((bm, 64)))
            acc_dQr.fill(0.0)
        dq1_mma.set(warpgroup.Field.ACCUMULATE, True)
        dqr_mma.set(warpgroup.Field.ACCUMULATE, True)
        dkv_mma.set(warpgroup.Field.ACCUMULATE, True)

        for blk in range(n_blocks):
            slot = blk % 2
            self._pair_step(blk, n_hb, True)
            load_block_indices(mIdx, idx_r, blk + 1, k_eff, idx_base, grow, *self._idx_walk)
            cute.arch.mbarrier_wait(mbar + DS_FULL, blk % 2)
            cute.arch.mbarrier_wait(mbar + KV_FULL, blk % 2)
            cute.arch.fence_proxy("async.shared", space="cta")

            # dQ[:, 256:Dqk] += dS K[:, 256:Dqk]
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tQrDS, mode=[2])):
                cute.gemm(dq1_mma, acc_dQ, tQrDS[None, None, k], tQrK[None, None, k],
                          acc_dQ)
            if cutlass.const_expr(self.rope > 0):
                for k in cutlass.range_constexpr(cute.size(tRrDS, mode=[2])):
                    cute.gemm(dqr_mma, acc_dQr, tRrDS[None, None, k], tRrK[None, None, k],
                              acc_dQr)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # refill columns [256, Dqk) with block blk + 1 (last reader: the dQ above)
            if blk + 1 < n_blocks:
                self._gather(kv_src, g_dbase, idx_r, S, kv_batch, grow, gsub,
                             self.c0_chunks, self.c1_chunks, sRow, 1 - slot, False)
                cute.arch.cp_async_mbarrier_arrive_noinc(mbar + KV_FULL)
                cute.arch.mbarrier_arrive(mbar + KV_FULL)

            # dKV chunks [wg0_chunks, n_ch) of this block; arrives ds_empty once their MMAs
            # are done (this block's P / dS tiles and sRow slot are free again)
            self._dkv_block(dkv_mma, gtid, ds_sw, p_sw, q_sw, do_sw, sTt_layout, sRow, slot,
                            blk, bt32, t_begin, K, kv_batch, hb, n_hb, kh, scale, mDKV,
                            self.wg0_chunks, self.n_ch, release=mbar + DS_EMPTY)

        if cutlass.const_expr(not self.fold_scale):
            acc_dQ.store(acc_dQ.load() * scale)
        r2s_o = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), dq1_mma
        ).get_slice(gtid)
        rdQ = cute.make_fragment_like(acc_dQ, self.dtype)
        rdQ.store(acc_dQ.load().to(self.dtype))
        sdQ1 = cute.make_tensor(o_base + cute.assume(bm * self.split_col, divby=512),
                                sOh_layout)
        cute.copy(r2s_o, r2s_o.retile(rdQ), r2s_o.partition_D(sdQ1))
        if cutlass.const_expr(self.rope > 0):
            if cutlass.const_expr(not self.fold_scale):
                acc_dQr.store(acc_dQr.load() * scale)
            r2s_r = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), dqr_mma
            ).get_slice(gtid)
            rdQr = cute.make_fragment_like(acc_dQr, self.dtype)
            rdQr.store(acc_dQr.load().to(self.dtype))
            sdQr = cute.make_tensor(o_base + cute.assume(bm * d_v, divby=512), sOr_layout)
            cute.copy(r2s_r, r2s_r.retile(rdQr), r2s_r.partition_D(sdQr))

    @cute.jit
    def _dkv_block(self, dkv_mma: cute.TiledMma, gtid: cutlass.Int32, ds_sw, p_sw, q_sw, do_sw,
                   sTt_layout: cute.Layout, sRow: cute.Tensor, slot, blk, bt32: cutlass.Int32,
                   t_begin: cutlass.Int32, K: cutlass.Int32, kv_batch: cutlass.Int64,
                   hb: cutlass.Int32, n_hb: cutlass.Int32, kh: cutlass.Int32,
                   scale: cutlass.Float32, mDKV: cute.Tensor, ch_lo: cutlass.Constexpr,
                   ch_hi: cutlass.Constexpr, release=None):
        """dKV columns [64 ch_lo, 64 ch_hi) of one block in 64-column chunks: wgmma with
        A = dS^T / P^T (M = KV rows, K = heads), B = Q / dO column chunks (N = 64 columns,
        K = heads), all MN-major views of the K-major smem tiles; then _scatter adds (or
        stores) each chunk. `release` (an mbarrier or None) is arrived on once the last chunk's
        MMA is done, when the P / dS tiles and the row slot (read into registers at the start)
        are free, before that chunk's scatter (at Dqk 576 the last chunk is peeled off the
        runtime loop for this; with early_release False it comes after the loop)."""
        bn, bm = self.bn, self.bm
        thr_kv = dkv_mma.get_slice(gtid)
        tKrDS = thr_kv.make_fragment_A(thr_kv.partition_A(cute.make_tensor(ds_sw, sTt_layout)))
        tKrP = thr_kv.make_fragment_A(thr_kv.partition_A(cute.make_tensor(p_sw, sTt_layout)))
        acc_kv_shape = thr_kv.partition_shape_C((bn, 64))
        # after _scatter's lane transpose, lane l of warp w adds to block rows
        # 16 w + 2 (l // 8) + {0, 1} + {0, 8} (see _scatter)
        kr_base = (gtid // 32) * 16 + 2 * ((gtid % 32) // 8)
        out_scale = cutlass.Float32(1.0)
        if cutlass.const_expr(not self.fold_scale):
            out_scale = scale
        lane = gtid % 32
        tok_row0 = cutlass.Int64(bt32 - t_begin) * cutlass.Int64(K)
        # this thread's 4 rows (r = kr_base + q0 + 8 rho, in order (rho, q0)): the gathered
        # row (-1: invalid entry, nothing is added) and its dkv offset
        rows = []
        g_bases = []
        for i in cutlass.range_constexpr(4):
            kr = kr_base + (i % 2) + 8 * (i // 2)
            row = sRow[slot * bn + kr]
            if cutlass.const_expr(self.group > 1):
                row = row & ((1 << GROUP_SHIFT) - 1) if row >= 0 else cutlass.Int32(-1)
            if cutlass.const_expr(self.deterministic):
                g_bases.append(((tok_row0 + cutlass.Int64(blk * bn + kr))
                                * cutlass.Int64(n_hb) + cutlass.Int64(hb))
                               * cutlass.Int64(self.d_qk))
            else:
                g_bases.append((kv_batch + cutlass.Int64(row)) * cutlass.Int64(self.d_qk))
            rows.append(row)
        # Dqk 512 (`rolling`): one straight-line pipeline over the chunks. Dqk 576 issues one
        # chunk at a time in a runtime loop: WG1's rope dQ accumulator leaves no room for a
        # second 64 x 64 one (ptxas spills).
        if cutlass.const_expr(self.rolling):
            # acc(c + 1) is issued into the other accumulator (its previous chunk, c - 1, was
            # scattered in the step before) and runs under scatter(c); all straight-line, so
            # no wgmma is in flight across a loop back edge
            accs = [self._dkv_issue(dkv_mma, thr_kv, acc_kv_shape, tKrDS, tKrP, q_sw, do_sw,
                                    sTt_layout, kh, ch_lo), None]
            for ch in cutlass.range_constexpr(ch_lo, ch_hi):
                if cutlass.const_expr(ch + 1 < ch_hi):
                    accs[(ch + 1 - ch_lo) % 2] = self._dkv_issue(
                        dkv_mma, thr_kv, acc_kv_shape, tKrDS, tKrP, q_sw, do_sw, sTt_layout, kh,
                        ch + 1)
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(release is not None):
                        cute.arch.mbarrier_arrive(release)
                self._scatter(accs[(ch - ch_lo) % 2], lane, rows, g_bases, ch, out_scale, mDKV)
        else:
            # with `release` and early_release, the last chunk is peeled off the loop so that
            # the release comes between its MMA and its scatter; else after the loop
            peel = release is not None and self.early_release
            ch_loop = ch_hi - 1 if cutlass.const_expr(peel) else ch_hi
            for ch in cutlass.range(ch_lo, ch_loop, unroll=1):
                acc = self._dkv_issue(dkv_mma, thr_kv, acc_kv_shape, tKrDS, tKrP, q_sw, do_sw,
                                      sTt_layout, kh, ch)
                warpgroup.wait_group(0)
                self._scatter(acc, lane, rows, g_bases, ch, out_scale, mDKV)
            if cutlass.const_expr(peel):
                acc = self._dkv_issue(dkv_mma, thr_kv, acc_kv_shape, tKrDS, tKrP, q_sw, do_sw,
                                      sTt_layout, kh, ch_hi - 1)
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(release)
                self._scatter(acc, lane, rows, g_bases, ch_hi - 1, out_scale, mDKV)
            elif cutlass.const_expr(release is not None):
                cute.arch.mbarrier_arrive(release)

    @cute.jit
    def _dkv_issue(self, dkv_mma: cute.TiledMma, thr_kv, acc_kv_shape, tKrDS: cute.Tensor,
                   tKrP: cute.Tensor, q_sw, do_sw, sTt_layout: cute.Layout, kh: cutlass.Int32,
                   ch) -> cute.Tensor:
        """Issue (and commit, not wait for) dKV chunk ch into a new zero-filled accumulator."""
        bm = self.bm
        sQc = cute.make_tensor(q_sw + cute.assume(ch * (bm * 64), divby=512), sTt_layout)
        tKrQ = thr_kv.make_fragment_B(thr_kv.partition_B(sQc))
        sDOc = cute.make_tensor(do_sw + cute.assume(ch * (bm * 64), divby=512), sTt_layout)
        tKrDO = thr_kv.make_fragment_B(thr_kv.partition_B(sDOc))
        acc = thr_kv.make_fragment_C(acc_kv_shape)
        acc.fill(0.0)
        # Straight-line wgmma sequences per live-head count (a wgmma under a runtime
        # condition is serialized by ptxas).
        if kh == 4 or cutlass.const_expr(not self.skip_heads):
            self._dkv_mma(dkv_mma, acc, tKrDS, tKrQ, tKrP, tKrDO, ch, 4)
        elif kh == 1:
            self._dkv_mma(dkv_mma, acc, tKrDS, tKrQ, tKrP, tKrDO, ch, 1)
        elif kh == 2:
            self._dkv_mma(dkv_mma, acc, tKrDS, tKrQ, tKrP, tKrDO, ch, 2)
        else:
            self._dkv_mma(dkv_mma, acc, tKrDS, tKrQ, tKrP, tKrDO, ch, 3)
        return acc

    @cute.jit
    def _dkv_mma(self, dkv_mma: cute.TiledMma, acc: cute.Tensor, tKrDS: cute.Tensor,
                 tKrQ: cute.Tensor, tKrP: cute.Tensor, tKrDO: cute.Tensor, ch: cutlass.Int32,
                 nk: cutlass.Constexpr):
        """acc += dS^T Q_ch (+ P^T dO_ch for ch < 8) over the first nk 16-head k-steps
        (dkv_mma accumulates: ACCUMULATE is set once, outside all runtime control flow)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(nk):
            cute.gemm(dkv_mma, acc, tKrDS[None, None, k], tKrQ[None, None, k], acc)
        if ch < self.d_v // 64:
            for k in cutlass.range_constexpr(nk):
                cute.gemm(dkv_mma, acc, tKrP[None, None, k], tKrDO[None, None, k], acc)
        warpgroup.commit_group()

    @cute.jit
    def _scatter(self, acc: cute.Tensor, lane: cutlass.Int32, rows: list, g_bases: list,
                 ch: cutlass.Int32, out_scale: cutlass.Float32, mDKV: cute.Tensor):
        """Add (or store) this thread's share of a 64 x 64 dKV chunk so that every 16-byte
        RED / store instruction of a warp covers 4 rows x 128 contiguous bytes (whole L2 lines),
        in the permuted column layout of scatter_layout.permuted_column (jax_dsa/cute/ffi.py
        restores the logical order when it casts dkv).

        Why: L2 processes a warp's reduction per 128-byte line touched, so random-row adds are
        fastest when each instruction covers whole lines: 4 rows x 128 B beats 8 x 64 B and the
        plain accumulator layout's 16 x 32 B (dev/red_scatter_bench.cu; the numbers are in
        docs/kernel_log.md, "line-wide RED"). In the permuted layout the 4 lanes of a row
        already hold 64 contiguous bytes of each 32-column half, so one shuffle per value pair
        between the lanes of rows q and q ^ 1 (scatter_layout.pair_rows_exchange: 16 shuffles
        and 48 selects per chunk) makes the 8 lanes of a row pair cover 128 bytes of one row;
        lane l then adds, for each (rho, second, g2), 4 floats at permuted columns
        32 g2 + 4 (l % 8) + [0, 4) of chunk row 16 w + 2 (l // 8) + second + 8 rho."""
        acc_mn = acc_mn_view(acc)
        assert cute.size(acc_mn, mode=[0]) == 2 and cute.size(acc_mn, mode=[1]) == 16
        odd = (lane & 4) != 0

        def select(p, a, b):
            return cutlass.Float32(cutlass.select_(p, a, b))

        def shuffle_xor4(x):
            return cute.arch.shuffle_sync_bfly(x, offset=4)

        out = pair_rows_exchange([acc_mn[(i >> 4) & 1, i & 15] * out_scale for i in range(32)],
                                 odd, select, shuffle_xor4)
        col0 = ch * 64 + 4 * (lane % 8)
        for rho in cutlass.range_constexpr(2):
            for second in cutlass.range_constexpr(2):
                for g2 in cutlass.range_constexpr(2):
                    v0, v1, v2, v3 = out[(rho, second, g2)]
                    off = g_bases[2 * rho + second] + cutlass.Int64(col0 + 32 * g2)
                    if cutlass.const_expr(self.deterministic):
                        if rows[2 * rho + second] >= 0:
                            st_global_v4_f32(mDKV.iterator + off, v0, v1, v2, v3)
                    elif cutlass.const_expr(self.rolling):
                        # predicated, not branched (the module docstring; at Dqk 576 the
                        # predicated form spills in the two-pool exports and serializes the
                        # grouped `_long` ones' wgmma)
                        red_add_v4_f32(mDKV.iterator + off, v0, v1, v2, v3,
                                       evict_last=self.red_evict_last,
                                       pred=cutlass.Int32(rows[2 * rho + second] >= 0))
                    elif rows[2 * rho + second] >= 0:
                        red_add_v4_f32(mDKV.iterator + off, v0, v1, v2, v3,
                                       evict_last=self.red_evict_last)


# -------------------------------------------------------------------- AOT compile entry
class SparseMlaBwdTwoPoolSm90(SparseMlaBwdSm90):
    """The plain backward over two KV pools without building one: idx holds both pools' rows
    as one (pool 2's from S1 = kv's row count on, as jax_dsa._core.one_list numbers them) and
    dkv has S = S1 + S2 rows; only the gather reads row r from kv2[b, r - S1] when r >= S1
    (_kv_source). Instead of coef and delta it takes the sink [H] and dlse [B*T*H], computes c
    per row and adds each row's -(1 - c) delta to dsink [B*H] (zero-filled by the caller) with
    one fp32 RED. Everything else is the one-pool kernel's."""

    def __init__(self, dtype, d_qk: int, d_v: int = 512, **tuning):
        super().__init__(dtype, d_qk, d_v, **tuning)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mKV2: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mLse: cute.Tensor,
        mDO: cute.Tensor,
        mO: cute.Tensor,
        mSink: cute.Tensor,
        mDlse: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        mDsink: cute.Tensor,
        B: cutlass.Int32,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        S1: cutlass.Int32,
        K: cutlass.Int32,
        t_begin: cutlass.Int32,
        n_tok: cutlass.Int32,
        scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        n_hb = (H + self.bm - 1) // self.bm
        consts, smem_bytes = self._setup()
        self._launch(self.kernel_two_pool,
                     (mQ, mKV, mKV2, mIdx, mLen, mLse, mDO, mO, mSink, mDlse, mDQ, mDKV, mDsink,
                      T, H, S, S1, K, t_begin, n_hb, scale, *consts),
                     n_tok, n_hb, smem_bytes, stream)

    @cute.kernel
    def kernel_two_pool(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mKV2: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mLse: cute.Tensor,
        mDO: cute.Tensor,
        mO: cute.Tensor,
        mSink: cute.Tensor,
        mDlse: cute.Tensor,
        mDQ: cute.Tensor,
        mDKV: cute.Tensor,
        mDsink: cute.Tensor,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        S1: cutlass.Int32,
        K: cutlass.Int32,
        t_begin: cutlass.Int32,
        n_hb: cutlass.Int32,
        scale: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sDO_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sT_layout: cute.Layout,
        sKt_layout: cute.Layout,
        sTt_layout: cute.Layout,
        sO_layout: cute.ComposedLayout,
        sOh_layout: cute.ComposedLayout,
        sOr_layout: cute.ComposedLayout,
        sdp_mma: cute.TiledMma,
        dq0_mma: cute.TiledMma,
        dq1_mma: cute.TiledMma,
        dqr_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self._body(mQ, mKV, mIdx, mLen, mLse, mDO, mO, None, mDQ, mDKV, None, T, H, S, K,
                   t_begin, n_hb, scale, swz, sQ_layout, sDO_layout, sKV_layout, sT_layout,
                   sKt_layout, sTt_layout, sO_layout, sOh_layout, sOr_layout, sdp_mma, dq0_mma,
                   dq1_mma, dqr_mma, dkv_mma, SharedStorage, (mKV2, S1, mSink, mDlse, mDsink))


def compile_bwd_two_pool(dtype, d_qk: int, d_v: int = 512, **tuning):
    """Compile the two-pool backward with fake tensors (common.bwd_two_pool_fake_args);
    `tuning`: red_evict_last, wg0_chunks, early_release, stream_evict_first, l2_prefetch
    (SparseMlaBwdSm90)."""
    return cute.compile(SparseMlaBwdTwoPoolSm90(dtype, d_qk, d_v, **tuning),
                        *bwd_two_pool_fake_args(dtype, d_qk, d_v))


def compile_bwd(dtype, d_qk: int, d_v: int = 512, deterministic: bool = False,
                group: int = 1, options: str | None = None, **tuning):
    """Compile one specialization with fake (shape-only) tensors (common.bwd_fake_args); no GPU
    needed. `tuning`: red_evict_last, wg0_chunks (None: the default for d_qk), early_release,
    stream_evict_first, l2_prefetch (SparseMlaBwdSm90). `options`: extra cute.compile options, e.g.
    "--ptxas-options '-v'"."""
    return cute.compile(SparseMlaBwdSm90(dtype, d_qk, d_v, deterministic, group=group, **tuning),
                        *bwd_fake_args(dtype, d_qk, d_v), **compile_options(options))
