"""Train a tiny DeepSeek Sparse Attention layer end to end: the indexer warm-up, then sparse.

jax_dsa.flax.DSAttention on a synthetic task where attention over time is needed
(y = tanh(cumsum(x) / sqrt(T)) @ teacher). Stage 1 ("dense", the warm-up) attends to every
causal position and trains the indexer against that attention's distribution; stage 2
("sparse") attends to the indexer's top-k and trains it on the selected entries. Printed every
10 steps and at the last: the task loss and the indexer's KL (both before that step's update),
and its recall after the update: the fraction of the dense attention's top-k positions (by the
head-summed probability) that the indexer's top-k contains.

    python examples/train_dsa.py [--steps 300] [--warmup 100] [--style v3.2|v4] [--mesh 2x2]
                                 [--plot out.png]

--style v4 trains DeepSeek-V4's layout instead: a sliding window over the raw KV plus the
indexer's top-k of the compressed rows (ratio 4) as a second KV pool.

--mesh DxH trains on a (data x heads) mesh of D * H devices (on a CPU machine: fake devices,
XLA_FLAGS=--xla_force_host_platform_device_count=4): the batch split over "data", the attention
heads (q and output projections, the sink) over "heads", the indexer and the shared KV
projection replicated; the same jitted step, partitioned by XLA and jax_dsa's sharding rules.

--size kernel trains a layer of the kernels' shapes (bf16, latent dim 576 with d_v 512 for v3.2,
512 / 512 for v4, 16 heads, an indexer of 16 heads of dim 128, T = 256) so that on a Hopper GPU
the attention and the indexer's selection run on the kernels; --implementation picks them
("cute") or the reference ("xla"), and --compare trains three times from the same initialisation:
on the kernels, on the reference, and on the reference with every initial parameter multiplied by
(1 + 2**-9 r), r a fixed-seed random sign (a quarter to half a bf16 ulp: a rounding's size). It
prints how far apart the kernels' and the reference's losses are, and beside it the same gap
between the reference and the perturbed reference: the bf16 noise baseline that a rounding
difference alone gives. --compare --implementation xla runs the first run on the reference too
(the kernels need a Hopper GPU; a check of the script elsewhere).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dsa.flax import DSAttention


def make_data(key, batch, tokens, d_model):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (batch, tokens, d_model), jnp.float32)
    teacher = jax.random.normal(kw, (d_model, d_model)) / np.sqrt(d_model)
    y = jnp.tanh(jnp.cumsum(x, axis=1) / np.sqrt(tokens)) @ teacher
    return x, y


def recall(model, x, topk):
    """Mean fraction of the dense attention's top-k candidates (by the head-summed probability)
    that the indexer's top-k contains; a token with fewer candidates counts the ones it has."""
    _, dense = model(x, stage="dense")
    _, sparse = model(x, stage="sparse")
    candidates = dense["idx"]  # [B, T, C]: positions (v3.2) or compressed rows (v4), -1 absent
    want = jnp.take_along_axis(candidates, jax.lax.top_k(dense["target"], topk)[1], axis=-1)
    n_valid = jnp.minimum(jnp.sum(candidates >= 0, axis=-1), topk)
    valid_want = jnp.arange(topk)[None, None, :] < n_valid[..., None]
    hit = jnp.any(want[..., :, None] == sparse["idx"][..., None, :], axis=-1) & valid_want
    return jnp.sum(hit) / jnp.sum(valid_want)


def param_spec(path, _):
    """Head-parallel layout of DSAttention's parameters (the indexer's stay replicated)."""
    names = [getattr(k, "key", str(k)) for k in path]
    if names[0] == "wq":
        return P(None, "heads", None)
    if names[0] == "wo":
        return P("heads", None, None)
    if names[0] == "attn":  # the sink
        return P("heads")
    return P()


def make_mesh(spec: str):
    """A (data, heads) mesh from "DxH" over the first D * H devices."""
    d, h = (int(n) for n in spec.lower().split("x"))
    devices = jax.devices()
    if d * h > len(devices):
        raise SystemExit(f"--mesh {spec} needs {d * h} devices; JAX sees {len(devices)}")
    return Mesh(np.array(devices[:d * h]).reshape(d, h), ("data", "heads"))


