"""Exact top-k of score rows (the lightning indexer's selection) by radix select, sm_90a.

For each row of scores [R, S] float32 it writes the K_eff = min(K, S) largest scores, highest
first, equal scores in ascending column order, with their columns; slots from K_eff on, and
slots whose score is -inf (rows not visible to the token), get column -1 and score -inf. NaN
scores are not supported (they order as the floats their bits encode).

One CTA of 256 threads per row; the row stays in global memory (L2 / HBM):
  1. four histogram passes over the row, one 8-bit digit of an order-preserving 32-bit key each
     (most significant first), counted with shared-memory atomics over the elements whose higher
     digits match the prefix found so far (each thread loads UNROLL keys, then counts them;
     aggregating a warp's equal bins with match.any first was slower); a suffix scan of the 256 bins picks the digit that
     holds the K_eff-th largest key. After the fourth pass the K_eff-th largest key `theta` and
     the number `need` of elements equal to it that belong to the top-k are known.
  2. one collection pass: keys above theta take slots 0 .. K_eff - need - 1 in any order (a
     shared atomic counter); keys equal to theta are ranked in column order (warp ballots, a
     per-chunk prefix over the warps) and the first `need` take the remaining slots.
  3. a bitonic sort of the K_eff candidates in shared memory on a 64-bit key (score key, then
     the complement of the column), descending, and the store.
The kernel reads and writes the float32 buffers as int32 bits (no float arithmetic is needed).
Shared memory: 8 x MAX_K bytes of candidates + 1 KB of bins.

Entry point: compile_indexer_topk(); ffi/build.py exports it as jax_dsa_indexer_topk
(ffi/indexer.cc).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from jax_dsa.cute.constants import INDEXER_MAX_TOPK as MAX_K  # candidates in shared memory

THREADS = 256
UNROLL = 8  # keys loaded per thread before they are counted (loads in flight)
NEG_INF_BITS = -8388608  # 0xFF800000, float32 -inf
INT32_MIN = -2147483648


def _as_int32(x: int) -> int:
    """The int32 with the low 32 bits of x (0xFF000000 -> -16777216)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


