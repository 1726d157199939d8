"""Sparse MLA forward for sm_90a, few heads (H <= 32, e.g. a tensor-parallel shard): heads on N.

The same outputs, arguments and invariants as fwd_pingpong.py; the default forward for H <= 32
(jax_dsa/cute/config.py). With so few heads a 64-head tile would be mostly padding and the work
is bound by the row gather, so both products are transposed to put the heads on wgmma's N side:

    S^T (64 keys x NP)  = K (64 x Dqk) . Q^T       wgmma 64 x NP x 16, A and B in shared memory
    O^T (512 x NP)     += V^T (512 x 64) . P^T     wgmma 64 x NP x 16, V^T the MN-major view of
                                                   the same gathered bytes, one m-tile per slab

NP = H rounded up to 8, 16, 24 or 32: one kernel per NP, the host function launches the one that
holds H (H > 32 launches nothing). Grid: ceil(B*T / tpc) CTAs, each walking tpc consecutive tokens
(tpc = ceil(B*T / CTA_TARGET)); 128 x (lanes + 1) threads, one CTA per SM (shared memory).
  * The last warpgroup is the producer: it loads Q (double-buffered by token parity) and the
    indices of a round, and gathers 16-byte cp.async chunks into a ring of 8 KB slabs (64 keys x
    64 columns; a block is nk = Dqk / 64 consecutive slabs, wrapping), as many slabs as fit next
    to Q (18..25). Invalid rows and heads h >= H are zero-filled (src-size 0, nothing read).
  * lanes consumer warpgroups (2, or 1 for NP 32 at Dqk 576 where the ring is too small) work on
    alternate tokens and never gather: S^T, the mask (each checks its own two keys per block),
    the online softmax per head column, P^T to shared memory, P V, and the epilogue, which
    stores O straight from the accumulators for h < H. A slab is released right after its last
    read (the rope slab after S^T, V slabs in pairs as the P V m-tiles complete).
  * Registers: no setmaxnreg at 256 threads (255 each) or at 384 threads up to NP 24 (168 each);
    NP 32 at Dqk 512 splits them, producer 40 / consumers 232.
All roles follow one flat stream of blocks (_stream_pos gives the order): slab n of the stream
is ring position n mod ring in its (n div ring)-th use, which sets every mbarrier parity, and
ring >= max(2 nk, lanes * nk + 2 (lanes - 1)) keeps it deadlock-free; docs/kernel_log.md ("Design
notes moved from the kernel modules") derives the slab ring, its phases and the block order.
Dead rows get o = 0 and lse = -inf; the sink enters the denominator only; offsets are 64-bit.

Entry point: compile_fwd_small_heads(dtype, d_qk), arguments common.fwd_fake_args; ffi/build.py
exports it as jax_dsa_fwd_small_heads_<dtype>_d<Dqk>.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
import cuda.bindings.driver as cuda

from .common import (LN_2, LOG2_E, acc_mn_view, cp_async_16_zfill, fwd_fake_args,
                     sw128_offset)

# Tokens per CTA = ceil(B*T / CTA_TARGET): about 4 waves of 1-CTA-per-SM work on 132 SMs.
CTA_TARGET = 528
# sm_90 opt-in maximum per block (227 KB) minus the 1 KB static reservation and 1 KB of margin.
SMEM_BUDGET = 232448 - 2048
SLAB_BYTES = 8192  # 64 keys x 64 columns x 16 bit
CONSUMER_BAR = 1  # named barrier of the 128 consumer threads (0 is __syncthreads)


class _SmallHKernel:
    """One kernel specialization for NP padded heads."""

    def __init__(self, dtype, d_qk: int, d_v: int, n_pad: int, lanes: int = 1,
                 split_regs: bool = False):
        assert d_v == 512 and d_qk in (512, 576)
        assert n_pad % 8 == 0 and 8 <= n_pad <= 32
        assert lanes in (1, 2)
        self.dtype = dtype
        self.lanes = lanes  # consumer warpgroups, each on its own tokens (see _stream_pos)
        # split_regs (two lanes only): setmaxnreg, producer 40 / consumers 232 registers
        # (128 x 40 + 256 x 232 = 64512), for NP 32 whose O^T needs more than 168 (at 56 / 224
        # ptxas spills 14 words)
        self.split_regs = split_regs and lanes == 2
        self.d_qk = d_qk
        self.d_v = d_v
        self.np_ = n_pad
        self.bn = 64  # keys per block
        self.threads = 128 * (lanes + 1)
        self.nk = d_qk // 64  # slabs per block (8 or 9)
        self.nv_slabs = d_v // 64  # slabs read by P V (8)
        self.q_chunks = d_qk // 8  # 16-byte chunks per Q row
        self.nv = n_pad // 2  # S^T accumulator values per thread (64 * NP / 128)
        self.nc = n_pad // 4  # head columns per thread
        # Shared memory: Q 2 x NP x Dqk, P^T NP x 64 per lane, small things, the rest is ring.
        q_bytes = 2 * n_pad * d_qk * 2
        p_bytes = lanes * n_pad * 64 * 2

        def total(ring):  # the layout of SharedStorage below
            small = lanes * 2 * 16 * n_pad + (2 * ring + 4) * 8
            return q_bytes + ring * SLAB_BYTES + p_bytes + small

        ring = 32
        while total(ring) > SMEM_BUDGET:
            ring -= 1
        self.ring = ring
        # One block per lane held by its consumer plus at least one being filled.
        assert self.ring >= lanes * self.nk + 2 * (lanes - 1) and self.ring >= 2 * self.nk, (
            d_qk, n_pad, lanes, self.ring)

    def layouts(self):
        """(k atom, Q layout, slab layout, V^T slab layout, P^T layout)."""
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, self.dtype)
        sQ_layout = cute.tile_to_shape(k_atom, (self.np_, self.d_qk), (0, 1))
        sK_layout = cute.tile_to_shape(k_atom, (self.bn, 64), (0, 1))
        sVt_layout = cute.tile_to_shape(mn_atom, (64, self.bn), (1, 0))
        sP_layout = cute.tile_to_shape(k_atom, (self.np_, self.bn), (0, 1))
        return k_atom, sQ_layout, sK_layout, sVt_layout, sP_layout

    def storage(self, sQ_layout, sK_layout):
        np_, ring = self.np_, self.ring

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sQ_layout)], 1024
            ]
            sRing: cute.struct.Align[
                cute.struct.MemRange[self.dtype, ring * cute.cosize(sK_layout)], 1024
            ]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, self.lanes * np_ * 64], 1024]
            sMax: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.lanes * 4 * np_],
                                    16]
            sSum: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.lanes * 4 * np_],
                                    16]
            # full[ring], empty[ring], qfull[2], qempty[2]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * ring + 4], 8]

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
        k_atom, sQ_layout, sK_layout, sVt_layout, sP_layout = self.layouts()
        SharedStorage = self.storage(sQ_layout, sK_layout)
        qk_mma, pv_mma = self.mmas()
        self.kernel(
            mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, BT, tpc, scale_log2,
            k_atom.inner, sQ_layout.outer, sK_layout.outer, sVt_layout.outer, sP_layout.outer,
            qk_mma, pv_mma, SharedStorage,
        ).launch(
            grid=[n_cta, 1, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            # launch bounds: ptxas then budgets each role by its setmaxnreg value
            **({"min_blocks_per_mp": 1} if self.split_regs else {}),
        )

    # ------------------------------------------------------------------ block stream
    @staticmethod
    def _n_blocks(mLen, tok, tok_end, K, bn):
        """(keff, blocks) of token tok: keff = min(K, topk_length) and at least one block (an
        empty list still has one all-invalid block); (0, 0) when tok >= tok_end."""
        live = tok < tok_end
        keff = cutlass.min(K, cutlass.max(mLen[cutlass.min(tok, tok_end - 1)], 0))
        nb = cutlass.max((keff + bn - 1) // bn, 1)
        return (cutlass.Int32(cutlass.select_(live, keff, cutlass.Int32(0))),
                cutlass.Int32(cutlass.select_(live, nb, cutlass.Int32(0))))

    @staticmethod
    def _stream_pos(base, r, lane, nb_other):
        """Stream position (in blocks) of block r of lane `lane`'s token in the current group.

        The CTA's tokens are taken in groups of `lanes` consecutive tokens; token tok_g + c
        belongs to consumer lane c. The producer emits a group's blocks round by round, lane 0's
        block r before lane 1's block r, skipping lanes whose token has no block r left; `base`
        counts the blocks of the earlier groups. Lane 0's block r follows r blocks of its own
        and min(r, nb_1) of lane 1; lane 1's block r follows min(r + 1, nb_0) and r."""
        return base + r + cutlass.min(r + lane, nb_other)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _produce(self, mQ, mKV, mIdx, mLen, q_base, ring_base, mbar, T, H, S, K,
                 tok_begin, tok_end, p):
        bn, nk, ring, np_, lanes = self.bn, self.nk, self.ring, self.np_, self.lanes
        prow = p // 8  # rows prow + 16 q, q < 4
        pch = p % 8  # 16-byte chunk inside the slab's 128-byte row segment
        kv_addr = mKV.iterator.toint()
        q_addr = mQ.iterator.toint()
        full = mbar
        empty = mbar + ring
        qfull = mbar + 2 * ring
        qempty = mbar + 2 * ring + 2
        # Byte offsets of this thread's 4 destination chunks inside a slab.
        dst_off = [sw128_offset(bn, prow + 16 * q, pch) for q in range(4)]

        pos = cutlass.Int32(0)  # ring position of the next slab
        ph = cutlass.Int32(0)  # parity of its use count
        wrapped = cutlass.Int32(0)  # 1 once the ring has been filled once
        tok_g = tok_begin
        while tok_g < tok_end:
            keffs = []
            nbs = []
            for c in cutlass.range_constexpr(lanes):
                ke, n = self._n_blocks(mLen, tok_g + c, tok_end, K, bn)
                keffs.append(ke)
                nbs.append(n)
            n_rounds = nbs[0]
            if cutlass.const_expr(lanes == 2):
                n_rounds = cutlass.max(nbs[0], nbs[1])

            # ---- Q of the group's tokens: buffer (token - tok_begin) % 2, heads >= H zeros ----
            for c in cutlass.range_constexpr(lanes):
                tok = tok_g + c
                if tok < tok_end:
                    qi = tok - tok_begin
                    qb = qi % 2
                    if qi >= 2:
                        cute.arch.mbarrier_wait(qempty + qb, ((qi // 2) - 1) % 2)
                    q_dst = q_base + qb * (np_ * self.d_qk * 2)
                    n_q = np_ * self.q_chunks
                    for i in cutlass.range_constexpr((n_q + 127) // 128):
                        flat = p + 128 * i
                        if flat < n_q:
                            h = flat // self.q_chunks
                            ch = flat - h * self.q_chunks
                            src = q_addr
                            nbytes = cutlass.Int32(0)
                            if h < H:
                                src = q_addr + (
                                    (cutlass.Int64(tok) * cutlass.Int64(H) + cutlass.Int64(h))
                                    * cutlass.Int64(self.d_qk) + cutlass.Int64(8 * ch)
                                ) * 2
                                nbytes = cutlass.Int32(16)
                            cp_async_16_zfill(q_dst + sw128_offset(np_, h, ch), src, nbytes)
                    cute.arch.cp_async_mbarrier_arrive_noinc(qfull + qb)

            for r in cutlass.range(n_rounds, unroll=1):
                # The round's indices for every lane first (one load latency per round); only
                # j < topk_length is read.
                srcs = []
                ns = []
                for c in cutlass.range_constexpr(lanes):
                    tok = tok_g + c
                    kv_batch = cutlass.Int64(tok // T) * cutlass.Int64(S)
                    tok_k = cutlass.Int64(tok) * cutlass.Int64(K)
                    for q in cutlass.range_constexpr(4):
                        j = r * bn + prow + 16 * q
                        ok = r < nbs[c] and j < keffs[c]
                        v = cutlass.Int32(-1)
                        if ok:
                            v = mIdx[tok_k + cutlass.Int64(j)]
                        ok = ok and v >= 0 and v < S
                        g_off = kv_addr + (
                            (kv_batch + cutlass.Int64(v)) * cutlass.Int64(self.d_qk)
                            + cutlass.Int64(8 * pch)
                        ) * 2
                        # Invalid: src-size 0 (zero fill) from row 0 of kv, which is never read.
                        srcs.append(g_off if ok else kv_addr)
                        ns.append(cutlass.Int32(16) if ok else cutlass.Int32(0))
                for c in cutlass.range_constexpr(lanes):
                    if r < nbs[c]:
                        # ---- block r of lane c's token: its nk slabs ---------------------------
                        for j in cutlass.range_constexpr(nk):
                            if wrapped != 0:
                                cute.arch.mbarrier_wait(empty + pos, 1 - ph)
                            slab = ring_base + pos * SLAB_BYTES
                            for q in cutlass.range_constexpr(4):
                                # column 64 j = byte 128 j of the row
                                cp_async_16_zfill(slab + dst_off[q], srcs[4 * c + q] + 128 * j,
                                             ns[4 * c + q])
                            cute.arch.cp_async_mbarrier_arrive_noinc(full + pos)
                            pos = pos + 1
                            if pos == ring:
                                pos = cutlass.Int32(0)
                                ph = 1 - ph
                                wrapped = cutlass.Int32(1)
            tok_g = tok_g + lanes
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    # ------------------------------------------------------------------ consumer
    @cute.jit
    def _consume(self, mIdx, mLen, mSink, mO, mLse, H, S, K, scale_log2, q_sw, ring_sw, sP,
                 sMax, sSum, mbar, sQ_layout, sK_layout, sVt_layout, qk_mma, pv_mma,
                 tok_begin, tok_end, gtid, lane_id: cutlass.Constexpr):
        bn, np_, nc, nk, ring, lanes = self.bn, self.np_, self.nc, self.nk, self.ring, self.lanes
        bar_id = CONSUMER_BAR + lane_id  # this consumer warpgroup's named barrier
        warp = gtid // 32
        lane = gtid % 32
        full = mbar
        empty = mbar + ring
        qfull = mbar + 2 * ring
        qempty = mbar + 2 * ring + 2
        q_elems = cute.cosize(sQ_layout)
        slab_elems = cute.cosize(sK_layout)

        thr_qk = qk_mma.get_slice(gtid)
        thr_pv = pv_mma.get_slice(gtid)
        acc_S_shape = thr_qk.partition_shape_C((bn, np_))
        acc_O_shape = thr_pv.partition_shape_C((64, np_))
        # (key, head) of this thread's S^T values; (d within an m-tile, head) of its O^T values.
        tScS = acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((bn, np_))))
        tOcO = acc_mn_view(thr_pv.partition_C(cute.make_identity_tensor((64, np_))))
        tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(sP))
        acc_O = [thr_pv.make_fragment_C(acc_O_shape) for _ in range(self.nv_slabs)]
        O_mn = [acc_mn_view(a) for a in acc_O]
        n_orows = cute.size(O_mn[0], mode=[0])
        col_max = cute.make_rmem_tensor(nc, cutlass.Float32)
        col_sum = cute.make_rmem_tensor(nc, cutlass.Float32)
        corr_r = cute.make_rmem_tensor(nc, cutlass.Float32)
        key0 = tScS[0, 0][0]
        key1 = tScS[1, 0][0]

        # This lane's tokens: tok_begin + lane_id, then every `lanes`-th (see _stream_pos).
        tok = tok_begin + lane_id
        blk = cutlass.Int32(0)
        keff, nb = self._n_blocks(mLen, tok, tok_end, K, bn)
        nb_o = cutlass.Int32(0)  # blocks of the other lane's token of the group
        if cutlass.const_expr(lanes == 2):
            _, nb_o = self._n_blocks(mLen, tok + 1 - 2 * lane_id, tok_end, K, bn)
        len_nxt = cutlass.Int32(0)  # topk_length of this lane's next token
        len_o_nxt = cutlass.Int32(0)  # and of the other lane's token of that group
        if tok + lanes < tok_end:
            len_nxt = mLen[tok + lanes]
        if cutlass.const_expr(lanes == 2):
            if tok + lanes + 1 - 2 * lane_id < tok_end:
                len_o_nxt = mLen[tok + lanes + 1 - 2 * lane_id]
        iv0 = cutlass.Int32(-1)
        iv1 = cutlass.Int32(-1)
        if tok < tok_end:
            tok_k = cutlass.Int64(tok) * cutlass.Int64(K)
            if key0 < keff:
                iv0 = mIdx[tok_k + cutlass.Int64(key0)]
            if key1 < keff:
                iv1 = mIdx[tok_k + cutlass.Int64(key1)]
        stream_base = cutlass.Int32(0)  # stream blocks of the earlier groups

        while tok < tok_end:
            n_tok = tok
            n_blk = blk + 1
            if n_blk == nb:
                n_tok = tok + lanes
                n_blk = cutlass.Int32(0)
            # Indices of my two keys in the next block (loaded a block ahead).
            n_keff = keff
            if n_tok != tok:
                n_keff = cutlass.min(K, cutlass.max(len_nxt, 0))
            nv0 = cutlass.Int32(-1)
            nv1 = cutlass.Int32(-1)
            if n_tok < tok_end:
                n_k = cutlass.Int64(n_tok) * cutlass.Int64(K)
                if n_blk * bn + key0 < n_keff:
                    nv0 = mIdx[n_k + cutlass.Int64(n_blk * bn + key0)]
                if n_blk * bn + key1 < n_keff:
                    nv1 = mIdx[n_k + cutlass.Int64(n_blk * bn + key1)]

            # ring position / parity of this block's first slab
            slab0 = self._stream_pos(stream_base, blk, lane_id, nb_o) * nk
            pos0 = slab0 % ring
            ph0 = (slab0 // ring) % 2
            qi = tok - tok_begin
            qb = qi % 2
            if blk == 0:
                cute.arch.mbarrier_wait(qfull + qb, (qi // 2) % 2)
                for m in cutlass.range_constexpr(self.nv_slabs):
                    acc_O[m].fill(0.0)
                col_max.fill(-cutlass.Float32.inf)
                col_sum.fill(0.0)
            sQs = cute.make_tensor(q_sw + cute.assume(qb * q_elems, divby=512), sQ_layout)
            tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(sQs))

            # ---- S^T = K . Q^T over the block's nk slabs --------------------------------
            # (All waits first: a wait loop between two wgmmas makes ptxas serialize them.)
            for j in cutlass.range_constexpr(nk):
                pj = pos0 + j
                phj = ph0
                if pj >= ring:
                    pj = pj - ring
                    phj = 1 - ph0
                cute.arch.mbarrier_wait(full + pj, phj)
            # cp.async data (generic proxy) -> wgmma (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            acc_S = thr_qk.make_fragment_C(acc_S_shape)
            warpgroup.fence()
            for j in cutlass.range_constexpr(nk):
                pj = pos0 + j
                if pj >= ring:
                    pj = pj - ring
                sKj = cute.make_tensor(
                    ring_sw + cute.assume(pj * slab_elems, divby=4096), sK_layout
                )
                tSrK = thr_qk.make_fragment_A(thr_qk.partition_A(sKj))
                for kk in cutlass.range_constexpr(4):
                    qk_mma.set(warpgroup.Field.ACCUMULATE, j * 4 + kk != 0)
                    cute.gemm(qk_mma, acc_S, tSrK[None, None, kk],
                              tSrQ[None, None, 4 * j + kk], acc_S)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if lane == 0:
                if blk == nb - 1:
                    cute.arch.mbarrier_arrive(qempty + qb)
                if cutlass.const_expr(nk > self.nv_slabs):  # the rope slab: done
                    pj = pos0 + self.nv_slabs
                    if pj >= ring:
                        pj = pj - ring
                    cute.arch.mbarrier_arrive(empty + pj)

            # ---- mask, online softmax over keys (rows) per head (column) ----------------
            S_mn = acc_mn_view(acc_S)
            key_base = blk * bn
            ok0 = key_base + key0 < keff and iv0 >= 0 and iv0 < S
            ok1 = key_base + key1 < keff and iv1 >= 0 and iv1 < S
            for c in cutlass.range_constexpr(nc):
                s0 = S_mn[0, c] * scale_log2
                s1 = S_mn[1, c] * scale_log2
                s0 = s0 if ok0 else -cutlass.Float32.inf
                s1 = s1 if ok1 else -cutlass.Float32.inf
                S_mn[0, c] = s0
                S_mn[1, c] = s1
                v = cute.arch.fmax(s0, s1)
                v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=4))
                v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=8))
                v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=16))
                if lane < 4:
                    sMax[warp, tScS[0, c][1]] = v
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
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
                sP[col, key0] = p0.to(self.dtype)
                sP[col, key1] = p1.to(self.dtype)
            # P^T (generic stores) -> wgmma.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
            for m in cutlass.range_constexpr(self.nv_slabs):
                for c in cutlass.range_constexpr(nc):
                    for r in cutlass.range_constexpr(n_orows):
                        O_mn[m][r, c] = O_mn[m][r, c] * corr_r[c]

            # ---- O^T[64 m : 64 m + 64] += V^T(slab m) . P^T, one commit group per 2 m ----
            warpgroup.fence()
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            for mp in cutlass.range_constexpr(self.nv_slabs // 2):
                for mi in cutlass.range_constexpr(2):
                    m = 2 * mp + mi
                    pj = pos0 + m
                    if pj >= ring:
                        pj = pj - ring
                    sVt = cute.make_tensor(
                        ring_sw + cute.assume(pj * slab_elems, divby=4096), sVt_layout
                    )
                    tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(sVt))
                    for k in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                        cute.gemm(pv_mma, acc_O[m], tOrV[None, None, k], tOrP[None, None, k],
                                  acc_O[m])
                warpgroup.commit_group()
            for mp in cutlass.range_constexpr(self.nv_slabs // 2):
                warpgroup.wait_group(self.nv_slabs // 2 - 1 - mp)
                if lane == 0:
                    for mi in cutlass.range_constexpr(2):
                        pj = pos0 + 2 * mp + mi
                        if pj >= ring:
                            pj = pj - ring
                        cute.arch.mbarrier_arrive(empty + pj)

            if blk == nb - 1:
                # ---- epilogue of token tok -----------------------------------------------
                for c in cutlass.range_constexpr(nc):
                    v = col_sum[c]
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=4)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=8)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=16)
                    if lane < 4:
                        sSum[warp, tScS[0, c][1]] = v
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
                tok_h = cutlass.Int64(tok) * cutlass.Int64(H)
                for c in cutlass.range_constexpr(nc):
                    h = tOcO[0, c][1]
                    l = (sSum[0, h] + sSum[1, h]) + (sSum[2, h] + sSum[3, h])
                    m_h = col_max[c]
                    m_use = 0.0 if m_h == -cutlass.Float32.inf else m_h
                    if h < H:
                        # exp(sink - m) in the denominator only; sink = -inf adds exactly 0.
                        denom = l + cute.math.exp2(mSink[h] * LOG2_E - m_use, fastmath=True)
                        inv = 0.0 if denom <= 0.0 else 1.0 / denom
                        o_row = tok_h + cutlass.Int64(h)
                        for mt in cutlass.range_constexpr(self.nv_slabs):
                            for r in cutlass.range_constexpr(n_orows):
                                mO[o_row, 64 * mt + tOcO[r, c][0]] = (
                                    O_mn[mt][r, c] * inv
                                ).to(self.dtype)
                        if warp == 0 and lane < 4:
                            lse = -cutlass.Float32.inf
                            if l > 0.0:
                                lse = (m_use + cute.math.log2(l)) * LN_2
                            mLse[o_row] = lse

            # ---- advance --------------------------------------------------------------------
            iv0 = nv0
            iv1 = nv1
            if n_tok != tok:
                stream_base = stream_base + nb + nb_o
                keff = cutlass.min(K, cutlass.max(len_nxt, 0))
                nb = cutlass.max((keff + bn - 1) // bn, 1)
                if cutlass.const_expr(lanes == 2):
                    nb_o = cutlass.Int32(0)
                    if n_tok + 1 - 2 * lane_id < tok_end:
                        nb_o = cutlass.max(
                            (cutlass.min(K, cutlass.max(len_o_nxt, 0)) + bn - 1) // bn, 1)
                    len_o_nxt = cutlass.Int32(0)
                    if n_tok + lanes + 1 - 2 * lane_id < tok_end:
                        len_o_nxt = mLen[n_tok + lanes + 1 - 2 * lane_id]
                len_nxt = cutlass.Int32(0)
                if n_tok + lanes < tok_end:
                    len_nxt = mLen[n_tok + lanes]
            tok = n_tok
            blk = n_blk

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
        BT: cutlass.Int32,
        tpc: cutlass.Int32,
        scale_log2: cutlass.Float32,
        swz: cute.Swizzle,
        sQ_layout: cute.Layout,
        sK_layout: cute.Layout,
        sVt_layout: cute.Layout,
        sP_layout: cute.Layout,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        np_, ring = self.np_, self.ring
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        wg = tidx // 128
        gtid = tidx % 128

        tok_begin = bx * tpc
        tok_end = cutlass.min(tok_begin + tpc, BT)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        full = mbar
        empty = mbar + ring
        qfull = mbar + 2 * ring
        qempty = mbar + 2 * ring + 2

        if tidx == 0:
            for i in cutlass.range_constexpr(ring):
                cute.arch.mbarrier_init(full + i, 128)
                cute.arch.mbarrier_init(empty + i, 4)
            for i in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(qfull + i, 128)
                cute.arch.mbarrier_init(qempty + i, 4)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == self.lanes:
            # ================================ producer =================================
            if cutlass.const_expr(self.split_regs):
                cute.arch.setmaxregister_decrease(40)
            self._produce(mQ, mKV, mIdx, mLen, storage.sQ.data_ptr().toint(),
                          storage.sRing.data_ptr().toint(), mbar, T, H, S, K,
                          tok_begin, tok_end, gtid)
        else:
            # ============================ consumer lane(s) =============================
            if cutlass.const_expr(self.split_regs):
                cute.arch.setmaxregister_increase(232)
            q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
            ring_sw = cute.recast_ptr(storage.sRing.data_ptr(), swizzle_=swz)
            for lane_id in cutlass.range_constexpr(self.lanes):
                if wg == lane_id:
                    sP = cute.make_tensor(
                        cute.recast_ptr(storage.sP.data_ptr() + lane_id * (np_ * 64),
                                        swizzle_=swz),
                        sP_layout,
                    )
                    small = cute.make_layout((4, np_), stride=(np_, 1))
                    sMax = cute.make_tensor(storage.sMax.data_ptr() + lane_id * (4 * np_), small)
                    sSum = cute.make_tensor(storage.sSum.data_ptr() + lane_id * (4 * np_), small)
                    self._consume(mIdx, mLen, mSink, mO, mLse, H, S, K, scale_log2, q_sw,
                                  ring_sw, sP, sMax, sSum, mbar, sQ_layout, sK_layout,
                                  sVt_layout, qk_mma, pv_mma, tok_begin, tok_end, gtid, lane_id)


class SparseMlaFwdSmallHeadsSm90:
    """Host entry: picks NP in (8, 16, 24, 32) from H at run time (H must be <= 32).

    Two consumer warpgroups on alternate tokens for NP <= 24, where the ring still holds two
    blocks plus two slabs next to the second P^T tile (_SmallHKernel asserts it) and a consumer
    fits in the 168 registers a thread of 384 gets. NP 32 at Dqk 512 runs on two consumers as
    well, registers split by setmaxnreg (NP 32's O^T alone is 128 fp32 per thread: at the plain
    168 ptxas spills); at Dqk 576 the ring does not fit and NP 32 keeps one consumer."""

    NPS = (8, 16, 24, 32)

    def __init__(self, dtype, d_qk: int, d_v: int = 512):
        nps = self.NPS
        self.variants = [_SmallHKernel(dtype, d_qk, d_v, n, 2 if n <= 24 else 1) for n in nps]
        if d_qk == 512:
            self.variants[nps.index(32)] = _SmallHKernel(dtype, d_qk, d_v, 32, 2,
                                                         split_regs=True)
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


def compile_fwd_small_heads(dtype, d_qk: int, d_v: int = 512):
    """Compile with shape-only tensors (common.fwd_fake_args). Valid for 1 <= H <= 32; other H
    launch nothing."""
    return cute.compile(SparseMlaFwdSmallHeadsSm90(dtype, d_qk, d_v),
                        *fwd_fake_args(dtype, d_qk, d_v))
