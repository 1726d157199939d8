"""The built library's FFI handlers as JAX functions (jax.ffi.ffi_call).

ffi/build.py produces jax_dsa/_lib/libjax_dsa_sm90.so: the CuTe DSL kernels (cubins embedded)
plus the XLA FFI handlers of ffi/*.cc. This module loads it with ctypes, registers the handlers
for the CUDA platform and wraps each one. Importing it never fails: without the library
`is_available()` is False and the wrappers raise a clear error. The kernel a handler launches
is named by a static attribute (jax_dsa.cute.config).
"""

from __future__ import annotations

import ctypes
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa.cute import deterministic
from jax_dsa.cute.constants import D_V, PERMUTED_DKV_DIMS

LIB_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_lib",
                        "libjax_dsa_sm90.so")
# FFI target name -> the library's handler symbol.
TARGETS = {
    "jax_dsa_sparse_mla_fwd_sm90": "JaxDsaSparseMlaFwdSm90",
    "jax_dsa_sparse_mla_fwd_split_sm90": "JaxDsaSparseMlaFwdSplitSm90",
    "jax_dsa_sparse_mla_fwd_two_pool_sm90": "JaxDsaSparseMlaFwdTwoPoolSm90",
    "jax_dsa_sparse_mla_bwd_sm90": "JaxDsaSparseMlaBwdSm90",
    "jax_dsa_sparse_mla_bwd_two_pool_sm90": "JaxDsaSparseMlaBwdTwoPoolSm90",
    "jax_dsa_sparse_mla_bwd_deterministic_sm90": "JaxDsaSparseMlaBwdDeterministicSm90",
    "jax_dsa_sparse_mla_bwd_grouped_sm90": "JaxDsaSparseMlaBwdGroupedSm90",
    "jax_dsa_group_union_sm90": "JaxDsaGroupUnionSm90",
    "jax_dsa_rows_order_sm90": "JaxDsaRowsOrderSm90",
    "jax_dsa_indexer_scores_sm90": "JaxDsaIndexerScoresSm90",
    "jax_dsa_indexer_topk_sm90": "JaxDsaIndexerTopkSm90",
    "jax_dsa_attention_target_sm90": "JaxDsaAttentionTargetSm90",
    "jax_dsa_indexer_loss_fwd_sm90": "JaxDsaIndexerLossFwdSm90",
    "jax_dsa_indexer_loss_bwd_sm90": "JaxDsaIndexerLossBwdSm90",
}
# Module loaders of the handler files (called once, outside any CUDA-graph capture).
_INITS = ("JaxDsaInit", "JaxDsaBwdInit", "JaxDsaGroupUnionInit", "JaxDsaRowsOrderInit",
          "JaxDsaIndexerInit", "JaxDsaTargetInit", "JaxDsaLossInit")

_lock = threading.Lock()
_lib = None
_load_error: str | None = None


def _open():
    """ctypes handle to the library (cached), or None with _load_error set."""
    global _lib, _load_error
    if _lib is None and _load_error is None:
        if not os.path.isfile(LIB_PATH):
            _load_error = f"{LIB_PATH} not found (built when jax_dsa is installed)"
        else:
            try:
                lib = ctypes.CDLL(LIB_PATH)
                lib.JaxDsaSparseMlaFwdSm90  # noqa: B018  (raises AttributeError if missing)
                _lib = lib
            except (OSError, AttributeError) as e:
                _load_error = f"cannot load {LIB_PATH}: {e}"
    return _lib


def is_available() -> bool:
    """True when the built library exists and loads. Never raises."""
    try:
        with _lock:
            return _open() is not None
    except Exception:  # pragma: no cover - defensive
        return False


_registered = False
_modules_loaded = False


def load():
    """Load the library and register its FFI targets (once). Returns the ctypes handle."""
    global _registered
    with _lock:
        lib = _open()
        if lib is None:
            raise RuntimeError(f"jax_dsa native kernels unavailable: {_load_error}")
        if not _registered:
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="CUDA")
            _registered = True
    return lib


