"""Sparse MLA (DSA) forward for sm_90a: the contract, and the pieces shared by the 64-head-tile
kernels (sparse_mla_fwd_ws.py, sparse_mla_fwd_ws2.py).

For every (b, t, h): s_j = scale * q[b,t,h,:] . kv[b, idx[b,t,j], :] over the valid j
(j < min(K, topk_length[b,t]) and 0 <= idx < S), online softmax, and

    o   = sum_j exp(s_j - m) v_j / (exp(sink_h - m) + sum_j exp(s_j - m)),  v = kv[..., :512]
    lse = m + log(sum_j exp(s_j - m))                      (natural log, sink excluded)

A row without any valid entry gets o = 0 and lse = -inf.

Common to every forward variant (ws, ws2, smallh2, smallh, simt; the FFI handler launches them
alike):
  * Inputs are flattened on the host side: q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,),
    topk_length (B*T,), sink (H,), o (B*T*H, 512), lse (B*T*H,). All row offsets are 64-bit.
  * Tokens are on grid x so T can reach 2^31 - 1. The 64-head-tile kernels run one CTA per
    (token, block of up to 64 heads): grid = (T, ceil(H / 64), B); missing heads (h >= H) are
    zero rows of Q, never stored. KV rows are gathered by index with 16-byte cp.async; invalid
    entries are never read (their rows zero-filled, their scores masked to -inf). V is the first
    512 columns of the same rows.
  * Shared memory uses the canonical 128-byte-swizzle wgmma layouts (swizzle on the byte
    address). A gathered tile is stored K-major (rows = keys, contiguous head dim); the V
    operand is the MN-major view of the same bytes: both place (key, d) at
    (d // 64) * 4096 + (key // 8) * 512 + swz((key % 8) * 64 + d % 64) elements.
(Versions 1 and 2 of this file held the mma.sync and the plain wgmma kernels; they are in git
history and the kernel log of docs/performance.md.)
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


class SparseMlaFwdTileSm90:
    """Sizes, shared-memory layouts and small helpers of the 64-head-tile kernels."""

    def __init__(self, dtype, d_qk: int, d_v: int = 512):
        assert d_qk % 64 == 0 and d_v % 64 == 0 and d_v <= d_qk
        self.dtype = dtype
        self.d_qk = d_qk
        self.d_v = d_v
        self.bm = 64  # head rows per CTA
        self.bn = 64  # gathered KV rows per block
        self.dv_g = d_v // 2  # O columns per consumer warpgroup
        self.chunks = d_qk // 8  # 16-byte chunks per row

    def _smem_layouts(self):
        """The 128 B K-major swizzle atom, then the outer layouts of Q, a KV stage, V^T (MN-major
        view of the same bytes), a P tile (the swizzle goes on the pointers: byte-address
        swizzle), and the software-swizzled O staging tile (element-unit 128 B swizzle), whole
        and per group."""
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, self.dtype)
        sQ_layout = cute.tile_to_shape(k_atom, (self.bm, self.d_qk), (0, 1))
        sKV_layout = cute.tile_to_shape(k_atom, (self.bn, self.d_qk), (0, 1))
        sVt_layout = cute.tile_to_shape(mn_atom, (self.dv_g, self.bn), (1, 0))
        sP_layout = cute.tile_to_shape(k_atom, (self.bm, self.bn), (0, 1))
        o_atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sO_layout = cute.tile_to_shape(o_atom, (self.bm, self.d_v), (0, 1))
        sOg_layout = cute.tile_to_shape(o_atom, (self.bm, self.dv_g), (0, 1))
        return k_atom, sQ_layout, sKV_layout, sVt_layout, sP_layout, sO_layout, sOg_layout

    @staticmethod
    def _acc_mn_view(t: cute.Tensor) -> cute.Tensor:
        """View a wgmma 64xN accumulator ((2 cols, 2 rows, N/8), 1, 1) as (rows, cols)."""
        c = cute.make_layout(t.layout.shape)
        mn = cute.make_layout(
            ((c.shape[0][1], c.shape[1]), ((c.shape[0][0], c.shape[0][2]), c.shape[2])),
            stride=(
                (c.stride[0][1], c.stride[1]),
                ((c.stride[0][0], c.stride[0][2]), c.stride[2]),
            ),
        )
        return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))

    @staticmethod
    def _stage(base, layout, stage) -> cute.Tensor:
        """Tensor `layout` at base + stage * cosize(layout) elements. Offsets are multiples of the
        512-element (1 KB) swizzle period, so the swizzle phase is unchanged."""
        off = cute.assume(stage * cute.cosize(layout), divby=512)
        return cute.make_tensor(base + off, layout)

    @staticmethod
    def _chunk(t: cute.Tensor, row, c) -> cute.Tensor:
        """The 8 contiguous elements (16 B) t[row, 8c : 8c + 8] as a rank-1 tensor."""
        return cute.local_tile(t, (1, 8), (row, c))[0, None]

    @staticmethod
    def _quad_allreduce(x, op):
        # The 4 threads of a quad hold the same accumulator rows.
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
        return x
