"""Lightning-indexer scores for sm_90a: a wgmma score GEMM with the ReLU and head sum fused.

    out[b, t, s] = sum_h w[b, t, h] * ReLU(scale * q[b, t, h] . k[b, s])   if row s is visible
                   -inf                                                    otherwise

Row s is visible to token t iff (s + 1) * ratio <= start + t + 1 (jax_dsa/indexer.py); q is
[B, T, Hi, 128] (Hi <= 64, padded to NP = 64 inside the kernel), k [B, S, 128] (one head),
w [B, T, Hi] float32, out [B, T, S] float32; `start` is read from a 1-element int32 buffer so
that a caller can walk chunks of tokens inside one XLA loop.

Grid (ceil(S / 256), ceil(T / tpc), B), 384 threads = 3 warpgroups, one CTA per SM:
  * warpgroup 0, the producer: the CTA's 256 rows of k once (16-byte cp.async, rows >= S zero),
    then Q of each of its tokens that sees any of those rows into a ring of NSTAGE stages
    (NP x 128, heads >= Hi zero-filled), a full and an empty mbarrier per stage.
  * warpgroups 1 and 2, the consumers: each owns 128 of the rows (two 64-row m-tiles, its A
    operands, fixed in shared memory). Per token: S = K Q^T (wgmma 64 x NP x 16, both operands
    in shared memory, 8 k-steps per m-tile), the stage released, then for each of its two rows
    per m-tile a thread sums ReLU(scale * S) * w over its NP / 4 head columns, the quad adds
    the four partial sums, and one thread of the quad stores the row's score (-inf past the
    causal edge).
  Tokens before the first that sees row p0 (causal: the tile is entirely in their future) run
  no GEMM: the consumers store -inf for them.
Shared memory: k 64 KB + NSTAGE x 16 KB Q = 128 KB. The wgmma operands are K-major with the
128-byte swizzle; the producer writes them at the swizzled byte offsets (sw128_offset).

Entry point: compile_indexer_scores(dtype); ffi/build.py exports it as
jax_dsa_indexer_scores_<dtype> (ffi/indexer.cc).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from .common import acc_mn_view, cp_async_16_zfill, quad_allreduce, sw128_offset


from jax_dsa.cute.constants import INDEXER_DIM as D, INDEXER_MAX_HEADS as NP  # Hi <= NP
BM = 64  # rows of k per m-tile
MT = 2  # m-tiles per consumer warpgroup
ROWS = 2 * MT * BM  # rows of k per CTA (256)
NSTAGE = 4  # Q ring stages
TILE_BYTES = BM * D * 2  # one m-tile of k, or one Q stage (16 KB)


class IndexerScoresSm90:
    def __init__(self, dtype):
        self.dtype = dtype
        self.threads = 384
        self.nc = NP // 4  # head columns per consumer thread

    def _layouts(self):
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        sK_layout = cute.tile_to_shape(k_atom, (BM, D), (0, 1))
        sQ_layout = cute.tile_to_shape(k_atom, (NP, D), (0, 1))
        return k_atom, sK_layout, sQ_layout

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor,
                 mStart: cute.Tensor, B: cutlass.Int32, T: cutlass.Int32, Hi: cutlass.Int32,
                 S: cutlass.Int32, ratio: cutlass.Int32, tpc: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        k_atom, sK_layout, sQ_layout = self._layouts()

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, 2 * MT * BM * D], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, NSTAGE * NP * D], 1024]
            # k full, full[NSTAGE], empty[NSTAGE]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1 + 2 * NSTAGE], 8]

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (BM, NP),
        )
        grid = [(S + ROWS - 1) // ROWS, (T + tpc - 1) // tpc, B]
        self.kernel(mQ, mK, mW, mOut, mStart, T, Hi, S, ratio, tpc, scale, k_atom.inner,
                    sK_layout.outer, sQ_layout.outer, qk_mma, SharedStorage).launch(
            grid=grid, block=[self.threads, 1, 1], smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor,
               mStart: cute.Tensor, T: cutlass.Int32, Hi: cutlass.Int32, S: cutlass.Int32,
               ratio: cutlass.Int32, tpc: cutlass.Int32, scale: cutlass.Float32,
               swz: cute.Swizzle, sK_layout: cute.Layout, sQ_layout: cute.Layout,
               qk_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, b = cute.arch.block_idx()
        wg = tidx // 128
        gtid = tidx % 128
        start = mStart[0]
        p0 = bx * ROWS
        t_begin = by * tpc
        t_end = cutlass.min(t_begin + tpc, T)
        # The first token that sees row p0: (p0 + 1) * ratio <= start + t + 1.
        t_first = cutlass.max(cutlass.min((p0 + 1) * ratio - 1 - start, t_end), t_begin)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 128)
            for i in cutlass.range_constexpr(NSTAGE):
                cute.arch.mbarrier_init(mbar + 1 + i, 128)  # full: the producer's cp.async
                cute.arch.mbarrier_init(mbar + 1 + NSTAGE + i, 8)  # empty: the consumer warps
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            self._produce(mQ, mK, storage.sK.data_ptr().toint(), storage.sQ.data_ptr().toint(),
                          mbar, b, T, Hi, S, p0, t_first, t_end, gtid)
        else:
            k_sw = cute.recast_ptr(storage.sK.data_ptr(), swizzle_=swz)
            q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
            self._consume(mW, mOut, k_sw, q_sw, mbar, sK_layout, sQ_layout, qk_mma, b, T, Hi,
                          S, start, ratio, scale, p0, t_begin, t_first, t_end, wg - 1, gtid)

    @cute.jit
    def _produce(self, mQ: cute.Tensor, mK: cute.Tensor, k_smem: cutlass.Int32,
                 q_smem: cutlass.Int32, mbar, b, T: cutlass.Int32, Hi: cutlass.Int32,
                 S: cutlass.Int32, p0, t_first, t_end, p):
        k_addr = mK.iterator.toint()
        q_addr = mQ.iterator.toint()
        ch = p % 16  # this thread's 16-byte chunk of every row it copies
        r0 = p // 16  # and its first row (then every 8th)
        # ---- the CTA's rows of k (zero past S) ----
        for i in cutlass.range_constexpr(ROWS // 8):
            row = r0 + 8 * i
            s = p0 + row
            src = k_addr + ((cutlass.Int64(b) * cutlass.Int64(S) + cutlass.Int64(s))
                            * cutlass.Int64(D) + cutlass.Int64(8 * ch)) * 2
            ok = s < S
            dst = k_smem + (row // BM) * TILE_BYTES + sw128_offset(BM, row % BM, ch)
            cp_async_16_zfill(dst, src if ok else k_addr,
                              cutlass.Int32(16) if ok else cutlass.Int32(0))
        cute.arch.cp_async_mbarrier_arrive_noinc(mbar)
        # ---- Q of every token that sees the tile, through the ring ----
        for i in cutlass.range(t_end - t_first, unroll=1):
            t = t_first + i
            st = i % NSTAGE
            if i >= NSTAGE:
                cute.arch.mbarrier_wait(mbar + 1 + NSTAGE + st, ((i // NSTAGE) - 1) % 2)
            dst = q_smem + st * TILE_BYTES
            q_tok = (cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)) * cutlass.Int64(Hi)
            for j in cutlass.range_constexpr(NP // 8):
                h = r0 + 8 * j
                ok = h < Hi
                src = q_addr + ((q_tok + cutlass.Int64(h)) * cutlass.Int64(D)
                                + cutlass.Int64(8 * ch)) * 2
                cp_async_16_zfill(dst + sw128_offset(NP, h, ch), src if ok else q_addr,
                                  cutlass.Int32(16) if ok else cutlass.Int32(0))
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + 1 + st)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _consume(self, mW: cute.Tensor, mOut: cute.Tensor, k_sw, q_sw, mbar,
                 sK_layout: cute.Layout, sQ_layout: cute.Layout, qk_mma: cute.TiledMma, b,
                 T: cutlass.Int32, Hi: cutlass.Int32, S: cutlass.Int32, start,
                 ratio: cutlass.Int32, scale: cutlass.Float32, p0, t_begin, t_first, t_end, g,
                 gtid):
        nc = self.nc
        lane = gtid % 32
        neg_inf = -cutlass.Float32.inf
        row_base = p0 + g * (MT * BM)  # this warpgroup's first row
        # ---- tokens in the tile's past: -inf only (one row per consumer thread) ----
        my_row = p0 + g * 128 + gtid
        for t in cutlass.range(t_begin, t_first, unroll=1):
            if my_row < S:
                mOut[(cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)) * cutlass.Int64(S)
                     + cutlass.Int64(my_row)] = neg_inf

        thr = qk_mma.get_slice(gtid)
        acc_shape = thr.partition_shape_C((BM, NP))
        tScS = acc_mn_view(thr.partition_C(cute.make_identity_tensor((BM, NP))))
        k_elems = cute.cosize(sK_layout)
        q_elems = cute.cosize(sQ_layout)
        tSrK = []
        for m in cutlass.range_constexpr(MT):
            sKm = cute.make_tensor(k_sw + cute.assume((g * MT + m) * k_elems, divby=4096),
                                   sK_layout)
            tSrK.append(thr.make_fragment_A(thr.partition_A(sKm)))
        wv = cute.make_rmem_tensor(nc, cutlass.Float32)
        cute.arch.mbarrier_wait(mbar, 0)

        for i in cutlass.range(t_end - t_first, unroll=1):
            t = t_first + i
            st = i % NSTAGE
            bt = cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)
            for c in cutlass.range_constexpr(nc):
                h = tScS[0, c][1]
                v = cutlass.Float32(0.0)
                if h < Hi:
                    v = mW[bt * cutlass.Int64(Hi) + cutlass.Int64(h)]
                wv[c] = v
            cute.arch.mbarrier_wait(mbar + 1 + st, (i // NSTAGE) % 2)
            # cp.async data (generic proxy) -> wgmma (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            sQs = cute.make_tensor(q_sw + cute.assume(st * q_elems, divby=4096), sQ_layout)
            tSrQ = thr.make_fragment_B(thr.partition_B(sQs))
            accs = [thr.make_fragment_C(acc_shape) for _ in range(MT)]
            warpgroup.fence()
            for m in cutlass.range_constexpr(MT):
                for kk in cutlass.range_constexpr(D // 16):
                    qk_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
                    cute.gemm(qk_mma, accs[m], tSrK[m][None, None, kk], tSrQ[None, None, kk],
                              accs[m])
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if lane == 0:
                cute.arch.mbarrier_arrive(mbar + 1 + NSTAGE + st)

            limit = start + t + 1  # row s is visible iff (s + 1) * ratio <= limit
            out_tok = bt * cutlass.Int64(S)
            for m in cutlass.range_constexpr(MT):
                S_mn = acc_mn_view(accs[m])
                for r in cutlass.range_constexpr(2):
                    acc = cutlass.Float32(0.0)
                    for c in cutlass.range_constexpr(nc):
                        acc = acc + cute.arch.fmax(S_mn[r, c] * scale, 0.0) * wv[c]
                    acc = quad_allreduce(acc, lambda x, y: x + y)
                    row = row_base + m * BM + tScS[r, 0][0]
                    if gtid % 4 == r and row < S:
                        v = acc
                        if (row + 1) * ratio > limit:
                            v = neg_inf
                        mOut[out_tok + cutlass.Int64(row)] = v


def fake_args(dtype):
    """q (B*T*Hi, 128), k (B*S, 128), w (B*T*Hi,) f32, out (B*T*S,) f32, start (1,) int32,
    then B, T, Hi, S, ratio, tpc, scale and the stream."""
    rows_q, rows_k, n_w, n_out, n_start = (cute.sym_int64() for _ in range(5))
    i32 = cutlass.Int32(1)
    return (
        make_fake_compact_tensor(dtype, (rows_q, D), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(dtype, (rows_k, D), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (n_w,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Float32, (n_out,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_start,), assumed_align=4),
        i32, i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream(),
    )


def compile_indexer_scores(dtype):
    """Compile with shape-only tensors (fake_args)."""
    return cute.compile(IndexerScoresSm90(dtype), *fake_args(dtype))
