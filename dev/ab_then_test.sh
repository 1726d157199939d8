#!/usr/bin/env bash
# One GPU call that decides between kernel libraries and validates the winner: dev/ab_libs.sh on
# the given rows, then the library with the smallest summed median (over rounds and rows) is put
# in jax_dsa/_lib and the backward's GPU tests and the memcheck case run on it.
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
def total(d):
    """Sum over rows of the row's mean time; inf if a row is missing from any round."""
    name, times = os.path.basename(d), {}
    logs = [f for f in os.listdir(out) if f.startswith(name + ".") and f.endswith(".log")]
    for f in logs:
        seen = {}
        for line in open(os.path.join(out, f)):
            m = re.match(r"^((?:V|TP|decode)\S*(?: \S+)*?)\s+\S+\s+\S+\s+([0-9.]+) us", line)
            if m:
                seen[m.group(1)] = float(m.group(2))
        for k, v in seen.items():
            times.setdefault(k, []).append(v)
    if not logs or any(len(v) != len(logs) for v in times.values()):
        return float("inf")
    return sum(sum(v) / len(v) for v in times.values()) if times else float("inf")
print(min(dirs, key=total))
PY
)
echo "== winner $(basename "$best")"
cp "$best/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest -q -n 4 -rf tests/test_gpu_backward.py 2>&1 | tail -3
compute-sanitizer --tool memcheck --leak-check no python3 tests/gpu_memcheck_case.py 2>&1 | tail -2
