"""Sparse MLA forward for sm_90a, 64 heads per CTA: warp-specialized ping-pong consumers.

For each (b, t, h): o = sum_j p_j v_j, with p the softmax of scale * q . k_j over the valid
entries and the sink in the denominator only, and lse (natural log, sink excluded). The default
forward for H > 32 (jax_dsa/cute/config.py); fwd_small_heads.py covers H <= 32.

Grid (T * ceil(H / 64), 1, B), a token's head blocks adjacent; 384 threads = 3 warpgroups,
one CTA per SM:
  * warpgroup 0, the producer (setmaxnreg 72): loads the indices and gathers 64-row KV blocks
    with 16-byte cp.async into a 2-stage ring (stage = block parity). A stage has two column
    halves, L = 0..255 and R = 256..Dqk-1, each with a full and an empty mbarrier; per pair of
    blocks the halves are filled 0L, 1R, 0R, 1L, each once its readers released it. Invalid rows
    are zero-filled; their validity flags go out with the first half of each stage.
  * warpgroups 1 and 2, the consumers "WG0" / "WG1" of the comments (cg = 0 / 1, setmaxnreg
    216), own the even / the odd blocks. Each computes its block's whole 64 x 64 S = Q K^T
    (wgmma 64x64x16); the row maxima pass WG0 -> WG1 -> WG0 through named barriers once per
    pair; each accumulates its half of O (d_v columns [256 cg, 256 cg + 256)) over both blocks
    of the pair: its own P from registers (wgmma RS), the partner's from shared memory (SS).
    Maxima are rescaled lazily (LAZY_RESCALE_LOG2).
Shared memory: Dqk 576: Q 72 KB + 2 x 72 KB ring + 8 KB P1 tile (P0 sits in the dead rope
columns of stage 0) = 224 KB; Dqk 512: 64 + 128 + 2 x 8 KB = 208 KB. Registers: 2 x 128 x 216 +
128 x 72 = 64512, no spills. No wgmma group is in flight across a loop back edge (ptxas would
serialize every wgmma, warning C7514). The barrier protocol, the ring's release order and why a
third stage does not fit: docs/kernel_log.md, "Design notes moved from the kernel modules".

Invariants: heads h >= H are zero Q rows, never stored (sink reads and lse stores guarded);
invalid entries (idx < 0, idx >= S, j >= topk_length) are never read and score -inf; a row
without a valid entry gets o = 0 and lse = -inf, never NaN; all row offsets are 64-bit. A token
with an odd number of blocks runs its last pair without block 2m + 1 (the named barriers still
run, so both consumers stay in step); a token without blocks runs the epilogue only.

Split (split=True, the decode form; jax_dsa/cute/config.py chooses it when the tokens alone
leave the GPU empty): o and lse hold P parts per token ([B, T, P, H] rows, P from their size on
the host, from the grid on the device); grid x runs (token, part, head block), and a CTA takes
entries [p ceil(K / P), (p + 1) ceil(K / P)) of its token's list (fewer for the last parts,
none past K; topk_length counts from the list's start), reads q at its token, and writes that
part's softmax without the sink (o = 0, lse = -inf for a part without a valid entry).
fwd_combine.py, launched next by the same handler, merges the parts by lse with the sink.

Two pools (SparseMlaFwdTwoPoolSm90, compile_fwd_two_pool; DeepSeek-V4's window over the raw
KV next to its top-k over the compressed KV): the token's blocks are ceil(K1 / 64) blocks of
pool 1's list (entries past K1 or topk_length invalid), then the blocks of pool 2's valid
prefix; each block's indices and rows come from its own pool (the producer picks the pool per
block; blocks 0 and 1 are prefetched from their pools at the CTA start, as the one-pool kernel
prefetches its first pair, and masked once the lengths are known). One softmax with the sink
over both; consumers and epilogue are the one-pool kernel's.

Entry point: compile_fwd_pingpong(dtype, d_qk, split=False), arguments common.fwd_fake_args
(flattened row-major views); ffi/build.py exports it as jax_dsa_fwd_pingpong_<dtype>_d<Dqk> and
jax_dsa_fwd_pingpong_split_<dtype>_d<Dqk>; compile_fwd_two_pool(dtype, d_qk) as
jax_dsa_fwd_two_pool_<dtype>_d<Dqk> (common.fwd_two_pool_fake_args).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
import cuda.bindings.driver as cuda

from cutlass.cute.nvgpu import cpasync

from .common import (LN_2, LOG2_E, acc_mn_view, chunk16, cp_async_16_zfill, fwd_fake_args,
                     fwd_two_pool_fake_args, gather_source, load_block_indices, quad_allreduce,
                     ring_stage)

CONSUMER_BAR = 1  # both consumer groups (Q ready, epilogue)
BAR_M0 = 2  # WG0's new row max published (WG0 arrives, WG1 syncs)
BAR_M1 = 3  # WG1's final row max published (WG1 arrives, WG0 syncs)
BAR_P0 = 4  # WG0's P tile (rescaled to the pair max) in shared memory
BAR_P1 = 5  # WG1's P tile in shared memory

# Lazy rescaling (as FA4 does on Blackwell): a row keeps its reference max while a new block's max
# exceeds it by at most this much (log2 units), so P <= 2^8 and O / the row sums are rescaled
# only when some row's reference moves (rare once the running max has settled).
LAZY_RESCALE_LOG2 = 8.0

# mbarrier slots
FULL_0L, FULL_0R, FULL_1L, FULL_1R = 0, 1, 2, 3
EMPTY_0L, EMPTY_0R, EMPTY_1L, EMPTY_1R = 4, 5, 6, 7


class SparseMlaFwdPingPongSm90:
    def __init__(self, dtype, d_qk: int, d_v: int = 512, split: bool = False):
        assert d_v == 512 and d_qk in (512, 576)
        self.dtype = dtype
        # The decode form (module docstring, "Split"): each CTA takes one part of a token's list.
        self.split = split
        self.d_qk = d_qk
        self.d_v = d_v
        self.bm = 64  # head rows per CTA
        self.bn = 64  # gathered KV rows per block
        self.bn_g = self.bn  # each owner scores all 64 keys of its block
        self.dv_g = d_v // 2  # O columns per consumer warpgroup
        self.chunks = d_qk // 8  # 16-byte chunks per row
        self.half_chunks = self.dv_g // 8  # 16-byte chunks of the L half (32)
        self.k_half = self.dv_g // 16  # k16 steps of Q K^T over the L half (16)
        self.threads = 384
        self.n_cons = 256  # consumer threads
        self.tpr = self.n_cons // self.bm  # consumer threads per row for the Q / O copies (4)
        self.p_tpr = 8  # producer threads per gathered row
        self.p_rows = 128 // self.p_tpr  # rows covered per pass (16)
        self.p_passes = self.bn // self.p_rows  # 4 rows per producer thread
        self.p_in_rope = d_qk == d_v + 64  # P tile stored in the dead rope columns
        assert self.chunks % self.p_tpr == 0
        assert (self.chunks - self.half_chunks) % self.p_tpr == 0
        # 2 x 128 x 216 + 128 x 72 = 64512 <= 65536 registers.
        self.prod_regs = 72
        self.cons_regs = 216

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
        SharedStorage, qk_mma, pv_rs, pv_ss = self._storage_and_mmas(
            sQ_layout, sKV_layout, sP_layout)
        n_head_blocks = (H + self.bm - 1) // self.bm
        # Grid x runs (token, head block) with the head blocks of a token adjacent: a token's
        # CTAs gather the same rows close in time, so the second finds them in L2.
        grid = [T * n_head_blocks, 1, B]
        if cutlass.const_expr(self.split):
            # (token, part, head block); the part count is what o / lse were sized for.
            n_parts = cutlass.Int32(cute.size(mLse) // cutlass.Int64(B * T * H))
            grid = [T * n_parts * n_head_blocks, 1, B]
        kernel = self.kernel(
            mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, scale * LOG2_E,
            k_atom.inner, sQ_layout.outer, sKV_layout.outer, sVt_layout.outer, sP_layout.outer,
            sO_layout, sOg_layout, qk_mma, pv_rs, pv_ss, SharedStorage,
        )
        kernel.launch(
            grid=grid,
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @property
    def _idx_walk(self):
        """load_block_indices' (bn, step, passes) for the producer threads."""
        return self.bn, self.p_rows, self.p_passes

    def _smem_layouts(self):
        """The 128 B K-major swizzle atom, then the outer layouts of Q, a KV stage, V^T (MN-major
        view of the same bytes), a P tile (the swizzle goes on the pointers: byte-address
        swizzle), and the software-swizzled O staging tile (element-unit 128 B swizzle), whole
        and per group."""
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

    def _storage_and_mmas(self, sQ_layout, sKV_layout, sP_layout):
        """The shared-memory struct (Q, the 2-stage ring, P tiles, row flags, the row-sum / max
        exchange buffers, the 8 mbarriers) and the tiled MMAs: Q K^T, P V with P in registers,
        P V with P in shared memory."""
        # P tiles: Dqk 576 -> P0 in stage 0's rope columns, only P1 here; Dqk 512 -> both.
        p_elems = cute.cosize(sP_layout) * (1 if self.p_in_rope else 2)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sKV_layout)], 1024
            ]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sValid: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * self.bn], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.bm], 16]
            sM: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.bm], 16]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 8], 8]

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (self.bm, self.bn),
        )
        pv_rs = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (self.bm, self.dv_g), warpgroup.OperandSource.RMEM,
        )
        pv_ss = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (self.bm, self.dv_g), warpgroup.OperandSource.SMEM,
        )
        return SharedStorage, qk_mma, pv_rs, pv_ss

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _load_pair_idx(self, mIdx: cute.Tensor, cur0: cute.Tensor, cur1: cute.Tensor, m,
                       k_eff: cutlass.Int32, idx_base: cutlass.Int64, prow: cutlass.Int32):
        """Pair m's indices (pair 0's were loaded at the CTA start; m >= pairs: all -1, nothing
        read), at the top of pair m, right before its row addresses need them (their latency
        hides behind the empty waits; loading them a pair earlier is no faster and holds 8 more
        registers across the pair: docs/kernel_log.md)."""
        if m > 0:
            load_block_indices(mIdx, cur0, 2 * m, k_eff, idx_base, prow, *self._idx_walk)
            load_block_indices(mIdx, cur1, 2 * m + 1, k_eff, idx_base, prow, *self._idx_walk)

    @cute.jit
    def _first_pair_indices(self, pre0: cute.Tensor, pre1: cute.Tensor, prow: cutlass.Int32,
                            k_eff: cutlass.Int32):
        """The first pair's indices, loaded at the CTA start before k_eff was known, masked
        now (-1 past k_eff)."""
        cur0 = cute.make_rmem_tensor(self.p_passes, cutlass.Int32)
        cur1 = cute.make_rmem_tensor(self.p_passes, cutlass.Int32)
        for p in cutlass.range_constexpr(self.p_passes):
            j = prow + self.p_rows * p
            cur0[p] = pre0[p] if j < k_eff else cutlass.Int32(-1)
            cur1[p] = pre1[p] if j + self.bn < k_eff else cutlass.Int32(-1)
        return cur0, cur1

    @cute.jit
    def _row_sources(self, cur: cute.Tensor, src: cute.Tensor, nbytes: cute.Tensor,
                     kv_addr: cutlass.Int64, kv_batch: cutlass.Int64, S: cutlass.Int32,
                     gsub: cutlass.Int64):
        """Per pass p: the global byte address of this thread's first chunk of row cur[p] and
        16, or (invalid row) the tensor's base and 0: a src-size-0 copy writes zeros."""
        for p in cutlass.range_constexpr(self.p_passes):
            row = cur[p]
            src[p], nbytes[p] = gather_source(kv_addr, kv_batch, row, row >= 0 and row < S,
                                              self.d_qk * 2, gsub)

    @cute.jit
    def _two_pool_idx(self, mIdx: cute.Tensor, dst: cute.Tensor, blk, k_eff: cutlass.Int32,
                      idx_base: cutlass.Int64, mIdx2: cute.Tensor, k_eff2: cutlass.Int32,
                      idx_base2: cutlass.Int64, n_blocks1: cutlass.Int32, prow: cutlass.Int32):
        """Two pools: block blk's indices, from pool 1's list for the first n_blocks1 blocks,
        else block blk - n_blocks1 of pool 2's; -1 at and past each list's bound."""
        if blk < n_blocks1:
            load_block_indices(mIdx, dst, blk, k_eff, idx_base, prow, *self._idx_walk)
        else:
            load_block_indices(mIdx2, dst, blk - n_blocks1, k_eff2, idx_base2, prow,
                               *self._idx_walk)

    @cute.jit
    def _first_pair_indices_two_pool(self, pre0: cute.Tensor, pre1: cute.Tensor,
                                     prow: cutlass.Int32, k_eff: cutlass.Int32, lists2):
        """_first_pair_indices for two pools: block 0 is pool 1's (K1 >= 1), block 1 pool 1's
        second block or pool 2's first."""
        _, k_eff2, _, _, _, _, n_blocks1 = lists2
        lim1 = k_eff - self.bn if n_blocks1 > 1 else k_eff2
        cur0 = cute.make_rmem_tensor(self.p_passes, cutlass.Int32)
        cur1 = cute.make_rmem_tensor(self.p_passes, cutlass.Int32)
        for p in cutlass.range_constexpr(self.p_passes):
            j = prow + self.p_rows * p
            cur0[p] = pre0[p] if j < k_eff else cutlass.Int32(-1)
            cur1[p] = pre1[p] if j < lim1 else cutlass.Int32(-1)
        return cur0, cur1

    @cute.jit
    def _produce(self, mKV: cute.Tensor, mIdx: cute.Tensor, sValid: cute.Tensor,
                 kv_smem: cutlass.Int32, mbar, n_blocks: cutlass.Int32, k_eff: cutlass.Int32,
                 S: cutlass.Int32, idx_base: cutlass.Int64, kv_batch: cutlass.Int64,
                 ptid: cutlass.Int32, pre0, pre1, lists2=None):
        """Per pair m: fills 0L, 1R, 0R, 1L (stage 1 only when block 2m+1 exists), each after
        the previous pair's release of that half; with the first half of a stage lane psub 0
        writes the rows' validity flags. pre0 / pre1: the first pair's indices, loaded at the
        CTA start before k_eff was known. lists2 (two pools): _two_pool_block's tuple; the
        blocks' indices are then all loaded here.

        Every copy is one cp.async at constant offsets from two registers, so a half-stage fill
        is a short run of instructions: the producer's warps share the schedulers with the
        consumers' softmax, and a late half's fill sits on the pair's chain between a release
        and the next Q K^T (docs/kernel_log.md). Thread (prow, psub) copies
        16-byte chunk psub + 8 i of rows prow + 16 p; in the K-major 128 B-swizzled stage
        (column tiles of 64 rows x 128 B) that chunk sits at tile i (+4 in the R half), row
        offset 128 (prow + 16 p), slot psub ^ (prow % 8): one per-thread shared base plus
        constants. Each row's global address is computed once per block; invalid rows copy
        zeros (src-size 0, no branch)."""
        psub = ptid % self.p_tpr
        prow = ptid // self.p_tpr
        npass = self.p_passes
        hc = self.half_chunks
        n_l = hc // self.p_tpr
        n_r = (self.chunks - hc) // self.p_tpr
        stage_bytes = self.bn * self.d_qk * 2
        tile_bytes = self.bn * 128  # one 64-column tile of a stage
        kv_addr = mKV.iterator.toint()
        dbase = kv_smem + prow * 128 + ((psub ^ (prow % 8)) * 16)
        gsub = cutlass.Int64(psub * 16)
        if cutlass.const_expr(lists2 is None):
            cur0, cur1 = self._first_pair_indices(pre0, pre1, prow, k_eff)
        else:
            cur0, cur1 = self._first_pair_indices_two_pool(pre0, pre1, prow, k_eff, lists2)
        src0 = cute.make_rmem_tensor(npass, cutlass.Int64)
        src1 = cute.make_rmem_tensor(npass, cutlass.Int64)
        nb0 = cute.make_rmem_tensor(npass, cutlass.Int32)
        nb1 = cute.make_rmem_tensor(npass, cutlass.Int32)
        n_pairs = (n_blocks + 1) // 2
        for m in range(n_pairs):
            has1 = 2 * m + 1 < n_blocks
            ph = (m + 1) % 2  # parity of the previous pair's release
            if cutlass.const_expr(lists2 is None):
                self._load_pair_idx(mIdx, cur0, cur1, m, k_eff, idx_base, prow)
                self._row_sources(cur0, src0, nb0, kv_addr, kv_batch, S, gsub)
                self._row_sources(cur1, src1, nb1, kv_addr, kv_batch, S, gsub)
            else:
                mIdx2, k_eff2, idx_base2, kv_addr2, kv_batch2, S2, n_blocks1 = lists2
                if m > 0:
                    self._two_pool_idx(mIdx, cur0, 2 * m, k_eff, idx_base, mIdx2, k_eff2,
                                       idx_base2, n_blocks1, prow)
                    self._two_pool_idx(mIdx, cur1, 2 * m + 1, k_eff, idx_base, mIdx2, k_eff2,
                                       idx_base2, n_blocks1, prow)
                if 2 * m < n_blocks1:
                    self._row_sources(cur0, src0, nb0, kv_addr, kv_batch, S, gsub)
                else:
                    self._row_sources(cur0, src0, nb0, kv_addr2, kv_batch2, S2, gsub)
                if 2 * m + 1 < n_blocks1:
                    self._row_sources(cur1, src1, nb1, kv_addr, kv_batch, S, gsub)
                else:
                    self._row_sources(cur1, src1, nb1, kv_addr2, kv_batch2, S2, gsub)
            for q in cutlass.range_constexpr(4):
                stage = q % 2
                is_r = 1 if q in (1, 2) else 0
                if stage == 0 or has1:
                    slot = 2 * stage + is_r
                    if m > 0:
                        cute.arch.mbarrier_wait(mbar + 4 + slot, ph)
                    src = src0 if stage == 0 else src1
                    nb = nb0 if stage == 0 else nb1
                    if cutlass.const_expr(q < 2):  # flags with the first half of each stage
                        if psub == 0:
                            for p in cutlass.range_constexpr(npass):
                                sValid[stage * self.bn + prow + self.p_rows * p] = (
                                    cutlass.Int32(1) if nb[p] != 0 else cutlass.Int32(0))
                    n_c = n_r if is_r else n_l
                    for p in cutlass.range_constexpr(npass):
                        for i in cutlass.range_constexpr(n_c):
                            ct = i + (hc // 8 if is_r else 0)
                            cp_async_16_zfill(
                                dbase, src[p], nb[p],
                                stage * stage_bytes + ct * tile_bytes + p * self.p_rows * 128,
                                ct * 128)
                    cute.arch.cp_async_mbarrier_arrive_noinc(mbar + slot)
                    cute.arch.mbarrier_arrive(mbar + slot)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    # ------------------------------------------------------------------ consumer pieces
    @cute.jit
    def _mask_scale_max(self, S_mn: cute.Tensor, tScS: cute.Tensor, sValid: cute.Tensor,
                        stage: cutlass.Constexpr, scale_log2: cutlass.Float32,
                        mx: cute.Tensor):
        n_rows = cute.size(S_mn, mode=[0])
        # Scale first, then mask: -inf * scale is NaN for scale 0 and +inf for scale < 0.
        for r in cutlass.range_constexpr(n_rows):
            S_mn[r, None] = S_mn[r, None].load() * scale_log2
        for c in cutlass.range_constexpr(cute.size(S_mn, mode=[1])):
            if sValid[stage * self.bn + tScS[0, c][1]] == 0:
                for r in cutlass.range_constexpr(n_rows):
                    S_mn[r, c] = -cutlass.Float32.inf
        for r in cutlass.range_constexpr(n_rows):
            mx[r] = quad_allreduce(
                S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0),
                cute.arch.fmax,
            )

    @cute.jit
    def _exp_rows(self, S_mn: cute.Tensor, O_mn: cute.Tensor, row_max: cute.Tensor,
                  row_sum: cute.Tensor, m_new: cute.Tensor):
        """P = exp2(S - m_new) in place; O and the row sums rescaled from row_max to m_new
        (a row with nothing valid yet uses 0 as its max: never exp2(-inf + inf)). O is rescaled
        only if one of this thread's rows changed its max (lazy rescaling, LAZY_RESCALE_LOG2)."""
        n_rows = cute.size(S_mn, mode=[0])
        corrs = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        moved = m_new[0] != row_max[0]
        for r in cutlass.range_constexpr(n_rows):
            mn = m_new[r]
            m_use = 0.0 if mn == -cutlass.Float32.inf else mn
            corr = cute.math.exp2(row_max[r] - m_use, fastmath=True)
            p_row = cute.math.exp2(S_mn[r, None].load() - m_use, fastmath=True)
            row_sum[r] = row_sum[r] * corr + p_row.reduce(
                cute.ReductionOp.ADD, cutlass.Float32.zero, 0
            )
            corrs[r] = corr
            if cutlass.const_expr(r > 0):
                moved = moved | (mn != row_max[r])
            S_mn[r, None] = p_row
        if moved:
            for r in cutlass.range_constexpr(n_rows):
                O_mn[r, None] = O_mn[r, None].load() * corrs[r]

    @cute.jit
    def _new_max(self, m_ref: cutlass.Float32, m_blk: cutlass.Float32) -> cutlass.Float32:
        """The new reference max: m_ref itself while m_blk <= m_ref + LAZY_RESCALE_LOG2 (also
        when both are -inf), else max(m_ref, m_blk)."""
        return m_ref if m_blk <= m_ref + LAZY_RESCALE_LOG2 else cute.arch.fmax(m_ref, m_blk)

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
        scale_log2: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sVt_layout: cute.Layout,
        sP_layout: cute.Layout,
        sO_layout: cute.ComposedLayout,
        sOg_layout: cute.ComposedLayout,
        qk_mma: cute.TiledMma,
        pv_rs: cute.TiledMma,
        pv_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self._body(mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, scale_log2, swz, sQ_layout,
                   sKV_layout, sVt_layout, sP_layout, sO_layout, sOg_layout, qk_mma, pv_rs,
                   pv_ss, SharedStorage, None)

    @cute.jit
    def _body(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
              mSink: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, T: cutlass.Int32,
              H: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32, scale_log2: cutlass.Float32,
              swz: cute.Swizzle, sQ_layout: cute.Layout, sKV_layout: cute.Layout,
              sVt_layout: cute.Layout, sP_layout: cute.Layout, sO_layout: cute.ComposedLayout,
              sOg_layout: cute.ComposedLayout, qk_mma: cute.TiledMma, pv_rs: cute.TiledMma,
              pv_ss: cute.TiledMma, SharedStorage: cutlass.Constexpr, pool2):
        """The kernel (one pool: pool2 None; two pools: SparseMlaFwdTwoPoolSm90's tuple)."""
        bm, bn = self.bm, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        th, _, b = cute.arch.block_idx()
        n_hb = (H + bm - 1) // bm
        hb = th % n_hb
        t = th // n_hb
        if cutlass.const_expr(self.split):
            gx, _, _ = cute.arch.grid_dim()
            n_parts = gx // (T * n_hb)
            part_idx = t % n_parts
            t = t // n_parts
        wg = tidx // 128
        h0 = hb * bm
        bt = cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)
        topk_len = mLen[bt]
        bt_out = bt  # o / lse row of this CTA's (token, part)
        list_len = K  # entries of idx this CTA may read
        if cutlass.const_expr(pool2 is not None):
            mKV2, mIdx2, mLen2, S2, K2 = pool2
            topk_len2 = mLen2[bt]

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_base = storage.sQ.data_ptr()
        kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * bn))
        sRed = storage.sRed.get_tensor(cute.make_layout(2 * bm))
        sM = storage.sM.get_tensor(cute.make_layout(2 * bm))
        mbar = storage.mbar.data_ptr()
        stage_elems = cute.cosize(sKV_layout)
        idx_base = bt * cutlass.Int64(K)
        if cutlass.const_expr(self.split):
            part = (K + n_parts - 1) // n_parts
            j0 = part_idx * part
            list_len = cutlass.max(cutlass.min(part, K - j0), 0)
            idx_base = idx_base + cutlass.Int64(j0)
            topk_len = topk_len - j0
            bt_out = bt * cutlass.Int64(n_parts) + cutlass.Int64(part_idx)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)
        # Before topk_length is consumed (one HBM latency less before the first Q K^T): the
        # producer loads its first pair's indices (j < K stays inside idx; _produce masks them
        # by k_eff) and the consumers issue their Q copies.
        pre0 = cute.make_rmem_tensor(self.p_passes, cutlass.Int32)
        pre1 = cute.make_rmem_tensor(self.p_passes, cutlass.Int32)
        if wg == 0:
            prow = tidx // self.p_tpr
            if cutlass.const_expr(pool2 is None):
                load_block_indices(mIdx, pre0, 0, list_len, idx_base, prow, *self._idx_walk)
                load_block_indices(mIdx, pre1, 1, list_len, idx_base, prow, *self._idx_walk)
            else:  # blocks 0 and 1 from their pools (which pool does not depend on the lengths)
                n_blocks1 = (K + bn - 1) // bn
                idx_base2 = bt * cutlass.Int64(K2)
                self._two_pool_idx(mIdx, pre0, 0, K, idx_base, mIdx2, K2, idx_base2, n_blocks1,
                                   prow)
                self._two_pool_idx(mIdx, pre1, 1, K, idx_base, mIdx2, K2, idx_base2, n_blocks1,
                                   prow)
        else:
            self._issue_q(mQ, q_base, swz, sQ_layout, bt, h0, H, (tidx - 128) // self.tpr,
                          (tidx - 128) % self.tpr)

        if tidx == 0:
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + i, 256)  # full: 128 cp.async + 128 plain
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + 4 + i, 128)  # empty: one consumer group
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        k_eff = cutlass.min(list_len, cutlass.max(topk_len, 0))
        n_blocks = (k_eff + bn - 1) // bn
        lists2 = None
        if cutlass.const_expr(pool2 is not None):
            # Blocks [0, ceil(K / bn)) gather pool 1's list, the next ones pool 2's valid prefix.
            n_blocks1 = (K + bn - 1) // bn
            k_eff2 = cutlass.min(K2, cutlass.max(topk_len2, 0))
            n_blocks = n_blocks1 + (k_eff2 + bn - 1) // bn
            lists2 = (mIdx2, k_eff2, bt * cutlass.Int64(K2), mKV2.iterator.toint(),
                      cutlass.Int64(b) * cutlass.Int64(S2), S2, n_blocks1)
        n_pairs = (n_blocks + 1) // 2

        if wg == 0:
            # ================================ producer =================================
            cute.arch.setmaxregister_decrease(self.prod_regs)
            self._produce(mKV, mIdx, sValid, storage.sKV.data_ptr().toint(), mbar, n_blocks,
                          k_eff, S, idx_base, kv_batch, tidx, pre0, pre1, lists2)
        else:
            # ================================ consumers ================================
            cute.arch.setmaxregister_increase(self.cons_regs)
            ctid = tidx - 128
            cg = wg - 1  # 0: even blocks, O columns 0..255; 1: odd blocks, O columns 256..511
            gtid = tidx % 128
            crow = ctid // self.tpr
            csub = ctid % self.tpr
            sQ = cute.make_tensor(cute.recast_ptr(q_base, swizzle_=swz), sQ_layout)

            # Q (heads h >= H zero-filled).
            q_ok = h0 + crow < H  # (Q was issued above)
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)

            thr_qk = qk_mma.get_slice(gtid)
            thr_rs = pv_rs.get_slice(gtid)
            thr_ss = pv_ss.get_slice(gtid)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            n_k = cute.size(tSrQ, mode=[2])
            kh = self.k_half
            acc_O = thr_rs.make_fragment_C(thr_rs.partition_shape_C((bm, self.dv_g)))
            acc_O.fill(0.0)
            O_mn = acc_mn_view(acc_O)
            tScS = acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((bm, bn))))
            acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((bm, bn)))
            S_mn = acc_mn_view(acc_S)
            # P in registers as the A operand of the RS P V (for 16-bit types the per-thread
            # order of a 64x64 accumulator is that of the four k16 A fragments).
            tOrP = cute.make_rmem_tensor(thr_rs.partition_shape_A((bm, bn)), self.dtype)
            rP = cute.make_tensor(tOrP.iterator, acc_S.layout)  # same registers, C order
            n_rows = cute.size(tScS, mode=[0])
            row_max = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            mx = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            m_own = cute.make_rmem_tensor(n_rows, cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            # Own stage (= cg): whole 64-key tile for Q K^T; V halves (column offset 256 g).
            sK_own = ring_stage(kv_sw, sKV_layout, cg)
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
            # P tiles: P0 (WG0's, read by WG1), P1 (WG1's, read by WG0).
            p0_ptr = kv_sw + cute.assume(self.d_v * bn, divby=512)  # stage 0 rope columns
            p1_ptr = cute.recast_ptr(storage.sP.data_ptr(), swizzle_=swz)
            if cutlass.const_expr(not self.p_in_rope):
                p0_ptr = p1_ptr + cute.assume(cute.cosize(sP_layout), divby=512)
            sP0 = cute.make_tensor(p0_ptr, sP_layout)
            sP1 = cute.make_tensor(p1_ptr, sP_layout)
            # P tiles to shared memory with stmatrix (warp-collective: 4 per thread and tile).
            r2s_p = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype),
                qk_mma,
            ).get_slice(gtid)
            n_kv = cute.size(tOrP, mode=[2])

            if cg == 0:
                # ---------------- WG0: even blocks, stage 0, O columns 0..255 ----------------
                tOrP_oth = thr_ss.make_fragment_A(thr_ss.partition_A(sP1))
                tPsP = r2s_p.partition_D(sP0)
                # Q K^T of a pair is issued at the end of the previous pair (under its SS P V)
                # and of pair 0 here, so that no wgmma is in flight across the loop back edge
                # (ptxas cannot track that and serializes every wgmma otherwise, C7514).
                if n_pairs > 0:
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
                for m in range(n_pairs):
                    has1 = 2 * m + 1 < n_blocks
                    self._mask_scale_max(S_mn, tScS, sValid, 0, scale_log2, mx)
                    for r in cutlass.range_constexpr(n_rows):
                        m_own[r] = self._new_max(row_max[r], mx[r])
                    if gtid % 4 == 0:
                        for r in cutlass.range_constexpr(n_rows):
                            sM[tScS[r, 0][0]] = m_own[r]
                    cute.arch.barrier_arrive(barrier_id=BAR_M0, number_of_threads=self.n_cons)
                    self._exp_rows(S_mn, O_mn, row_max, row_sum, m_own)
                    # O_0 += P0 V0[:, :256] with P0 in registers.
                    rP.store(acc_S.load().to(self.dtype))
                    # P0 for WG1 now, stored again below only if the pair max moves. (WG1's
                    # reads of the previous P0 ended before stage 0 R was refilled.)
                    cute.copy(r2s_p, r2s_p.retile(rP), tPsP)
                    warpgroup.fence()
                    pv_rs.set(warpgroup.Field.ACCUMULATE, True)
                    for k in cutlass.range_constexpr(n_kv):
                        cute.gemm(pv_rs, acc_O, tOrP[None, None, k], tOrV_own[None, None, k],
                                  acc_O)
                    warpgroup.commit_group()
                    # Stage 0 L is free once the RS P V is: the producer refills it while this
                    # group waits for WG1's max.
                    warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(mbar + EMPTY_0L)
                    # WG1's pair max (>= m_own); factor f = exp2(m_own - m1), 0 if m_own = -inf
                    # (then P0 = 0 and O_0 = 0 already).
                    cute.arch.barrier(barrier_id=BAR_M1, number_of_threads=self.n_cons)
                    pair_moved = sM[bm + tScS[0, 0][0]] != m_own[0]
                    for r in cutlass.range_constexpr(n_rows):
                        m1 = sM[bm + tScS[r, 0][0]]
                        mo = m_own[r]
                        m1_use = 0.0 if m1 == -cutlass.Float32.inf else m1
                        f = cute.math.exp2(mo - m1_use, fastmath=True)
                        mx[r] = 0.0 if mo == -cutlass.Float32.inf else f
                        row_max[r] = m1
                        if cutlass.const_expr(r > 0):
                            pair_moved = pair_moved | (m1 != mo)
                    # If the pair max moved past m_own: P0' = P0 * f for WG1 (from the fp32
                    # values), O_0 *= f.
                    # stmatrix is warp-collective: the whole warp takes the branch (f = 1 for
                    # the rows that did not move).
                    pair_moved = cute.arch.vote_any_sync(pair_moved)
                    if pair_moved:
                        for r in cutlass.range_constexpr(n_rows):
                            S_mn[r, None] = S_mn[r, None].load() * mx[r]
                            O_mn[r, None] = O_mn[r, None].load() * mx[r]
                            row_sum[r] = row_sum[r] * mx[r]
                        rP.store(acc_S.load().to(self.dtype))
                        cute.copy(r2s_p, r2s_p.retile(rP), tPsP)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier_arrive(barrier_id=BAR_P0, number_of_threads=self.n_cons)
                    # O_0 += P1 V1[:, :256] (P1 from shared memory), left in flight under the
                    # next pair's Q K^T (left columns: stage 0 L is released first).
                    cute.arch.barrier(barrier_id=BAR_P1, number_of_threads=self.n_cons)
                    if has1:
                        warpgroup.fence()
                        pv_ss.set(warpgroup.Field.ACCUMULATE, True)
                        for k in cutlass.range_constexpr(n_kv):
                            cute.gemm(pv_ss, acc_O, tOrP_oth[None, None, k],
                                      tOrV_oth[None, None, k], acc_O)
                        warpgroup.commit_group()
                    # Stage 1 L is released when the SS P V ends, not after the next pair's
                    # 0 L fill, so WG1 does not wait for its refill (docs/kernel_log.md).
                    # (Releasing WG1's 1 R as early needs a wait before the P0 barrier, which
                    # makes ptxas serialize every wgmma, C7514.)
                    warpgroup.wait_group(0)
                    if m + 1 < n_pairs:
                        cute.arch.mbarrier_arrive(mbar + EMPTY_1L)
                    if m + 1 < n_pairs:  # (then has1 holds)
                        ph = (m + 1) % 2
                        cute.arch.mbarrier_wait(mbar + FULL_0L, ph)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        warpgroup.fence()
                        for k in cutlass.range_constexpr(0, kh):
                            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                        warpgroup.commit_group()
                        cute.arch.mbarrier_wait(mbar + FULL_0R, ph)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        warpgroup.fence()
                        for k in cutlass.range_constexpr(kh, n_k):
                            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
                            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                        warpgroup.commit_group()
                    warpgroup.wait_group(0)
            else:
                # ---------------- WG1: odd blocks, stage 1, O columns 256..511 ---------------
                tOrP_oth = thr_ss.make_fragment_A(thr_ss.partition_A(sP0))
                tPsP = r2s_p.partition_D(sP1)
                for m in range(n_pairs):
                    ph = m % 2
                    has1 = 2 * m + 1 < n_blocks
                    if has1:
                        # S1 = Q K1^T: right columns first (1R is refilled earliest).
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
                        self._mask_scale_max(S_mn, tScS, sValid, 1, scale_log2, mx)
                    else:
                        acc_S.fill(-cutlass.Float32.inf)
                        mx.fill(-cutlass.Float32.inf)
                    cute.arch.barrier(barrier_id=BAR_M0, number_of_threads=self.n_cons)
                    for r in cutlass.range_constexpr(n_rows):
                        m_own[r] = self._new_max(sM[tScS[r, 0][0]], mx[r])
                    if gtid % 4 == 0:
                        for r in cutlass.range_constexpr(n_rows):
                            sM[bm + tScS[r, 0][0]] = m_own[r]
                    cute.arch.barrier_arrive(barrier_id=BAR_M1, number_of_threads=self.n_cons)
                    self._exp_rows(S_mn, O_mn, row_max, row_sum, m_own)
                    for r in cutlass.range_constexpr(n_rows):
                        row_max[r] = m_own[r]
                    if has1:
                        # O_1 += P1 V1[:, 256:] with P1 in registers, issued first, then P1 to
                        # shared memory for WG0.
                        rP.store(acc_S.load().to(self.dtype))
                        warpgroup.fence()
                        pv_rs.set(warpgroup.Field.ACCUMULATE, True)
                        for k in cutlass.range_constexpr(n_kv):
                            cute.gemm(pv_rs, acc_O, tOrP[None, None, k],
                                      tOrV_own[None, None, k], acc_O)
                        warpgroup.commit_group()
                        # A second conversion for the store, which the compiler merges with the
                        # first: stmatrix then reads the A registers of the in-flight wgmma.
                        # Reading them is harmless (only writes race) and ptxas adds no wait
                        # (7 WARPGROUP.DEPBAR for 112 HGMMA); storing from rP directly makes
                        # ptxas serialize every wgmma (C7514).
                        rP1 = cute.make_fragment_like(acc_S, self.dtype)
                        rP1.store(acc_S.load().to(self.dtype))
                        cute.copy(r2s_p, r2s_p.retile(rP1), tPsP)
                        cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier_arrive(barrier_id=BAR_P1, number_of_threads=self.n_cons)
                    # O_1 += P0' V0[:, 256:] (P0' from shared memory).
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

            # ---- epilogue (both groups end with the same running max) -------------------
            # (its consumer barrier also orders every wgmma / P tile / Q read of both groups
            # before the O staging)
            self._epilogue(acc_O, row_sum, row_max, tScS, sRed, mSink, mLse, mO, q_base,
                           sO_layout, sOg_layout, pv_rs, bt_out, h0, H, cg, gtid, crow, csub,
                           q_ok)

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
                cute.copy(cp_atom, chunk16(mQ, q_row, c), chunk16(sQ, crow, c))
        else:
            for i in cutlass.range_constexpr(self.chunks // self.tpr):
                chunk16(sQ, crow, csub + self.tpr * i).fill(0)
        cute.arch.cp_async_commit_group()
        return q_ok

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
            l_all[r] = quad_allreduce(row_sum[r], lambda a, c: a + c)
        if gtid % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                sRed[red_off + cg * bm + tScS[r, 0][0]] = l_all[r]
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=self.n_cons)
        for r in cutlass.range_constexpr(n_rows):
            row = tScS[r, 0][0]
            l_all[r] = sRed[red_off + row] + sRed[red_off + bm + row]
        O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(n_rows):
            l = l_all[r]
            m = row_max[r]
            m_use = 0.0 if m == -cutlass.Float32.inf else m
            h = h0 + tScS[r, 0][0]
            denom = l
            if cutlass.const_expr(not self.split):  # a split's parts leave the sink to the combine
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
                cute.copy(st_atom, chunk16(sO, crow, c), chunk16(mO, o_row, c))


