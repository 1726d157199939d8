"""Pieces shared by the sm_90a kernels: accumulator and shared-memory views, the gathers' index
loads and row addresses, inline PTX the DSL does not wrap (zero-filling cp.async, vector fp32
RED / stores, predicated forms), and the shape-only ("fake") argument lists the ahead-of-time
compile entry points hand to cute.compile.

The fake tensors fix each kernel's exported C signature (ffi/build.py, ffi/*.cc): flattened
row-major views whose row counts are dynamic, 16-byte aligned where vector copies need it. Every
forward kernel takes fwd_fake_args(); every backward kernel bwd_fake_args().
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def acc_mn_view(t: cute.Tensor) -> cute.Tensor:
    """View a wgmma 64xN accumulator ((2 cols, 2 rows, N/8), MMA_M, MMA_N) as (rows, cols)."""
    c = cute.make_layout(t.layout.shape)
    if cutlass.const_expr(len(c.shape[0]) == 3):
        cols = ((c.shape[0][0], c.shape[0][2]), c.shape[2])
        cols_st = ((c.stride[0][0], c.stride[0][2]), c.stride[2])
    else:  # N = 8: ((2 cols, 2 rows), MMA_M, MMA_N)
        cols = (c.shape[0][0], c.shape[2])
        cols_st = (c.stride[0][0], c.stride[2])
    mn = cute.make_layout(
        ((c.shape[0][1], c.shape[1]), cols),
        stride=((c.stride[0][1], c.stride[1]), cols_st),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def chunk16(t: cute.Tensor, row, c) -> cute.Tensor:
    """The 8 contiguous 16-bit elements (16 B) t[row, 8c : 8c + 8] as a rank-1 tensor."""
    return cute.local_tile(t, (1, 8), (row, c))[0, None]


def sw128_offset(rows: int, row, chunk):
    """Byte offset of 16-byte chunk `chunk` of row `row` in a K-major 128 B-swizzled tile of
    `rows` rows (rows % 8 == 0) based at a 1024-byte-aligned address: the layout of
    tile_to_shape(K_SW128 atom, (rows, cols), (0, 1)) with the swizzle applied. For producers
    that write wgmma operands with cp.async at computed addresses."""
    return ((chunk // 8) * rows + row) * 128 + (((chunk % 8) ^ (row % 8)) * 16)


def ring_stage(base, layout, stage) -> cute.Tensor:
    """Tensor `layout` at base + stage * cosize(layout) elements. Offsets are multiples of the
    512-element (1 KB) swizzle period, so the swizzle phase is unchanged."""
    off = cute.assume(stage * cute.cosize(layout), divby=512)
    return cute.make_tensor(base + off, layout)


@cute.jit
def load_block_indices(mIdx: cute.Tensor, dst: cute.Tensor, blk, k_eff: cutlass.Int32,
                       idx_base: cutlass.Int64, row: cutlass.Int32, bn: cutlass.Constexpr,
                       step: cutlass.Constexpr, passes: cutlass.Constexpr):
    """dst[p] <- the index of entry blk * bn + row + step * p of the token's list (which starts
    at idx_base), or -1 at and past k_eff (the valid length): a gather thread's rows of block
    blk."""
    for p in cutlass.range_constexpr(passes):
        j = blk * bn + row + step * p
        v = cutlass.Int32(-1)
        if j < k_eff:
            v = mIdx[idx_base + cutlass.Int64(j)]
        dst[p] = v


def quad_allreduce(x, op):
    """op-reduce x over the 4 threads of a quad (they hold the same accumulator rows)."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return x


def _asm(text: str, constraints: str, operands, loc, ip):
    """Inline PTX with side effects and no result."""
    llvm.inline_asm(
        None,
        operands,
        text,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )



