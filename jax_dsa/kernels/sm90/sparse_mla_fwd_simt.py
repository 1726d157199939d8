"""Plain SIMT sparse MLA forward: a slow, simple cross-check of the tensor-core kernel.

Same math, arguments and flattened layouts as the other variants (contract in
sparse_mla_fwd.py; the FFI handler selects it with JAX_DSA_FWD_IMPL=simt). One CTA per (token, head, batch) = grid (T, H, B), 4
warps; warp w walks the index slots j = w, w + 4, ... and keeps its own online softmax state;
lane l owns the columns l + 32 i. The 4 partial states are merged through shared memory.
"""

import math

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from jax_dsa.kernels.sm90.common import LN_2, LOG2_E, fwd_fake_args

WARPS = 4


class SparseMlaFwdSimt:
    def __init__(self, dtype, d_qk: int, d_v: int = 512):
        assert d_qk % 32 == 0 and d_v % 32 == 0 and d_v <= d_qk
        self.dtype, self.d_qk, self.d_v = dtype, d_qk, d_v

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
                 mSink: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, B: cutlass.Int32,
                 T: cutlass.Int32, H: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            m: cute.struct.MemRange[cutlass.Float32, WARPS]
            l: cute.struct.MemRange[cutlass.Float32, WARPS]
            o: cute.struct.MemRange[cutlass.Float32, WARPS * self.d_v]

        self.kernel(mQ, mKV, mIdx, mLen, mSink, mO, mLse, T, H, S, K, scale * LOG2_E,
                    SharedStorage).launch(
            grid=[T, H, B], block=[32 * WARPS, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
               mSink: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, T: cutlass.Int32,
               H: cutlass.Int32, S: cutlass.Int32, K: cutlass.Int32,
               scale_log2: cutlass.Float32, SharedStorage: cutlass.Constexpr):
        nq, nv = self.d_qk // 32, self.d_v // 32
        tidx, _, _ = cute.arch.thread_idx()
        t, h, b = cute.arch.block_idx()
        w = tidx // 32
        lane = tidx % 32
        bt = cutlass.Int64(b) * cutlass.Int64(T) + cutlass.Int64(t)
        row_q = bt * cutlass.Int64(H) + cutlass.Int64(h)
        k_eff = cutlass.min(K, cutlass.max(mLen[bt], 0))

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        sM = st.m.get_tensor(cute.make_layout(WARPS))
        sL = st.l.get_tensor(cute.make_layout(WARPS))
        sO = st.o.get_tensor(cute.make_layout((self.d_v, WARPS)))

        q = cute.make_rmem_tensor(nq, cutlass.Float32)
        for i in cutlass.range_constexpr(nq):
            q[i] = mQ[row_q, lane + 32 * i].to(cutlass.Float32)
        acc = cute.make_rmem_tensor(nv, cutlass.Float32)
        acc.fill(0.0)
        kv_row = cute.make_rmem_tensor(nq, cutlass.Float32)
        m = cutlass.Float32(-math.inf)  # running max, log2 domain
        l = cutlass.Float32(0.0)
        for j in range(w, k_eff, WARPS):
            r = mIdx[bt * cutlass.Int64(K) + cutlass.Int64(j)]
            if r >= 0 and r < S:  # invalid slots are never read
                g = cutlass.Int64(b) * cutlass.Int64(S) + cutlass.Int64(r)
                part = cutlass.Float32(0.0)
                for i in cutlass.range_constexpr(nq):
                    kv_row[i] = mKV[g, lane + 32 * i].to(cutlass.Float32)
                    part = part + q[i] * kv_row[i]
                for off in cutlass.range_constexpr(5):
                    part = part + cute.arch.shuffle_sync_bfly(part, offset=1 << off)
                s = part * scale_log2
                m_new = cute.arch.fmax(m, s)
                corr = cute.math.exp2(m - m_new)  # m = -inf -> 0; m_new is finite here
                p = cute.math.exp2(s - m_new)
                l = l * corr + p
                for i in cutlass.range_constexpr(nv):
                    acc[i] = acc[i] * corr + p * kv_row[i]
                m = m_new

        if lane == 0:
            sM[w] = m
            sL[w] = l
        for i in cutlass.range_constexpr(nv):
            sO[lane + 32 * i, w] = acc[i]
        cute.arch.sync_threads()

        m_all = sM[0]
        for x in cutlass.range_constexpr(1, WARPS):
            m_all = cute.arch.fmax(m_all, sM[x])
        m_use = 0.0 if m_all == -cutlass.Float32.inf else m_all
        l_all = cutlass.Float32(0.0)
        for x in cutlass.range_constexpr(WARPS):
            l_all = l_all + sL[x] * cute.math.exp2(sM[x] - m_use)
        denom = l_all + cute.math.exp2(mSink[h] * LOG2_E - m_use)
        inv = 0.0 if denom <= 0.0 else 1.0 / denom
        for i in cutlass.range_constexpr(self.d_v // (32 * WARPS)):
            d = tidx + 32 * WARPS * i
            o = cutlass.Float32(0.0)
            for x in cutlass.range_constexpr(WARPS):
                o = o + sO[d, x] * cute.math.exp2(sM[x] - m_use)
            mO[row_q, d] = (o * inv).to(self.dtype)
        if tidx == 0:
            lse = -cutlass.Float32.inf
            if l_all > 0.0:
                lse = (m_use + cute.math.log2(l_all)) * LN_2
            mLse[row_q] = lse


def compile_fwd_simt(dtype, d_qk: int, d_v: int = 512):
    """Compile with shape-only tensors (common.fwd_fake_args)."""
    return cute.compile(SparseMlaFwdSimt(dtype, d_qk, d_v), *fwd_fake_args(dtype, d_qk, d_v))
