"""The examples run and do what they claim (CPU; small settings)."""
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import benchmark_layer  # noqa: E402
import quickstart  # noqa: E402
import train_dsa  # noqa: E402
import train_flax  # noqa: E402


def test_quickstart_matches_reference():
    err_o, err_lse = quickstart.main(["--tokens", "64", "--heads", "4", "--repeats", "2"])
    assert err_o < 5e-2 and err_lse < 1e-3


def test_training_loss_goes_down_and_jit_equals_shard_map():
    jit_losses = train_flax.train("jit", steps=5, verbose=False)
    sm_losses = train_flax.train("shard_map", steps=5, verbose=False)
    assert jit_losses[-1] < 0.7 * jit_losses[0]
    np.testing.assert_allclose(jit_losses, sm_losses, rtol=1e-4)


def test_dsa_layer_trains_and_the_indexer_learns_the_attention():
    """Warm-up then sparse training of jax_dsa.flax.DSAttention: the task loss and the
    indexer's KL go down and the indexer's recall of the attention's top positions goes up."""
    history = train_dsa.train(steps=60, warmup=30, verbose=False)
    recall = [r["recall"] for r in history if "recall" in r]
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["indexer_loss"] < 0.5 * history[0]["indexer_loss"]
    assert recall[-1] > recall[0] + 0.05 and 0.0 <= min(recall) and max(recall) <= 1.0


def test_dsa_layer_trains_the_same_on_a_data_by_heads_mesh():
    """examples/train_dsa.py --mesh 2x2 (4 fake CPU devices): the same losses as one device, the
    parameters kept head-sharded through the steps."""
    plain = train_dsa.train(steps=12, warmup=6, verbose=False)
    sharded = train_dsa.train(steps=12, warmup=6, verbose=False,
                              mesh=train_dsa.make_mesh("2x2"))
    np.testing.assert_allclose([r["loss"] for r in sharded], [r["loss"] for r in plain],
                               rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose([r["indexer_loss"] for r in sharded],
                               [r["indexer_loss"] for r in plain], rtol=2e-4, atol=1e-6)


def test_v4_style_layer_trains_with_a_window_and_compressed_rows():
    """DSAttention(style="v4"): a sliding window over the raw KV plus the indexer's top-k of the
    compressed rows as a second pool; the loss and the KL go down, the recall goes up."""
    history = train_dsa.train(steps=60, warmup=30, verbose=False, style="v4")
    recall = [r["recall"] for r in history if "recall" in r]
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["indexer_loss"] < 0.5 * history[0]["indexer_loss"]
    assert recall[-1] > recall[0] + 0.05 and max(recall) <= 1.0


def test_layer_benchmark_runs_small():
    (label, impl, times), = benchmark_layer.main(["--small", "--impls", "xla", "--batches", "1",
                                                  "--shapes", "V4-Flash"])
    assert (label, impl) == ("V4-Flash", "xla")
    assert set(times) == {"indexer", "attn fwd", "attn bwd", "target", "index bwd", "step"}
    assert all(v > 0 for v in times.values())


def test_kernel_sized_layer_selects_in_its_dtype_and_trains_on_the_reference(monkeypatch):
    """examples/train_dsa.py --size kernel (the Hopper kernels' shapes, bf16): the indexer's
    selection gets bf16 q / k (the indexer kernels' dtype) and the implementation asked for, and
    a few v4 steps on the reference give finite, changing losses."""
    import jax_dsa.flax as dsa_flax
    seen = []
    real = dsa_flax.indexer_topk

    def spy(q, k, w, topk, **kw):
        seen.append((q.dtype, k.dtype, kw["implementation"]))
        return real(q, k, w, topk, **kw)

    monkeypatch.setattr(dsa_flax, "indexer_topk", spy)
    history = train_dsa.train(steps=3, warmup=1, size="kernel", style="v4",
                              implementation="xla", verbose=False)
    assert seen and all(s == (jnp.bfloat16, jnp.bfloat16, "xla") for s in seen)
    losses = [r["loss"] for r in history]
    assert np.all(np.isfinite(losses)) and losses[-1] != losses[0]
    assert np.all(np.isfinite([r["indexer_loss"] for r in history]))


def test_compare_prints_the_gap_and_a_noise_baseline(capsys):
    """examples/train_dsa.py --compare (here with the first run on the reference too): the
    kernels-vs-reference gap and, last, the reference-vs-perturbed-reference gap (the bf16 noise
    baseline: the same start with every parameter nudged by 2**-9 relative)."""
    kern, ref, noisy = train_dsa.main(["--compare", "--implementation", "xla", "--steps", "4",
                                       "--warmup", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("kernels vs reference: largest relative gap: task loss 0.00%")
    assert lines[-1].startswith("reference vs perturbed reference (noise baseline): largest "
                                "relative gap: task loss ")
    assert [r["loss"] for r in kern] == [r["loss"] for r in ref]
    losses = np.array([[r["loss"] for r in h] for h in (ref, noisy)])
    assert np.all(losses[0] != losses[1])
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-2)
