#!/usr/bin/env python
"""Build an experimental library: some of ffi/build.py's exports, compiled with other keyword
arguments of their compile function, under the same export names (so the handlers and every
config run them unchanged). For same-run A/Bs on the GPU machine: swap the library file between
two runs of one script.

    python dev/experiment_lib.py --out build/exp_lib --only jax_dsa_bwd_bf16 \\
        --set bwd:interleave_heads=True

--set MODULE:NAME=VALUE (VALUE a Python literal) applies to every selected export of
ffi/kernels/sm90/MODULE.py; --only keeps the exports whose prefix contains one of the strings.
"""
import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ffi"))

import build  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--only", nargs="+", required=True)
    ap.add_argument("--set", nargs="*", default=[], dest="settings")
    args = ap.parse_args()
    extra = {}
    for item in args.settings:
        module, assignment = item.split(":", 1)
        name, value = assignment.split("=", 1)
        extra.setdefault(module, {})[name] = ast.literal_eval(value)
    table = build.exports()

    def exports():
        return [(op, prefix, module, fn, dict(kwargs, **extra.get(module, {})))
                for op, prefix, module, fn, kwargs in table
                if any(o in prefix for o in args.only)]

    build.exports = exports  # one process (--jobs 1): workers would re-import the table
    build_dir = args.build_dir or os.path.join(args.out, "objects")
    sys.argv = ["build.py", "--out", args.out, "--build-dir", build_dir, "--jobs", "1"]
    build.main()


if __name__ == "__main__":
    main()
