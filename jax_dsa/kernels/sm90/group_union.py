"""Union of the index lists of G consecutive tokens, for the grouped backward (sm_90a, CuTe DSL).

The kernel form of jax_dsa.grouping.group_lists + pack_entries: per group the same multiset of
union entries (row | membership bits << MEMBER_SHIFT) and the same length, in another order
(the backward does not depend on the order). XLA's sort, scans and scatters cost ~0.4 ms for
the benchmark's H = 16 lists (4096 tokens x 640 entries), more than the grouped backward saves.

One CTA per group i (tokens G i .. G i + G - 1 of the flattened [B * T] tokens; T % G == 0, so
a group never spans two batch rows), a hash table in shared memory:
  1. every valid entry (slot j < min(K, topk_length), 0 <= row < S) of token g finds its row's
     table slot (linear probing from row mod TABLE, claimed by atomic CAS) and adds 1 to that
     slot's 16-bit count for token g (two counts per 32-bit word, atomic add; the words are
     laid out [G / 2][TABLE], so a warp reading 32 consecutive slots hits 32 banks);
  2. a slot holding row r with counts c_g stands for max_g c_g union entries: entry occ
     (0 <= occ < max c) carries the bits of the tokens with c_g > occ (the n-th occurrence of a
     row in one token's list is its own softmax term; group_lists pairs them the same way);
  3. warp w of the 16 owns slots [w TABLE / 16, (w + 1) TABLE / 16), read 32 consecutive slots
     (one per lane) at a time, each slot's entries occ = 0 .. max c - 1 in turn. Entries are
     bucketed by the k-step mask of their tokens (jax_dsa.grouping.KSTEP_ORDER: the 4-bit mask
     of the grouped backward's 16-row k-steps their tokens' head rows fall in), lanes of one
     bucket finding each other with match.any: a first pass counts each warp's entries per
     bucket; the buckets in KSTEP_ORDER (one token's first), and the warps in order within a
     bucket, give each (warp, bucket) its first output position; a second pass writes every
     entry at its bucket's next position. So most 64-entry blocks of the grouped backward hold
     one token's entries, and its candidate `wgg<G>m` issues only that token's dKV k-steps.
     out[i, :length] = the entries, -1 after, length[i] = their number; the order is a
     function of the table, the same run to run. (A first version gave each thread 32
     consecutive slots: every shared-memory read was a 32-way bank conflict and the kernel
     took 118 us on the benchmark's lists; the second, with each thread's inserts waiting on
     one global load at a time, 86 us; one that staged the entries in shared memory and sorted
     them afterwards, 72 us against 39 without the order: 24 KB more shared memory, one CTA
     fewer per SM.)
Rows land at slot row mod TABLE (or the next free one), so the output is close to row order
for S <= TABLE. Load factor <= G * K / TABLE <= 0.75: each group size is exported with every
table size of TABLES, and the handler runs the smallest that holds G * K at that load and has
S <= TABLE (no two rows share a home slot), the largest if S exceeds them all. Clearing and
scanning the table is most of the work (at H = 32, G * K = 1280: 76 us per call with 8192
slots), but a table smaller than S is slower still: rows r and r + TABLE collide and the
window's consecutive rows fill one long probe run (2048 slots at S = 4096: 0.40 ms).
CAPACITY (3/4 of the largest table) is the bound on G * K.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from jax_dsa.grouping import KSTEP_ORDER, MEMBER_SHIFT, token_ksteps

THREADS = 512
BATCH = 8  # entries each thread loads before inserting any (overlaps the global loads)
TABLES = (2048, 4096, 8192)  # hash slots per group (powers of two), one export each
CAPACITY = 6144  # G * K at most: load factor <= 0.75 in the largest table
EMPTY = -1


class GroupUnionSm90:
    def __init__(self, group: int, table: int = TABLES[-1]):
        assert 1 <= group <= 8  # the bits must fit in 31 - MEMBER_SHIFT
        assert table in TABLES
        self.group = group
        self.table = table
        self.words = (group + 1) // 2  # 32-bit count words per slot (two 16-bit counts each)
        self.per_thread = table // THREADS  # slots each thread clears and scans

    @cute.jit
    def __call__(self, mIdx: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
                 mLength: cute.Tensor, n_groups: cutlass.Int32, K: cutlass.Int32,
                 S: cutlass.Int32, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            row: cute.struct.MemRange[cutlass.Int32, self.table]
            count: cute.struct.MemRange[cutlass.Int32, self.table * self.words]
            # [warp][k-step mask] entry counts, then next output positions
            bucket: cute.struct.MemRange[cutlass.Int32, (THREADS // 32) * 16]
            total: cute.struct.MemRange[cutlass.Int32, 17]  # per mask; [16]: the length

        self.kernel(mIdx, mLen, mOut, mLength, K, S, SharedStorage).launch(
            grid=[n_groups, 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream)

    @cute.jit
    def _entries_at(self, sCount: cute.Tensor, slot: cutlass.Int32) -> cutlass.Int32:
        """Union entries of one table slot: the largest of its G per-token counts."""
        most = cutlass.Int32(0)
        for w in cutlass.range_constexpr(self.words):
            word = sCount[w * self.table + slot]
            most = cutlass.max(most, cutlass.max(word & 0xFFFF, (word >> 16) & 0xFFFF))
        return most

    @cute.jit
    def _ksteps_of(self, entry: cutlass.Int32) -> cutlass.Int32:
        """The k-step mask of an entry's tokens (token_ksteps of each membership bit)."""
        mask = cutlass.Int32(0)
        for g in cutlass.range_constexpr(self.group):
            mask = mask | cutlass.select_(((entry >> (MEMBER_SHIFT + g)) & 1) != 0,
                                          cutlass.Int32(token_ksteps(self.group, g)),
                                          cutlass.Int32(0))
        return mask

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
               mLength: cute.Tensor, K: cutlass.Int32, S: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        G, W, TABLE = self.group, self.words, self.table
        tidx, _, _ = cute.arch.thread_idx()
        gid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        sRow = st.row.get_tensor(cute.make_layout(TABLE))
        sCount = st.count.get_tensor(cute.make_layout(TABLE * W))
        sBucket = st.bucket.get_tensor(cute.make_layout((THREADS // 32) * 16))
        sTotal = st.total.get_tensor(cute.make_layout(17))
        gk = K * G
        tok0 = cutlass.Int64(gid) * cutlass.Int64(G)

        for i in cutlass.range_constexpr(self.per_thread):
            sRow[tidx + THREADS * i] = cutlass.Int32(EMPTY)
        for i in cutlass.range_constexpr(self.per_thread * W):
            sCount[tidx + THREADS * i] = cutlass.Int32(0)
        cute.arch.sync_threads()

        # 1. insert every valid entry. Each thread first loads BATCH entries (clamped addresses,
        # so every load is in bounds and none waits on another), then inserts the valid ones.
        rRow = cute.make_rmem_tensor(BATCH, cutlass.Int32)
        rLen = cute.make_rmem_tensor(BATCH, cutlass.Int32)
        for base in range(0, gk, THREADS * BATCH):
            for b in cutlass.range_constexpr(BATCH):
                e = cutlass.min(base + tidx + THREADS * b, gk - 1)
                g = e // K
                tok = tok0 + cutlass.Int64(g)
                rLen[b] = mLen[tok]
                rRow[b] = mIdx[tok * cutlass.Int64(K) + cutlass.Int64(e - g * K)]
            for b in cutlass.range_constexpr(BATCH):
                e = base + tidx + THREADS * b
                g = e // K
                r = rRow[b]
                if (e < gk) & (e - g * K < rLen[b]) & (r >= 0) & (r < S):
                    h = r & (TABLE - 1)
                    placed = cutlass.Boolean(False)
                    while not placed:
                        old = cute.arch.atomic_cas((sRow.iterator + h).llvm_ptr,
                                                   cmp=cutlass.Int32(EMPTY), val=r, sem="relaxed",
                                                   scope="cta")
                        if (old == EMPTY) | (old == r):
                            placed = cutlass.Boolean(True)
                        else:
                            h = (h + 1) & (TABLE - 1)
                    cute.arch.atomic_add((sCount.iterator + ((g // 2) * TABLE + h)).llvm_ptr,
                                         cutlass.Int32(1) << (16 * (g % 2)), sem="relaxed",
                                         scope="cta")
        cute.arch.sync_threads()

        # 2.-4. warp w scans its slots 32 at a time (one per lane), each slot's entries occ
        # = 0 .. most - 1 in turn. Entries are bucketed by their k-step mask (1..15); lanes
        # with the same mask find each other with match.any. Pass 0 counts each warp's entries
        # per bucket, then the buckets' order (KSTEP_ORDER) and the warps' order give each
        # (warp, bucket) its first output position; pass 1 writes each entry at its bucket's
        # next position. The order is a function of the table: the same run to run.
        warps = THREADS // 32
        span = TABLE // warps
        for i in cutlass.range_constexpr((warps * 16 + THREADS - 1) // THREADS):
            if tidx + THREADS * i < warps * 16:
                sBucket[tidx + THREADS * i] = cutlass.Int32(0)
        cute.arch.sync_threads()
        below = cutlass.Int32(cute.arch.lanemask_lt())
        out_base = cutlass.Int64(gid) * cutlass.Int64(gk)
        for write in cutlass.range_constexpr(2):
            for r in cutlass.range(span // 32, unroll=2):
                slot = warp * span + r * 32 + lane
                most = self._entries_at(sCount, slot)
                top = most
                for d in cutlass.range_constexpr(5):
                    top = cutlass.max(top, cute.arch.shuffle_sync_bfly(top, 1 << d))
                row = sRow[slot]
                for occ in range(top):
                    bits = cutlass.Int32(0)
                    for g in cutlass.range_constexpr(G):
                        c = (sCount[(g // 2) * TABLE + slot] >> (16 * (g % 2))) & 0xFFFF
                        if c > occ:
                            bits = bits | (1 << g)
                    entry = row | (bits << MEMBER_SHIFT)
                    # 0: this lane has no entry occ (an empty slot's row is -1: no mask)
                    key = cutlass.select_(occ < most, self._ksteps_of(entry), cutlass.Int32(0))
                    peers = cutlass.Int32(cute.arch.match_sync(0xFFFFFFFF, key))
                    at = warp * 16 + key
                    if cutlass.const_expr(write == 1):
                        if key != 0:
                            mOut[out_base + cutlass.Int64(sBucket[at] +
                                                          cute.arch.popc(peers & below))] = entry
                    cute.arch.sync_warp()
                    if (key != 0) & ((peers & below) == 0):  # the bucket's lowest lane
                        sBucket[at] = sBucket[at] + cute.arch.popc(peers)
                    cute.arch.sync_warp()
            cute.arch.sync_threads()
            if cutlass.const_expr(write == 0):
                # counts -> first positions: buckets in KSTEP_ORDER, warps in order within
                # one; thread `key` (< 16) handles its bucket
                if tidx < 16:
                    run = cutlass.Int32(0)
                    for w in cutlass.range_constexpr(warps):
                        n = sBucket[w * 16 + tidx]
                        sBucket[w * 16 + tidx] = run
                        run = run + n
                    sTotal[tidx] = run
                cute.arch.sync_threads()
                if tidx < 16:
                    rank = cutlass.Int32(len(KSTEP_ORDER))  # key 0 (no entries): last
                    for i in cutlass.range_constexpr(len(KSTEP_ORDER)):
                        if tidx == KSTEP_ORDER[i]:
                            rank = cutlass.Int32(i)
                    before = cutlass.Int32(0)
                    for i in cutlass.range_constexpr(len(KSTEP_ORDER)):
                        if i < rank:
                            before = before + sTotal[KSTEP_ORDER[i]]
                    for w in cutlass.range_constexpr(warps):
                        sBucket[w * 16 + tidx] = sBucket[w * 16 + tidx] + before
                    if tidx == 0:
                        sTotal[16] = before  # everything before key 0: the union's length
                cute.arch.sync_threads()
        length = sTotal[16]
        for s in range(length + tidx, gk, THREADS):
            mOut[out_base + cutlass.Int64(s)] = cutlass.Int32(-1)
        if tidx == 0:
            mLength[gid] = length


def compile_group_union(group: int, table: int = TABLES[-1]):
    """Compile with shape-only tensors: idx (B*T*K,), topk_length (B*T,), out (n_groups*G*K,),
    length (n_groups,), all int32."""
    n_idx, n_tok, n_out, n_groups = (cute.sym_int64() for _ in range(4))
    idx = make_fake_compact_tensor(cutlass.Int32, (n_idx,), assumed_align=4)
    lengths = make_fake_compact_tensor(cutlass.Int32, (n_tok,), assumed_align=4)
    out = make_fake_compact_tensor(cutlass.Int32, (n_out,), assumed_align=4)
    length = make_fake_compact_tensor(cutlass.Int32, (n_groups,), assumed_align=4)
    i32 = cutlass.Int32(1)
    return cute.compile(GroupUnionSm90(group, table), idx, lengths, out, length, i32, i32, i32,
                        make_fake_stream())
