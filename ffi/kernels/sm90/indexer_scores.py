"""Lightning-indexer scores for sm_90a: a wgmma score GEMM with the ReLU and head sum fused.

    out[b, t, s] = sum_h w[b, t, h] * ReLU(scale * q[b, t, h] . k[b, s])   if row s is visible
                   -inf                                                    otherwise

Row s is visible to token t iff (s + 1) * ratio <= start + t + 1 (jax_dsa/indexer.py); q is
[B, T, Hi, 128] (Hi <= 64, padded to NP = 64 inside the kernel), k [B, S, 128] (one head),
w [B, T, Hi] float32, out [B, T, S] float32; `start` is read from a 1-element int32 buffer so
that a caller can walk chunks of tokens inside one XLA loop.

Grid (ceil(S / 256), ceil(T / tpc), B) with tpc tokens per CTA (ffi/indexer.cc: 256),
384 threads = 3 warpgroups, one CTA per SM:
  * warpgroup 0, the producer (40 registers): the CTA's 256 rows of k once (16-byte cp.async,
    rows >= S zero), then Q and w of each of its tokens that sees any of those rows into a
    ring of NSTAGE stages (NP x 128 of Q and NP floats of w, heads >= Hi zero-filled), a full
    and an empty mbarrier per stage. A stage is released (full) once its copies have landed
    and been fenced for the async proxy, one stage behind the copies in flight.
  * warpgroups 1 and 2, the consumers (232 registers): each owns 128 of the rows, two 64-row
    m-tiles held in registers for the whole CTA as the A operands of the score GEMM (wgmma
    64 x NP x 16 with A from registers, 8 k-steps per m-tile; the rows negated once when
    scale < 0, since ReLU(scale x) = |scale| ReLU(-x)). The two consumers take turns at the
    tensor cores (two named barriers): one issues both m-tiles' GEMMs of a token, hands the
    turn over when the first is done, then waits for the second and runs their epilogue
    (for each of its rows the sum of ReLU(S) * w over the thread's NP / 4 head columns, the
    quad's all-reduce times |scale|, one store per row, -inf past the causal edge) while
    the other's GEMMs run. A token's stage goes back to the producer (empty) once both
    consumers' GEMMs of it are done.
  Tokens before the first that sees row p0 (causal: the tile is entirely in their future) run
  no GEMM: the consumers store -inf for them.
Shared memory: k 64 KB + NSTAGE x (16 KB Q + 256 B w) = 129 KB. The wgmma operands are K-major
with the 128-byte swizzle; the producer writes them at the swizzled byte offsets
(sw128_offset).

Entry point: compile_indexer_scores(dtype); ffi/build.py exports it as
jax_dsa_indexer_scores_<dtype> (ffi/indexer.cc).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from .common import (acc_mn_view, cp_async_4_zfill, cp_async_16_zfill, quad_allreduce,
                     sw128_offset)


from jax_dsa.cute.constants import INDEXER_DIM as D, INDEXER_MAX_HEADS as NP  # Hi <= NP
BM = 64  # rows of k per m-tile
MT = 2  # m-tiles per consumer warpgroup
ROWS = 2 * MT * BM  # rows of k per CTA (256)
NSTAGE = 4  # Q ring stages
TURN_BAR = 1  # named barriers TURN_BAR + g: consumer g may issue its GEMMs
TILE_BYTES = BM * D * 2  # one m-tile of k, or one Q stage (16 KB)
PRODUCER_REGS, CONSUMER_REGS = 40, 232


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

    def _mma(self):
        """The score GEMM: rows of k (A, from registers) x heads of Q (B, shared memory)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (BM, NP), warpgroup.OperandSource.RMEM,
        )

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
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NSTAGE * NP], 16]
            # k full, full[NSTAGE], empty[NSTAGE]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1 + 2 * NSTAGE], 8]

        qk_mma = self._mma()
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

        sW = storage.sW.get_tensor(cute.make_layout(NSTAGE * NP))
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self._produce(mQ, mK, mW, storage.sK.data_ptr().toint(),
                          storage.sQ.data_ptr().toint(), storage.sW.data_ptr().toint(), mbar, b,
                          T, Hi, S, p0, t_first, t_end, gtid)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            k_sw = cute.recast_ptr(storage.sK.data_ptr(), swizzle_=swz)
            q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
            self._consume(mOut, sW, k_sw, q_sw, mbar, sK_layout, sQ_layout, qk_mma, b, T, Hi,
                          S, start, ratio, scale, p0, t_begin, t_first, t_end, wg - 1, gtid)

    @cute.jit
    def _produce(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, k_smem: cutlass.Int32,
                 q_smem: cutlass.Int32, w_smem: cutlass.Int32, mbar, b, T: cutlass.Int32,
                 Hi: cutlass.Int32, S: cutlass.Int32, p0, t_first, t_end, p):
        k_addr = mK.iterator.toint()
        q_addr = mQ.iterator.toint()
        w_addr = mW.iterator.toint()
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
            if p < NP:  # w[b, t, p] (0 for heads >= Hi)
                ok = p < Hi
                src = w_addr + (q_tok + cutlass.Int64(p)) * 4
                cp_async_4_zfill(w_smem + (st * NP + p) * 4, src if ok else w_addr,
                                 cutlass.Int32(4) if ok else cutlass.Int32(0))
            # Stage i's copies in flight, stage i - 1's landed: fenced for the async proxy
            # (the consumers' wgmma reads Q from shared memory) and released to the consumers.
            cute.arch.cp_async_commit_group()
            if i > 0:
                cute.arch.cp_async_wait_group(1)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(mbar + 1 + (i - 1) % NSTAGE)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        if t_end > t_first:  # the last stage
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(mbar + 1 + (t_end - t_first - 1) % NSTAGE)

    @cute.jit
    def _consume(self, mOut: cute.Tensor, sW: cute.Tensor, k_sw, q_sw, mbar,
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
        abs_scale = cute.arch.fmax(scale, -scale)
        # ---- this warpgroup's rows of k into registers, once (negated when scale < 0) ----
        cute.arch.mbarrier_wait(mbar, 0)
        tSrK = []
        for m in cutlass.range_constexpr(MT):
            sKm = cute.make_tensor(k_sw + cute.assume((g * MT + m) * k_elems, divby=4096),
                                   sK_layout)
            rK = cute.make_rmem_tensor(thr.partition_shape_A((BM, D)), self.dtype)
            cute.autovec_copy(thr.partition_A(sKm), rK)
            if scale < 0.0:
                rK.store(-rK.load())
            tSrK.append(rK)
        accs = [thr.make_fragment_C(acc_shape) for _ in range(MT)]
        wv = cute.make_rmem_tensor(nc, cutlass.Float32)

        # The two consumers take turns at the tensor cores (named barriers TURN_BAR + g: "g
        # may issue"): each issues both m-tiles' GEMMs of token t, lets the other issue once
        # its first m-tile is done (the second still keeps the tensor cores busy), waits for
        # its own and runs the epilogue while the other's GEMMs run. w is read before the
        # wait and used after it, so no shared-memory load stalls the hand-over; the
        # epilogue follows a wait, so ptxas cannot interleave it between the wgmma
        # instructions.
        if g == 1:
            cute.arch.barrier_arrive(barrier_id=TURN_BAR, number_of_threads=256)
        n = t_end - t_first
        for i in cutlass.range(n, unroll=1):
            t = t_first + i
            st = i % NSTAGE
            cute.arch.mbarrier_wait(mbar + 1 + st, (i // NSTAGE) % 2)
            cute.arch.barrier(barrier_id=TURN_BAR + g, number_of_threads=256)
            for m in cutlass.range_constexpr(MT):
                self._issue(qk_mma, accs[m], tSrK[m], q_sw, sQ_layout, st, gtid)
            for c in cutlass.range_constexpr(nc):
                wv[c] = sW[st * NP + tScS[0, c][1]]
            warpgroup.wait_group(1)
            cute.arch.barrier_arrive(barrier_id=TURN_BAR + 1 - g, number_of_threads=256)
            warpgroup.wait_group(0)
            if lane == 0:  # both GEMMs of token t are done with its stage
                cute.arch.mbarrier_arrive(mbar + 1 + NSTAGE + st)
            for m in cutlass.range_constexpr(MT):
                self._store_rows(accs[m], wv, tScS, mOut, b, T, t, row_base + m * BM, S, start,
                                 ratio, gtid, abs_scale)
        if g == 0:  # the other's last hand-over
            cute.arch.barrier(barrier_id=TURN_BAR, number_of_threads=256)

    @cute.jit
    def _issue(self, qk_mma: cute.TiledMma, acc: cute.Tensor, rK: cute.Tensor, q_sw,
               sQ_layout: cute.Layout, st, gtid):
        """The GEMM of one m-tile (rK, in registers) against the Q of ring stage st into acc,
        committed as one wgmma group. (A tiled MMA of its own: its accumulate flag is set
        inside the staged branches that call this.)"""
        mma = self._mma()
        thr = mma.get_slice(gtid)
        sQs = cute.make_tensor(q_sw + cute.assume(st * cute.cosize(sQ_layout), divby=4096),
                               sQ_layout)
        tSrQ = thr.make_fragment_B(thr.partition_B(sQs))
        warpgroup.fence()
        for kk in cutlass.range_constexpr(D // 16):
            mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
            cute.gemm(mma, acc, rK[None, None, kk], tSrQ[None, None, kk], acc)
        warpgroup.commit_group()

    @cute.jit
    def _store_rows(self, acc: cute.Tensor, wv: cute.Tensor, tScS: cute.Tensor,
                    mOut: cute.Tensor, b, T: cutlass.Int32, t, row0, S: cutlass.Int32, start,
                    ratio: cutlass.Int32, gtid, abs_scale):
        """The scores of an m-tile's rows for token t: each thread's two rows, summed over
        its head columns (four independent partial sums: a short dependency chain) and across
        the quad, times |scale| (w is unscaled); one thread of the quad stores each row."""
        limit = start + t + 1  # row s is visible iff (s + 1) * ratio <= limit
        out_tok = (cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)) * cutlass.Int64(S)
        S_mn = acc_mn_view(acc)
        for r in cutlass.range_constexpr(2):
            part = [cutlass.Float32(0.0)] * 4
            for c in cutlass.range_constexpr(self.nc):
                part[c % 4] = part[c % 4] + cute.arch.fmax(S_mn[r, c], 0.0) * wv[c]
            a = (part[0] + part[1]) + (part[2] + part[3])
            a = quad_allreduce(a, lambda x, y: x + y) * abs_scale
            row = row0 + tScS[r, 0][0]
            if gtid % 4 == r and row < S:
                v = a
                if (row + 1) * ratio > limit:
                    v = -cutlass.Float32.inf
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
