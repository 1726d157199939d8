"""Union of the index lists of G consecutive tokens, for the grouped backward (sm_90a, CuTe DSL).

The kernel form of jax_dsa/cute/grouping.py (group_lists + pack_entries): per group the same
multiset of union entries (row | membership bits << MEMBER_SHIFT) and the same length, in another
order (the backward does not depend on the order). It is the default (BwdConfig.union =
"kernel"): the XLA form's sort, scans and scatters cost more than grouping saves on the
benchmark's H = 16 lists (docs/kernel_log.md).

Grid: one CTA of 512 threads per group i (tokens G i .. G i + G - 1 of the flattened B * T;
T % G == 0, so a group never spans two batch rows), a hash table of TABLE slots in shared memory:
  1. each thread loads BATCH entries, then inserts the valid ones (slot j < min(K, topk_length),
     0 <= row < S): linear probing from row mod TABLE, slots claimed by atomic CAS, then 1 added
     to the slot's 16-bit count for token g (two counts per 32-bit word, laid out [G / 2][TABLE]
     so that a warp reading 32 consecutive slots hits 32 banks);
  2. a slot holding row r with counts c_g stands for max_g c_g union entries: entry occ
     (0 <= occ < max c) carries the bits of the tokens with c_g > occ (the n-th occurrence of a
     row in one token's list is its own softmax term; group_lists pairs them the same way);
  3. warp w of the 16 owns slots [w TABLE / 16, (w + 1) TABLE / 16) and reads them 32 at a time,
     one per lane: a first pass counts the warp's entries, the warp totals give each warp its
     first output position, a second pass places each lane's entries by a warp prefix sum;
     out[i, :length] = the entries in slot order, -1 after; length[i] = their number.
Rows land at slot row mod TABLE (or the next free one), so the output is close to row order for
S <= TABLE. Each group size is exported with every table size of TABLES; the handler runs the
smallest with G * K <= 3/4 TABLE and S <= TABLE (no two rows share a home slot: otherwise the
window's consecutive rows fill one long probe run), the largest if S exceeds them all. Clearing
and scanning the table is most of the work. CAPACITY (3/4 of the largest table) bounds G * K.

Entry point: compile_group_union(group, table); ffi/build.py exports it as
jax_dsa_group_union_g<G>_t<TABLE>.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from jax_dsa.cute.constants import MEMBER_SHIFT
from jax_dsa.cute.constants import UNION_CAPACITY as CAPACITY  # G * K at most
from jax_dsa.cute.constants import UNION_TABLES as TABLES  # hash slots per group, one export each

THREADS = 512
BATCH = 8  # entries each thread loads before inserting any (overlaps the global loads)
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
            warp_total: cute.struct.MemRange[cutlass.Int32, THREADS // 32]

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
        sWarpTotal = st.warp_total.get_tensor(cute.make_layout(THREADS // 32))
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

        # 2.-3. warp w scans its slots 32 at a time; pass 0 counts, pass 1 writes.
        warps = THREADS // 32
        span = TABLE // warps
        mine = cutlass.Int32(0)
        for r in cutlass.range_constexpr(span // 32):
            mine = mine + self._entries_at(sCount, warp * span + r * 32 + lane)
        for d in cutlass.range_constexpr(5):
            mine = mine + cute.arch.shuffle_sync_bfly(mine, 1 << d)
        if lane == 0:
            sWarpTotal[warp] = mine
        cute.arch.sync_threads()
        pos = cutlass.Int32(0)  # the warp's first output position
        length = cutlass.Int32(0)
        for w in cutlass.range_constexpr(warps):
            t = sWarpTotal[w]
            if w < warp:
                pos = pos + t
            length = length + t

        out_base = cutlass.Int64(gid) * cutlass.Int64(gk)
        for r in cutlass.range(span // 32, unroll=4):
            slot = warp * span + r * 32 + lane
            most = self._entries_at(sCount, slot)
            incl = most
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            at = pos + incl - most
            if most > 0:
                row = sRow[slot]
                for occ in range(most):
                    bits = cutlass.Int32(0)
                    for g in cutlass.range_constexpr(G):
                        c = (sCount[(g // 2) * TABLE + slot] >> (16 * (g % 2))) & 0xFFFF
                        if c > occ:
                            bits = bits | (1 << g)
                    mOut[out_base + cutlass.Int64(at + occ)] = row | (bits << MEMBER_SHIFT)
            pos = pos + cute.arch.shuffle_sync(incl, 31)
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
