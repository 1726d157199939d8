"""The split forward's combine (sm_90a, CuTe DSL): P partial softmaxes of each (token, head)
row merged by their lse, with the sink in the denominator.

Input: the parts that fwd_pingpong's split form wrote, o_parts (B*T*P*H, 512) in q's dtype and
lse_parts (B*T*P*H,) float32 (natural log, sink excluded, -inf for a part without a valid
entry), row (bt * P + p) * H + h; the sink (H,) float32 (-inf: none). Output, row bt * H + h:

    M = max_p lse_p (0 when every part is -inf),  w_p = e^(lse_p - M),  l = sum_p w_p,
    o = sum_p w_p o_p / (l + e^(sink - M)),  lse = M + log l (-inf and o = 0 when l = 0).

A NaN sink gives NaN for its head, as the unsplit kernel. Grid ceil(B*T*H / 4) CTAs of 256
threads: 64 threads per row, each owning one 16-byte chunk (8 columns) of o and walking the
parts (ptxas keeps about two parts' loads in flight per thread; issuing all of them at once
through cp.async was measured no faster: docs/kernel_log.md). The lse of the row's parts is
read by every thread of the row (one broadcast line). Offsets are 64-bit.

Entry point: compile_fwd_combine(dtype), exported by ffi/build.py as jax_dsa_fwd_combine_<dtype>
and launched by ffi/sparse_mla_fwd.cc after the split kernel.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from .common import LN_2, LOG2_E, chunk16

D_V = 512
THREADS = 256
ROW_THREADS = D_V // 8  # one 16-byte chunk per thread
ROWS_PER_CTA = THREADS // ROW_THREADS


class SparseMlaFwdCombineSm90:
    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLsep: cute.Tensor, mSink: cute.Tensor,
                 mO: cute.Tensor, mLse: cute.Tensor, n_rows: cutlass.Int32,
                 P: cutlass.Int32, H: cutlass.Int32, stream: cuda.CUstream):
        n_cta = (n_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        self.kernel(mOp, mLsep, mSink, mO, mLse, n_rows, P, H).launch(
            grid=[n_cta, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLsep: cute.Tensor, mSink: cute.Tensor, mO: cute.Tensor,
               mLse: cute.Tensor, n_rows: cutlass.Int32, P: cutlass.Int32, H: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        c = tidx % ROW_THREADS
        row = bidx * ROWS_PER_CTA + tidx // ROW_THREADS  # bt * H + h
        if row < n_rows:
            h = row % H
            first = (cutlass.Int64(row - h) * cutlass.Int64(P)
                     + cutlass.Int64(h))  # part 0's row; part p at first + p * H
            m = -cutlass.Float32.inf
            for p in cutlass.range(P, unroll=4):
                m = cute.arch.fmax(m, mLsep[first + cutlass.Int64(p) * cutlass.Int64(H)])
            m_use = 0.0 if m == -cutlass.Float32.inf else m
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
            acc = cute.make_rmem_tensor((8,), cutlass.Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((8,), self.dtype)
            l = cutlass.Float32(0.0)
            for p in cutlass.range(P, unroll=4):
                prow = first + cutlass.Int64(p) * cutlass.Int64(H)
                w = cute.math.exp2((mLsep[prow] - m_use) * LOG2_E, fastmath=True)
                l = l + w
                cute.copy(atom, chunk16(mOp, prow, c), part)
                acc.store(acc.load() + w * part.load().to(cutlass.Float32))
            denom = l + cute.math.exp2((mSink[h] - m_use) * LOG2_E, fastmath=True)
            inv = 0.0 if denom <= 0.0 else 1.0 / denom
            part.store((acc.load() * inv).to(self.dtype))
            cute.copy(atom, part, chunk16(mO, cutlass.Int64(row), c))
            if c == 0:
                lse = -cutlass.Float32.inf
                if l > 0.0:
                    lse = m_use + cute.math.log2(l) * LN_2
                mLse[row] = lse


def compile_fwd_combine(dtype):
    """Compile with shape-only tensors: o_parts (rows_p, 512) dtype, lse_parts (rows_p,) f32,
    sink (H,) f32, o (rows, 512) dtype, lse (rows,) f32, then n_rows, P, H and the stream."""
    rows_p, n_head, rows = (cute.sym_int64() for _ in range(3))
    op = make_fake_compact_tensor(dtype, (rows_p, D_V), stride_order=(1, 0), assumed_align=16)
    lsep = make_fake_compact_tensor(cutlass.Float32, (rows_p,), assumed_align=4)
    sink = make_fake_compact_tensor(cutlass.Float32, (n_head,), assumed_align=4)
    o = make_fake_compact_tensor(dtype, (rows, D_V), stride_order=(1, 0), assumed_align=16)
    lse = make_fake_compact_tensor(cutlass.Float32, (rows,), assumed_align=4)
    i32 = cutlass.Int32(1)
    return cute.compile(SparseMlaFwdCombineSm90(dtype), op, lsep, sink, o, lse, i32, i32, i32,
                        make_fake_stream())
