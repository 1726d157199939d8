"""Public entry points: `sparse_mla` (argument checks, layouts, implementation choice) and
`explain` (what a call would run, and why)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import _core, reference
from jax_dsa.cute import constants
from jax_dsa.cute.config import Config

IMPLEMENTATIONS = (None, "xla", "cute")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
_log = logging.getLogger("jax_dsa")


def sparse_mla(q, kv, idx, *, scale=None, sink=None, topk_length=None, d_v=None,
               return_lse=False, implementation=None, deterministic=False, config=None,
               extra_kv=None, extra_idx=None, extra_topk_length=None):
    """DeepSeek sparse attention (sparse MLA): each query token attends to its own K rows of kv.

    Args:
      q: [B, T, H, Dqk] (or [T, H, Dqk] for one sequence), bfloat16 / float16 (float32 and
        float64 run on the reference only, which computes float64 in float64).
      kv: [B, S, Dqk] (or [S, Dqk]), the shared latent KV, same dtype as q. Keys are kv, values are
        kv[..., :d_v].
      idx: [B, T, K] (or [T, K]) int32: the rows of kv each token attends to. Entries < 0 or >= S are
        skipped (never read); duplicates count as many times as they appear.
      scale: softmax scale, a finite real number of either sign; default Dqk ** -0.5.
      sink: optional [H] learnable attention sink (logit), in the softmax denominator only. A NaN
        sink gives NaN outputs (and gradients) for its head, as any NaN input does.
      topk_length: optional [B, T] (or [T]) int32: only the first topk_length[b, t] slots of
        idx[b, t] are used; a length <= 0 uses none, a length > K all K (not Python's
        negative slicing).
      d_v: value width (the first d_v columns of kv), <= Dqk; default min(512, Dqk). The kernels
        take d_v = 512.
      return_lse: also return lse [B, T, H] float32 (float64 for float64 inputs), the
        natural-log log-sum-exp of scale * q.k over the valid entries (the sink excluded);
        -inf for a row with no valid entry.
      implementation: None (the Hopper kernels when the arrays are on an sm_90 GPU and the shape
        is supported, otherwise the pure-JAX reference; a GPU call that falls back logs a
        warning once per shape), "xla" (always the reference), "cute" (always the kernels;
        raises NotImplementedError with the reason where they cannot run), or a sequence of
        these names tried in order, e.g. ("cute", "xla"): the first that can run.
        `jax_dsa.explain` tells what a call runs and why.
      deterministic: make the gradients bitwise reproducible run to run. The default backward
        kernel adds dkv contributions with fp32 atomics, whose order varies; with True it stores
        them per entry and sums each kv row's contributions in a fixed order instead (slower:
        see docs/performance.md). Forward results are reproducible either way.
      config: optional jax_dsa.cute.Config pinning the Hopper kernels (for experts and tests);
        its None fields, and config=None, are chosen per device shard by jax_dsa.cute.select.
        Ignored by the reference.
      extra_kv, extra_idx, extra_topk_length: a second KV pool ([B, S2, Dqk], q's dtype) with
        its own lists ([B, T, K2] int32, optional lengths [B, T]), e.g. DeepSeek-V4's sliding
        window over the raw KV next to the top-k over the compressed KV. Each token attends to
        the entries of both lists under one softmax (and the sink); gradients reach both. It
        runs as one attention over both pools (on the kernels the forward and the plain
        backward read each pool in place; the deterministic and grouped backward and the
        reference work on the pools concatenated inside the op), or, where copying the pools
        would move more bytes than combining (decode: few tokens against long pools), as one
        call per pool combined by their lse (jax_dsa.reference.combine_partials).

    Returns:
      o [B, T, H, d_v] in q's dtype (zeros on a row with no valid entry), and lse if return_lse.
    """
    if extra_kv is not None or extra_idx is not None or extra_topk_length is not None:
        return _two_pools(q, kv, idx, scale, sink, topk_length, d_v, return_lse, implementation,
                          deterministic, config, extra_kv, extra_idx, extra_topk_length)
    call = _prepare(q, kv, idx, scale, sink, topk_length, d_v, return_lse, implementation,
                    deterministic, config)
    q, kv, idx, topk_length, sink = _same_variance(call.q, call.kv, call.idx, call.topk_length,
                                                   call.sink)
    args = (q, kv, idx, topk_length, sink)
    static = (call.scale, call.d_v, call.impl, config, call.deterministic)
    if any(isinstance(x, jax.core.Tracer) for x in args):
        o, lse = _core.attention(*args, *static)
    else:  # eager: one compiled program per shape and static arguments (jit's cache)
        o, lse = _eager_attention(*args, *static)
    if call.unbatched:
        o, lse = o[0], lse[0]
    return (o, lse) if return_lse else o


_eager_attention = jax.jit(_core.attention, static_argnums=(5, 6, 7, 8, 9))


def _two_pools(q, kv, idx, scale, sink, topk_length, d_v, return_lse, implementation,
               deterministic, config, extra_kv, extra_idx, extra_topk_length):
    """sparse_mla over two pools: one attention over their concatenation, or each pool's
    attention without the sink combined by lse, whichever moves fewer bytes
    (_concatenate_pools)."""
    if extra_kv is None or extra_idx is None:
        raise ValueError("extra_kv and extra_idx go together (extra_topk_length is optional); "
                         f"got extra_kv={'None' if extra_kv is None else 'an array'}, "
                         f"extra_idx={'None' if extra_idx is None else 'an array'}")
    main = _prepare(q, kv, idx, scale, sink, topk_length, d_v, return_lse, implementation,
                    deterministic, config)
    extra = _prepare(q, extra_kv, extra_idx, scale, None, extra_topk_length, d_v, return_lse,
                     implementation, deterministic, config,
                     names=("extra_kv", "extra_idx", "extra_topk_length"))
    args = _same_variance(main.q, main.kv, main.idx, main.topk_length, extra.kv, extra.idx,
                          extra.topk_length, main.sink)
    static = (main.scale, main.d_v, main.impl, extra.impl, config, main.deterministic)
    if any(isinstance(x, jax.core.Tracer) for x in args):
        o, lse = _two_pool_attention(*args, *static)
    else:
        o, lse = _eager_two_pool_attention(*args, *static)
    if main.unbatched:
        o, lse = o[0], lse[0]
    return (o, lse) if return_lse else o


def _concatenate_pools(q_shape, s1: int, s2: int, d_qk: int, d_v: int) -> bool:
    """Whether two pools run as one attention over their concatenation (one kernel call, one
    softmax with the sink) rather than one attention per pool combined by lse: the cheaper in
    memory traffic where the one softmax concatenates (the kernels read both pools in place
    only in the unsplit pingpong forward and the plain backward). Concatenating reads and
    writes both pools, 2 (S1 + S2) Dqk elements per batch row; combining reads two partial
    outputs and writes one, 3 T H d_v. (Prefill at long context runs one softmax; decode, with
    T small against S, combines.)"""
    t, h = q_shape[1], q_shape[2]
    return 2 * (s1 + s2) * d_qk < 3 * t * h * d_v


def _two_pool_attention(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink, scale, d_v,
                        impl, impl2, config, deterministic):
    if impl == impl2 and _concatenate_pools(q.shape, kv.shape[1], kv2.shape[1], q.shape[3],
                                            d_v):
        return _core.attention_two_pool(q, kv, idx, topk_length, kv2, idx2, topk_length2, sink,
                                        scale, d_v, impl, config, deterministic)
    no_sink = jnp.full_like(sink, -jnp.inf)
    o1, lse1 = _core.attention(q, kv, idx, topk_length, no_sink, scale, d_v, impl, config,
                               deterministic)
    o2, lse2 = _core.attention(q, kv2, idx2, topk_length2, no_sink, scale, d_v, impl2, config,
                               deterministic)
    o, lse = reference.combine_partials(jnp.stack([o1, o2], axis=2),
                                        jnp.stack([lse1, lse2], axis=2), sink, axis=2)
    return o.astype(q.dtype), lse.astype(lse1.dtype)


_eager_two_pool_attention = jax.jit(_two_pool_attention,
                                    static_argnums=(8, 9, 10, 11, 12, 13))


@dataclasses.dataclass(frozen=True)
class _Call:
    """A checked sparse_mla call in the canonical 4-D layout."""
    q: jax.Array
    kv: jax.Array
    idx: jax.Array
    topk_length: jax.Array
    sink: jax.Array
    scale: float
    d_v: int
    impl: str  # "xla", "cute" or "auto" (kernel when lowered for CUDA, reference elsewhere)
    reason: str  # why impl was chosen
    deterministic: bool
    unbatched: bool


def _prepare(q, kv, idx, scale, sink, topk_length, d_v, return_lse, implementation,
             deterministic, config, names=("kv", "idx", "topk_length")) -> _Call:
    """names: what the messages call kv, idx and topk_length (the second pool's arguments)."""
    q, kv = _as_array(q, "q"), _as_array(kv, names[0])
    idx = _as_array(idx, names[1], index=True)
    unbatched = _check_layout(q, kv, idx, *names[:2])
    if topk_length is not None:
        topk_length = _as_array(topk_length, names[2], index=True)
    if unbatched:
        q, kv, idx = q[None], kv[None], idx[None]
        if topk_length is not None:
            topk_length = topk_length[None]
    b, t, h, dqk = q.shape
    k = idx.shape[2]
    d_v = _check_d_v(d_v, dqk)
    scale = _check_scale(scale, dqk)
    _check_flag(return_lse, "return_lse")
    _check_flag(deterministic, "deterministic")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a jax_dsa.cute.Config or None; got {config!r}")
    topk_length = _check_topk_length(topk_length, b, t, k, unbatched, names[2])
    sink = _check_sink(sink, h, _compute_dtype(q.dtype))
    impl, reason = _resolve_implementation(implementation, q, kv, d_v)
    return _Call(q, kv, idx, topk_length, sink, scale, d_v, impl, reason, bool(deterministic),
                 unbatched)


def _compute_dtype(dtype):
    """The reference's accumulation dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def _as_array(x, name, index=False):
    if not (isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "shape")):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if isinstance(x, jax.Array):
        return x
    if index and not isinstance(x, jax.core.Tracer):
        host = np.asarray(x)
        if host.dtype.kind in "iu" and host.dtype.itemsize > 4 and host.size:
            lo, hi = host.min(), host.max()
            info = np.iinfo(np.int32)
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise ValueError(f"{name} holds {bad}, outside int32: {name} must be int32 "
                                 "(converting would wrap it to another row)")
            return jnp.asarray(host.astype(np.int32))
    return jnp.asarray(x)


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool; got {value!r}")


def _check_float(x, name):
    """Refuses any dtype but bfloat16, float16, float32 and float64 (8-bit floats included)."""
    if jnp.dtype(x.dtype).name not in ("bfloat16", "float16", "float32", "float64"):
        hint = "; dequantise 8-bit floats first" if jnp.dtype(x.dtype).itemsize == 1 else ""
        raise TypeError(f"{name} must be a floating dtype (bfloat16, float16, float32, float64); "
                        f"got {x.dtype}{hint}")


def _check_int(value, name, lowest):
    """value as an int (a Python or NumPy int, not a bool) that is at least `lowest`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int; got {value!r}")
    if value < lowest:
        raise ValueError(f"{name} must be >= {lowest}; got {value}")
    return int(value)


def _check_layout(q, kv, idx, kv_name="kv", idx_name="idx") -> bool:
    """Checks ranks, dtypes and the shapes q, kv and idx share. True for the 3-D layout."""
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [B, T, H, Dqk] or [T, H, Dqk]; got shape {q.shape}")
    unbatched = q.ndim == 3
    layout = "3-D" if unbatched else "4-D"
    want = "[S, Dqk]" if unbatched else "[B, S, Dqk]"
    if kv.ndim != q.ndim - 1:
        raise ValueError(f"{kv_name} must be {want} for {layout} q; got shape {kv.shape}")
    want = "[T, K]" if unbatched else "[B, T, K]"
    if idx.ndim != q.ndim - 1:
        raise ValueError(f"{idx_name} must be {want} for {layout} q; got shape {idx.shape}")
    _check_float(q, "q")
    if kv.dtype != q.dtype:
        raise TypeError(f"{kv_name} must have q's dtype {q.dtype}; got {kv.dtype}")
    if idx.dtype != jnp.int32:
        raise TypeError(f"{idx_name} must be int32; got {idx.dtype}")
    qs, kvs, ids = ((1,) + q.shape, (1,) + kv.shape, (1,) + idx.shape) if unbatched else (
        q.shape, kv.shape, idx.shape)
    if kvs[0] != qs[0]:
        raise ValueError(f"{kv_name}'s batch size {kvs[0]} differs from q's {qs[0]}")
    if ids[0] != qs[0] or ids[1] != qs[1]:
        raise ValueError(f"{idx_name}'s batch and token extents {ids[:2]} differ from q's {qs[:2]}")
    if kvs[2] != qs[3]:
        raise ValueError(f"{kv_name}'s last dimension {kvs[2]} differs from q's head dim Dqk={qs[3]}")
    if qs[2] < 1:
        raise ValueError(f"q must have at least one head; got H={qs[2]}")
    if qs[3] < 1:
        raise ValueError(f"q's head dim must be at least 1; got Dqk={qs[3]}")
    if kvs[1] < 1:
        raise ValueError(f"{kv_name} must have at least one row (S >= 1)")
    if ids[2] < 1:
        raise ValueError(f"{idx_name} must list at least one entry per token (K >= 1)")
    return unbatched


def _check_d_v(d_v, dqk) -> int:
    if d_v is None:
        return min(constants.D_V, dqk)
    if isinstance(d_v, bool) or not isinstance(d_v, (int, np.integer)):
        raise TypeError(f"d_v must be a Python int; got {d_v!r}")
    if not 1 <= d_v <= dqk:
        raise ValueError(f"d_v must be in 1..Dqk={dqk}; got d_v={d_v}")
    return int(d_v)


def _check_scale(scale, dqk) -> float:
    if scale is None:
        return float(dqk) ** -0.5
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a static Python float, not a traced value")
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"scale must be a real number (a Python float); got {scale!r}")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    return scale


def _check_topk_length(topk_length, b, t, k, unbatched, name="topk_length"):
    if topk_length is None:
        return jnp.full((b, t), k, jnp.int32)
    topk_length = _as_array(topk_length, name, index=True)
    if topk_length.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32; got {topk_length.dtype}")
    if topk_length.shape != (b, t):
        want = f"[T]=({t},)" if unbatched else f"[B, T]=({b}, {t})"
        got = topk_length.shape[1:] if unbatched else topk_length.shape
        raise ValueError(f"{name} must be {want}; got shape {got}")
    return topk_length


def _check_sink(sink, h, dtype):
    if sink is None:
        return jnp.full((h,), -jnp.inf, dtype)
    sink = _as_array(sink, "sink")
    _check_float(sink, "sink")
    if sink.shape != (h,):
        raise ValueError(f"sink must be [H]=({h},) for q's H={h} heads; got shape {sink.shape}")
    return sink.astype(dtype)


def _variance(x) -> frozenset:
    """The manual mesh axes x varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax 0.10 keeps it on the manual-axis type
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def _same_variance(*arrays):
    """Inside shard_map, mark replicated operands as varying over the axes q and the others vary
    over (pcast, free). Its transpose is a psum: that is how dkv and dsink get summed over head or
    token shards without the user writing one."""
    union = frozenset().union(*(_variance(x) for x in arrays))
    if not union:
        return arrays
    cast = (lambda x, ax: jax.lax.pcast(x, ax, to="varying")) if hasattr(jax.lax, "pcast") else (
        jax.lax.pvary)
    return tuple(x if _variance(x) == union else cast(x, tuple(sorted(union - _variance(x))))
                 for x in arrays)


def kernel_shape_problem(q, kv, d_v) -> str | None:
    """Why the Hopper kernel cannot take this problem, or None when it can."""
    h, dqk = q.shape[-2], q.shape[-1]
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernel takes bfloat16/float16, not {q.dtype}"
    if dqk not in constants.HEAD_DIMS:
        return f"the kernel takes Dqk in {constants.HEAD_DIMS}, not {dqk}"
    if d_v != constants.D_V:
        return f"the kernel takes d_v={constants.D_V}, not {d_v}"
    if h > constants.MAX_HEADS:
        return f"the kernel takes H in 1..{constants.MAX_HEADS}, not {h}"
    return None


@functools.lru_cache(maxsize=None)
def kernel_runtime_problem() -> str | None:
    """Why the Hopper kernels cannot run in this process, or None when they can."""
    from jax_dsa.cute import ffi
    if not ffi.is_available():
        return "the kernel library was not built (install jax_dsa with nvidia-cutlass-dsl present)"
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return "no CUDA device is visible to JAX"
    archs = {getattr(d, "compute_capability", "?") for d in gpus}
    if archs != {"9.0"}:
        return f"the kernels are built for sm_90 (Hopper); the CUDA devices are {sorted(archs)}"
    return None


def _arrays_off_gpu(*arrays) -> bool:
    for x in arrays:
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            continue
        if any(d.platform != "gpu" for d in x.devices()):
            return True
    return False


def _resolve_implementation(implementation, q, kv, d_v) -> tuple[str, str]:
    """(impl, reason): impl is "xla", "cute" or "auto" (see _Call)."""
    if isinstance(implementation, Sequence) and not isinstance(implementation, str):
        names = tuple(implementation)
        if not names or any(n not in ("xla", "cute") for n in names):
            raise ValueError("implementation must be None, 'xla', 'cute' or a non-empty sequence "
                             f"of 'xla' / 'cute'; got {implementation!r}")
    elif implementation in IMPLEMENTATIONS:
        names = (implementation,)
    else:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or a sequence of them; "
                         f"got {implementation!r}")
    shape_problem = kernel_shape_problem(q, kv, d_v)
    problem = shape_problem or kernel_runtime_problem()
    if names == (None,):
        if problem is None:
            return "auto", "the Hopper kernels (on CUDA; the reference on other platforms)"
        if shape_problem and kernel_runtime_problem() is None:
            _warn_fallback(q.shape, q.dtype, d_v, shape_problem)
        return "xla", f"the reference: {problem}"
    if problem is None and _arrays_off_gpu(q, kv):
        problem = "q/kv are not on a CUDA device"
    for name in names:
        if name == "xla":
            return "xla", "the reference (asked for)" if not problem else f"the reference: {problem}"
        if problem is None:
            return "cute", "the Hopper kernels (asked for)"
    raise NotImplementedError(f"implementation='cute' cannot run here: {problem}")


def op_kernel_problem(shape_problem, *arrays) -> str | None:
    """Why the kernel of an op beside sparse_mla cannot take its canonical `arrays` here (None
    when it can): the process (library, GPU), then `shape_problem()` (the op's own limits),
    then arrays committed off the GPU."""
    problem = kernel_runtime_problem() or shape_problem()
    if problem is None and _arrays_off_gpu(*arrays):
        problem = "the inputs are not on a CUDA device"
    return problem


@functools.lru_cache(maxsize=None)
def warn_op_fallback(op, shape, dtype, problem):
    """Logs once per op and shape that a call on a Hopper GPU runs the (slower) reference."""
    _log.warning("jax_dsa.%s: q %s %s runs the pure-JAX reference, not the Hopper kernels: %s "
                 "(pass implementation='xla' to silence this)", op, shape, dtype, problem)


def choose(implementation, problem: str | None, op: str, q) -> str:
    """The implementation of an op beside sparse_mla (indexer, attention target, indexer loss):
    "xla", "cute" or "auto" (see `dispatch`). `problem`: why its kernel cannot take the call
    (op_kernel_problem; None when it can); when the default (None) falls back to the reference
    on a machine where the kernels run, warn_op_fallback logs it (op, q's shape and dtype)."""
    sequence = isinstance(implementation, Sequence) and not isinstance(implementation, str)
    names = tuple(implementation) if sequence else (implementation,)
    if not names or any(n not in IMPLEMENTATIONS for n in names) or (sequence and None in names):
        raise ValueError("implementation must be None, 'xla', 'cute' or a sequence of 'xla' / "
                         f"'cute'; got {implementation!r}")
    if names == (None,):
        if problem and kernel_runtime_problem() is None:
            warn_op_fallback(op, q.shape, q.dtype, problem)
        return "xla" if problem else "auto"
    for name in names:
        if name == "xla":
            return "xla"
        if problem is None:
            return "cute"
    raise NotImplementedError(f"implementation='cute' cannot run here: {problem}")


def dispatch(impl, ref, kernel, *args):
    """impl's function of args; "auto": the kernel when lowered for CUDA, the reference
    elsewhere (as sparse_mla's). Called while tracing a jitted op."""
    if impl == "xla":
        return ref(*args)
    if impl == "cute":
        return kernel(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=ref)


@functools.lru_cache(maxsize=None)
def _warn_fallback(shape, dtype, d_v, problem):
    """Logs once per shape that a call on a Hopper GPU runs the (slower) reference."""
    _log.warning("jax_dsa.sparse_mla: q %s %s, d_v=%d runs the pure-JAX reference, not the "
                 "Hopper kernels: %s (pass implementation='xla' to silence this, or see "
                 "jax_dsa.explain)", shape, dtype, d_v, problem)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a sparse_mla call runs: `implementation` ("cute" or "xla"; "auto" runs the kernels
    on CUDA and the reference on other platforms), `reason`, and for the kernels the `config`
    that jax_dsa.cute.select (or the given config) picks on these (unsharded) shapes."""
    implementation: str
    reason: str
    config: Config | None

    def __str__(self):
        text = f"{self.implementation}: {self.reason}"
        if self.config is not None:
            fwd, bwd = self.config.fwd, self.config.bwd
            grouped = (f"grouped by {bwd.group} tokens, list union by {bwd.union}"
                       if bwd.group > 1 else "one token per 64-row tile")
            split = f", each list in {fwd.splits} parts" if fwd.splits > 1 else ""
            text += f"; forward kernel {fwd.kernel}{split}; backward {grouped}"
        return text


def explain(q, kv, idx, *, scale=None, sink=None, topk_length=None, d_v=None, return_lse=False,
            implementation=None, deterministic=False, config=None) -> Plan:
    """What `sparse_mla` with these arguments runs, and why (a `Plan`; str() reads well).

    Takes sparse_mla's arguments for one KV pool (not extra_kv / extra_idx /
    extra_topk_length) and checks them the same way, but computes nothing. Under
    sharding the kernels are chosen per device shard: pass one shard's arrays to see that
    choice.
    """
    call = _prepare(q, kv, idx, scale, sink, topk_length, d_v, return_lse, implementation,
                    deterministic, config)
    if call.impl == "xla":
        return Plan("xla", call.reason, None)
    from jax_dsa.cute import config as kernel_config
    cfg = kernel_config.resolve(config, call.q.shape, call.idx.shape[2], call.kv.shape[1],
                                call.deterministic)
    return Plan(call.impl, call.reason, cfg)