class IndexerTopkSm90:
    @cute.jit
    def __call__(self, mScores: cute.Tensor, mIdx: cute.Tensor, mVal: cute.Tensor,
                 R: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32, n_sort: cutlass.Int32,
                 stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            cand: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, MAX_K], 16]
            hist: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 256], 16]
            warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, THREADS // 32], 16]
            # 0: selected digit, 1: still needed, 2: counter of the keys above theta
            sel: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]

        self.kernel(mScores, mIdx, mVal, S, K, n_sort, SharedStorage).launch(
            grid=[R, 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream)

    @staticmethod
    def _key(bits):
        """Signed order-preserving key of float32 bits: the float order of the bits' values."""
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @cute.jit
    def _warp_inclusive_sum(self, x, lane):
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(x, 1 << d)
            if lane >= (1 << d):
                x = x + up
        return x

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mIdx: cute.Tensor, mVal: cute.Tensor,
               S: cutlass.Int32, K: cutlass.Int32, n_sort: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        cand = st.cand.get_tensor(cute.make_layout(MAX_K))
        hist = st.hist.get_tensor(cute.make_layout(256))
        sWarp = st.warp.get_tensor(cute.make_layout(THREADS // 32))
        sel = st.sel.get_tensor(cute.make_layout(4))
        base = cutlass.Int64(row) * cutlass.Int64(S)
        k_eff = cutlass.min(K, S)

        # ---- 1. radix select of the k_eff-th largest key (unsigned view: key ^ INT32_MIN) ----
        prefix = cutlass.Int32(0)
        mask = cutlass.Int32(0)
        need = k_eff
        for d in cutlass.range_constexpr(4):
            shift = 24 - 8 * d
            hist[tidx] = cutlass.Int32(0)
            cute.arch.sync_threads()
            for c0 in cutlass.range(0, S, THREADS * UNROLL, unroll=1):
                us = cute.make_rmem_tensor(UNROLL, cutlass.Int32)
                for j in cutlass.range_constexpr(UNROLL):  # the loads first
                    col = cutlass.min(c0 + tidx + THREADS * j, S - 1)
                    us[j] = self._key(mScores[base + cutlass.Int64(col)]) ^ INT32_MIN
                for j in cutlass.range_constexpr(UNROLL):
                    u = us[j]
                    if c0 + tidx + THREADS * j < S and (u & mask) == prefix:
                        cute.arch.atomic_add((hist.iterator + ((u >> shift) & 255)).llvm_ptr,
                                             cutlass.Int32(1), sem="relaxed", scope="cta")
            cute.arch.sync_threads()
            # Thread i takes bin 255 - i: an inclusive scan counts the keys in bins >= that one.
            h = hist[255 - tidx]
            incl = self._warp_inclusive_sum(h, lane)
            if lane == 31:
                sWarp[warp] = incl
            cute.arch.sync_threads()
            for w in cutlass.range_constexpr(THREADS // 32):
                if w < warp:
                    incl = incl + sWarp[w]
            if incl >= need and incl - h < need:
                sel[0] = 255 - tidx
                sel[1] = need - (incl - h)
            cute.arch.sync_threads()
            digit = sel[0]
            need = sel[1]
            prefix = prefix | (digit << shift)
            mask = mask | cutlass.Int32(_as_int32(255 << shift))
            cute.arch.sync_threads()  # sel and hist are rewritten by the next pass
        theta = prefix ^ INT32_MIN  # the signed key of the k_eff-th largest score
        n_above = k_eff - need

        # ---- 2. collection: above theta in any order, equal to theta in column order ----
        if tidx == 0:
            sel[2] = cutlass.Int32(0)
        cute.arch.sync_threads()
        taken = cutlass.Int32(0)  # equal keys seen in earlier chunks
        for c0 in cutlass.range(0, S, THREADS, unroll=1):
            s = c0 + tidx
            key = cutlass.Int32(INT32_MIN)
            if s < S:
                key = self._key(mScores[base + cutlass.Int64(s)])
            comp = (cutlass.Int64(key) << 32) | cutlass.Int64(0x7FFFFFFF - s)
            if s < S and key > theta:
                pos = cute.arch.atomic_add((sel.iterator + 2).llvm_ptr, cutlass.Int32(1),
                                           sem="relaxed", scope="cta")
                if pos < k_eff:  # always (the counts are exact); never past the buffer
                    cand[pos] = comp
            eq = s < S and key == theta
            ballot = cute.arch.vote_ballot_sync(eq)
            rank = cute.arch.popc(ballot & ((cutlass.Int32(1) << lane) - 1))
            if lane == 0:
                sWarp[warp] = cute.arch.popc(ballot)
            cute.arch.sync_threads()
            before = taken
            total = cutlass.Int32(0)
            for w in cutlass.range_constexpr(THREADS // 32):
                cnt = sWarp[w]
                if w < warp:
                    before = before + cnt
                total = total + cnt
            if eq and before + rank < need and n_above + before + rank < k_eff:
                cand[n_above + before + rank] = comp
            taken = taken + total
            cute.arch.sync_threads()

        # ---- 3. bitonic sort (descending) of the candidates, padded to n_sort ----
        for i in cutlass.range(k_eff + tidx, n_sort, THREADS, unroll=1):
            cand[i] = cutlass.Int64(-9223372036854775807 - 1)
        cute.arch.sync_threads()
        size = cutlass.Int32(2)
        while size <= n_sort:
            j = size // 2
            while j > 0:
                for i in cutlass.range(tidx, n_sort, THREADS, unroll=1):
                    l = i ^ j
                    if l > i:
                        a = cand[i]
                        b = cand[l]
                        if (i & size) == 0:  # a descending run
                            if a < b:
                                cand[i] = b
                                cand[l] = a
                        else:
                            if a > b:
                                cand[i] = b
                                cand[l] = a
                cute.arch.sync_threads()
                j = j // 2
            size = size * 2

        # ---- store ----
        out = cutlass.Int64(row) * cutlass.Int64(K)
        for i in cutlass.range(tidx, K, THREADS, unroll=1):
            col = cutlass.Int32(-1)
            bits = cutlass.Int32(NEG_INF_BITS)
            if i < k_eff:
                comp = cand[i]
                key = cutlass.Int32(comp >> 32)
                b = key ^ ((key >> 31) & 0x7FFFFFFF)
                if b != NEG_INF_BITS:
                    bits = b
                    col = cutlass.Int32(0x7FFFFFFF) - cutlass.Int32(comp & 0x7FFFFFFF)
            mIdx[out + cutlass.Int64(i)] = col
            mVal[out + cutlass.Int64(i)] = bits


def fake_args():
    """scores (R*S,) int32 bits, idx (R*K,) int32, val (R*K,) int32 bits, then R, S, K,
    n_sort (a power of two >= min(K, S), <= MAX_K) and the stream."""
    n_in, n_out = cute.sym_int64(), cute.sym_int64()
    i32 = cutlass.Int32(1)
    return (make_fake_compact_tensor(cutlass.Int32, (n_in,), assumed_align=4),
            make_fake_compact_tensor(cutlass.Int32, (n_out,), assumed_align=4),
            make_fake_compact_tensor(cutlass.Int32, (n_out,), assumed_align=4),
            i32, i32, i32, i32, make_fake_stream())


def compile_indexer_topk():
    """Compile with shape-only tensors (fake_args)."""
    return cute.compile(IndexerTopkSm90(), *fake_args())
