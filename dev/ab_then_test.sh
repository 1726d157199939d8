#!/usr/bin/env bash
# One GPU call that decides between kernel libraries and validates the winner: dev/ab_libs.sh on
# the given rows, then the library with the smallest sum over the rows of its mean time (one that
# misses a row in any round loses) goes to jax_dsa/_lib and the backward's GPU tests and the
# memcheck case run on it.
#
#   ROUNDS=2 bash dev/ab_then_test.sh "V3.2 S=8K,V3.2 S=128K" bwd build/libs/a build/libs/b ...
#
# The winner's name is printed ("== winner NAME"); its tests' tails follow. Carry the DIRs and
# jax_dsa/_lib. The tests take ~4 minutes and a `--long` run at S 128K ~40 s per library and
# round: keep rows x libraries x rounds small enough for the call's 10 minutes.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-build/ab}"
bash dev/ab_libs.sh "$@"
shift 2
best=$(python3 - "$out" "$@" <<'PY'
import os, re, sys
out, dirs = sys.argv[1], sys.argv[2:]
def times(d):
    """{row: [time per round]} from this library's logs."""
    name, rows = os.path.basename(d), {}
    logs = [f for f in os.listdir(out) if f.startswith(name + ".") and f.endswith(".log")]
    for f in logs:
        for line in open(os.path.join(out, f)):
            m = re.match(r"^((?:V|TP|decode)\S*(?: \S+)*?)\s+\S+\s+\S+\s+([0-9.]+) us", line)
            if m:
                rows.setdefault(m.group(1), {})[f] = float(m.group(2))
    return {k: list(v.values()) for k, v in rows.items()}, len(logs)
every = {d: times(d) for d in dirs}
all_rows = set().union(*(t for t, _ in every.values()))
def total(d):
    """Sum over rows of the row's mean time; inf if the library lacks a row in any round."""
    t, n = every[d]
    if not n or set(t) != all_rows or any(len(v) != n for v in t.values()):
        return float("inf")
    return sum(sum(v) / n for v in t.values())
for d in dirs:
    print(f"  {os.path.basename(d)}: {total(d):.1f} us", file=sys.stderr)
print(min(dirs, key=total))
PY
)
echo "== winner $(basename "$best")"
cp "$best/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest -q -n 4 -rf tests/test_gpu_backward.py 2>&1 | tail -3
compute-sanitizer --tool memcheck --leak-check no python3 tests/gpu_memcheck_case.py 2>&1 | tail -2
