"""CPU checks of the ahead-of-time built kernel library (skipped when it was not built)."""
import ctypes
import os
import shutil
import subprocess

import pytest

from jax_dsa.cute import ffi as _native

needs_lib = pytest.mark.skipif(
    not os.path.isfile(_native.LIB_PATH), reason="kernel library not built (ffi/build.py)"
)


def test_import_and_is_available_never_raise():
    assert isinstance(_native.is_available(), bool)


@needs_lib
def test_library_loads_and_exports_handlers():
    assert _native.is_available()
    lib = ctypes.CDLL(_native.LIB_PATH)
    for sym in ("JaxDsaSparseMlaFwdSm90", "JaxDsaInit", "JaxDsaSparseMlaBwdSm90",
                "JaxDsaSparseMlaBwdDeterministicSm90", "JaxDsaBwdInit", "JaxDsaBwdNumKernels",
                "JaxDsaGroupUnionSm90", "JaxDsaGroupUnionInit", "JaxDsaGroupUnionNumKernels",
                "JaxDsaSparseMlaBwdGroupedSm90", "JaxDsaIndexerScoresSm90", "JaxDsaIndexerInit",
                "JaxDsaIndexerNumKernels"):
        assert getattr(lib, sym) is not None
    assert _native.has_backward()
    lib.JaxDsaBwdNumKernels.restype = ctypes.c_int
    # plain, deterministic, 3 grouped, and the long-context builds of plain and 3 grouped,
    # x 4 specs (bf16 / f16 x Dqk 512 / 576)
    assert lib.JaxDsaBwdNumKernels() == 36
    # The default build has the list-union kernels (G = 2, 4, 8, each with 3 table sizes) that the
    # grouped backward needs; without them H = 32 / 16 / 8 would silently run the slower plain kernel.
    assert _native.has_group_union()
    lib.JaxDsaGroupUnionNumKernels.restype = ctypes.c_int
    assert lib.JaxDsaGroupUnionNumKernels() == 9
    # the row-order kernel of the backward past the L2 (BwdConfig.sort_rows)
    assert _native.has_rows_order()
    lib.JaxDsaRowsOrderNumKernels.restype = ctypes.c_int
    assert lib.JaxDsaRowsOrderNumKernels() == 1
    assert getattr(lib, "JaxDsaRowsOrderSm90") is not None
    # the indexer's score kernel (bf16, f16) and its top-k (one per INDEXER_TOPK_SIZES)
    assert _native.has_indexer()
    lib.JaxDsaIndexerNumKernels.restype = ctypes.c_int
    assert lib.JaxDsaIndexerNumKernels() == 6
    assert getattr(lib, "JaxDsaIndexerTopkSm90") is not None
    # the attention-target kernel: 64 or 128 heads per CTA x bf16, f16 x Dqk 512, 576
    assert _native.has_target()
    lib.JaxDsaTargetNumKernels.restype = ctypes.c_int
    assert lib.JaxDsaTargetNumKernels() == 8
    assert getattr(lib, "JaxDsaAttentionTargetSm90") is not None
    assert _native.has_indexer_loss()  # the indexer loss and its backward (bf16, f16)
    lib.JaxDsaLossNumKernels.restype = ctypes.c_int
    assert lib.JaxDsaLossNumKernels() == 4
    assert getattr(lib, "JaxDsaIndexerLossFwdSm90") is not None
    assert getattr(lib, "JaxDsaIndexerLossBwdSm90") is not None


@needs_lib
@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_library_is_self_contained():
    out = subprocess.run(["readelf", "-d", _native.LIB_PATH], capture_output=True, text=True,
                         check=True).stdout
    needed = [l.split("[")[1].rstrip("]") for l in out.splitlines() if "(NEEDED)" in l]
    allowed = ("libc.so", "libstdc++.so", "libm.so", "libdl.so", "librt.so", "libpthread.so",
               "ld-linux", "libcuda.so")
    assert needed and all(n.startswith(allowed) for n in needed), needed


@needs_lib
def test_ffi_target_registers():
    _native.load()
    _native.load()  # idempotent
