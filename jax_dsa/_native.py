"""Runtime side of the ahead-of-time built GPU kernels.

`tools/build_kernels.py` produces jax_dsa/_lib/libjax_dsa_sm90.so: the CuTe DSL kernels (cubins
embedded) plus the XLA FFI handlers. This module loads it with ctypes, registers the handlers
with XLA for the CUDA platform and wraps them with `jax.ffi.ffi_call`. Importing it never fails:
without the library `is_available()` is False and `load()` raises a clear error.
"""

from __future__ import annotations

import ctypes
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

LIB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", "libjax_dsa_sm90.so")
FWD_TARGET = "jax_dsa_sparse_mla_fwd_sm90"
BWD_TARGET = "jax_dsa_sparse_mla_bwd_sm90"
BWD_DET_TARGET = "jax_dsa_sparse_mla_bwd_deterministic_sm90"
BWD_GROUPED_TARGET = "jax_dsa_sparse_mla_bwd_grouped_sm90"
UNION_TARGET = "jax_dsa_group_union_sm90"
D_V = 512

_lock = threading.Lock()
_lib = None
_load_error: str | None = None


def _open():
    """ctypes handle to the library (cached), or None with _load_error set."""
    global _lib, _load_error
    if _lib is None and _load_error is None:
        if not os.path.isfile(LIB_PATH):
            _load_error = f"{LIB_PATH} not found (run tools/build_kernels.py)"
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


def load():
    """Load the library and register its FFI targets (once). Returns the ctypes handle."""
    global _registered
    with _lock:
        lib = _open()
        if lib is None:
            raise RuntimeError(f"jax_dsa native kernels unavailable: {_load_error}")
        if not _registered:
            jax.ffi.register_ffi_target(
                FWD_TARGET, jax.ffi.pycapsule(lib.JaxDsaSparseMlaFwdSm90), platform="CUDA"
            )
            if hasattr(lib, "JaxDsaSparseMlaBwdSm90"):
                jax.ffi.register_ffi_target(
                    BWD_TARGET, jax.ffi.pycapsule(lib.JaxDsaSparseMlaBwdSm90), platform="CUDA"
                )
            if hasattr(lib, "JaxDsaSparseMlaBwdDeterministicSm90"):
                jax.ffi.register_ffi_target(
                    BWD_DET_TARGET,
                    jax.ffi.pycapsule(lib.JaxDsaSparseMlaBwdDeterministicSm90),
                    platform="CUDA",
                )
            if hasattr(lib, "JaxDsaSparseMlaBwdGroupedSm90"):
                jax.ffi.register_ffi_target(
                    BWD_GROUPED_TARGET, jax.ffi.pycapsule(lib.JaxDsaSparseMlaBwdGroupedSm90),
                    platform="CUDA",
                )
            if hasattr(lib, "JaxDsaGroupUnionSm90"):
                jax.ffi.register_ffi_target(
                    UNION_TARGET, jax.ffi.pycapsule(lib.JaxDsaGroupUnionSm90), platform="CUDA"
                )
            _registered = True
    return lib


_modules_loaded = False


def _ensure_modules_loaded(lib):
    # Load the kernel modules onto the GPUs now, outside of any CUDA-graph capture (the handler
    # would otherwise do it lazily on its first call). Only meaningful once a GPU is present.
    global _modules_loaded
    if _modules_loaded:
        return
    with _lock:
        if not _modules_loaded:
            # (the forward's loader always exists; the others only in libraries built with them)
            for init, what in (("JaxDsaInit", "kernel"), ("JaxDsaBwdInit", "backward kernel"),
                               ("JaxDsaGroupUnionInit", "list-union kernel")):
                if init != "JaxDsaInit" and not hasattr(lib, init):
                    continue
                fn = getattr(lib, init)
                fn.restype = ctypes.c_int
                rc = fn()
                if rc != 0:
                    raise RuntimeError(f"jax_dsa: loading the {what} modules failed (cudaError {rc})")
            _modules_loaded = True


def sparse_mla_fwd(q, kv, idx, topk_length, sink, scale, poison_outputs=False):
    """Forward on the CUDA kernels.

    q [B, T, H, Dqk] bf16/f16, kv [B, S, Dqk], idx [B, T, K] int32, topk_length [B, T] int32,
    sink [H] float32 (-inf = no sink), scale: Python float. Returns (o [B, T, H, 512] q.dtype,
    lse [B, T, H] float32). Shapes are checked by the handler as well. poison_outputs (tests):
    the handler fills o and lse with NaN before the launch, so unwritten elements show.
    """
    lib = load()
    if any(d.platform == "gpu" for d in jax.devices()):
        _ensure_modules_loaded(lib)
    B, T, H, _ = q.shape
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (
            jax.ShapeDtypeStruct((B, T, H, D_V), q.dtype),
            jax.ShapeDtypeStruct((B, T, H), jnp.float32),
        ),
        vmap_method="sequential",
    )
    return call(
        q,
        kv,
        jnp.asarray(idx, jnp.int32),
        jnp.asarray(topk_length, jnp.int32),
        jnp.asarray(sink, jnp.float32),
        scale=np.float32(scale),
        poison=np.int32(bool(poison_outputs)),
    )


