"""Test setup: 8 fake CPU devices for the sharding tests (must be set before jax is imported).

Under pytest-xdist (`-n N`) every worker is its own process on the one GPU: each takes an equal
share of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set), instead of the default 75 %
that only the first worker could have.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / _workers:.3f}")

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (Hopper for the kernels); skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
