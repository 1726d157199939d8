"""One training step on a (data x heads) mesh of several devices equals the one-device step.

On a CPU machine this runs on 8 fake devices with the reference; on a machine with 2+ GPUs the
same test runs the Hopper kernels with H / n heads per GPU (issue: multi-GPU training).
"""
import os
import sys

import jax
import numpy as np
import pytest

from jax_dsa import api

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_flax  # noqa: E402


def _devices():
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    return gpus if len(gpus) >= 2 else jax.devices("cpu")


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_step_on_n_devices_equals_one_device(mode):
    devices = _devices()
    if len(devices) < 2:
        pytest.skip("needs 2+ devices")
    on_gpus = devices[0].platform == "gpu"
    if on_gpus and api.kernel_runtime_problem():
        pytest.skip(api.kernel_runtime_problem())
    kw = dict(train_flax.KERNEL_SHAPE) if on_gpus else dict(num_heads=8)
    kw.pop("lr", None)
    n = 8 if len(devices) >= 8 else (4 if len(devices) >= 4 else 2)
    heads = 2 if n == 2 else n // 2  # e.g. 8 devices: 2 data x 4 head shards

    def loss_and_grads(devs, head_shards):
        loss_fn, state, x, y, _ = train_flax.build(mode, devices=devs, head_shards=head_shards, **kw)
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state, x, y)
        return float(loss), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)

    loss_1, grads_1 = loss_and_grads(devices[:1], 1)
    loss_n, grads_n = loss_and_grads(devices[:n], heads)
    tol = 2e-2 if on_gpus else 1e-5  # bf16 attention on the GPUs
    np.testing.assert_allclose(loss_n, loss_1, rtol=tol)
    for g1, gn in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads_n)):
        scale = np.max(np.abs(g1)) or 1.0
        assert np.max(np.abs(gn - g1)) / scale < tol
