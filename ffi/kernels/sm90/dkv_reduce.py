"""Deterministic dkv reduction for the sparse MLA backward (sm_90a, CuTe DSL).

The deterministic backward (bwd.py, deterministic=True) adds nothing atomically: for a chunk of
tokens it stores the fp32 contribution of every valid entry (token bt, slot j) and head block hb
as one workspace row,

    ws[((bt - t_begin) * K + j) * n_hb + hb, :Dqk].

jax_dsa/cute/deterministic.py sorts the chunk's entries by destination kv row with a stable
sort, so the entries of one kv row are contiguous and always in the same (entry id) order:

    order[p]    local entry id (bt - t_begin) * K + j of sorted position p
    seg_end[p]  at the first position of a kv row's run: one past its last position; 0 elsewhere
    rows[p]     destination row b * S + idx of that entry (only read at run starts)

Grid ceil(n_pos / 8) CTAs of 8 warps, one warp per sorted position. A warp at a run start sums
the run's workspace rows in order (and within an entry the head blocks in order) in fp32
registers, 16-byte loads, then adds the sum to dkv[row] with a plain read-modify-write; warps at
other positions return at once. One warp owns a row within a chunk and the chunks run one after
the other on the stream, so every dkv element is a fixed sequence of fp32 additions: bitwise
reproducible. Invalid entries are in no run (the sort puts them last with seg_end = 0): nothing
is read or written for them. Offsets are 64-bit.

Entry point: compile_dkv_reduce(d_qk); ffi/build.py exports it as jax_dsa_dkv_reduce_d<Dqk>.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

WARPS_PER_CTA = 8


class DkvSegmentReduceSm90:
    def __init__(self, d_qk: int):
        assert d_qk % 4 == 0
        self.d_qk = d_qk
        self.n_vec = d_qk // 4  # 16-byte column groups per row
        self.iters = (self.n_vec + 31) // 32  # column groups per lane

    @cute.jit
    def __call__(
        self,
        mWs: cute.Tensor,
        mOrder: cute.Tensor,
        mSegEnd: cute.Tensor,
        mRows: cute.Tensor,
        mDKV: cute.Tensor,
        n_pos: cutlass.Int32,
        n_hb: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        n_cta = (n_pos + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(mWs, mOrder, mSegEnd, mRows, mDKV, n_pos, n_hb).launch(
            grid=[n_cta, 1, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream
        )

    @staticmethod
    def _vec(t: cute.Tensor, row, c) -> cute.Tensor:
        """The 4 contiguous fp32 (16 B) t[row, 4c : 4c + 4] as a rank-1 tensor."""
        return cute.local_tile(t, (1, 4), (row, c))[0, None]

    @cute.kernel
    def kernel(
        self,
        mWs: cute.Tensor,
        mOrder: cute.Tensor,
        mSegEnd: cute.Tensor,
        mRows: cute.Tensor,
        mDKV: cute.Tensor,
        n_pos: cutlass.Int32,
        n_hb: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        p = bidx * WARPS_PER_CTA + tidx // 32
        end = cutlass.Int32(0)
        if p < n_pos:
            end = mSegEnd[p]
        if end > p:
            acc = cute.make_rmem_tensor((4, self.iters), cutlass.Float32)
            acc.fill(0.0)
            for q in cutlass.range(p, end):
                base = cutlass.Int64(mOrder[q]) * cutlass.Int64(n_hb)
                for hb in cutlass.range(n_hb):
                    w_row = base + cutlass.Int64(hb)
                    for i in cutlass.range_constexpr(self.iters):
                        c = lane + 32 * i
                        if c < self.n_vec:
                            acc[None, i].store(acc[None, i].load() + self._vec(mWs, w_row, c).load())
            row = cutlass.Int64(mRows[p])
            for i in cutlass.range_constexpr(self.iters):
                c = lane + 32 * i
                if c < self.n_vec:
                    dst = self._vec(mDKV, row, c)
                    dst.store(dst.load() + acc[None, i].load())


def compile_dkv_reduce(d_qk: int):
    """Compile with shape-only tensors: ws (rows_ws, Dqk) f32, order / seg_end / rows (n,) int32,
    dkv (rows_kv, Dqk) f32."""
    rows_ws, n, rows_kv = (cute.sym_int64() for _ in range(3))
    ws = make_fake_compact_tensor(cutlass.Float32, (rows_ws, d_qk), stride_order=(1, 0),
                                  assumed_align=16)
    order = make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=4)
    seg_end = make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=4)
    rows = make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=4)
    dkv = make_fake_compact_tensor(cutlass.Float32, (rows_kv, d_qk), stride_order=(1, 0),
                                   assumed_align=16)
    i32 = cutlass.Int32(1)
    return cute.compile(DkvSegmentReduceSm90(d_qk), ws, order, seg_end, rows, dkv, i32, i32,
                        make_fake_stream())
