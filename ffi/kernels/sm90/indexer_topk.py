"""Exact top-k of score rows (the lightning indexer's selection) by radix select, sm_90a.

For each row of scores [R, S] float32 it writes the K_eff = min(K, S) largest scores, highest
first, equal scores in ascending column order, with their columns; slots from K_eff on, and
slots whose score is -inf (rows not visible to the token), get column -1 and score -inf. NaN
scores are not supported (they order as the floats their bits encode).

One CTA of 256 threads per row; the row stays in global memory (L2 / HBM), and is read twice
on the fast path (dev/topk_model.py models it and checks it against an oracle):
  A. a histogram of the top 13 bits of an order-preserving 32-bit key (8192 bins, shared-memory
     atomics; each thread loads UNROLL keys, then counts them); a suffix scan picks the bin b0
     that holds the K_eff-th largest key.
  B. keys above b0 go to the candidates (a shared atomic counter), the keys of b0 (at most BUF)
     to a shared-memory buffer, where two more histogram passes (10 and 9 bits) find the
     K_eff-th largest key theta. The buffer's keys above theta join the candidates; the keys
     equal to theta all join too (when they fit in CAP = 2 max_k), so the final sort orders the
     ties by column; at theta = -inf none is needed (those slots are (-1, -inf)).
  Fallback (b0 holds more than BUF keys, or more ties than CAP): four 8-bit histogram passes
  over the row and a collection pass that ranks the ties in column order (warp ballots).
  Then a bitonic sort of the candidates on a 64-bit key (score key, then the complement of the
  column), descending: in registers (E = max_k / 256 per thread; shuffles between the lanes of a
  warp, shared memory only for partners in other warps) when they fit in max_k, else in shared
  memory; then the store of the first K.
The kernel reads and writes the float32 buffers as int32 bits (no float arithmetic is needed).
Shared memory: 8 x CAP bytes of candidates + 8 x BUF of buffer (which holds pass A's bins
first) + 4 KB of bins: 45 KB at max_k 512 (five CTAs per SM) up to 100 KB at 4096 (two). One
build per max_k of INDEXER_TOPK_SIZES; the handler runs the smallest that holds K.

Entry point: compile_indexer_topk(max_k); ffi/build.py exports it as
jax_dsa_indexer_topk_k<max_k> (ffi/indexer.cc).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from jax_dsa.cute.constants import INDEXER_MAX_TOPK

THREADS = 256
A_BITS = 13  # the first digit: the key's top 13 bits
BINS_A = 1 << A_BITS
BINS = 1024  # the other digits' bins (at most 10 bits)
BUF = 4096  # keys of the selected first-digit bin held in shared memory (fast path)
UNROLL = 16  # keys loaded per thread before they are counted (loads in flight)
NEG_INF_BITS = -8388608  # 0xFF800000, float32 -inf
NEG_INF_KEY = NEG_INF_BITS ^ 0x7FFFFFFF  # its signed order key
INT32_MIN = -2147483648
INT64_MIN = -9223372036854775808


def _as_int32(x: int) -> int:
    """The int32 with the low 32 bits of x (0xFF000000 -> -16777216)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


