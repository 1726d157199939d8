"""What a new user trips over: NaN inputs, index dtypes, silent fallbacks, eager calls, the
argument rules, d_v's default, float64, the Flax module and the benchmark (CPU; the kernel side
of the NaN sink is in tests/test_gpu_forward.py and test_gpu_backward.py)."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_dsa
from jax_dsa import api, reference
from cases import make_problem, rel_err
import oracle

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _problem(seed=0, b=1, t=6, h=3, d=32, s=20, k=5):
    p = make_problem(np.random.default_rng(seed), b, t, h, d, s, k, sink=True, topk="partial")
    return p, jnp.asarray(p.q), jnp.asarray(p.kv), jnp.asarray(p.idx)


def test_nan_sink_reaches_its_heads_outputs_and_gradient():
    p, q, kv, idx = _problem()
    sink = jnp.asarray(p.sink).at[1].set(jnp.nan)
    tl = jnp.asarray(p.topk_length)
    o = np.asarray(jax_dsa.sparse_mla(q, kv, idx, sink=sink, topk_length=tl, d_v=16))
    assert np.all(np.isnan(o[:, :, 1])), "NaN sink must give NaN o for its head"
    assert not np.any(np.isnan(o[:, :, [0, 2]])), "other heads untouched"
    o_ref, _ = oracle.numpy_forward(p.q, p.kv, p.idx, p.lengths, np.asarray(p.sink), p.scale, 16)
    assert rel_err(o[:, :, [0, 2]], o_ref[:, :, [0, 2]]) < 1e-5
    dsink = jax.grad(lambda s: jnp.sum(jax_dsa.sparse_mla(q, kv, idx, sink=s, topk_length=tl,
                                                          d_v=16)))(sink)
    assert np.isnan(dsink[1]) and np.all(np.isfinite(np.asarray(dsink)[[0, 2]]))


def test_nan_in_q_reaches_o():
    p, q, kv, idx = _problem(1)
    o = np.asarray(jax_dsa.sparse_mla(q.at[0, 2, 0, 3].set(jnp.nan), kv, idx, d_v=16))
    assert np.all(np.isnan(o[0, 2, 0])) and not np.any(np.isnan(o[0, 2, 1:]))


def test_int64_indices_beyond_int32_raise_and_in_range_ones_convert():
    _, q, kv, idx = _problem(2)
    big = np.asarray(idx).astype(np.int64)
    big[0, 1, 2] = 2 ** 32 + 1  # would wrap to row 1
    with pytest.raises(ValueError, match="idx holds 4294967297"):
        jax_dsa.sparse_mla(q, kv, big, d_v=16)
    tl = np.full((1, q.shape[1]), -2 ** 40, np.int64)
    with pytest.raises(ValueError, match="topk_length"):
        jax_dsa.sparse_mla(q, kv, idx, topk_length=tl, d_v=16)
    ok = np.asarray(idx).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(jax_dsa.sparse_mla(q, kv, ok, d_v=16)),
                                  np.asarray(jax_dsa.sparse_mla(q, kv, idx, d_v=16)))


def test_empty_extents_are_refused_or_give_empty_results():
    _, q, kv, idx = _problem(3)
    with pytest.raises(ValueError, match="Dqk=0"):
        jax_dsa.sparse_mla(q[..., :0], kv[..., :0], idx)
    w = jnp.ones((1, 0, 2))
    idx0, scores0 = jax_dsa.indexer_topk(jnp.ones((1, 0, 2, 4)), jnp.ones((1, 8, 4)), w, 3,
                                         return_scores=True)
    assert idx0.shape == scores0.shape == (1, 0, 3) and idx0.dtype == jnp.int32


def test_implementation_sequence_and_explain():
    _, q, kv, idx = _problem(3)
    want = jax_dsa.sparse_mla(q, kv, idx, d_v=16, implementation="xla")
    got = jax_dsa.sparse_mla(q, kv, idx, d_v=16, implementation=("cute", "xla"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    plan = jax_dsa.explain(q, kv, idx, d_v=16, implementation=("cute", "xla"))
    assert plan.implementation == "xla" and "kernel" in plan.reason
    assert str(plan).startswith("xla: the reference")
    with pytest.raises(NotImplementedError, match="implementation='cute' cannot run here"):
        jax_dsa.sparse_mla(q, kv, idx, d_v=16, implementation=("cute",))
    for bad in ((), ("cute", "triton"), "pallas", 3):
        with pytest.raises(ValueError, match="implementation"):
            jax_dsa.sparse_mla(q, kv, idx, d_v=16, implementation=bad)


def test_explain_names_the_kernels_it_would_pick(monkeypatch):
    """On a Hopper machine explain() shows the kernels select() picks; here the runtime check is
    replaced so that the choice shows without a GPU."""
    monkeypatch.setattr(api, "kernel_runtime_problem", lambda: None)
    q = jnp.zeros((1, 8, 16, 576), jnp.bfloat16)
    kv = jnp.zeros((1, 64, 576), jnp.bfloat16)
    idx = jnp.zeros((1, 8, 40), jnp.int32)
    plan = jax_dsa.explain(q, kv, idx)
    assert plan.implementation == "auto"
    assert plan.config == jax_dsa.cute.select(q.shape, 40, 64)
    assert "small_heads" in str(plan) and "grouped by 4" in str(plan)
    plan = jax_dsa.explain(q, kv, idx, deterministic=True)
    assert plan.config.bwd.group == 1


def test_fallback_on_a_hopper_gpu_logs_once_per_shape(monkeypatch, caplog):
    """implementation=None with an unsupported shape on a machine whose kernels could run logs a
    warning (once per shape) instead of silently running the reference."""
    monkeypatch.setattr(api, "kernel_runtime_problem", lambda: None)
    api._warn_fallback.cache_clear()
    q = jnp.zeros((1, 4, 2, 64), jnp.bfloat16)  # Dqk 64: no kernel
    kv = jnp.zeros((1, 8, 64), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 3), jnp.int32)
    with caplog.at_level(logging.WARNING, logger="jax_dsa"):
        for _ in range(3):
            jax_dsa.explain(q, kv, idx)
    msgs = [r.getMessage() for r in caplog.records if r.name == "jax_dsa"]
    assert len(msgs) == 1 and "runs the pure-JAX reference" in msgs[0] and "Dqk" in msgs[0]


def test_eager_calls_compile_once(monkeypatch):
    """Eager calls go through one cached compiled program per shape: the reference is traced
    once for two calls with the same shapes (op-by-op execution would trace it each time)."""
    calls = []
    forward = reference.forward
    monkeypatch.setattr(reference, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    p, q, kv, idx = _problem(4, t=5)
    for _ in range(2):
        jax_dsa.sparse_mla(q, kv, idx, d_v=16, scale=0.37)
    assert len(calls) == 1


@pytest.mark.parametrize("kwargs,error", [
    (dict(scale="0.5"), TypeError), (dict(scale=True), TypeError),
    (dict(scale=float("nan")), ValueError), (dict(scale=float("inf")), ValueError),
    (dict(return_lse="yes"), TypeError), (dict(return_lse=1), TypeError),
    (dict(deterministic=1), TypeError), (dict(d_v=16.0), TypeError), (dict(d_v=33), ValueError),
])
def test_one_rule_for_scalar_arguments(kwargs, error):
    _, q, kv, idx = _problem(5)
    with pytest.raises(error, match=next(iter(kwargs))):
        jax_dsa.sparse_mla(q, kv, idx, **kwargs)


@pytest.mark.parametrize("scale", [-1, 0, np.float32(0.25), 2])
def test_any_finite_real_scale_is_taken(scale):
    p, q, kv, idx = _problem(6)
    o = jax_dsa.sparse_mla(q, kv, idx, scale=scale, d_v=16, topk_length=jnp.asarray(
        p.topk_length), sink=jnp.asarray(p.sink))
    o_ref, _ = oracle.numpy_forward(p.q, p.kv, p.idx, p.lengths, np.asarray(p.sink),
                                    float(scale), 16)
    assert rel_err(o, o_ref) < 1e-5


def test_d_v_defaults_to_min_512_dqk():
    _, q, kv, idx = _problem(7)  # Dqk 32
    assert jax_dsa.sparse_mla(q, kv, idx).shape == q.shape
    q2 = jnp.zeros((1, 2, 1, 576), jnp.float32)
    kv2 = jnp.zeros((1, 3, 576), jnp.float32)
    assert jax_dsa.sparse_mla(q2, kv2, jnp.zeros((1, 2, 1), jnp.int32)).shape[-1] == 512


def test_float64_runs_in_float64_and_check_grads_passes():
    from jax.test_util import check_grads
    with jax.enable_x64(True):
        p, _, _, _ = _problem(8, t=4, h=2, d=16, s=9, k=4)
        q, kv = jnp.asarray(p.q, jnp.float64), jnp.asarray(p.kv, jnp.float64)
        idx, sink = jnp.asarray(p.idx), jnp.asarray(p.sink, jnp.float64)
        tl = jnp.asarray(p.topk_length)
        f = lambda q, kv, s: jax_dsa.sparse_mla(q, kv, idx, sink=s, topk_length=tl, d_v=8,
                                                return_lse=True)
        o, lse = f(q, kv, sink)
        assert o.dtype == jnp.float64 and lse.dtype == jnp.float64
        o_ref, lse_ref = oracle.numpy_forward(p.q, p.kv, p.idx, p.lengths, p.sink, p.scale, 8)
        assert rel_err(o, o_ref) < 1e-12
        check_grads(lambda q, kv, s: f(q, kv, s)[0], (q, kv, sink), order=1, modes=["rev"])
        # the indexer's selection stays int32 (sparse_mla's idx) with x64 on
        sel = jax_dsa.indexer_topk(q, kv, jnp.ones(q.shape[:3]), 3)
        assert sel.dtype == jnp.int32
        assert jax_dsa.sparse_mla(q, kv, sel, d_v=8).dtype == jnp.float64


def test_flax_module_follows_nnx_conventions():
    from flax import nnx
    assert jax_dsa.flax.SparseMLA is not None  # import jax_dsa; jax_dsa.flax works
    with nnx.use_eager_sharding(False):
        layer = jax_dsa.flax.SparseMLA(3, sink_init=nnx.initializers.normal(1.0),
                                       sink_sharding=("heads",), rngs=nnx.Rngs(0),
                                       dtype=jnp.bfloat16, d_v=16)
    assert layer.sink[...].dtype == jnp.float32 and np.any(np.asarray(layer.sink[...]) != 0)
    spec = nnx.get_partition_spec(nnx.state(layer))
    sink_spec = spec["sink"]
    sink_spec = sink_spec.get_value() if hasattr(sink_spec, "get_value") else sink_spec.value
    assert tuple(sink_spec) == ("heads",)
    _, q, kv, idx = _problem(9)
    o = layer(q, kv, idx)
    assert o.dtype == jnp.bfloat16
    want = jax_dsa.sparse_mla(q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), idx,
                              sink=layer.sink[...], d_v=16)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="num_heads=3"):
        layer(q[:, :, :2], kv, idx)
    with pytest.raises(ValueError, match="needs rngs"):
        jax_dsa.flax.SparseMLA(3, sink_init=nnx.initializers.zeros_init())


def _benchmark(*args):
    # On a GPU this process already holds XLA's preallocated share: the child allocates as it goes.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "benchmark.py"), *args],
                          capture_output=True, text=True, timeout=600, env=env)


def test_benchmark_refuses_kernels_it_cannot_run():
    if api.kernel_runtime_problem() is None:
        pytest.skip("the kernels can run here")
    r = _benchmark("--small", "--impls", "cute", "--passes", "fwd")
    assert r.returncode != 0 and "cannot run here" in r.stderr


def test_benchmark_small_mode_reports_the_real_k(tmp_path):
    r = _benchmark("--small", "--impls", "xla", "--passes", "fwd", "--heads", "16",
                   "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "[1/1] TP shard H=16 fwd xla" in r.stdout
    table = (tmp_path / "benchmark.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| TP shard H=16"))
    k = int(row.split("|")[3])
    # T = 256 < top-k 512: 256 distinct rows plus the window (-1 before the start).
    assert k == round((256 * 256 + sum(min(t + 1, 128) for t in range(256))) / 256)


def test_dsattention_styles_and_their_errors():
    from flax import nnx
    from jax_dsa.flax import DSAttention
    with pytest.raises(ValueError, match="style must be"):
        DSAttention(8, 2, 8, 8, topk=2, style="v5", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="topk=None"):
        DSAttention(8, 2, 8, 8, topk=None, rngs=nnx.Rngs(0))
    dense_c = DSAttention(8, 2, 8, 8, topk=None, style="v4", window=2, ratio=4, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 12, 8))
    y, aux = dense_c(x)  # every visible compressed row; no indexer, no indexer loss
    assert y.shape == (1, 12, 8) and aux["idx"].shape == (1, 12, 3)
    assert float(aux["indexer_loss"]) == 0.0 and dense_c.indexer is None
    with pytest.raises(ValueError, match="needs T >= ratio"):
        dense_c(jnp.ones((1, 3, 8)))
    with pytest.raises(ValueError, match="stage must be"):
        dense_c(x, stage="warm")
    for bad in (jnp.ones((12, 8)), jnp.ones((1, 12, 6))):
        with pytest.raises(ValueError, match=r"x must be \[B, T, d_model = 8\]"):
            dense_c(bad)


def test_flax_sink_sharding_on_a_mesh_and_int_arguments():
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert jax_dsa.flax.SparseMLA(np.int64(3)).num_heads == 3
    for bad, error in ((3.0, TypeError), (True, TypeError), (0, ValueError)):
        with pytest.raises(error, match="num_heads"):
            jax_dsa.flax.SparseMLA(bad)
    mesh = Mesh(np.array(jax.devices()[:2]), ("heads",))
    with jax.set_mesh(mesh):
        layer = jax_dsa.flax.SparseMLA(4, sink_init=1.5, sink_sharding=("heads",))
    if hasattr(nnx, "use_eager_sharding"):  # flax >= 0.12 places the sink on the mesh
        assert layer.sink[...].sharding == NamedSharding(mesh, P("heads"))
        with pytest.raises(ValueError, match=r"sink_sharding=\('heads',\).*set_mesh"):
            jax_dsa.flax.SparseMLA(4, sink_sharding=("heads",))
    np.testing.assert_array_equal(np.asarray(layer.sink[...]), np.full(4, 1.5, np.float32))


def test_indexer_fallback_on_a_hopper_gpu_logs_once_per_shape(monkeypatch, caplog):
    """indexer_topk with implementation=None and inputs the kernels do not take (float32 here)
    on a machine whose kernels could run logs once per shape, then runs the reference."""
    from jax_dsa import indexer
    monkeypatch.setattr(api, "kernel_runtime_problem", lambda: None)
    indexer._warn_fallback.cache_clear()
    q = jnp.zeros((1, 4, 2, 128), jnp.float32)
    k = jnp.zeros((1, 8, 128), jnp.float32)
    w = jnp.zeros((1, 4, 2), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="jax_dsa"):
        for _ in range(3):
            jax_dsa.indexer_topk(q, k, w, 2)
    msgs = [r.getMessage() for r in caplog.records if r.name == "jax_dsa"]
    assert len(msgs) == 1 and "indexer" in msgs[0] and "float32" in msgs[0], msgs


def test_every_op_refuses_none_inside_an_implementation_sequence():
    q, k, w = jnp.ones((1, 4, 2, 8)), jnp.ones((1, 8, 8)), jnp.ones((1, 4, 2))
    idx = jnp.zeros((1, 4, 3), jnp.int32)
    for call in (lambda impl: jax_dsa.sparse_mla(q, k, idx, implementation=impl),
                 lambda impl: jax_dsa.indexer_topk(q, k, w, 2, implementation=impl),
                 lambda impl: jax_dsa.attention_target(q, k, idx, implementation=impl)):
        with pytest.raises(ValueError, match="implementation"):
            call((None,))


def test_rows_no_valid_entry_uses_may_hold_nan_or_inf():
    """An invalid entry is never read: NaN / inf in rows that only invalid entries (or none)
    name leave o, lse and every gradient as with those rows zero (the kernels zero-fill them)."""
    rng = np.random.default_rng(11)
    p = make_problem(rng, 2, 6, 3, 32, 20, 6, sink=True, topk="partial")
    idx = np.where(np.isin(p.idx, (0, 7)), 1, p.idx)  # rows 0 and 7: no entry names them
    idx[0, 1, :2] = (0, -7)  # ...except slots past topk_length / out of range
    tl = p.topk_length.copy()
    tl[0, 1] = 0
    kv_bad = p.kv.copy()
    kv_bad[:, 0], kv_bad[:, 7] = np.nan, np.inf
    extra = rng.standard_normal((2, 5, 32)).astype(np.float32)
    extra_bad = extra.copy()
    extra_bad[:, 2] = np.nan
    extra_idx = rng.integers(0, 5, size=(2, 6, 3)).astype(np.int32)
    extra_idx = np.where(extra_idx == 2, -1, extra_idx)
    sink, w = jnp.asarray(p.sink), jnp.asarray(rng.standard_normal((2, 6, 3, 16)), jnp.float32)

    def run(kv, ex):
        def f(q, kv, sink, ex):
            pools = {} if ex is None else dict(extra_kv=ex, extra_idx=jnp.asarray(extra_idx))
            o, lse = jax_dsa.sparse_mla(q, kv, jnp.asarray(idx), sink=sink,
                                        topk_length=jnp.asarray(tl), d_v=16, return_lse=True,
                                        **pools)
            return jnp.sum(o * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (o, lse)
        args = (jnp.asarray(p.q), jnp.asarray(kv), sink, None if ex is None else jnp.asarray(ex))
        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return [np.asarray(x) for x in (*out, *grads) if x is not None]

    for ex, ex_bad in ((None, None), (extra, extra_bad)):
        clean, bad = run(p.kv, ex), run(kv_bad, ex_bad)
        for name, c, b in zip(("o", "lse", "dq", "dkv", "dsink", "dextra_kv"), clean, bad):
            _assert_same_sums(b, c, f"{name} (two pools: {ex is not None})")
        if ex is None:  # and o, lse as the float64 oracle's, which never reads rows 0 / 7
            o_ref, lse_ref = oracle.numpy_forward(p.q, kv_bad, idx, tl, p.sink, p.scale, 16)
            assert rel_err(bad[0], o_ref) < 1e-5
            np.testing.assert_allclose(bad[1], lse_ref, rtol=1e-5, atol=1e-5)  # -inf: dead rows

    # The indexer loss: a NaN key row that no valid entry selects.
    qi = jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32)
    wi = jnp.asarray(rng.standard_normal((2, 6, 2)), jnp.float32)
    k = rng.standard_normal((2, 20, 8)).astype(np.float32)
    target = rng.random(idx.shape).astype(np.float32)

    def kl_grads(k):
        def loss(*args):
            return jnp.sum(jax_dsa.indexer_loss(*args, jnp.asarray(idx), jnp.asarray(target),
                                                topk_length=jnp.asarray(tl), reduction="none"))
        return jax.grad(loss, argnums=(0, 1, 2))(qi, jnp.asarray(k), wi)

    k_bad = k.copy()
    k_bad[:, 0] = np.nan
    for name, c, b in zip(("dq", "dk", "dweights"), kl_grads(k), kl_grads(k_bad)):
        _assert_same_sums(b, c, f"indexer_loss {name}")


def _assert_same_sums(got, want, name):
    """got equals want: the same bits on CPU; on a GPU up to the order of a sum, since XLA's
    scatter-add there (dkv, dsink, dk) adds in any order, which moves the last bit."""
    got, want = np.asarray(got), np.asarray(want)
    assert not np.isnan(got).any(), f"{name}: NaN"
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


def test_8bit_floats_are_refused_by_name():
    """fp8 inputs get a TypeError naming the argument (not a deep promotion error)."""
    f8 = jnp.float8_e4m3fn
    _, q, kv, idx = _problem(3)
    qi, k = jnp.ones((1, 6, 2, 16), f8), jnp.ones((1, 20, 16), f8)
    w, target = jnp.ones((1, 6, 2), jnp.float32), jnp.ones(idx.shape, jnp.float32)
    calls = {
        "q": [lambda: jax_dsa.sparse_mla(q.astype(f8), kv.astype(f8), idx),
              lambda: jax_dsa.indexer_topk(qi, k, w, 2),
              lambda: jax_dsa.indexer_scores(qi, k, w),
              lambda: jax_dsa.attention_target(q.astype(f8), kv.astype(f8), idx),
              lambda: jax_dsa.indexer_loss(qi, k, w, idx, target)],
        "sink": [lambda: jax_dsa.sparse_mla(q, kv, idx, sink=jnp.zeros(3, f8))],
        "weights": [lambda: jax_dsa.indexer_scores(qi.astype(jnp.float32),
                                                   k.astype(jnp.float32), w.astype(f8))],
        "lse": [lambda: jax_dsa.attention_target(q, kv, idx, lse=jnp.zeros(q.shape[:3], f8))],
        "target": [lambda: jax_dsa.indexer_loss(qi.astype(jnp.float32), k.astype(jnp.float32),
                                                w, idx, target.astype(f8))],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(TypeError, match=f"^{name} must be a floating dtype.*dequantise"):
                fn()
