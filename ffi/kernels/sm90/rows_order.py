"""Each token's index list in row order, for the backward past the L2 (sm_90a, CuTe DSL).

The kernel form of jax_dsa.cute.kernel.rows_ascending, coarser: per token the valid entries
(slot < topk_length, 0 <= row < S) ordered by bucket = row * 127 // S (127 buckets of S / 127
rows), the list's own order kept within a bucket, then the invalid entries as row S; and the
valid count. The backward (BwdConfig.sort_rows) needs the rows of one 64-entry block to fall
into a narrow range of dkv, the same for every token, not a full sort: with K <= 127 * 64 a
bucket is narrower than a block.

Grid: one warp (CTA of 32 threads) per token, a 128-slot table in shared memory:
  1. the warp counts its token's entries per bucket (shared-memory atomics, 32 entries a step);
  2. lane l scans buckets 4l .. 4l + 3 and the warp adds the lanes' sums (shuffles): each
     bucket's first output position; the last bucket's is the valid count;
  3. the warp walks the list again 32 entries a step: eight ballots of the bucket's bits give
     each lane the lanes of its bucket (a warp multisplit), its rank among the lower ones and
     their number; every lane reads its bucket's next position, the lowest lane of each bucket
     advances it, each lane writes its entry at position + rank. Steps run in list order, so the
     order within a bucket is the list's: the output is deterministic.
Offsets are 64-bit; K is any size (the steps are a runtime loop).

Entry point: compile_rows_order(); ffi/build.py exports it as jax_dsa_rows_order, launched by
ffi/rows_order.cc.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

BUCKETS = 128  # 0 .. 126: valid rows by row * 127 // S; 127: the invalid entries
LANES = 32
OUTSIDE = 255  # a lane past the list's end (8 bits: never a bucket)


class RowsOrderSm90:
    @cute.jit
    def __call__(self, mIdx: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
                 mCount: cute.Tensor, n_tok: cutlass.Int32, K: cutlass.Int32,
                 S: cutlass.Int32, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            start: cute.struct.MemRange[cutlass.Int32, BUCKETS]

        self.kernel(mIdx, mLen, mOut, mCount, K, S, SharedStorage).launch(
            grid=[n_tok, 1, 1], block=[LANES, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream)

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
               mCount: cute.Tensor, K: cutlass.Int32, S: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        lane, _, _ = cute.arch.thread_idx()
        tok, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        sStart = st.start.get_tensor(cute.make_layout(BUCKETS))
        for i in cutlass.range_constexpr(BUCKETS // LANES):
            sStart[lane + LANES * i] = cutlass.Int32(0)
        cute.arch.sync_threads()
        base = cutlass.Int64(tok) * cutlass.Int64(K)
        length = mLen[tok]
        last = BUCKETS - 1

        # 1. entries per bucket
        for e0 in range(0, K, LANES):
            e = e0 + lane
            if e < K:
                r = mIdx[base + cutlass.Int64(e)]
                b = cutlass.Int32(last)
                if (e < length) & (r >= 0) & (r < S):
                    b = cutlass.Int32((cutlass.Int64(r) * cutlass.Int64(last)) // cutlass.Int64(S))
                cute.arch.atomic_add((sStart.iterator + b).llvm_ptr, cutlass.Int32(1),
                                     sem="relaxed", scope="cta")
        cute.arch.sync_threads()

        # 2. each bucket's first position: lane l owns buckets 4l .. 4l + 3
        c0 = sStart[4 * lane]
        c1 = sStart[4 * lane + 1]
        c2 = sStart[4 * lane + 2]
        c3 = sStart[4 * lane + 3]
        own = c0 + c1 + c2 + c3
        incl = own
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << d)
            if lane >= (1 << d):
                incl = incl + up
        first = incl - own
        cute.arch.sync_threads()
        sStart[4 * lane] = first
        sStart[4 * lane + 1] = first + c0
        sStart[4 * lane + 2] = first + c0 + c1
        sStart[4 * lane + 3] = first + c0 + c1 + c2
        if lane == LANES - 1:
            mCount[tok] = first + c0 + c1 + c2  # where the invalid bucket starts
        cute.arch.sync_threads()

        # 3. stable scatter, 32 entries a step
        below = (cutlass.Int32(1) << lane) - 1  # the lanes under this one
        for e0 in range(0, K, LANES):
            e = e0 + lane
            r = mIdx[base + cutlass.Int64(cutlass.min(e, K - 1))]
            b = cutlass.Int32(OUTSIDE)
            v = S
            if e < K:
                b = cutlass.Int32(last)
                if (e < length) & (r >= 0) & (r < S):
                    b = cutlass.Int32((cutlass.Int64(r) * cutlass.Int64(last))
                                      // cutlass.Int64(S))
                    v = r
            peers = cutlass.Int32(-1)
            for i in cutlass.range_constexpr(8):
                bit = (b >> i) & 1
                ballot = cute.arch.vote_ballot_sync(bit == 1)
                sel = 0 - bit  # all ones where this lane's bit is set
                peers = peers & ((ballot & sel) | ((ballot ^ -1) & (sel ^ -1)))
            rank = cute.arch.popc(peers & below)
            at = cutlass.Int32(0)
            if e < K:
                at = sStart[b]
            cute.arch.sync_threads()
            if (e < K) & (rank == 0):
                sStart[b] = at + cute.arch.popc(peers)
            cute.arch.sync_threads()
            if e < K:
                mOut[base + cutlass.Int64(at + rank)] = v


def compile_rows_order():
    """Compile with shape-only tensors: idx (B*T*K,), topk_length (B*T,), out (B*T*K,), count
    (B*T,), all int32, then the token count, K, S and the stream."""
    n_idx, n_tok = (cute.sym_int64() for _ in range(2))
    idx = make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4)
    lengths = make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4)
    out = make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4)
    count = make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4)
    i32 = cutlass.Int32(1)
    return cute.compile(RowsOrderSm90(), idx, lengths, out, count, i32, i32, i32,
                        make_fake_stream())
