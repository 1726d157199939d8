#!/usr/bin/env python
"""A / B speed comparison of kernel variants on the GPU, with the run-to-run drift cancelled:

    python tools/ab_bench.py --pass fwd --impls default,<tag> [--rounds 3] [--heads 64,128]
                             [--out DIR]
    python tools/ab_bench.py --pass bwd --impls default,<tag>

Why: separate benchmark processes of the same export differ by ~2 % (clocks, placement), as
much as the gains we try to measure. This runs examples/benchmark.py (--quick, or the shapes
of --heads) once per variant
and round (one process each: JAX_DSA_FWD_IMPL / JAX_DSA_BWD_IMPL are read once per process),
reversing the variant order every round (A B, B A, A B, ...), and reports per shape the
median time of each variant and the median over rounds of each candidate's time relative to
the first variant's time in the same round.
"""
import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_table(path):
  """{shape: µs} from a benchmark.md written by examples/benchmark.py."""
  times = {}
  with open(path) as f:
    rows = [l for l in f if l.startswith("|")]
  header = [c.strip() for c in rows[0].strip("|\n").split("|")]
  for line in rows[2:]:
    cells = dict(zip(header, (c.strip() for c in line.strip("|\n").split("|"))))
    times[cells["shape"]] = float(cells["µs"])
  return times


def run_variant(variant, pass_name, out_dir, timeout, heads=""):
  env = dict(os.environ)
  env["JAX_DSA_FWD_IMPL" if pass_name == "fwd" else "JAX_DSA_BWD_IMPL"] = variant
  # --heads picks from all of the benchmark's shapes (e.g. 32), else its --quick ones
  cmd = [sys.executable, os.path.join(ROOT, "examples", "benchmark.py"),
         "--impls", "cute", "--passes", pass_name, "--calls", "5", "--batches", "3",
         "--out", out_dir] + (["--heads", heads] if heads else ["--quick"])
  with open(out_dir + ".log", "w") as log:
    subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                   timeout=timeout)
  return read_table(os.path.join(out_dir, "benchmark.md"))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--pass", dest="pass_name", choices=("fwd", "bwd"), required=True)
  ap.add_argument("--impls", required=True,
                  help="comma-separated variant tags; the first is the baseline (e.g. default)")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/jax_dsa_gpu") + "/ab")
  ap.add_argument("--heads", default="",
                  help="head counts to time, from all of the benchmark's shapes (e.g. 64,128: "
                       "the ws2 candidates run only there; 32); default: its --quick shapes")
  ap.add_argument("--timeout", type=int, default=150, help="seconds per benchmark process")
  args = ap.parse_args()
  variants = args.impls.split(",")
  if len(variants) < 2:
    raise SystemExit("ab_bench: --impls needs a baseline and at least one candidate")
  os.makedirs(args.out, exist_ok=True)

  runs = {v: [] for v in variants}  # per variant, per round: {shape: µs}
  for r in range(args.rounds):
    order = variants if r % 2 == 0 else variants[::-1]
    for v in order:
      runs[v].append(run_variant(v, args.pass_name, os.path.join(args.out, f"r{r}_{v}"),
                                 args.timeout, args.heads))
      print(f"round {r} {v}: " + " ".join(f"{t:.0f}" for t in runs[v][-1].values()),
            flush=True)

  base = variants[0]
  print(f"\n{args.pass_name}, {args.rounds} rounds, µs (median) and candidate / {base} "
        "(median over rounds, [min, max])")
  print("| shape | " + " | ".join(variants) + " | " +
        " | ".join(f"{v} / {base}" for v in variants[1:]) + " |")
  print("|---" * (2 * len(variants)) + "|")
  for shape in runs[base][0]:
    med = [statistics.median(run[shape] for run in runs[v]) for v in variants]
    cells = [f"{m:.0f}" for m in med]
    for v in variants[1:]:
      ratios = [c[shape] / b[shape] for c, b in zip(runs[v], runs[base])]
      cells.append(f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