@dsl_user_op
def cp_async_16_zfill(dst_smem, src_gmem, src_bytes, dst_off: int = 0, src_off: int = 0, *,
                      loc=None, ip=None):
    """cp.async.cg of 16 bytes from global src_gmem + src_off to shared dst_smem + dst_off (the
    constant byte offsets are part of the instruction, so a run of copies needs no address
    arithmetic); src_bytes = 0 writes 16 zero bytes and reads nothing."""
    _asm(f"cp.async.cg.shared.global [$0+{int(dst_off)}], [$1+{int(src_off)}], 16, $2;",
         "r,l,r,~{memory}",
         [cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip),
          cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
          cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None):
    """An L2 cache policy (createpolicy, fraction 1.0) for data read or written once: its lines
    are evicted first. Int64, for the `*_policy` copies below."""
    i64 = cutlass.Int64.mlir_type
    res = llvm.inline_asm(i64, [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l",
                          has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return cutlass.Int64(res)


@dsl_user_op
def lane_opaque(x, *, loc=None, ip=None):
    """x (Int32) through an identity shuffle (each lane reads its own value), so that ptxas
    cannot split a shared-memory address made from it into a uniform base plus a per-thread
    register (see cp_async_16_policy). A full-warp shuffle: call it where all 32 lanes are
    converged, never under a per-lane branch."""
    i32 = cutlass.Int32.mlir_type
    res = llvm.inline_asm(
        i32, [cutlass.Int32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 lane; mov.u32 lane, %laneid; shfl.sync.idx.b32 $0, $1, lane, 0x1f, -1; }",
        "=r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return cutlass.Int32(res)


@dsl_user_op
def cp_async_16_policy(dst_smem, src_gmem, policy, dst_off: int = 0, src_off: int = 0, *,
                       loc=None, ip=None):
    """cp.async.cg of 16 bytes from global src_gmem + src_off to shared dst_smem + dst_off
    under the L2 cache policy `policy` (offsets: immediates). dst_smem must come from
    lane_opaque: the ptxas of nvidia-cutlass-dsl 4.8 encodes a cache-hinted LDGSTS whose shared
    address it has split into a register and a uniform base with registers it never sets
    (an illegal instruction at run time; dev/check_kernel_build.py rejects that form)."""
    _asm(f"cp.async.cg.shared.global.L2::cache_hint [$0+{int(dst_off)}], [$1+{int(src_off)}], "
         "16, $2;", "r,l,l,~{memory}",
         [cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip),
          cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
          cutlass.Int64(policy).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def ld_global_v4_b32_policy(src_gmem, policy, *, loc=None, ip=None):
    """ld.global.v4.b32 of 16 bytes at src_gmem (16-byte aligned) under the L2 cache policy
    `policy`: four Int32."""
    i32 = cutlass.Int32.mlir_type
    res = llvm.inline_asm(
        llvm.StructType.get_literal([i32] * 4),
        [cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
         cutlass.Int64(policy).ir_value(loc=loc, ip=ip)],
        "ld.global.L2::cache_hint.v4.b32 {$0, $1, $2, $3}, [$4], $5;",
        "=r,=r,=r,=r,l,l",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return [cutlass.Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def st_global_v4_b32_policy(dst_gmem, vals, policy, *, loc=None, ip=None):
    """st.global.v4.b32 of four Int32 at dst_gmem (16-byte aligned) under the L2 cache policy
    `policy`."""
    _asm("st.global.L2::cache_hint.v4.b32 [$0], {$1, $2, $3, $4}, $5;", "l,r,r,r,r,l",
         [cutlass.Int64(dst_gmem).ir_value(loc=loc, ip=ip)]
         + [cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in vals]
         + [cutlass.Int64(policy).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def cp_async_4_zfill(dst_smem, src_gmem, src_bytes, *, loc=None, ip=None):
    """cp.async.ca of 4 bytes from global src_gmem to shared dst_smem; src_bytes = 0 writes
    4 zero bytes and reads nothing."""
    _asm("cp.async.ca.shared.global [$0], [$1], 4, $2;", "r,l,r,~{memory}",
         [cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip),
          cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
          cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip)], loc, ip)


@cute.jit
def gather_source(kv_addr: cutlass.Int64, kv_batch: cutlass.Int64, row: cutlass.Int32,
                  ok, row_bytes: cutlass.Constexpr, sub_bytes: cutlass.Int64):
    """(global byte address, cp.async src-size) of a gathered kv row's 16-byte chunk at
    sub_bytes: the row's address and 16, or (invalid row) kv's base and 0, a copy that reads
    nothing and writes zeros."""
    g = kv_addr + (kv_batch + cutlass.Int64(row)) * cutlass.Int64(row_bytes) + sub_bytes
    return (g if ok else kv_addr), (cutlass.Int32(16) if ok else cutlass.Int32(0))


# Row copies of 128 threads, 8 per row (16-byte chunks sub + 8 i of rows row + 16 p, with
# row = thread // 8 and sub = thread % 8), into K-major 128 B-swizzled tiles.
ROW_COPY_THREADS = 128
ROW_COPY_TPR = 8


@cute.jit
def load_rows_sw128(src_addr: cutlass.Int64, first_row: cutlass.Int64, n_valid: cutlass.Int32,
                    dst: cutlass.Int32, row, sub, rows: cutlass.Constexpr,
                    row_bytes: cutlass.Constexpr):
    """Rows [first_row, first_row + rows) of a row-major array at src_addr into the tile at
    shared address dst; tile rows >= n_valid are zeros (nothing read)."""
    per_pass = ROW_COPY_THREADS // ROW_COPY_TPR
    for p in cutlass.range_constexpr(rows // per_pass):
        r = row + per_pass * p
        ok = r < n_valid
        src = src_addr + (first_row + cutlass.Int64(r)) * row_bytes + cutlass.Int64(16 * sub)
        for i in cutlass.range_constexpr(row_bytes // 16 // ROW_COPY_TPR):
            cp_async_16_zfill(dst + sw128_offset(rows, r, sub + ROW_COPY_TPR * i),
                              src + 16 * ROW_COPY_TPR * i if ok else src_addr,
                              cutlass.Int32(16) if ok else cutlass.Int32(0))


@cute.jit
def gather_rows_sw128(mIdx: cute.Tensor, src_addr: cutlass.Int64, dst: cutlass.Int32,
                      sRow: cute.Tensor, slot, blk, k_eff: cutlass.Int32,
                      idx_base: cutlass.Int64, batch_rows: cutlass.Int64, S: cutlass.Int32,
                      row, sub, bn: cutlass.Constexpr, row_bytes: cutlass.Constexpr,
                      threads: cutlass.Constexpr = ROW_COPY_THREADS):
    """Block blk of a token's list (entries blk * bn + r, the list at mIdx[idx_base:]) into the
    bn-row tile at shared address dst: the rows of the array at src_addr (batch_rows rows before
    this batch's); an invalid entry (at or past k_eff, < 0 or >= S) is a zero row that reads
    nothing. sRow[slot * bn + r] gets the entry, or -1 if invalid. `threads` copy (row =
    thread // ROW_COPY_TPR, sub = thread % ROW_COPY_TPR)."""
    per_pass = threads // ROW_COPY_TPR
    for p in cutlass.range_constexpr(bn // per_pass):
        r = row + per_pass * p
        j = blk * bn + r
        entry = cutlass.Int32(-1)
        if j < k_eff:
            entry = mIdx[idx_base + cutlass.Int64(j)]
        ok = entry >= 0 and entry < S
        if sub == 0:
            sRow[slot * bn + r] = entry if ok else cutlass.Int32(-1)
        src, nbytes = gather_source(src_addr, batch_rows, entry, ok, row_bytes,
                                    cutlass.Int64(sub * 16))
        for i in cutlass.range_constexpr(row_bytes // 16 // ROW_COPY_TPR):
            cp_async_16_zfill(dst + sw128_offset(bn, r, sub + ROW_COPY_TPR * i), src, nbytes, 0,
                              16 * ROW_COPY_TPR * i)


@cute.jit
def head_sums(vals: cute.Tensor, tScS: cute.Tensor, sPart: cute.Tensor, tidx,
              bn: cutlass.Constexpr):
    """Column sums over the 64 rows of a warpgroup's 64 x bn wgmma accumulator, given vals[c]
    = this thread's sum over its two rows of its column c (tScS: the accumulator's (row,
    column) coordinates): over the 8 lanes holding the same columns (shuffles), then over the
    4 warps (through sPart, 4 x bn floats, and a barrier of the 128 threads). Returns column
    tidx's total to threads tidx < bn (0 to the others); sPart is free again after the next
    barrier."""
    lane = tidx % 32
    warp = tidx // 32
    for c in cutlass.range_constexpr(cute.size(vals)):
        v = vals[c]
        for m in (4, 8, 16):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=m)
        if lane < 4:
            sPart[warp * bn + tScS[0, c][1]] = v
    cute.arch.barrier()
    tot = cutlass.Float32(0.0)
    if tidx < bn:
        tot = (sPart[tidx] + sPart[bn + tidx]) + (sPart[2 * bn + tidx] + sPart[3 * bn + tidx])
    return tot


def _ir(x, loc, ip):
    """A pointer's address (toint), or an Int32 / Float32 value, as an MLIR value."""
    if hasattr(x, "toint"):
        return x.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
    return x.ir_value(loc=loc, ip=ip)


def _f32s(vals, loc, ip):
    return [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in vals]


def _v4_f32(op: str, ptr, vals, loc, ip):
    _asm(op + " [$0], {$1, $2, $3, $4};", "l,f,f,f,f", [_ir(ptr, loc, ip)] + _f32s(vals, loc, ip),
         loc, ip)


@dsl_user_op
def red_add_v4_f32(ptr, a, b, c, d, *, evict_last: bool = False, pred=None, loc=None, ip=None):
    """red.global.add.v4.f32 [ptr], {a, b, c, d} (sm_90; ptr 16-byte aligned global memory);
    evict_last: with an L2 evict-last policy; pred (an Int32, or None: always): the RED only
    where pred != 0, as one predicated instruction (no branch around it)."""
    regs, setup, guard, hint, policy = "", "", "", "", ""
    operands = [_ir(ptr, loc, ip)] + _f32s((a, b, c, d), loc, ip)
    constraints = "l,f,f,f,f"
    if evict_last:
        regs += " .reg .b64 pol;"
        hint, policy = ".L2::cache_hint", ", pol"
    if pred is not None:
        regs += " .reg .pred p;"
        setup += " setp.ne.b32 p, $5, 0;"
        guard = "@p "
        operands.append(cutlass.Int32(pred).ir_value(loc=loc, ip=ip))
        constraints += ",r"
    if evict_last:
        setup += " createpolicy.fractional.L2::evict_last.b64 pol, 1.0;"
    _asm(f"{{{regs}{setup} {guard}red.relaxed.gpu.global.add{hint}.v4.f32 "
         f"[$0], {{$1, $2, $3, $4}}{policy}; }}", constraints, operands, loc, ip)


@dsl_user_op
def prefetch_l2_bulk(src_gmem, nbytes: int, pred, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16) at src_gmem (16-byte aligned
    global memory) where pred (an Int32) != 0: the copy engine brings the bytes into the L2,
    nothing waits for it, no shared memory is written."""
    _asm(f"{{ .reg .pred p; setp.ne.b32 p, $1, 0; @p cp.async.bulk.prefetch.L2.global [$0], "
         f"{int(nbytes)}; }}", "l,r",
         [_ir(src_gmem, loc, ip), cutlass.Int32(pred).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def red_add_f32(ptr, a, *, loc=None, ip=None):
    """red.global.add.f32 [ptr], a (ptr 4-byte aligned global memory)."""
    _asm("red.relaxed.gpu.global.add.f32 [$0], $1;", "l,f",
         [_ir(ptr, loc, ip)] + _f32s((a,), loc, ip), loc, ip)


@dsl_user_op
def st_global_v4_f32(ptr, a, b, c, d, *, loc=None, ip=None):
    """st.global.v4.f32 [ptr], {a, b, c, d} (ptr 16-byte aligned global memory)."""
    _v4_f32("st.global.v4.f32", ptr, (a, b, c, d), loc, ip)


@dsl_user_op
def bulk_reduce_add_f32_if(pred, dst_gmem, src_smem, n_bytes: cutlass.Constexpr, *, loc=None,
                           ip=None):
    """cp.reduce.async.bulk ... add.f32: the copy engine adds n_bytes (a multiple of 16; both
    addresses 16-byte aligned) of fp32 from shared memory src_smem to global memory dst_gmem,
    under a predicate (pred != 0). The shared-memory side must have been fenced for the async
    proxy; the copy is tracked by bulk_commit_group / bulk_wait_group."""
    _asm("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.reduce.async.bulk.global.shared::cta"
         f".bulk_group.add.f32 [$0], [$1], {int(n_bytes)}; }}", "l,r,r,~{memory}",
         [cutlass.Int64(dst_gmem).ir_value(loc=loc, ip=ip),
          cutlass.Int32(src_smem).ir_value(loc=loc, ip=ip),
          cutlass.Int32(pred).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def bulk_commit_group(*, loc=None, ip=None):
    """cp.async.bulk.commit_group: the thread's bulk copies issued since the last commit form
    one group."""
    _asm("cp.async.bulk.commit_group;", "~{memory}", [], loc, ip)


@dsl_user_op
def bulk_wait_group(n: cutlass.Constexpr, read: cutlass.Constexpr, *, loc=None, ip=None):
    """cp.async.bulk.wait_group[.read] n: all but the thread's n newest bulk groups are complete
    (read: have finished reading their shared-memory sources)."""
    _asm(f"cp.async.bulk.wait_group{'.read' if read else ''} {int(n)};", "~{memory}", [],
         loc, ip)


def _rows(dtype, n_rows, n_cols, align=16):
    return make_fake_compact_tensor(dtype, (n_rows, n_cols), stride_order=(1, 0),
                                    assumed_align=align)


def _vec(dtype, n, align=4):
    return make_fake_compact_tensor(dtype, (n,), assumed_align=align)


def fwd_fake_args(dtype, d_qk: int, d_v: int, separate_out_rows: bool = False):
    """Forward: q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,), topk_length (B*T,), sink (H,),
    o (B*T*H, d_v), lse (B*T*H,), then B, T, H, S, K, scale and the stream.
    separate_out_rows: o and lse get a row count of their own (the split forward's B*T*P*H)."""
    rows_q, rows_kv, n_idx, n_tok, n_head = (cute.sym_int64() for _ in range(5))
    rows_o = cute.sym_int64() if separate_out_rows else rows_q
    i32 = cutlass.Int32(1)
    return (
        _rows(dtype, rows_q, d_qk), _rows(dtype, rows_kv, d_qk), _vec(cutlass.Int32, n_idx),
        _vec(cutlass.Int32, n_tok), _vec(cutlass.Float32, n_head), _rows(dtype, rows_o, d_v),
        _vec(cutlass.Float32, rows_o), i32, i32, i32, i32, i32, cutlass.Float32(1.0),
        make_fake_stream(),
    )


def fwd_two_pool_fake_args(dtype, d_qk: int, d_v: int):
    """Two-pool forward: q (B*T*H, Dqk), kv (B*S, Dqk), idx (B*T*K,), topk_length (B*T,), kv2
    (B*S2, Dqk), idx2 (B*T*K2,), topk_length2 (B*T,), sink (H,), o (B*T*H, d_v), lse (B*T*H,),
    then B, T, H, S, K, S2, K2, scale and the stream."""
    rows_q, rows_kv, n_idx, n_tok, rows_kv2, n_idx2, n_head = (cute.sym_int64() for _ in range(7))
    i32 = cutlass.Int32(1)
    return (
        _rows(dtype, rows_q, d_qk), _rows(dtype, rows_kv, d_qk), _vec(cutlass.Int32, n_idx),
        _vec(cutlass.Int32, n_tok), _rows(dtype, rows_kv2, d_qk), _vec(cutlass.Int32, n_idx2),
        _vec(cutlass.Int32, n_tok), _vec(cutlass.Float32, n_head), _rows(dtype, rows_q, d_v),
        _vec(cutlass.Float32, rows_q), i32, i32, i32, i32, i32, i32, i32, cutlass.Float32(1.0),
        make_fake_stream(),
    )


def bwd_fake_args(dtype, d_qk: int, d_v: int):
    """Backward: q, kv, idx, topk_length, lse (B*T*H,), do and o (B*T*H, d_v), coef (B*T*H*2,),
    dq (B*T*H, Dqk), dkv float32 (B*S rows, or the deterministic workspace's rows, x Dqk),
    delta float32 (B*T*H,), then B, T, H, S, K, t_begin, n_tok, scale and the stream."""
    rows_q, rows_kv, n_idx, n_tok, n_coef, rows_dkv = (cute.sym_int64() for _ in range(6))
    i32 = cutlass.Int32(1)
    return (
        _rows(dtype, rows_q, d_qk), _rows(dtype, rows_kv, d_qk), _vec(cutlass.Int32, n_idx),
        _vec(cutlass.Int32, n_tok), _vec(cutlass.Float32, rows_q), _rows(dtype, rows_q, d_v),
        _rows(dtype, rows_q, d_v), _vec(cutlass.Float32, n_coef, align=8),
        _rows(dtype, rows_q, d_qk), _rows(cutlass.Float32, rows_dkv, d_qk),
        _vec(cutlass.Float32, rows_q), i32, i32, i32, i32, i32, i32, i32,
        cutlass.Float32(1.0), make_fake_stream(),
    )


def bwd_two_pool_fake_args(dtype, d_qk: int, d_v: int):
    """Two-pool backward: q (B*T*H, Dqk), kv (B*S1, Dqk), kv2 (B*S2, Dqk), idx (B*T*K,) over
    both pools' rows (pool 2's from S1 on), topk_length (B*T,), lse (B*T*H,), do and o
    (B*T*H, d_v), sink (H,), dlse (B*T*H,), dq (B*T*H, Dqk), dkv float32 (B*(S1 + S2), Dqk),
    dsink float32 (B*H,), then B, T, H, S = S1 + S2, S1, K, t_begin, n_tok, scale and the
    stream."""
    rows_q, rows_kv, rows_kv2, n_idx, n_tok, n_head, rows_dkv, n_bh = (
        cute.sym_int64() for _ in range(8))
    i32 = cutlass.Int32(1)
    return (
        _rows(dtype, rows_q, d_qk), _rows(dtype, rows_kv, d_qk), _rows(dtype, rows_kv2, d_qk),
        _vec(cutlass.Int32, n_idx), _vec(cutlass.Int32, n_tok), _vec(cutlass.Float32, rows_q),
        _rows(dtype, rows_q, d_v), _rows(dtype, rows_q, d_v), _vec(cutlass.Float32, n_head),
        _vec(cutlass.Float32, rows_q), _rows(dtype, rows_q, d_qk),
        _rows(cutlass.Float32, rows_dkv, d_qk), _vec(cutlass.Float32, n_bh),
        i32, i32, i32, i32, i32, i32, i32, i32, cutlass.Float32(1.0), make_fake_stream(),
    )


def compile_options(options: str | None) -> dict:
    """cute.compile keyword arguments for extra options, e.g. "--ptxas-options '-v'"."""
    return {"options": options} if options else {}