def has_backward(deterministic: bool = False) -> bool:
    """True when the library was built with the backward kernels (with the deterministic
    variant when asked). Never raises."""
    try:
        with _lock:
            lib = _open()
        if lib is None or not hasattr(lib, "JaxDsaBwdNumKernels"):
            return False
        if deterministic and not hasattr(lib, "JaxDsaSparseMlaBwdDeterministicSm90"):
            return False
        lib.JaxDsaBwdNumKernels.restype = ctypes.c_int
        return lib.JaxDsaBwdNumKernels() > 0
    except Exception:  # pragma: no cover - defensive
        return False


def sparse_mla_bwd(q, kv, idx, topk_length, lse, do, o, coef, scale, group=1):
    """Backward on the CUDA kernels: (dq [B, T, H, Dqk] q.dtype, dkv [B, S, Dqk] float32,
    delta [B, T, H] float32 = rowsum(do * o)).

    lse [B, T, H] float32 and o [B, T, H, 512] (the forward's; lse -inf on dead rows),
    do [B, T, H, 512], coef [B, T, H, 2] float32 = (c, dlse) per row (see jax_dsa._core). dkv is
    the fp32 accumulator (zero-filled by the handler); the caller casts it.
    group > 1: the grouped kernel (jax_dsa._core._grouped_kernel_backward: H = 64
    rows of `group` tokens, idx = the union's packed entries, topk_length = its lengths).
    """
    lib = load()
    if any(d.platform == "gpu" for d in jax.devices()):
        _ensure_modules_loaded(lib)
    B, T, H, D = q.shape
    S = kv.shape[1]
    attrs = {} if group == 1 else {"group": np.int32(group)}
    call = jax.ffi.ffi_call(
        BWD_TARGET if group == 1 else BWD_GROUPED_TARGET,
        (
            jax.ShapeDtypeStruct((B, T, H, D), q.dtype),
            jax.ShapeDtypeStruct((B, S, D), jnp.float32),
            jax.ShapeDtypeStruct((B, T, H), jnp.float32),  # delta
        ),
        vmap_method="sequential",
    )
    return call(
        q,
        kv,
        jnp.asarray(idx, jnp.int32),
        jnp.asarray(topk_length, jnp.int32),
        jnp.asarray(lse, jnp.float32),
        do.astype(q.dtype),
        o.astype(q.dtype),
        jnp.asarray(coef, jnp.float32),
        scale=np.float32(scale),
        **attrs,
    )


# ---------------------------------------------------------------- grouped backward's list union
def has_group_union() -> bool:
    """True when the library was built with the list-union kernels (the default build). Never
    raises."""
    try:
        with _lock:
            lib = _open()
        if lib is None or not hasattr(lib, "JaxDsaGroupUnionNumKernels"):
            return False
        lib.JaxDsaGroupUnionNumKernels.restype = ctypes.c_int
        return lib.JaxDsaGroupUnionNumKernels() > 0
    except Exception:  # pragma: no cover - defensive
        return False


def group_union(idx, topk_length, num_kv_rows: int, group: int):
    """The union entries of jax_dsa.grouping.pack_entries(*group_lists(...)[:2]) (the same
    multiset per group, in another order) and the union lengths, by the CUDA kernel
    (ffi/group_union.cc): (packed [B, T / G, G * K] int32, length [B, T / G] int32).
    Needs T % G == 0, G * K <= group_union.CAPACITY (6144) and num_kv_rows < 2^23 (the handler
    checks and says which)."""
    lib = load()
    if any(d.platform == "gpu" for d in jax.devices()):
        _ensure_modules_loaded(lib)
    B, T, K = idx.shape
    n = T // group
    call = jax.ffi.ffi_call(
        UNION_TARGET,
        (jax.ShapeDtypeStruct((B, n, group * K), jnp.int32),
         jax.ShapeDtypeStruct((B, n), jnp.int32)),
        vmap_method="sequential",
    )
    return call(jnp.asarray(idx, jnp.int32), jnp.asarray(topk_length, jnp.int32),
                num_kv_rows=np.int64(num_kv_rows), group=np.int32(group))


