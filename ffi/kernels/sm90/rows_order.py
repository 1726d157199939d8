"""Each token's index list in row order, for the backward past the L2 (sm_90a, CuTe DSL).

The kernel form of jax_dsa.cute.kernel.rows_ascending, coarser: per token the valid entries
(slot < topk_length, 0 <= row < S) ordered by bucket = row * 127 // S (127 buckets of S / 127
rows), the list's own order kept within a bucket, then the invalid entries as row S; and the
valid count. The backward (BwdConfig.sort_rows) needs the rows of one 64-entry block to fall
into a narrow range of dkv, the same for every token, not a full sort: with K <= 127 * 64 a
bucket is narrower than a block. With wave > 0 the tokens of every other run of `wave`
consecutive tokens (tok // wave odd) take the buckets in descending order (126 - bucket; the
invalid entries still last): the backward's CTAs run in waves of about that many tokens, and a
wave that sweeps the rows the way the last one ended finds its first rows still in the L2.

Grid: one CTA of WARPS warps per token. Warp w owns the w-th of WARPS contiguous slices of the
list (whole 32-entry steps) and a 128-slot row of a [WARPS, 128] table in shared memory:
  1. each warp counts its slice's entries per bucket into its row (shared-memory atomics,
     UNROLL steps of loads in flight);
  2. thread t sums bucket t over the warps; a block scan of those sums gives each bucket's first
     output position, and warp w's part of bucket t starts after the parts of warps < w; the
     invalid bucket's first position is the valid count;
  3. each warp walks its slice again, 32 entries a step: match.any on the bucket gives each lane
     the lanes of its bucket (a warp multisplit), its rank among the lower ones and their
     number; the lane reads its part's next position, the lowest lane of each bucket advances
     it, and each lane writes its entry at position + rank. Slices run in list order and steps
     in slice order, so the order within a bucket is the list's: the output is deterministic.
The bucket is computed in fp32 and corrected to the exact integer quotient (two 64-bit
products). Offsets are 64-bit; K is any size (the steps are a runtime loop).

Entry point: compile_rows_order(); ffi/build.py exports it as jax_dsa_rows_order, launched by
ffi/rows_order.cc.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

BUCKETS = 128  # 0 .. 126: valid rows by row * 127 // S; 127: the invalid entries
LANES = 32
WARPS = 4
UNROLL = 4  # steps of loads in flight in the counting pass
OUTSIDE = 255  # a lane past its slice's end (never a bucket)
assert WARPS * LANES == BUCKETS  # the scan gives thread t bucket t


class RowsOrderSm90:
    @cute.jit
    def __call__(self, mIdx: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
                 mCount: cute.Tensor, n_tok: cutlass.Int32, K: cutlass.Int32,
                 S: cutlass.Int32, wave: cutlass.Int32, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            table: cute.struct.MemRange[cutlass.Int32, WARPS * BUCKETS]
            warp_sum: cute.struct.MemRange[cutlass.Int32, WARPS]

        self.kernel(mIdx, mLen, mOut, mCount, K, S, wave, SharedStorage).launch(
            grid=[n_tok, 1, 1], block=[WARPS * LANES, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.jit
    def bucket(self, r: cutlass.Int32, S: cutlass.Int32, inv_s: cutlass.Float32,
               descending: cutlass.Boolean):
        """row * 127 // S for 0 <= row < S (126 minus it when descending): an fp32 estimate,
        off by at most one, corrected."""
        last = BUCKETS - 1
        q = cutlass.Int32(cutlass.Float32(r) * cutlass.Float32(last) * inv_s)
        num = cutlass.Int64(r) * cutlass.Int64(last)
        if cutlass.Int64(q + 1) * cutlass.Int64(S) <= num:
            q = q + 1
        if cutlass.Int64(q) * cutlass.Int64(S) > num:
            q = q - 1
        if descending:
            q = (last - 1) - q
        return q

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
               mCount: cute.Tensor, K: cutlass.Int32, S: cutlass.Int32, wave: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        tid, _, _ = cute.arch.thread_idx()
        tok, _, _ = cute.arch.block_idx()
        lane = tid % LANES
        warp = tid // LANES
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        sTab = st.table.get_tensor(cute.make_layout((BUCKETS, WARPS), stride=(1, BUCKETS)))
        sWarpSum = st.warp_sum.get_tensor(cute.make_layout(WARPS))
        for w in cutlass.range_constexpr(WARPS):
            sTab[tid, w] = cutlass.Int32(0)
        cute.arch.sync_threads()
        base = cutlass.Int64(tok) * cutlass.Int64(K)
        length = mLen[tok]
        last = BUCKETS - 1
        inv_s = cutlass.Float32(1.0) / cutlass.Float32(S)
        descending = cutlass.Boolean(False)
        if wave > 0:
            descending = (tok // wave) % 2 == 1
        steps = (K + LANES - 1) // LANES
        per_warp = (steps + WARPS - 1) // WARPS
        lo = cutlass.min(warp * per_warp * LANES, K)
        hi = cutlass.min(lo + per_warp * LANES, K)

        # 1. this warp's entries per bucket
        for e0 in range(lo, hi, LANES * UNROLL):
            rs = []
            for u in cutlass.range_constexpr(UNROLL):
                e = e0 + u * LANES + lane
                rs.append(mIdx[base + cutlass.Int64(cutlass.min(e, K - 1))])
            for u in cutlass.range_constexpr(UNROLL):
                e = e0 + u * LANES + lane
                if e < hi:
                    r = rs[u]
                    b = cutlass.Int32(last)
                    if (e < length) & (r >= 0) & (r < S):
                        b = self.bucket(r, S, inv_s, descending)
                    cute.arch.atomic_add((sTab.iterator + (b + warp * BUCKETS)).llvm_ptr,
                                         cutlass.Int32(1), sem="relaxed", scope="cta")
        cute.arch.sync_threads()

        # 2. each warp's first position in each bucket: thread t owns bucket t
        counts = [sTab[tid, w] for w in range(WARPS)]
        own = cutlass.Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            own = own + counts[w]
        incl = own
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << d)
            if lane >= (1 << d):
                incl = incl + up
        if lane == LANES - 1:
            sWarpSum[warp] = incl
        cute.arch.sync_threads()
        first = incl - own
        for w in cutlass.range_constexpr(WARPS - 1):
            if w < warp:
                first = first + sWarpSum[w]
        for w in cutlass.range_constexpr(WARPS):
            sTab[tid, w] = first
            first = first + counts[w]
        if tid == last:
            mCount[tok] = sTab[tid, 0]  # where the invalid bucket starts
        cute.arch.sync_threads()

        # 3. stable scatter of this warp's slice, 32 entries a step
        below = (cutlass.Int32(1) << lane) - 1  # the lanes under this one
        for e0 in range(lo, hi, LANES):
            e = e0 + lane
            r = mIdx[base + cutlass.Int64(cutlass.min(e, K - 1))]
            b = cutlass.Int32(OUTSIDE)
            v = S
            if e < hi:
                b = cutlass.Int32(last)
                if (e < length) & (r >= 0) & (r < S):
                    b = self.bucket(r, S, inv_s, descending)
                    v = r
            peers = cutlass.Int32(cute.arch.match_sync(0xFFFFFFFF, b, kind="any"))
            rank = cute.arch.popc(peers & below)
            at = cutlass.Int32(0)
            if e < hi:
                at = sTab[b, warp]
            cute.arch.sync_warp()
            if (e < hi) & (rank == 0):
                sTab[b, warp] = at + cute.arch.popc(peers)
            cute.arch.sync_warp()
            if e < hi:
                mOut[base + cutlass.Int64(at + rank)] = v


def compile_rows_order():
    """Compile with shape-only tensors: idx (B*T*K,), topk_length (B*T,), out (B*T*K,), count
    (B*T,), all int32, then the token count, K, S, the wave (tokens; 0: all ascending) and the
    stream."""
    n_idx, n_tok = (cute.sym_int64() for _ in range(2))
    idx = make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4)
    lengths = make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4)
    out = make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4)
    count = make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4)
    i32 = cutlass.Int32(1)
    return cute.compile(RowsOrderSm90(), idx, lengths, out, count, i32, i32, i32, i32,
                        make_fake_stream())