def _load_modules(lib):
    """Load the kernel modules onto the GPUs now, outside of any CUDA-graph capture (the
    handlers would otherwise do it lazily on their first call)."""
    global _modules_loaded
    with _lock:
        if _modules_loaded:
            return
        for init in _INITS:
            fn = getattr(lib, init)
            fn.restype = ctypes.c_int
            rc = fn()
            if rc != 0:
                raise RuntimeError(f"jax_dsa: {init} failed to load the kernels (cudaError {rc})")
        _modules_loaded = True


def _call(target, result_shapes, *args, **attrs):
    """ffi_call of `target` (after loading the library, and its modules when a GPU is there)."""
    lib = load()
    if not _modules_loaded and any(d.platform == "gpu" for d in jax.devices()):
        _load_modules(lib)
    call = jax.ffi.ffi_call(target, result_shapes, vmap_method="sequential")
    return call(*args, **attrs)


def _num_kernels(symbol: str) -> int:
    """The library's count of kernels behind a handler file (0 without the library)."""
    try:
        with _lock:
            lib = _open()
        if lib is None:
            return 0
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        return fn()
    except Exception:  # pragma: no cover - defensive
        return 0


def has_two_pool_forward() -> bool:
    """True when the library holds the two-pool forward kernels. Never raises."""
    return _num_kernels("JaxDsaFwdTwoPoolNumKernels") > 0


def has_two_pool_backward() -> bool:
    """True when the library holds the two-pool backward kernels. Never raises."""
    return _num_kernels("JaxDsaBwdTwoPoolNumKernels") > 0


def has_backward() -> bool:
    """True when the library holds the backward kernels. Never raises."""
    return _num_kernels("JaxDsaBwdNumKernels") > 0


def has_group_union() -> bool:
    """True when the library holds the list-union kernels. Never raises."""
    return _num_kernels("JaxDsaGroupUnionNumKernels") > 0


def has_rows_order() -> bool:
    """True when the library holds the row-order kernel. Never raises."""
    return _num_kernels("JaxDsaRowsOrderNumKernels") > 0


def has_indexer() -> bool:
    """True when the library holds the indexer kernels. Never raises."""
    return _num_kernels("JaxDsaIndexerNumKernels") > 0


def has_target() -> bool:
    """True when the library holds the attention-target kernels. Never raises."""
    return _num_kernels("JaxDsaTargetNumKernels") > 0


