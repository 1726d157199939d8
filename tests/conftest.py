"""Test setup: 8 fake CPU devices for the sharding tests (must be set before jax is imported)."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

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
