"""Random problems for the tests: fresh normal inputs, invalid indices, duplicates, dead rows."""
import dataclasses

import numpy as np


@dataclasses.dataclass
class Problem:
    q: np.ndarray
    kv: np.ndarray
    idx: np.ndarray
    topk_length: np.ndarray | None
    sink: np.ndarray | None
    d_v: int

    @property
    def scale(self):
        return self.q.shape[-1] ** -0.5

    @property
    def lengths(self):
        """topk_length as the math sees it (K everywhere when absent)."""
        if self.topk_length is not None:
            return self.topk_length
        return np.full(self.idx.shape[:2], self.idx.shape[2], np.int32)


def make_problem(rng, b, t, h, d, s, k, *, sink=False, topk="none", d_v=None,
                 dtype=np.float32, dead_row=True):
    """topk: "none" (argument absent), "full", "partial" (random lengths incl. 0 and K)."""
    q = rng.standard_normal((b, t, h, d)).astype(dtype)
    kv = rng.standard_normal((b, s, d)).astype(dtype)
    # About 1 in 8 entries out of range on either side (-1, -S, S, S + 3, ...).
    idx = rng.integers(-(s // 8) - 1, s + s // 8 + 1, size=(b, t, k)).astype(np.int32)
    if k > 1:
        idx[..., 1] = idx[..., 0]  # duplicates count twice
    if dead_row:
        idx[0, 0, :] = -1  # a token with nothing to attend to
    topk_length = None
    if topk == "full":
        topk_length = np.full((b, t), k, np.int32)
    elif topk == "partial":
        topk_length = rng.integers(0, k + 1, size=(b, t)).astype(np.int32)
        topk_length.flat[-1] = 0
        if b * t > 2:
            topk_length.flat[1] = k
    sink_v = (rng.standard_normal(h) * 2).astype(np.float32) if sink else None
    return Problem(q, kv, idx, topk_length, sink_v, d_v or min(512, d))


def rel_err(got, want):
    """max |got - want| / max |want| over finite entries (0 when both are empty/zero)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if want.size == 0:
        return 0.0
    scale = np.max(np.abs(want)) if want.size else 0.0
    return float(np.max(np.abs(got - want)) / scale) if scale > 0 else float(np.max(np.abs(got)))