def has_indexer_loss() -> bool:
    """True when the library holds the indexer-loss kernels. Never raises."""
    return _num_kernels("JaxDsaLossNumKernels") > 0


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def sparse_mla_fwd(q, kv, idx, topk_length, sink, *, scale, kernel, poison_outputs=False):
    """Forward on the kernel `kernel` ("pingpong" or "small_heads").

    q [B, T, H, Dqk] bf16/f16, kv [B, S, Dqk], idx [B, T, K] int32, topk_length [B, T] int32,
    sink [H] float32 (-inf = no sink), scale: Python float. Returns (o [B, T, H, 512] q.dtype,
    lse [B, T, H] float32). The handler checks the shapes as well. poison_outputs (tests): the
    handler fills o and lse with NaN before the launch, so unwritten elements show.
    """
    B, T, H, _ = q.shape
    out = (jax.ShapeDtypeStruct((B, T, H, D_V), q.dtype),
           jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    return _call("jax_dsa_sparse_mla_fwd_sm90", out, q, kv, _i32(idx), _i32(topk_length),
                 _f32(sink), scale=np.float32(scale), kernel=str(kernel),
                 poison=np.int32(bool(poison_outputs)))


def sparse_mla_fwd_split(q, kv, idx, topk_length, sink, *, scale, parts, poison_outputs=False):
    """The decode form of the pingpong forward: each token's list as `parts` contiguous parts
    of ceil(K / parts) entries, one CTA per (token, part, 64 heads), then a combine kernel
    that merges the parts by their lse with the sink. Returns (o [B, T, H, 512] q.dtype, lse
    [B, T, H] float32), as sparse_mla_fwd up to rounding each part's o to q.dtype; the parts
    (a workspace output) are dropped."""
    B, T, H, _ = q.shape
    out = (jax.ShapeDtypeStruct((B, T, H, D_V), q.dtype),
           jax.ShapeDtypeStruct((B, T, H), jnp.float32),
           jax.ShapeDtypeStruct((B, T, parts, H, D_V), q.dtype),
           jax.ShapeDtypeStruct((B, T, parts, H), jnp.float32))
    o, lse, *_ = _call("jax_dsa_sparse_mla_fwd_split_sm90", out, q, kv, _i32(idx),
                       _i32(topk_length), _f32(sink), scale=np.float32(scale),
                       poison=np.int32(bool(poison_outputs)))
    return o, lse


def sparse_mla_fwd_two_pool(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, *, scale,
                            poison_outputs=False):
    """The pingpong forward over two pools in one softmax: token t's entries are idx[b, t]
    (rows of kv, valid below topk_length) then idx2[b, t] (rows of kv2, below topk_length2).
    Returns (o [B, T, H, 512] q.dtype, lse [B, T, H] float32), as sparse_mla_fwd over the
    pools' concatenation would."""
    B, T, H, _ = q.shape
    out = (jax.ShapeDtypeStruct((B, T, H, D_V), q.dtype),
           jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    return _call("jax_dsa_sparse_mla_fwd_two_pool_sm90", out, q, kv, _i32(idx),
                 _i32(topk_length), kv2.astype(q.dtype), _i32(idx2), _i32(topk_length2),
                 _f32(sink), scale=np.float32(scale), poison=np.int32(bool(poison_outputs)))


def _bwd_args(q, kv, idx, topk_length, lse, do, o, *f32_args):
    """The backward handlers' leading arguments in their dtypes, then f32_args as float32
    (coef; or sink and dlse for the two-pool handler)."""
    return (q, kv, _i32(idx), _i32(topk_length), _f32(lse), do.astype(q.dtype),
            o.astype(q.dtype)) + tuple(_f32(a) for a in f32_args)


def _bwd_shapes(q, kv_rows: int):
    B, T, H, D = q.shape
    return (jax.ShapeDtypeStruct((B, T, H, D), q.dtype),  # dq
            jax.ShapeDtypeStruct((B, kv_rows, D), jnp.float32),  # dkv
            jax.ShapeDtypeStruct((B, T, H), jnp.float32))  # delta


def _dkv_logical(dkv):
    """The backward kernels at Dqk in PERMUTED_DKV_DIMS (all) add dkv in a permuted column
    order (each 16 columns 8 g0 + 2 s + c stored at 4 s + 2 g0 + c, so that a lane's values are
    contiguous: ffi/kernels/sm90/scatter_layout.permuted_column); this restores the logical
    order (a transpose that XLA fuses with the caller's cast). Other dims are logical already."""
    b, s, d = dkv.shape
    if d not in PERMUTED_DKV_DIMS:
        return dkv
    return dkv.reshape(b, s, d // 16, 4, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(b, s, d)


def sparse_mla_bwd(q, kv, idx, topk_length, lse, do, o, coef, *, scale, group=1):
    """Backward on the atomic kernels: (dq [B, T, H, Dqk] q.dtype, dkv [B, S, Dqk] float32,
    delta [B, T, H] float32 = rowsum(do * o)).

    lse [B, T, H] float32 and o [B, T, H, 512] (the forward's; lse -inf on dead rows),
    do [B, T, H, 512], coef [B, T, H, 2] float32 = (c, dlse) per row (jax_dsa.cute.kernel).
    dkv is the fp32 accumulator (zero-filled by the handler); the caller casts it.
    group > 1: the grouped kernel (q, lse, do, o, coef viewed as [B, T / G, 64, ...], idx = the
    union's packed entries, topk_length = its lengths; jax_dsa.cute.kernel).
    """
    args = _bwd_args(q, kv, idx, topk_length, lse, do, o, coef)
    if group == 1:
        dq, dkv, delta = _call("jax_dsa_sparse_mla_bwd_sm90", _bwd_shapes(q, kv.shape[1]), *args,
                               scale=np.float32(scale))
    else:
        dq, dkv, delta = _call("jax_dsa_sparse_mla_bwd_grouped_sm90", _bwd_shapes(q, kv.shape[1]), *args,
                               scale=np.float32(scale), group=np.int32(group))
    return dq, _dkv_logical(dkv), delta


def sparse_mla_bwd_two_pool(q, kv, kv2, idx, topk_length, lse, do, o, sink, dlse, *, scale):
    """The plain backward over two pools read in place: idx [B, T, K] numbers kv's rows
    [0, S1) then kv2's from S1 on (jax_dsa._core.one_list); returns (dq, dkv [B, S1 + S2, Dqk]
    float32 in that numbering, dsink [B, H] float32). sink [H] float32 (-inf: none), dlse
    [B, T, H] float32; the kernel computes c and the sink's gradient itself."""
    b, _, h, _ = q.shape
    shapes = _bwd_shapes(q, kv.shape[1] + kv2.shape[1])[:2] + (
        jax.ShapeDtypeStruct((b, h), jnp.float32),)
    args = _bwd_args(q, kv, idx, topk_length, lse, do, o, sink, dlse)
    dq, dkv, dsink = _call("jax_dsa_sparse_mla_bwd_two_pool_sm90", shapes, args[0], args[1],
                           kv2.astype(q.dtype), *args[2:], scale=np.float32(scale))
    return dq, _dkv_logical(dkv), dsink


def group_union(idx, topk_length, num_kv_rows: int, group: int):
    """The union entries of jax_dsa.cute.grouping.pack_entries(*group_lists(...)[:2]) (the
    same multiset per group, in another order) and the union lengths, by the CUDA kernel
    (ffi/group_union.cc): (packed [B, T / G, G * K] int32, length [B, T / G] int32).
    Needs T % G == 0, G * K <= UNION_CAPACITY and num_kv_rows < 2^MEMBER_SHIFT (the handler
    checks and says which)."""
    B, T, K = idx.shape
    n = T // group
    out = (jax.ShapeDtypeStruct((B, n, group * K), jnp.int32),
           jax.ShapeDtypeStruct((B, n), jnp.int32))
    return _call("jax_dsa_group_union_sm90", out, _i32(idx), _i32(topk_length),
                 num_kv_rows=np.int64(num_kv_rows), group=np.int32(group))


def rows_order(idx, topk_length, num_kv_rows: int, ctas_per_token: int = 0):
    """Each token's list in row order by the CUDA kernel (ffi/rows_order.cc): (rows [B, T, K]
    int32 = the valid entries ordered by row * 127 // S, the list's order within a bucket, then
    num_kv_rows for each invalid entry; count [B, T] int32 = the valid entries). With
    ctas_per_token > 0 (the backward's CTAs per token) the buckets run descending for the
    tokens t (flattened over B, T) with t // (SMs // ctas_per_token) odd: every other wave of
    the backward sweeps the rows the other way."""
    out = (jax.ShapeDtypeStruct(idx.shape, jnp.int32),
           jax.ShapeDtypeStruct(idx.shape[:2], jnp.int32))
    return _call("jax_dsa_rows_order_sm90", out, _i32(idx), _i32(topk_length),
                 num_kv_rows=np.int64(num_kv_rows), ctas_per_token=np.int32(ctas_per_token))


def sparse_mla_bwd_deterministic(q, kv, idx, topk_length, lse, do, o, coef, *, scale,
                                 workspace_bytes):
    """sparse_mla_bwd with a bitwise reproducible dkv: no float atomics (each entry's dkv row
    goes to a workspace of at most `workspace_bytes`, chunk by chunk of tokens, and the
    dkv_reduce kernel adds each kv row's run of rows in a fixed order). Same results."""
    B, T, H, D = q.shape
    S, K = kv.shape[1], idx.shape[2]
    if B * S >= deterministic.NO_ROW:
        raise ValueError(f"deterministic=True needs B * S < 2^31 - 1; got B={B}, S={S}")
    chunk = deterministic.chunk_tokens(B * T, K, D, H, workspace_bytes)
    order, seg_end, rows = deterministic.entry_order(_i32(idx), _i32(topk_length), S, chunk)
    workspace = jax.ShapeDtypeStruct((chunk * K * (-(-H // 64)), D), jnp.float32)
    dq, dkv, delta, _ = _call(
        "jax_dsa_sparse_mla_bwd_deterministic_sm90", _bwd_shapes(q, kv.shape[1]) + (workspace,),
        *_bwd_args(q, kv, idx, topk_length, lse, do, o, coef), order, seg_end, rows,
        scale=np.float32(scale))
    return dq, _dkv_logical(dkv), delta


def indexer_scores(q, k, w, start, *, scale, ratio, poison_outputs=False):
    """The lightning indexer's scores [B, T, S] float32 (-inf where row s is not visible to
    token t: (s + 1) * ratio > start + t + 1) on the score kernel (ffi/indexer.cc).

    q [B, T, Hi, 128] bf16/f16 (Hi <= 64), k [B, S, 128] (q's dtype), w [B, T, Hi] (cast to
    float32), start: an int32 scalar (may be traced), scale: Python float, ratio: Python int.
    poison_outputs (tests): the handler fills the scores with NaN before the launch.
    """
    B, T, _, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, k.shape[1]), jnp.float32)
    return _call("jax_dsa_indexer_scores_sm90", out, q, k, _f32(w),
                 jnp.reshape(_i32(start), (1,)), scale=np.float32(scale),
                 ratio=np.int32(ratio), poison=np.int32(bool(poison_outputs)))


def indexer_topk(scores, topk: int):
    """(values [B, T, topk] float32, idx [B, T, topk] int32): each row's min(topk, S) largest
    scores of scores [B, T, S] float32, highest first, equal scores to the smaller column;
    (-inf, -1) in the slots past S and where the score is -inf (ffi/indexer.cc, the
    radix-select kernel). topk <= INDEXER_MAX_TOPK."""
    B, T, _ = scores.shape
    out = (jax.ShapeDtypeStruct((B, T, topk), jnp.float32),
           jax.ShapeDtypeStruct((B, T, topk), jnp.int32))
    return _call("jax_dsa_indexer_topk_sm90", out, _f32(scores), topk=np.int32(topk))


def attention_mass(q, kv, idx, topk_length, off, *, scale, poison_outputs=False):
    """Each entry's attention mass summed over each block of 64 heads, [B, T, ceil(H / 64), K]
    float32 (0 at invalid entries), on the target kernel (ffi/attention_target.cc).

    q [B, T, H, Dqk] bf16/f16, kv [B, S, Dqk], idx [B, T, K] int32, topk_length [B, T] int32,
    off [B, T, H] float32 = logaddexp(lse, sink) (+inf for a dead head), scale: Python float.
    poison_outputs (tests): the handler fills mass with NaN before the launch.
    """
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, -(-H // 64), idx.shape[2]), jnp.float32)
    return _call("jax_dsa_attention_target_sm90", out, q, kv, _i32(idx), _i32(topk_length),
                 _f32(off), scale=np.float32(scale), poison=np.int32(bool(poison_outputs)))


def indexer_loss_fwd(q, k, w, idx, topk_length, target, *, scale):
    """(The per-token KL [B, T], signal [B, T, K]: p_j sum(target) - target_j per entry, 0 at
    the invalid ones), float32, of jax_dsa.indexer_loss on the loss kernel
    (ffi/indexer_loss.cc); target [B, T, K], the other arguments as indexer_loss_bwd's."""
    B, T = q.shape[:2]
    out = (jax.ShapeDtypeStruct((B, T), jnp.float32),
           jax.ShapeDtypeStruct(idx.shape, jnp.float32))
    return _call("jax_dsa_indexer_loss_fwd_sm90", out, q, k, _f32(w), _i32(idx),
                 _i32(topk_length), _f32(target), scale=np.float32(scale))


def indexer_loss_bwd(q, k, w, idx, topk_length, signal, g, *, scale):
    """(dq [B, T, Hi, 128], dw [B, T, Hi], dk [B, S, 128]), all float32: the gradients of
    sum_t g[b, t] KL_t of jax_dsa.indexer_loss on the loss kernel (ffi/indexer_loss.cc).

    q [B, T, Hi, 128] bf16/f16 (Hi <= 64), k [B, S, 128] (q's dtype), w [B, T, Hi], idx
    [B, T, K] int32 (K <= INDEXER_LOSS_MAX_K), topk_length [B, T] int32, signal [B, T, K]
    (indexer_loss_fwd's), g [B, T] (cast to float32), scale: Python float.
    """
    B, T, H, D = q.shape
    out = (jax.ShapeDtypeStruct((B, T, H, D), jnp.float32),
           jax.ShapeDtypeStruct((B, T, H), jnp.float32),
           jax.ShapeDtypeStruct(k.shape, jnp.float32))
    return _call("jax_dsa_indexer_loss_bwd_sm90", out, q, k, _f32(w), _i32(idx),
                 _i32(topk_length), _f32(signal), _f32(g),
                 scale=np.float32(scale))
