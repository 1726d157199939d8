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
            lib.JaxDsaInit.restype = ctypes.c_int
            rc = lib.JaxDsaInit()
            if rc != 0:
                raise RuntimeError(f"jax_dsa: loading the kernel modules failed (cudaError {rc})")
            if hasattr(lib, "JaxDsaBwdInit"):
                lib.JaxDsaBwdInit.restype = ctypes.c_int
                rc = lib.JaxDsaBwdInit()
                if rc != 0:
                    raise RuntimeError(
                        f"jax_dsa: loading the backward kernel modules failed (cudaError {rc})")
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


def has_backward() -> bool:
    """True when the library was built with the backward kernels. Never raises."""
    try:
        with _lock:
            lib = _open()
        if lib is None or not hasattr(lib, "JaxDsaBwdNumKernels"):
            return False
        lib.JaxDsaBwdNumKernels.restype = ctypes.c_int
        return lib.JaxDsaBwdNumKernels() > 0
    except Exception:  # pragma: no cover - defensive
        return False


def sparse_mla_bwd(q, kv, idx, topk_length, lse, do, coef, scale):
    """Backward on the CUDA kernels: (dq [B, T, H, Dqk] q.dtype, dkv [B, S, Dqk] float32).

    lse [B, T, H] float32 (the forward's; -inf on dead rows), do [B, T, H, 512],
    coef [B, T, H, 2] float32 = (c, c * Delta - dlse) per row (see jax_dsa._core). dkv is the
    fp32 accumulator (zero-filled by the handler); the caller casts it.
    """
    lib = load()
    if any(d.platform == "gpu" for d in jax.devices()):
        _ensure_modules_loaded(lib)
    B, T, H, D = q.shape
    S = kv.shape[1]
    call = jax.ffi.ffi_call(
        BWD_TARGET,
        (
            jax.ShapeDtypeStruct((B, T, H, D), q.dtype),
            jax.ShapeDtypeStruct((B, S, D), jnp.float32),
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
        jnp.asarray(coef, jnp.float32),
        scale=np.float32(scale),
    )
