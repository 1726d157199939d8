#!/usr/bin/env python
"""Executable model of the synchronisation protocol of the experimental persistent forward
(jax_dsa/kernels/sm90/sparse_mla_fwd_ws2p.py), to check it for hangs and phase overruns on the CPU:

    python tools/ws2p_protocol_model.py [--trials 3000]

The three warpgroups (producer, consumer groups WG0 / WG1) are generators that run the kernel's
sequence of mbarrier arrivals / parity waits and named-barrier arrive / sync per work item, for
random lists of per-item block counts, under random interleavings. The model fails on
  * a hang (no agent can progress),
  * an mbarrier wait whose barrier is already two phases past the awaited one (a parity wait
    would then block forever or pass wrongly),
  * a named barrier arrived twice by one group before the other group arrived once (the hardware
    would count both into one instance).
wgmma completion is not modelled (each group waits for its own MMAs in program order). Keep it in
step with the kernel when its barrier code changes; remove it together with ws2p.
"""
import argparse
import random


class MBarrier:
    """Arrival count per phase; `done` = completed phases."""

    def __init__(self, count):
        self.count, self.pending, self.done = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.done = 0, self.done + 1


def wait(mb, phase):
    """try_wait.parity(phase % 2) until phase `phase` (0-based) has completed."""
    while True:
        if mb.done >= phase + 2:
            raise RuntimeError(f"mbarrier two phases past the awaited one ({phase}, {mb.done})")
        if mb.done == phase + 1:
            return
        yield


class NamedBarrier:
    """One named barrier shared by the two consumer groups: arrivals per group."""

    def __init__(self):
        self.arrivals = [0, 0]


def arrive(nb, g):
    if nb.arrivals[g] > nb.arrivals[1 - g]:
        raise RuntimeError("named barrier arrived twice by one group before the other arrived")
    nb.arrivals[g] += 1


def sync(nb, g):
    arrive(nb, g)
    while nb.arrivals[1 - g] < nb.arrivals[g]:
        yield


class Kernel:
    def __init__(self):
        self.full = [MBarrier(1) for _ in range(4)]  # 0L, 0R, 1L, 1R (producer arrivals)
        self.empty = [MBarrier(1) for _ in range(4)]  # one consumer group each
        self.q_full, self.q_empty = MBarrier(1), MBarrier(2)
        self.m0, self.m1, self.p0, self.p1, self.cons = (NamedBarrier() for _ in range(5))

    def producer(self, items):
        u0 = u1 = 0
        for i, nb in enumerate(items):
            if i > 0:
                yield from wait(self.q_empty, i - 1)
            self.q_full.arrive()
            for m in range((nb + 1) // 2):
                has1 = 2 * m + 1 < nb
                for q in range(4):  # fills 0L, 1R, 0R, 1L
                    stage, is_r = q % 2, int(q in (1, 2))
                    if stage == 0 or has1:
                        slot = 2 * stage + is_r
                        n_use = (u0 if stage == 0 else u1) + m
                        if n_use > 0:
                            yield from wait(self.empty[slot], n_use - 1)
                        yield
                        self.full[slot].arrive()
            u0, u1 = u0 + (nb + 1) // 2, u1 + nb // 2

    def wg0(self, items):
        u0 = 0
        if items and items[0] > 0:
            yield from wait(self.q_full, 0)
            yield from wait(self.full[0], 0)
            yield from wait(self.full[1], 0)
        for i, nb in enumerate(items):
            n_pairs = (nb + 1) // 2
            yield from wait(self.q_full, i)
            if n_pairs <= 1:
                self.q_empty.arrive()
            for m in range(n_pairs):
                has1 = 2 * m + 1 < nb
                arrive(self.m0, 0)
                yield from sync(self.m1, 0)
                self.empty[0].arrive()  # 0L after the RS P V
                arrive(self.p0, 0)
                yield from sync(self.p1, 0)
                if m + 1 < n_pairs:  # next pair's Q K^T: 0L, release 1L, 0R
                    yield from wait(self.full[0], u0 + m + 1)
                    self.empty[2].arrive()
                    yield from wait(self.full[1], u0 + m + 1)
                if m + 2 == n_pairs:
                    self.q_empty.arrive()
                if m + 1 == n_pairs and has1:
                    self.empty[2].arrive()
            u0 += n_pairs
            if i + 1 < len(items) and items[i + 1] > 0:  # next item's first Q K^T
                yield from wait(self.q_full, i + 1)
                yield from wait(self.full[0], u0)
                yield from wait(self.full[1], u0)
            yield from sync(self.cons, 0)  # epilogue

    def wg1(self, items):
        u1 = 0
        for i, nb in enumerate(items):
            yield from wait(self.q_full, i)
            if nb < 2:
                self.q_empty.arrive()
            for m in range((nb + 1) // 2):
                has1 = 2 * m + 1 < nb
                if has1:
                    yield from wait(self.full[3], u1 + m)
                    yield from wait(self.full[2], u1 + m)
                    if m + 1 == nb // 2:
                        self.q_empty.arrive()
                yield from sync(self.m0, 1)
                arrive(self.m1, 1)
                arrive(self.p1, 1)
                yield from sync(self.p0, 1)
                if has1:
                    self.empty[3].arrive()  # 1R
                self.empty[1].arrive()  # 0R
            u1 += nb // 2
            yield from sync(self.cons, 1)  # epilogue


def run(items, seed):
    k = Kernel()
    rng = random.Random(seed)
    agents = [k.producer(items), k.wg0(items), k.wg1(items)]
    alive, idle = [True] * 3, 0
    while any(alive):
        j = rng.choice([a for a in range(3) if alive[a]])
        try:
            next(agents[j])
            idle += 1
        except StopIteration:
            alive[j], idle = False, 0
        if idle > 200_000:
            raise RuntimeError("hang")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3000)
    args = ap.parse_args()
    for t in range(args.trials):
        rng = random.Random(t)
        items = [rng.choice([0, 1, 2, 3, 4, 5, 10, 11]) for _ in range(rng.randint(1, 6))]
        try:
            run(items, t)
        except RuntimeError as e:
            raise SystemExit(f"trial {t}, blocks per item {items}: {e}")
    print(f"ws2p protocol model: {args.trials} random item sequences, no hang or overrun")


if __name__ == "__main__":
    main()