# Layer shapes: "tiny" for CPU runs, "kernel" for the Hopper kernels (bf16; Dqk 576 / d_v 512 for
# v3.2, 512 / 512 for v4; the indexer's Di = 128).
SIZES = {
    "tiny": dict(batch=8, tokens=32, d_model=32, num_heads=4, head_dim={"v3.2": 16, "v4": 16},
                 d_v=16, index_heads=4, index_dim=16, dtype=None, lr=1e-2, window=4,
                 topk={"v3.2": 8, "v4": 3}),
    "kernel": dict(batch=2, tokens=256, d_model=64, num_heads=16,
                   head_dim={"v3.2": 576, "v4": 512}, d_v=512,
                   index_heads=16, index_dim=128, dtype=jnp.bfloat16, lr=3e-3, window=32,
                   topk={"v3.2": 32, "v4": 16}),
}


def train(*, steps=300, warmup=100, size="tiny", topk=None, seed=0, mesh=None, style="v3.2",
          implementation=None, perturb=None, verbose=True):
    """Returns a list of per-step dicts (stage, loss, indexer_loss, recall every 10 steps).
    size: a key of SIZES. mesh: None, or a (data, heads) jax.sharding.Mesh to train on (see
    make_mesh). style "v3.2" selects topk of the positions; "v4" a sliding window plus topk of
    the T / 4 compressed rows. implementation: as jax_dsa.sparse_mla's (the attention and the
    indexer's selection). perturb: None, or a seed: every initial parameter is multiplied by
    (1 + 2**-9 r), r random signs drawn from it (a rounding-sized change, for a noise baseline)."""
    cfg = SIZES[size]
    if topk is None:
        topk = cfg["topk"][style]
    extra = dict(style="v4", window=cfg["window"], ratio=4) if style == "v4" else {}
    batch, tokens, d_model, lr = cfg["batch"], cfg["tokens"], cfg["d_model"], cfg["lr"]
    model = DSAttention(d_model, cfg["num_heads"], cfg["head_dim"][style], cfg["d_v"], topk=topk,
                        index_heads=cfg["index_heads"], index_dim=cfg["index_dim"],
                        dtype=cfg["dtype"], implementation=implementation,
                        rngs=nnx.Rngs(seed), **extra)
    x, y = make_data(jax.random.key(seed + 1), batch, tokens, d_model)
    graphdef, state = nnx.split(model)
    if perturb is not None:
        leaves, treedef = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(perturb), len(leaves))
        state = jax.tree.unflatten(treedef, [
            v * (1 + 2**-9 * jax.random.rademacher(k, v.shape, v.dtype))
            for v, k in zip(leaves, keys)])
    if mesh is not None:
        specs = jax.tree_util.tree_map_with_path(param_spec, state)
        state = jax.tree.map(lambda v, sp: jax.device_put(v, NamedSharding(mesh, sp)), state,
                             specs)
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    opt = optax.adam(lr)
    opt_state = opt.init(state)

    def loss_fn(state, stage):
        y_hat, aux = nnx.merge(graphdef, state)(x, stage=stage)
        task = jnp.mean((y_hat.astype(jnp.float32) - y) ** 2)
        return task + aux["indexer_loss"], (task, aux["indexer_loss"])

    def make_step(stage):
        @jax.jit
        def step(state, opt_state):
            (_, (task, kl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, stage)
            updates, opt_state = opt.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state, task, kl
        return step

    steps_by_stage = {"dense": make_step("dense"), "sparse": make_step("sparse")}
    history = []
    for i in range(steps):
        stage = "dense" if i < warmup else "sparse"
        state, opt_state, task, kl = steps_by_stage[stage](state, opt_state)
        row = dict(step=i, stage=stage, loss=float(task), indexer_loss=float(kl))
        if i % 10 == 0 or i == steps - 1:
            row["recall"] = float(recall(nnx.merge(graphdef, state), x, topk))
            if verbose:
                print(f"step {i:4d} [{stage}] loss {row['loss']:.4f} indexer KL "
                      f"{row['indexer_loss']:.4f} recall@{topk} {row['recall']:.3f}", flush=True)
        history.append(row)
    return history


def gap_line(label, a, b):
    """The largest gap between two runs' task loss and indexer KL, relative to b's value at that
    step and to b's step-0 value (a converged loss near 0 makes any rounding difference a large
    relative gap), and both runs' final recall, as one line."""
    names = ("loss", "indexer_loss")
    gap = {n: max(abs(r[n] - s[n]) / max(abs(s[n]), 1e-6) for r, s in zip(a, b)) for n in names}
    gap0 = {n: max(abs(r[n] - s[n]) for r, s in zip(a, b)) / max(abs(b[0][n]), 1e-6)
            for n in names}
    return (f"{label}: largest relative gap: task loss {gap['loss']:.2%}, indexer KL "
            f"{gap['indexer_loss']:.2%}; of the step-0 value: {gap0['loss']:.2%}, "
            f"{gap0['indexer_loss']:.2%}; final recall {a[-1]['recall']:.3f} / "
            f"{b[-1]['recall']:.3f}")


def compare(run, implementation="cute"):
    """Train on the kernels (or `implementation`), on the reference, and on the reference from a
    perturbed start (train's perturb), from the same initialisation and data; print the three
    runs' task loss and indexer KL every 10 steps, then the largest gaps kernels vs reference and
    reference vs perturbed reference (the noise baseline)."""
    print(f"== kernels (implementation={implementation!r})", flush=True)
    kern = train(**run, implementation=implementation)
    print("== reference (implementation='xla')", flush=True)
    ref = train(**run, implementation="xla")
    print("== perturbed reference (implementation='xla', parameters x (1 + 2**-9 r))", flush=True)
    noisy = train(**run, implementation="xla", perturb=0)
    print("step   loss: kernels / reference / perturbed   indexer KL: kernels / reference / "
          "perturbed")
    for a, b, c in zip(kern, ref, noisy):
        if a["step"] % 10 == 0 or a["step"] == len(ref) - 1:
            print(f"{a['step']:4d}   {a['loss']:.5f} / {b['loss']:.5f} / {c['loss']:.5f}   "
                  f"{a['indexer_loss']:.5f} / {b['indexer_loss']:.5f} / {c['indexer_loss']:.5f}")
    print(gap_line("kernels vs reference", kern, ref))
    print(gap_line("reference vs perturbed reference (noise baseline)", ref, noisy))
    return kern, ref, noisy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--mesh", help="train on a (data x heads) mesh, e.g. 2x2")
    parser.add_argument("--style", default="v3.2", choices=("v3.2", "v4"))
    parser.add_argument("--size", default="tiny", choices=tuple(SIZES))
    parser.add_argument("--implementation", choices=("cute", "xla"),
                        help="the kernels or the reference (default: the kernels where they run)")
    parser.add_argument("--compare", action="store_true",
                        help="train on the kernels, on the reference and on the reference "
                        "from a perturbed start; print the loss gaps")
    parser.add_argument("--plot", help="write a PNG of the loss, the KL and the recall")
    args = parser.parse_args(argv)
    mesh = make_mesh(args.mesh) if args.mesh else None
    run = dict(steps=args.steps, warmup=args.warmup, mesh=mesh, style=args.style, size=args.size)
    if args.compare:
        return compare(run, args.implementation or "cute")
    history = train(**run, implementation=args.implementation)
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 3, figsize=(12, 3.5))
        steps = [r["step"] for r in history]
        ax[0].plot(steps, [r["loss"] for r in history]), ax[0].set_title("task loss")
        ax[1].plot(steps, [r["indexer_loss"] for r in history]), ax[1].set_title("indexer KL")
        rec = [(r["step"], r["recall"]) for r in history if "recall" in r]
        ax[2].plot(*zip(*rec)), ax[2].set_title("indexer recall")
        for a in ax:
            a.axvline(args.warmup, color="gray", linestyle=":")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    return history


if __name__ == "__main__":
    main()