# ---------------------------------------------------------------- deterministic backward
# Workspace of the deterministic backward: one fp32 row of Dqk per (entry, 64-head block) for a
# chunk of tokens; the chunk is sized to stay within this many bytes (rounded down to whole
# waves of 132 CTAs when that leaves at least one wave).
DET_WORKSPACE_BYTES = 512 << 20
_SM_COUNT = 132
_NO_ROW = np.iinfo(np.int32).max  # sort key of invalid entries: after every kv row


def det_chunk_tokens(n_tok: int, k: int, d_qk: int, heads: int, budget: int | None = None) -> int:
    """Tokens per chunk of the deterministic backward (static: shapes only); the workspace
    budget defaults to DET_WORKSPACE_BYTES, read at trace time."""
    budget = DET_WORKSPACE_BYTES if budget is None else budget
    per_token = k * (-(-heads // 64)) * d_qk * 4
    tc = max(1, budget // per_token)
    if tc >= _SM_COUNT:
        tc -= tc % _SM_COUNT
    return int(max(1, min(tc, n_tok)))


def det_entry_order(idx, topk_length, num_kv_rows: int, chunk: int):
    """Per chunk of `chunk` tokens, the entries sorted by destination kv row (stable).

    Returns int32 arrays of n_chunks * chunk * K elements (chunk-major): order (the entry's id
    within its chunk, (bt - t_begin) * K + j), seg_end (one past the end of the run of equal rows
    at a run's first position, 0 elsewhere and for invalid entries) and rows (b * S + idx).
    """
    from jax import lax

    from jax_dsa.reference import valid_mask

    B, T, K = idx.shape
    valid = valid_mask(idx, topk_length, num_kv_rows)
    base = (jnp.arange(B, dtype=jnp.int32) * num_kv_rows)[:, None, None]
    rows = jnp.where(valid, idx + base, _NO_ROW).reshape(-1)
    n_chunks = -(-(B * T) // chunk)
    width = chunk * K
    rows = jnp.pad(rows, (0, n_chunks * width - rows.size), constant_values=_NO_ROW)
    rows = rows.reshape(n_chunks, width)
    local = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    rows, order = lax.sort((rows, local), dimension=1, num_keys=1, is_stable=True)
    start = jnp.concatenate(
        [jnp.ones((n_chunks, 1), bool), rows[:, 1:] != rows[:, :-1]], axis=1)
    # One past the end of each run: the next run start to the right (width after the last).
    next_start = lax.cummin(jnp.where(start, local, width), axis=1, reverse=True)
    end = jnp.concatenate(
        [next_start[:, 1:], jnp.full((n_chunks, 1), width, jnp.int32)], axis=1)
    seg_end = jnp.where(start & (rows != _NO_ROW), end, 0)
    return order.reshape(-1), seg_end.reshape(-1), rows.reshape(-1)


def sparse_mla_bwd_deterministic(q, kv, idx, topk_length, lse, do, o, coef, scale):
    """sparse_mla_bwd with a bitwise reproducible dkv: no float atomics (see
    jax_dsa/kernels/sm90/sparse_mla_dkv_reduce.py). Same arguments and results."""
    lib = load()
    if any(d.platform == "gpu" for d in jax.devices()):
        _ensure_modules_loaded(lib)
    B, T, H, D = q.shape
    S = kv.shape[1]
    K = idx.shape[2]
    if B * S >= _NO_ROW:
        raise ValueError(f"deterministic=True needs B * S < 2^31 - 1; got B={B}, S={S}")
    chunk = det_chunk_tokens(B * T, K, D, H)
    order, seg_end, rows = det_entry_order(
        jnp.asarray(idx, jnp.int32), jnp.asarray(topk_length, jnp.int32), S, chunk)
    n_hb = -(-H // 64)
    call = jax.ffi.ffi_call(
        BWD_DET_TARGET,
        (
            jax.ShapeDtypeStruct((B, T, H, D), q.dtype),
            jax.ShapeDtypeStruct((B, S, D), jnp.float32),
            jax.ShapeDtypeStruct((B, T, H), jnp.float32),  # delta
            jax.ShapeDtypeStruct((chunk * K * n_hb, D), jnp.float32),  # workspace
        ),
        vmap_method="sequential",
    )
    dq, dkv, delta, _ = call(
        q,
        kv,
        jnp.asarray(idx, jnp.int32),
        jnp.asarray(topk_length, jnp.int32),
        jnp.asarray(lse, jnp.float32),
        do.astype(q.dtype),
        o.astype(q.dtype),
        jnp.asarray(coef, jnp.float32),
        order,
        seg_end,
        rows,
        scale=np.float32(scale),
    )
    return dq, dkv, delta
