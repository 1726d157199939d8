"""The indexer's training target for sm_90a: each entry's attention mass summed over a block of
64 heads, from q, kv and the forward's log-sum-exp (no [B, T, H, K] array in HBM).

    mass[b, t, hb, j] = sum_{h in head block hb} exp(scale * q[b, t, h] . kv[b, idx[b, t, j]]
                                                      - off[b, t, h])
                        (0 for invalid entries: j >= min(K, topk_length), idx < 0, idx >= S)

with off = logaddexp(lse, sink) (+inf for dead heads: every term 0), so that each term is
sparse_mla's probability p[b, t, h, j] with the sink in its denominator. jax_dsa/cute/target.py
computes off, sums the head blocks and normalises over the entries.

Layouts (flattened row-major): q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,) int32,
topk_length (B*T,) int32, off (B*T*H,) float32, mass (B*T*n_hb*K,) float32 with
n_hb = ceil(H / 64); every element of mass is written.

One CTA per token (one per SM: shared memory), 384 threads, two variants (`heads`: 64 for
H <= 64, 128 for 64 < H <= 128), so that each row is gathered once for all the token's heads:
  * warpgroup 0, the producer, gathers the list's rows in blocks of 64 entries, a block as
    Dqk / 64 slabs of 64 rows x 64 columns (8 KB, the K-major 128-byte-swizzled layout's
    column tiles), into a ring of RING_SLABS slabs with a full and an empty mbarrier each
    (16-byte cp.async, 8 threads per row; invalid entries are zero rows that read nothing,
    their flags go out with a block's first slab);
  * warpgroups 1 and 2, the consumers, take alternate blocks and compute S^T = K Q^T with the
    rows on wgmma's M and all the variant's heads on N (wgmma 64 x heads x 16, both operands in
    shared memory, one Q tile both read, 4 k-steps per slab; a slab is released once the
    wgmmas after it were issued and it is done). While one consumer runs its epilogue, the
    other's wgmmas keep the tensor pipe busy. Heads >= H are zero rows of Q, never read from
    global.
Epilogue per block: p = exp2(S scale log2(e) - off log2(e)) summed over the thread's 16 head
columns of each 64-head block in each of its two rows, then over the quad holding the row (two
shuffles): a row's head sum needs no barrier; one store per entry and 64-head block, 0 for
invalid entries.
Shared memory: Q (72 KB per 64 heads at Dqk 576) + the ring (10 / 12 slabs at 128 heads,
19 / 20 at 64) + 2 KB of flags: at most 227 KB. Registers: 127-128, no spills; no wgmma group
is in flight across the block loop's back edge.

Entry point: compile_attention_target(dtype, d_qk, heads); ffi/build.py exports it as
jax_dsa_attention_target_h<heads>_<dtype>_d<Dqk> (ffi/attention_target.cc picks by H).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from .common import (LOG2_E, ROW_COPY_THREADS as WG_THREADS, ROW_COPY_TPR as TPR,
                     acc_mn_view, cp_async_16_zfill, gather_source, load_block_indices,
                     load_rows_sw128, quad_allreduce)

BM = 64  # rows per block, heads per Q tile

# 64 x 64 slabs (8 KB) of the row ring per (heads, Dqk): what shared memory leaves next to Q
RING_SLABS = {(128, 512): 12, (128, 576): 10, (64, 512): 20, (64, 576): 19}
FLAG_BLOCKS = 8  # blocks of row flags kept (an epilogue lags the flags written by <= 4 blocks)
PRODUCER_ROWS = WG_THREADS // TPR  # rows a producer pass covers (16)


class AttentionTargetSm90:
    """The target kernel for up to `heads` (64 or 128) heads of one token per CTA (module
    docstring)."""

    def __init__(self, dtype, d_qk: int, heads: int):
        assert d_qk in (512, 576) and heads in (64, 128)
        self.dtype = dtype
        self.d_qk = d_qk
        self.n_slab = d_qk // 64  # slabs per block
        self.n_ring = RING_SLABS[(heads, d_qk)]
        self.heads = heads  # wgmma's N
        self.n_hb = heads // BM  # 64-head blocks of the output

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
                 mOff: cute.Tensor, mMass: cute.Tensor, B: cutlass.Int32, T: cutlass.Int32,
                 H: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                 self.dtype)
        q_layout = cute.tile_to_shape(k_atom, (self.heads, self.d_qk), (0, 1))
        slab_layout = cute.tile_to_shape(k_atom, (BM, 64), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, self.heads * self.d_qk],
                                  1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, self.n_ring * BM * 64],
                                   1024]
            sValid: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, FLAG_BLOCKS * BM],
                                      16]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * self.n_ring], 8]

        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (BM, self.heads))
        self.kernel(mQ, mKV, mIdx, mLen, mOff, mMass, T, H, S, K, scale, k_atom.inner,
                    q_layout.outer, slab_layout.outer, mma, SharedStorage).launch(
            grid=[B * T, 1, 1], block=[3 * WG_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
               mOff: cute.Tensor, mMass: cute.Tensor, T: cutlass.Int32, H: cutlass.Int32,
               S: cutlass.Int32, K: cutlass.Int32, scale: cutlass.Float32, swz: cute.Swizzle,
               q_layout: cute.Layout, slab_layout: cute.Layout, mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        NS, NR = self.n_slab, self.n_ring
        tidx, _, _ = cute.arch.thread_idx()
        bt32, _, _ = cute.arch.block_idx()
        wg = tidx // WG_THREADS
        wtid = tidx % WG_THREADS
        bt = cutlass.Int64(bt32)
        b = bt32 // T
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))
        n_blocks = (k_eff + BM - 1) // BM
        idx_base = bt * cutlass.Int64(K)
        kv_batch = cutlass.Int64(b) * cutlass.Int64(S)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sValid = storage.sValid.get_tensor(cute.make_layout(FLAG_BLOCKS * BM))
        mbar = storage.mbar.data_ptr()  # [0, NR): slab full; [NR, 2 NR): slab empty
        kv_smem = storage.sKV.data_ptr().toint()
        slab_bytes = BM * 128

        # Q, the tile both consumers read (heads >= H: zeros, nothing read), by consumer 1
        if wg == 1:
            load_rows_sw128(mQ.iterator.toint(), bt * cutlass.Int64(H), H,
                            storage.sQ.data_ptr().toint(), wtid // TPR, wtid % TPR, self.heads,
                            self.d_qk * 2)
            cute.arch.cp_async_commit_group()
        if tidx == 0:
            for i in cutlass.range_constexpr(NR):
                cute.arch.mbarrier_init(mbar + i, 2 * WG_THREADS)  # 128 cp.async + 128 plain
                cute.arch.mbarrier_init(mbar + NR + i, WG_THREADS)  # the block's consumer
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ---- producer: slab sl of block blk goes to ring slot (blk NS + sl) % NR once
            # both consumers released that slot's previous slab. Thread (prow, psub) copies
            # 16-byte chunk psub of rows prow + 16 p of each slab. ----
            prow = wtid // TPR
            psub = wtid % TPR
            dbase = kv_smem + prow * 128 + ((psub ^ (prow % 8)) * 16)
            kv_addr = mKV.iterator.toint()
            gsub = cutlass.Int64(psub * 16)
            n_pass = BM // PRODUCER_ROWS
            cur = cute.make_rmem_tensor(n_pass, cutlass.Int32)
            src = cute.make_rmem_tensor(n_pass, cutlass.Int64)
            nb = cute.make_rmem_tensor(n_pass, cutlass.Int32)
            for blk in cutlass.range(n_blocks, unroll=1):
                load_block_indices(mIdx, cur, blk, k_eff, idx_base, prow, BM, PRODUCER_ROWS,
                                   n_pass)
                for p in cutlass.range_constexpr(n_pass):
                    row = cur[p]
                    src[p], nb[p] = gather_source(kv_addr, kv_batch, row, row >= 0 and row < S,
                                                  self.d_qk * 2, gsub)
                for sl in cutlass.range_constexpr(NS):
                    s = blk * NS + sl
                    slot = s % NR
                    if s >= NR:
                        cute.arch.mbarrier_wait(mbar + NR + slot, (s // NR + 1) % 2)
                    if cutlass.const_expr(sl == 0):
                        if psub == 0:
                            for p in cutlass.range_constexpr(n_pass):
                                sValid[(blk % FLAG_BLOCKS) * BM + prow + PRODUCER_ROWS * p] = (
                                    cutlass.Int32(1) if nb[p] != 0 else cutlass.Int32(0))
                    dst = dbase + slot * slab_bytes
                    for p in cutlass.range_constexpr(n_pass):
                        cp_async_16_zfill(dst, src[p], nb[p], p * PRODUCER_ROWS * 128, sl * 128)
                    cute.arch.cp_async_mbarrier_arrive_noinc(mbar + slot)
                    cute.arch.mbarrier_arrive(mbar + slot)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
        else:
            # ---- consumers: S^T (64 rows x all heads) of the blocks blk % 2 == cg ----
            cg = wg - 1
            ctid = tidx - WG_THREADS
            for j in cutlass.range(n_blocks * BM + ctid, K, 2 * WG_THREADS, unroll=1):
                for hb in cutlass.range_constexpr(self.n_hb):
                    mMass[(bt * cutlass.Int64(self.n_hb) + cutlass.Int64(hb)) * cutlass.Int64(K)
                          + cutlass.Int64(j)] = cutlass.Float32(0.0)
            thr = mma.get_slice(wtid)
            tScS = acc_mn_view(thr.partition_C(cute.make_identity_tensor((BM, self.heads))))
            nc = cute.size(tScS, mode=[1])
            scale_log2 = scale * LOG2_E
            off_c = cute.make_rmem_tensor(nc, cutlass.Float32)  # log2 units; +inf: no head
            for c in cutlass.range_constexpr(nc):
                h = tScS[0, c][1]
                v = cutlass.Float32.inf
                if h < H:
                    v = mOff[bt * cutlass.Int64(H) + cutlass.Int64(h)] * LOG2_E
                off_c[c] = v
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=2 * WG_THREADS)
            q_sw = cute.recast_ptr(storage.sQ.data_ptr(), swizzle_=swz)
            sQ = cute.make_tensor(q_sw, q_layout)
            tSrQ = thr.make_fragment_B(thr.partition_B(sQ))
            kv_sw = cute.recast_ptr(storage.sKV.data_ptr(), swizzle_=swz)
            acc = thr.make_fragment_C(thr.partition_shape_C((BM, self.heads)))
            S_mn = acc_mn_view(acc)
            for blk in cutlass.range(cg, n_blocks, 2, unroll=1):
                warpgroup.fence()
                for sl in cutlass.range_constexpr(NS):
                    s = blk * NS + sl
                    slot = s % NR
                    cute.arch.mbarrier_wait(mbar + slot, (s // NR) % 2)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    sA = cute.make_tensor(kv_sw + cute.assume(slot * (BM * 64), divby=4096),
                                          slab_layout)
                    tSrA = thr.make_fragment_A(thr.partition_A(sA))
                    for kk in cutlass.range_constexpr(4):
                        mma.set(warpgroup.Field.ACCUMULATE, sl * 4 + kk != 0)
                        cute.gemm(mma, acc, tSrA[None, None, kk], tSrQ[None, None, sl * 4 + kk],
                                  acc)
                    warpgroup.commit_group()
                    if cutlass.const_expr(sl > 0):  # the previous slab's wgmmas are done
                        warpgroup.wait_group(1)
                        cute.arch.mbarrier_arrive(mbar + NR + (s - 1) % NR)
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(mbar + NR + (blk * NS + NS - 1) % NR)
                # each row's p summed over the thread's columns of each 64-head block (columns
                # c < nc / 2 are heads < 64: wgmma's accumulator order), then over the quad's
                for r in cutlass.range_constexpr(2):
                    rr = tScS[r, 0][0]
                    j = blk * BM + rr
                    ok = sValid[(blk % FLAG_BLOCKS) * BM + rr] != 0
                    for hb in cutlass.range_constexpr(self.n_hb):
                        a = cutlass.Float32(0.0)
                        for c in cutlass.range_constexpr(hb * nc // self.n_hb,
                                                         (hb + 1) * nc // self.n_hb):
                            a = a + cute.math.exp2(S_mn[r, c] * scale_log2 - off_c[c],
                                                   fastmath=True)
                        a = quad_allreduce(a, lambda x, y: x + y)
                        if wtid % 4 == 0 and j < K:
                            mMass[(bt * cutlass.Int64(self.n_hb) + cutlass.Int64(hb))
                                  * cutlass.Int64(K) + cutlass.Int64(j)] = (
                                a if ok else cutlass.Float32(0.0))

def fake_args(dtype, d_qk: int):
    """q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,), topk_length (B*T,), off (B*T*H,) f32,
    mass (B*T*n_hb*K,) f32, then B, T, H, S, K, scale and the stream."""
    rows_q, rows_kv, n_idx, n_tok, n_mass = (cute.sym_int64() for _ in range(5))
    i32 = cutlass.Int32(1)
    return (
        make_fake_compact_tensor(dtype, (rows_q, d_qk), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(dtype, (rows_kv, d_qk), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Float32, (rows_q,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Float32, (n_mass,), assumed_align=4),
        i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream(),
    )


def compile_attention_target(dtype, d_qk: int, heads: int = 64):
    """Compile with shape-only tensors (fake_args); heads: 64 or 128 per CTA."""
    return cute.compile(AttentionTargetSm90(dtype, d_qk, heads), *fake_args(dtype, d_qk))