class SparseMlaFwdTwoPoolSm90(SparseMlaFwdPingPongSm90):
    """The pingpong forward over two KV pools (module docstring, "Two pools"): the token's
    entries are pool 1's list (kv, idx, topk_length) then pool 2's (kv2, idx2, topk_length2),
    one softmax with the sink over both; each 64-row block gathers from one pool."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mKV2: cute.Tensor,
        mIdx2: cute.Tensor,
        mLen2: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        B: cutlass.Int32,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        S2: cutlass.Int32,
        K2: cutlass.Int32,
        scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout, sO_layout, sOg_layout = (
            self._smem_layouts())
        SharedStorage, qk_mma, pv_rs, pv_ss = self._storage_and_mmas(
            sQ_layout, sKV_layout, sP_layout)
        n_head_blocks = (H + self.bm - 1) // self.bm
        kernel = self.kernel_two_pool(
            mQ, mKV, mIdx, mLen, mKV2, mIdx2, mLen2, mSink, mO, mLse, T, H, S, K, S2, K2,
            scale * LOG2_E, k_atom.inner, sQ_layout.outer, sKV_layout.outer, sVt_layout.outer,
            sP_layout.outer, sO_layout, sOg_layout, qk_mma, pv_rs, pv_ss, SharedStorage,
        )
        kernel.launch(
            grid=[T * n_head_blocks, 1, B],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel_two_pool(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor,
        mKV2: cute.Tensor,
        mIdx2: cute.Tensor,
        mLen2: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        T: cutlass.Int32,
        H: cutlass.Int32,
        S: cutlass.Int32,
        K: cutlass.Int32,
        S2: cutlass.Int32,
        K2: cutlass.Int32,
        scale_log2: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sKV_layout: cute.Layout,
        sVt_layout: cute.Layout,
        sP_layout: cute.Layout,
        sO_layout: cute.ComposedLayout,
        sOg_layout: cute.ComposedLayout,
        qk_mma: cute.TiledMma,
        pv_rs: cute.TiledMma,
        pv_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self._body(mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, scale_log2, swz, sQ_layout,
                   sKV_layout, sVt_layout, sP_layout, sO_layout, sOg_layout, qk_mma, pv_rs,
                   pv_ss, SharedStorage, (mKV2, mIdx2, mLen2, S2, K2))


def compile_fwd_two_pool(dtype, d_qk: int, d_v: int = 512):
    """Compile the two-pool forward with shape-only tensors (common.fwd_two_pool_fake_args)."""
    return cute.compile(SparseMlaFwdTwoPoolSm90(dtype, d_qk, d_v),
                        *fwd_two_pool_fake_args(dtype, d_qk, d_v))


def compile_fwd_pingpong(dtype, d_qk: int, d_v: int = 512, split: bool = False):
    """Compile with shape-only tensors (common.fwd_fake_args); split: the decode form."""
    return cute.compile(SparseMlaFwdPingPongSm90(dtype, d_qk, d_v, split=split),
                        *fwd_fake_args(dtype, d_qk, d_v, separate_out_rows=split))

