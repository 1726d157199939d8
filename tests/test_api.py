"""Argument checking and implementation choice of jax_dsa.sparse_mla."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsa
from jax_dsa import api


def _args(b=2, t=3, h=4, d=64, s=10, k=5, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), dtype)
    idx = jnp.asarray(rng.integers(0, s, (b, t, k)), jnp.int32)
    return q, kv, idx


BAD = [
    # (description, kwargs-modifier, exception, message fragment)
    ("q rank", lambda q, kv, idx: dict(q=q[0, 0]), ValueError, "q must be"),
    ("kv rank", lambda q, kv, idx: dict(kv=kv[0]), ValueError, "kv must be"),
    ("idx rank", lambda q, kv, idx: dict(idx=idx[..., 0]), ValueError, "idx must be"),
    ("idx dtype", lambda q, kv, idx: dict(idx=idx.astype(jnp.int64) if jax.config.jax_enable_x64
                                          else idx.astype(jnp.int16)), TypeError, "idx must be int32"),
    ("idx float", lambda q, kv, idx: dict(idx=idx.astype(jnp.float32)), TypeError, "idx must be int32"),
    ("q int", lambda q, kv, idx: dict(q=q.astype(jnp.int32), kv=kv.astype(jnp.int32)), TypeError,
     "q must be a floating"),
    ("kv dtype", lambda q, kv, idx: dict(kv=kv.astype(jnp.float16)), TypeError, "kv must have q's dtype"),
    ("batch", lambda q, kv, idx: dict(kv=kv[:1]), ValueError, "kv's batch size"),
    ("idx tokens", lambda q, kv, idx: dict(idx=idx[:, :2]), ValueError, "idx's batch and token"),
    ("idx batch", lambda q, kv, idx: dict(idx=idx[:1]), ValueError, "idx's batch and token"),
    ("head dim", lambda q, kv, idx: dict(kv=kv[..., :32]), ValueError, "kv's last dimension"),
    ("d_v > Dqk", lambda q, kv, idx: dict(d_v=65), ValueError, "d_v must be in"),
    ("d_v float", lambda q, kv, idx: dict(d_v=32.0), TypeError, "d_v must be"),
    ("sink shape", lambda q, kv, idx: dict(sink=jnp.zeros(3)), ValueError, "sink must be"),
    ("sink int", lambda q, kv, idx: dict(sink=jnp.zeros(4, jnp.int32)), TypeError, "sink must be"),
    ("topk shape", lambda q, kv, idx: dict(topk_length=jnp.zeros((2,), jnp.int32)), ValueError,
     "topk_length must be"),
    ("topk dtype", lambda q, kv, idx: dict(topk_length=jnp.zeros((2, 3), jnp.float32)), TypeError,
     "topk_length must be int32"),
    ("K = 0", lambda q, kv, idx: dict(idx=idx[..., :0]), ValueError, "K >= 1"),
    ("S = 0", lambda q, kv, idx: dict(kv=kv[:, :0]), ValueError, "S >= 1"),
    ("impl", lambda q, kv, idx: dict(implementation="triton"), ValueError, "implementation must be"),
    ("scale", lambda q, kv, idx: dict(scale=float("nan")), ValueError, "scale must be finite"),
    ("not array", lambda q, kv, idx: dict(q=[1.0, 2.0]), TypeError, "q must be an array"),
    ("deterministic", lambda q, kv, idx: dict(deterministic="yes"), TypeError,
     "deterministic must be a Python bool"),
]


@pytest.mark.parametrize("name,modify,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(name, modify, exc, msg):
    q, kv, idx = _args()
    kwargs = dict(q=q, kv=kv, idx=idx, d_v=32)
    kwargs.update(modify(q, kv, idx))
    with pytest.raises(exc, match=msg):
        jax_dsa.sparse_mla(kwargs.pop("q"), kwargs.pop("kv"), kwargs.pop("idx"), **kwargs)


def test_traced_scale_is_rejected():
    q, kv, idx = _args()
    with pytest.raises(TypeError, match="scale must be a static"):
        jax.jit(lambda s: jax_dsa.sparse_mla(q, kv, idx, d_v=32, scale=s))(0.5)


def test_three_dim_layout_checks_name_the_3d_shapes():
    q, kv, idx = _args()
    with pytest.raises(ValueError, match=r"\[S, Dqk\]"):
        jax_dsa.sparse_mla(q[0], kv, idx[0], d_v=32)
    with pytest.raises(ValueError, match=r"topk_length must be \[T\]"):
        jax_dsa.sparse_mla(q[0], kv[0], idx[0], d_v=32, topk_length=jnp.zeros((2, 3), jnp.int32))


def test_default_scale_and_return_shapes():
    q, kv, idx = _args(dtype=jnp.float32)
    o = jax_dsa.sparse_mla(q, kv, idx, d_v=32)
    o2, lse = jax_dsa.sparse_mla(q, kv, idx, d_v=32, scale=64 ** -0.5, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    assert o.shape == (2, 3, 4, 32) and lse.shape == (2, 3, 4) and lse.dtype == jnp.float32


def test_dispatch_on_cpu_uses_reference_and_cute_raises():
    if api.kernel_runtime_problem() is None:
        pytest.skip("a Hopper GPU with the kernels is present")
    q, kv, idx = _args(d=512, dtype=jnp.bfloat16)
    assert jax_dsa.explain(q, kv, idx).implementation == "xla"
    np.testing.assert_array_equal(jax_dsa.sparse_mla(q, kv, idx),
                                  jax_dsa.sparse_mla(q, kv, idx, implementation="xla"))
    with pytest.raises(NotImplementedError, match="implementation='cute' cannot run here"):
        jax_dsa.sparse_mla(q, kv, idx, implementation="cute")


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(dtype=jnp.float32, d=512), "bfloat16/float16"),
    (dict(d=256), "Dqk in"),
    (dict(h=129, d=512), "H in 1..128"),
])
def test_kernel_shape_limits_are_explained(kwargs, fragment):
    q, kv, _ = _args(**kwargs)
    assert fragment in api.kernel_shape_problem(q, kv, 512 if q.shape[-1] >= 512 else 256)
    assert api.kernel_shape_problem(*_args(d=576)[:2], 512) is None
    assert "d_v=512" in api.kernel_shape_problem(*_args(d=576)[:2], 256)


def test_deterministic_flag_keeps_the_reference_gradients():
    """On the reference (CPU here) deterministic=True changes nothing: same values, bit for bit."""
    q, kv, idx = _args(h=3, d=64)

    def grads(det):
        def loss(q, kv):
            o = jax_dsa.sparse_mla(q, kv, idx, d_v=32, deterministic=det)
            return jnp.sum(o.astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_flax_module_passes_deterministic_backward_through():
    """SparseMLA(deterministic_backward=True) is sparse_mla(..., deterministic=True), and NNX's
    eval() / train() (which set attributes named `deterministic`) leave it alone."""
    from flax import nnx
    from jax_dsa.flax import SparseMLA

    q, kv, idx = _args(h=3, d=64)
    layer = SparseMLA(3, d_v=32, deterministic_backward=True, sink_init=0.5)
    layer.eval()
    layer.train()
    assert layer.deterministic_backward is True

    def loss(layer, q):
        return jnp.sum(layer(q, kv, idx).astype(jnp.float32) ** 2)

    grads = nnx.grad(loss, argnums=(0, 1))(layer, q)
    want = jax.grad(lambda s, q: jnp.sum(jax_dsa.sparse_mla(
        q, kv, idx, sink=s, d_v=32, deterministic=True).astype(jnp.float32) ** 2),
        argnums=(0, 1))(jnp.full((3,), 0.5, jnp.float32), q)
    np.testing.assert_array_equal(np.asarray(grads[0].sink[...]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(grads[1], np.float32), np.asarray(want[1], np.float32))
