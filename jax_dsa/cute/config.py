"""The kernel policy: which Hopper kernel runs for a call, as frozen configuration.

`select` is the one heuristic behind every default; `Config` pins a choice (tests, experts:
`jax_dsa.sparse_mla(..., config=Config(...))`). The choice is static: it reaches the FFI handler
as an attribute, so two configurations can run in one process and under one `jax.jit`.

Forward (FwdConfig.kernel):
  "small_heads"  H <= 32 (tensor-parallel shards): heads on wgmma's N side, two consumer
                 warpgroups on alternate tokens (ffi/kernels/sm90/fwd_small_heads.py).
  "pingpong"     any H (64-head tiles, padded inside the kernel): a producer warpgroup gathers
                 KV blocks, two consumers ping-pong over block pairs (fwd_pingpong.py).
FwdConfig.splits > 1 (decode: too few tokens to fill the GPU) runs each token's list as
`splits` contiguous parts combined by their lse: pingpong's split form reads the parts in
place (one CTA per token, part and 64 heads) and a small kernel combines them (fwd_combine.py),
small_heads runs them as tokens of their own, combined by jax_dsa.reference.combine_partials.
Backward (BwdConfig.group): 1 runs one token per 64-row tile (ffi/kernels/sm90/bwd.py); G > 1
runs G consecutive tokens of 64 / G heads as one 64-row token over the union of their index
lists, so rows the tokens share (the window) are gathered and added to dkv once per group. The
union comes from the list-union kernel (union="kernel", G * K <= UNION_CAPACITY) or from XLA
(union="xla", jax_dsa.cute.grouping). The deterministic backward (deterministic=True) never
groups; it stores each entry's dkv row in a workspace of at most `workspace_bytes` and sums
each kv row's contributions in a fixed order.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_dsa.cute import constants

FWD_KERNELS = ("pingpong", "small_heads")
# The forward's list split (decode): the SMs one launch should fill (an H200 or H100 SXM has
# 132) and the fewest entries a part may have (4 KV blocks: below that the kernel's fixed cost
# of loading Q and storing O outweighs the parallelism gained).
SPLIT_TARGET_CTAS = 132
SPLIT_MIN_ENTRIES = 256
MAX_SPLITS = 64
UNIONS = ("kernel", "xla")
DET_WORKSPACE_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """The forward kernel: "pingpong" (any H) or "small_heads" (H <= 32), and the parts each
    token's list is split into (`splits`, 1 = no split; see the module docstring)."""
    kernel: str = "pingpong"
    splits: int = 1

    def __post_init__(self):
        if self.kernel not in FWD_KERNELS:
            raise ValueError(f"FwdConfig.kernel must be one of {FWD_KERNELS}; "
                             f"got {self.kernel!r}")
        if (isinstance(self.splits, bool) or not isinstance(self.splits, int)
                or not 1 <= self.splits <= MAX_SPLITS):
            raise ValueError(f"FwdConfig.splits must be an int in [1, {MAX_SPLITS}]; "
                             f"got {self.splits!r}")


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """The backward: tokens per 64-row tile (`group`: 1, or 2 / 4 / 8 with H * group = 64),
    where a grouped call's list union is computed (`union`), the deterministic backward's
    workspace bound in bytes (`workspace_bytes`), and whether the plain backward (group 1, not
    deterministic) walks each token's valid rows in row order (`sort_rows`: the row-order kernel
    buckets each list by row first, jax_dsa.cute.kernel.rows_in_order; the invalid entries go
    last and topk_length becomes the valid count; the dkv REDs that miss L2 then land on nearby
    rows, which pays once dkv outgrows the L2)."""
    group: int = 1
    union: str = "kernel"
    workspace_bytes: int = DET_WORKSPACE_BYTES
    sort_rows: bool = False

    def __post_init__(self):
        if (isinstance(self.group, bool) or not isinstance(self.group, int)
                or self.group not in (1,) + constants.GROUPS):
            raise ValueError(f"BwdConfig.group must be one of {(1,) + constants.GROUPS}; "
                             f"got {self.group!r}")
        if self.union not in UNIONS:
            raise ValueError(f"BwdConfig.union must be one of {UNIONS}; got {self.union!r}")
        if (isinstance(self.workspace_bytes, bool) or not isinstance(self.workspace_bytes, int)
                or self.workspace_bytes < 1):
            raise ValueError("BwdConfig.workspace_bytes must be a positive int; "
                             f"got {self.workspace_bytes!r}")
        if not isinstance(self.sort_rows, bool):
            raise TypeError(f"BwdConfig.sort_rows must be a bool; got {self.sort_rows!r}")
        if self.sort_rows and self.group != 1:
            raise ValueError("BwdConfig.sort_rows applies to the plain backward (group=1); "
                             f"got group={self.group}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Kernel choice for one `sparse_mla` call; a field left None is chosen by `select`."""
    fwd: FwdConfig | None = None
    bwd: BwdConfig | None = None

    def __post_init__(self):
        if self.fwd is not None and not isinstance(self.fwd, FwdConfig):
            raise TypeError(f"Config.fwd must be a FwdConfig or None; got {self.fwd!r}")
        if self.bwd is not None and not isinstance(self.bwd, BwdConfig):
            raise TypeError(f"Config.bwd must be a BwdConfig or None; got {self.bwd!r}")


def select_fwd(q_shape, k: int) -> FwdConfig:
    """The forward for q [B, T, H, D] (per device, after sharding) and K entries per token:
    the small-heads kernel for H <= 32, else pingpong; the lists split when the call's CTAs
    (B * T * ceil(H / 64) for pingpong, B * T for small_heads) fill fewer than half the SMs,
    into as many parts as fill them, each of at least SPLIT_MIN_ENTRIES entries.

    Example: 8 decode tokens at H = 128, K = 2048 run 16 CTAs unsplit; `select_fwd((8, 1, 128,
    576), 2048)` gives FwdConfig("pingpong", splits=8), 128 CTAs of 256 entries.
    """
    b, t, h, _ = q_shape
    kernel = "small_heads" if h <= constants.SMALL_HEADS else "pingpong"
    ctas = b * t * (1 if kernel == "small_heads" else -(-h // 64))
    splits = 1
    if 0 < ctas <= SPLIT_TARGET_CTAS // 2:
        splits = max(1, min(SPLIT_TARGET_CTAS // ctas, k // SPLIT_MIN_ENTRIES, MAX_SPLITS))
    return FwdConfig(kernel, splits)


def grouping_problem(q_shape, num_kv_rows: int, group: int, deterministic: bool) -> str:
    """Why a backward call with q [B, T, H, D] cannot run grouped by `group` ("" if it can)."""
    _, t, h, _ = q_shape
    if group == 1:
        return ""
    if deterministic or h * group != 64 or t % group or num_kv_rows >= 1 << constants.MEMBER_SHIFT:
        return (f"the grouped backward (group={group}) needs H * {group} = 64, T a multiple of "
                f"{group}, S < 2^{constants.MEMBER_SHIFT} and deterministic=False; got H={h}, "
                f"T={t}, S={num_kv_rows}, deterministic={deterministic}")
    return ""


def select_bwd(q_shape, k: int, num_kv_rows: int, deterministic: bool = False) -> BwdConfig:
    """The backward for q [B, T, H, D] (per device) and K entries per token: grouped by
    G = 64 / H at H = 32, 16 and 8 when the call can run grouped and the list-union kernel takes
    G * K entries (the tokens' lists overlap in the window, so the union carries fewer rows
    than the lists and the dkv atomics, the small-H backward's floor, shrink with it); else the
    plain backward, with its rows sorted (`sort_rows`) when the fp32 dkv (B * S * D * 4 bytes)
    holds at least LONG_DKV_MIN_BYTES, as the kernels' `_long` builds."""
    b, _, h, d = q_shape
    group = 64 // h if h in (8, 16, 32) else 1
    if (group > 1 and not grouping_problem(q_shape, num_kv_rows, group, deterministic)
            and group * k <= constants.UNION_CAPACITY):
        return BwdConfig(group=group)
    long_dkv = b * num_kv_rows * d * 4 >= constants.LONG_DKV_MIN_BYTES
    return BwdConfig(sort_rows=long_dkv and not deterministic)


def select(q_shape, k: int, num_kv_rows: int, *, deterministic: bool = False) -> Config:
    """The default kernels for q [B, T, H, Dqk] (per device), K entries per token and S kv rows.

    Example: `select((1, 4096, 16, 576), 640, 65536)` gives
    Config(fwd=FwdConfig("small_heads"), bwd=BwdConfig(group=4)).
    """
    if len(tuple(q_shape)) != 4:
        raise ValueError(f"q_shape must be [B, T, H, Dqk] (a 3-D q is B = 1); got {q_shape}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a Python bool; got {deterministic!r}")
    return Config(select_fwd(q_shape, k), select_bwd(q_shape, k, num_kv_rows, deterministic))


def resolve(config: Config | None, q_shape, k: int, num_kv_rows: int,
            deterministic: bool) -> Config:
    """`config` with its None fields chosen by `select`; raises ValueError where a pinned
    choice cannot run this call."""
    config = config or Config()
    fwd = config.fwd or select_fwd(q_shape, k)
    bwd = config.bwd or select_bwd(q_shape, k, num_kv_rows, deterministic)
    if fwd.kernel == "small_heads" and q_shape[2] > constants.SMALL_HEADS:
        raise ValueError(f"config: FwdConfig('small_heads') takes H <= {constants.SMALL_HEADS} "
                         f"heads per device; got H={q_shape[2]}")
    problem = grouping_problem(q_shape, num_kv_rows, bwd.group, deterministic)
    if problem:
        raise ValueError(f"config: {problem}")
    if bwd.group > 1 and bwd.union == "kernel" and bwd.group * k > constants.UNION_CAPACITY:
        raise ValueError(f"config: the list-union kernel takes group * K <= "
                         f"{constants.UNION_CAPACITY}; got {bwd.group} * {k} (use union='xla')")
    return Config(fwd, bwd)