class IndexerTopkSm90:
    def __init__(self, max_k: int = INDEXER_MAX_TOPK):
        assert max_k >= THREADS and max_k & (max_k - 1) == 0, \
            "max_k must be a power of two >= THREADS (the register sort's E >= 1)"
        self.max_k = max_k  # the largest K this build takes
        self.cap = 2 * max_k  # candidates in the final sort (a power of two > max_k)

    @cute.jit
    def __call__(self, mScores: cute.Tensor, mIdx: cute.Tensor, mVal: cute.Tensor,
                 R: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32,
                 stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            cand: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, self.cap], 16]
            buf: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, BUF], 16]
            hist: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, BINS], 16]
            warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, THREADS // 32], 16]
            # 0: selected digit, 1: still needed, 2: candidate counter, 3: the digit's count,
            # 4: buffer counter, 5: ties at theta
            sel: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 8], 16]

        self.kernel(mScores, mIdx, mVal, S, K, SharedStorage).launch(
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

    @cute.jit
    def _select(self, hist: cute.Tensor, sWarp: cute.Tensor, sel: cute.Tensor, nb: int, need,
                tidx, lane, warp):
        """sel[0] = the bin b (scanning down from nb - 1) with count(bins > b) < need <=
        count(bins >= b), sel[1] = what of need is left for it, sel[3] = its count. Thread t
        owns bins nb - 1 - (per * t + j). The caller syncs before reading sel."""
        per = nb // THREADS
        loc = cute.make_rmem_tensor(per, cutlass.Int32)
        tot = cutlass.Int32(0)
        for j in cutlass.range_constexpr(per):
            loc[j] = hist[nb - 1 - (per * tidx + j)]
            tot = tot + loc[j]
        incl = self._warp_inclusive_sum(tot, lane)
        if lane == 31:
            sWarp[warp] = incl
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(THREADS // 32):
            if w < warp:
                incl = incl + sWarp[w]
        run = incl - tot
        for j in cutlass.range_constexpr(per):
            c = loc[j]
            if run < need and run + c >= need:
                sel[0] = nb - 1 - (per * tidx + j)
                sel[1] = need - run
                sel[3] = c
            run = run + c

    @cute.jit
    def _five_pass_select(self, mScores: cute.Tensor, cand: cute.Tensor, hist: cute.Tensor,
                          sWarp: cute.Tensor, sel: cute.Tensor, base, S, k_eff, tidx, lane,
                          warp):
        """The fallback (a first-digit bin larger than BUF, or more ties than CAP): four 8-bit
        histogram passes over the row, then the collection pass (ties in column order);
        cand[0 .. k_eff) gets the top k_eff in any order."""
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

    @cute.jit
    def _bitonic_stage(self, cand: cute.Tensor, n_pow2, lsize, lj, tidx):
        """One compare-exchange stage over cand[0, n_pow2): each thread takes pairs p (every
        THREADS-th), the elements i (p with a 0 bit inserted at bit lj) and i + 2^lj, larger
        first in a run of 2^lsize whose bit lsize of i is 0, smaller first otherwise."""
        j = cutlass.Int32(1) << lj
        for p in cutlass.range(tidx, n_pow2 // 2, THREADS, unroll=4):
            i = ((p >> lj) << (lj + 1)) | (p & (j - 1))
            a = cand[i]
            b = cand[i + j]
            hi = cutlass.max(a, b)
            lo = cutlass.min(a, b)
            desc = ((i >> lsize) & 1) == 0
            cand[i] = hi if desc else lo
            cand[i + j] = lo if desc else hi

    @cute.jit
    def _sort_in_registers(self, cand: cute.Tensor, tidx, lane):
        """Bitonic sort (descending) of cand[0, max_k) with the elements in registers: thread t
        holds positions t E .. t E + E - 1 (E = max_k / THREADS). A compare-exchange between
        positions closer than E stays in the thread, closer than 32 E goes through one shuffle
        per 32-bit half, and the farther ones (the last log2(max_k / 32 E) levels of each
        merge) through shared memory with a barrier each. Returns with the sorted elements in
        cand and the threads synchronised."""
        E = self.max_k // THREADS
        log_e = E.bit_length() - 1
        log_n = self.max_k.bit_length() - 1
        log_we = log_e + 5  # partners at least 2^log_we apart sit in other warps
        r = cute.make_rmem_tensor(E, cutlass.Int64)
        for e in cutlass.range_constexpr(E):
            r[e] = cand[tidx * E + e]
        for lsize in cutlass.range_constexpr(1, log_n + 1):  # merges into runs of 2^lsize
            top = lsize - 1
            if cutlass.const_expr(top >= log_we):
                for e in cutlass.range_constexpr(E):
                    cand[tidx * E + e] = r[e]
                cute.arch.sync_threads()
                for lj in cutlass.range_constexpr(top, log_we - 1, -1):
                    self._bitonic_stage(cand, self.max_k, lsize, lj, tidx)
                    cute.arch.sync_threads()
                for e in cutlass.range_constexpr(E):
                    r[e] = cand[tidx * E + e]
                top = log_we - 1
            # bit lsize of this thread's positions (0: the run is sorted descending), for
            # lsize >= log_e; the last merge (lsize = log_n) is descending everywhere
            t_bit = cutlass.Int32(0)
            if cutlass.const_expr(lsize >= log_e and lsize < log_n):
                t_bit = (tidx >> (lsize - log_e)) & 1
            for lj in cutlass.range_constexpr(top, -1, -1):
                d = 1 << lj
                if cutlass.const_expr(d >= E):  # the partner is lane ^ (d / E)
                    up = (lane >> (lj - log_e)) & 1
                    keep_max = t_bit == up  # descending and lower, or ascending and upper
                    for e in cutlass.range_constexpr(E):
                        mine = r[e]
                        o_lo = cute.arch.shuffle_sync_bfly(cutlass.Int32(mine), offset=d // E)
                        o_hi = cute.arch.shuffle_sync_bfly(cutlass.Int32(mine >> 32),
                                                           offset=d // E)
                        other = (cutlass.Int64(o_hi) << 32) | (cutlass.Int64(o_lo) & 0xFFFFFFFF)
                        hi = cutlass.max(mine, other)
                        lo = cutlass.min(mine, other)
                        r[e] = hi if keep_max else lo
                else:
                    for e in cutlass.range_constexpr(E):
                        if cutlass.const_expr((e & d) == 0):
                            a = r[e]
                            b = r[e + d]
                            hi = cutlass.max(a, b)
                            lo = cutlass.min(a, b)
                            if cutlass.const_expr(lsize < log_e):
                                if cutlass.const_expr(((e >> lsize) & 1) == 0):
                                    r[e] = hi
                                    r[e + d] = lo
                                else:
                                    r[e] = lo
                                    r[e + d] = hi
                            else:
                                desc = t_bit == 0
                                r[e] = hi if desc else lo
                                r[e + d] = lo if desc else hi
        for e in cutlass.range_constexpr(E):
            cand[tidx * E + e] = r[e]
        cute.arch.sync_threads()

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mIdx: cute.Tensor, mVal: cute.Tensor,
               S: cutlass.Int32, K: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        cand = st.cand.get_tensor(cute.make_layout(self.cap))
        buf = st.buf.get_tensor(cute.make_layout(BUF))
        hist = st.hist.get_tensor(cute.make_layout(BINS))
        # The first digit's bins share the buffer's memory (8 x BUF = 4 x BINS_A bytes): they
        # are read for the last time before pass B fills the buffer.
        hist_a = cute.make_tensor(cute.recast_ptr(st.buf.data_ptr(), dtype=cutlass.Int32),
                                  cute.make_layout(BINS_A))
        sWarp = st.warp.get_tensor(cute.make_layout(THREADS // 32))
        sel = st.sel.get_tensor(cute.make_layout(8))
        base = cutlass.Int64(row) * cutlass.Int64(S)
        k_eff = cutlass.min(K, S)
        count = k_eff  # candidates to sort

        # ---- fast path, pass A: histogram of the top 11 bits ----
        for i in cutlass.range(tidx, BINS_A, THREADS, unroll=1):
            hist_a[i] = cutlass.Int32(0)
        if tidx == 0:
            sel[2] = cutlass.Int32(0)
            sel[4] = cutlass.Int32(0)
            sel[5] = cutlass.Int32(0)
        cute.arch.sync_threads()
        for c0 in cutlass.range(0, S, THREADS * UNROLL, unroll=1):
            us = cute.make_rmem_tensor(UNROLL, cutlass.Int32)
            for j in cutlass.range_constexpr(UNROLL):
                col = cutlass.min(c0 + tidx + THREADS * j, S - 1)
                us[j] = self._key(mScores[base + cutlass.Int64(col)]) ^ INT32_MIN
            for j in cutlass.range_constexpr(UNROLL):
                if c0 + tidx + THREADS * j < S:
                    cute.arch.atomic_add((hist_a.iterator + ((us[j] >> (32 - A_BITS)) & (BINS_A - 1))).llvm_ptr,
                                         cutlass.Int32(1), sem="relaxed", scope="cta")
        cute.arch.sync_threads()
        self._select(hist_a, sWarp, sel, BINS_A, k_eff, tidx, lane, warp)
        cute.arch.sync_threads()
        b0 = sel[0]
        need = sel[1]
        n_bin = sel[3]
        fast = n_bin <= BUF
        cute.arch.sync_threads()
        if fast:
            # ---- pass B: keys above bin b0 to the candidates, bin b0 to shared memory ----
            for c0 in cutlass.range(0, S, THREADS * UNROLL, unroll=1):
                us = cute.make_rmem_tensor(UNROLL, cutlass.Int32)
                for j in cutlass.range_constexpr(UNROLL):
                    col = cutlass.min(c0 + tidx + THREADS * j, S - 1)
                    us[j] = self._key(mScores[base + cutlass.Int64(col)])
                for j in cutlass.range_constexpr(UNROLL):
                    s = c0 + tidx + THREADS * j
                    d = ((us[j] ^ INT32_MIN) >> (32 - A_BITS)) & (BINS_A - 1)
                    comp = (cutlass.Int64(us[j]) << 32) | cutlass.Int64(0x7FFFFFFF - s)
                    if s < S and d > b0:
                        pos = cute.arch.atomic_add((sel.iterator + 2).llvm_ptr,
                                                   cutlass.Int32(1), sem="relaxed", scope="cta")
                        if pos < self.cap:  # always: fewer than k_eff keys are above bin b0
                            cand[pos] = comp
                    if s < S and d == b0:
                        pos = cute.arch.atomic_add((sel.iterator + 4).llvm_ptr,
                                                   cutlass.Int32(1), sem="relaxed", scope="cta")
                        if pos < BUF:  # always: the bin holds n_bin <= BUF keys
                            buf[pos] = comp
            cute.arch.sync_threads()
            # ---- the other 21 bits, within the buffer ----
            prefix = b0 << (32 - A_BITS)
            mask = cutlass.Int32(_as_int32(0xFFFFFFFF << (32 - A_BITS)))
            for shift, nbits in ((9, 10), (0, 9)):  # the other 19 bits
                nb = 1 << nbits
                for i in cutlass.range(tidx, nb, THREADS, unroll=1):
                    hist[i] = cutlass.Int32(0)
                cute.arch.sync_threads()
                for i in cutlass.range(tidx, n_bin, THREADS, unroll=1):
                    u = cutlass.Int32(buf[i] >> 32) ^ INT32_MIN
                    if (u & mask) == prefix:
                        cute.arch.atomic_add((hist.iterator + ((u >> shift) & (nb - 1))).llvm_ptr,
                                             cutlass.Int32(1), sem="relaxed", scope="cta")
                cute.arch.sync_threads()
                self._select(hist, sWarp, sel, nb, need, tidx, lane, warp)
                cute.arch.sync_threads()
                prefix = prefix | (sel[0] << shift)
                need = sel[1]
                mask = mask | cutlass.Int32(_as_int32((nb - 1) << shift))
                cute.arch.sync_threads()
            theta = prefix ^ INT32_MIN
            # ---- the buffer's keys above theta; count the ties ----
            for i in cutlass.range(tidx, n_bin, THREADS, unroll=1):
                comp = buf[i]
                key = cutlass.Int32(comp >> 32)
                if key > theta:
                    pos = cute.arch.atomic_add((sel.iterator + 2).llvm_ptr, cutlass.Int32(1),
                                               sem="relaxed", scope="cta")
                    if pos < self.cap:
                        cand[pos] = comp
                if key == theta:
                    cute.arch.atomic_add((sel.iterator + 5).llvm_ptr, cutlass.Int32(1),
                                         sem="relaxed", scope="cta")
            cute.arch.sync_threads()
            n_cand = sel[2]  # = k_eff - need
            n_eq = sel[5]
            # Ties at theta: all of them go into the sort (key descending, then column
            # ascending) when they fit; at -inf none is needed (those slots are (-inf, -1)).
            fast = theta == NEG_INF_KEY or n_cand + n_eq <= self.cap
            if theta != NEG_INF_KEY and n_cand + n_eq <= self.cap:
                for i in cutlass.range(tidx, n_bin, THREADS, unroll=1):
                    comp = buf[i]
                    if cutlass.Int32(comp >> 32) == theta:
                        pos = cute.arch.atomic_add((sel.iterator + 2).llvm_ptr,
                                                   cutlass.Int32(1), sem="relaxed", scope="cta")
                        if pos < self.cap:
                            cand[pos] = comp
            cute.arch.sync_threads()
            count = cutlass.min(sel[2], self.cap)
            cute.arch.sync_threads()
        if not fast:
            self._five_pass_select(mScores, cand, hist, sWarp, sel, base, S, k_eff, tidx, lane,
                                   warp)
            count = k_eff

        # ---- bitonic sort (descending) of the candidates, padded with the smallest key ----
        if count <= self.max_k:  # always, unless ties at theta took more slots
            for i in cutlass.range(count + tidx, self.max_k, THREADS, unroll=1):
                cand[i] = cutlass.Int64(INT64_MIN)
            cute.arch.sync_threads()
            self._sort_in_registers(cand, tidx, lane)
        else:  # in shared memory, padded to a power of two
            n_pow2 = cutlass.Int32(1)
            log_n = cutlass.Int32(0)
            while n_pow2 < count:
                n_pow2 = n_pow2 * 2
                log_n = log_n + 1
            for i in cutlass.range(count + tidx, n_pow2, THREADS, unroll=1):
                cand[i] = cutlass.Int64(INT64_MIN)
            cute.arch.sync_threads()
            for lsize in cutlass.range(1, log_n + 1, unroll=1):  # runs of 2^lsize
                for d in cutlass.range(lsize, unroll=1):  # partners 2^(lsize - 1 - d) apart
                    lj = lsize - 1 - d
                    self._bitonic_stage(cand, n_pow2, lsize, lj, tidx)
                    cute.arch.sync_threads()

        # ---- store ----
        out = cutlass.Int64(row) * cutlass.Int64(K)
        for i in cutlass.range(tidx, K, THREADS, unroll=1):
            col = cutlass.Int32(-1)
            bits = cutlass.Int32(NEG_INF_BITS)
            if i < k_eff and i < count:  # past count: -inf ties, (-1, -inf)
                comp = cand[i]
                key = cutlass.Int32(comp >> 32)
                b = key ^ ((key >> 31) & 0x7FFFFFFF)
                if b != NEG_INF_BITS:
                    bits = b
                    col = cutlass.Int32(0x7FFFFFFF) - cutlass.Int32(comp & 0x7FFFFFFF)
            mIdx[out + cutlass.Int64(i)] = col
            mVal[out + cutlass.Int64(i)] = bits


def fake_args():
    """scores (R*S,) int32 bits, idx (R*K,) int32, val (R*K,) int32 bits, then R, S, K and the
    stream."""
    n_in, n_out = cute.sym_int64(), cute.sym_int64()
    i32 = cutlass.Int32(1)
    return (make_fake_compact_tensor(cutlass.Int32, (n_in,), assumed_align=4),
            make_fake_compact_tensor(cutlass.Int32, (n_out,), assumed_align=4),
            make_fake_compact_tensor(cutlass.Int32, (n_out,), assumed_align=4),
            i32, i32, i32, make_fake_stream())


def compile_indexer_topk(max_k: int = INDEXER_MAX_TOPK):
    """Compile with shape-only tensors (fake_args) for K <= max_k."""
    return cute.compile(IndexerTopkSm90(max_k), *fake_args())
