#!/usr/bin/env python
"""Prove that the kernels build on a machine without a GPU, and report what ptxas made of them:
registers, spills, local memory and the SASS instructions that matter.

    python dev/check_kernel_build.py [OP ...] [--only bf16_d576 ...] [--out DIR] [--keep-sass]
                                     [--allow-spills]

OP is one of ffi/build.py's ops (fwd, fwd_split, combine, fwd2, bwd, bwd2, reduce, union, rows,
indexer, select, target, loss_fwd, loss_bwd); default: all. Every export of ffi/build.py's
table is compiled for sm_90a keeping the cubin (CUTE_DSL_KEEP=cubin; CHECK_KEEP=ptx,cubin keeps
the PTX too, under --out/dump) and exported into --out (nothing in the source tree is written),
then
  * cuobjdump --dump-resource-usage: registers, stack frame, local memory per kernel function;
  * nvdisasm: counts of HGMMA / HMMA, LDGSTS, SYNCS (mbarrier), BAR, UBLKRED (TMA bulk reduce),
    WARPGROUP.DEPBAR (one after every HGMMA, or more than one per two HGMMA, means ptxas
    serialized the wgmma chain), LDL / STL, and RED / STG vector widths.
Fails on spills or local memory (unless --allow-spills), on serialized wgmma, on a forward or
backward kernel without HGMMA, on scalar fp32 RED (but the two-pool backward's one for dsink),
and on RED in a deterministic backward.
The CUDA binary tools are found as dev/cuda_tools.py says.
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ffi"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import build  # noqa: E402  (ffi/build.py: the export table)
from cuda_tools import find_tool  # noqa: E402


def log(msg):
    print(f"[check_kernel_build] {msg}", flush=True)


def sass_facts(sass):
    """Instruction counts (by base opcode), RED / STG widths, and "HGMMA>DEPBAR": HGMMAs that
    are directly followed by a WARPGROUP.DEPBAR (all of them: ptxas serialized the chain)."""
    ops, wide = collections.Counter(), collections.Counter()
    prev = ""
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(1)
        base = op.split(".")[0]
        ops[base] += 1
        if op.startswith("WARPGROUP.DEPBAR"):
            ops["WARPGROUP.DEPBAR"] += 1
            if prev == "HGMMA":
                ops["HGMMA>DEPBAR"] += 1
        prev = base
        if base in ("RED", "REDG", "ATOMG", "STG"):
            w = re.search(r"\.(F32x4|F32x2|F32|F16x2|BF16x2|128|64)\b", op)
            wide[f"{base}.{w.group(1)}" if w else op] += 1
    return ops, wide


def ldgsts_unset_uniforms(sass):
    """LDGSTS instructions whose shared base [R+URn] or descriptor desc[URm] names a uniform
    register that no instruction of the kernel writes. The ptxas of nvidia-cutlass-dsl 4.8
    emits such an LDGSTS for a cache-hinted cp.async whose shared address it splits into a
    register and a uniform base (an illegal instruction at run time; common.cp_async_16_policy)."""
    written = set()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s+UR(\d+)",
                         sass):
        n = int(m.group(2))
        written.update((n, n + 1) if ".64" in m.group(1) else (n,))
    bad = []
    for line in sass.splitlines():
        if "LDGSTS" not in line or "ARRIVES" in line:
            continue
        regs = [int(r) for r in re.findall(r"\+UR(\d+)", line)]
        regs += [int(r) for r in re.findall(r"desc\[UR(\d+)\]", line)]
        if any(r not in written for r in regs):
            bad.append(line.strip())
    return bad


def jobs(ops):
    """(op, export prefix, compile thunk, deterministic) of every export of the requested ops
    (default: all), from ffi/build.py's table."""
    table = build.exports()
    known = sorted({e[0] for e in table})
    unknown = [o for o in ops if o not in known]
    if unknown:
        raise SystemExit(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [(op, prefix, lambda m=module, f=fn, k=kwargs: build.compile_kernel(m, f, k),
             bool(kwargs.get("deterministic")))
            for op, prefix, module, fn, kwargs in table if not ops or op in ops]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ops", nargs="*")
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to check")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "kernel_check"))
    ap.add_argument("--keep-sass", action="store_true", help="write <prefix>.sass into --out")
    ap.add_argument("--allow-spills", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    dump = os.path.join(out, "dump")
    os.makedirs(dump)
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = os.environ.get("CHECK_KEEP", "cubin")
    os.environ["CUTE_DSL_DUMP_DIR"] = dump
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    log(f"cuobjdump: {cuobjdump}, nvdisasm: {nvdisasm}")
    problems, summary = [], []
    if not cuobjdump or not nvdisasm:
        problems.append("cuobjdump / nvdisasm not found: resource usage and SASS not checked")

    for op, prefix, compile_fn, det in jobs(args.ops):
        if args.only and not any(o in prefix for o in args.only):
            continue
        shutil.rmtree(dump, ignore_errors=True)  # the kept cubin is named after the kernel
        os.makedirs(dump)
        t0 = time.time()
        compile_fn().export_to_c(out, prefix, prefix)
        cubins = sorted(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True),
                        key=os.path.getmtime)
        line = f"{prefix}: {time.time() - t0:.1f}s"
        if not all(os.path.isfile(os.path.join(out, prefix + e)) for e in (".h", ".o")):
            problems.append(f"{prefix}: export not written")
        if not cubins:
            problems.append(f"{prefix}: no cubin kept")
        if not cubins or not cuobjdump or not nvdisasm:
            log(line)
            continue
        cubin = os.path.join(out, prefix + ".cubin")
        shutil.copyfile(cubins[-1], cubin)
        res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                             text=True).stdout
        regs = []
        for _, usage in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", res):
            vals = dict(kv.split(":") for kv in usage.split() if ":" in kv)
            regs.append(vals.get("REG", "?"))
            if (int(vals.get("STACK", 0)) or int(vals.get("LOCAL", 0))) and not args.allow_spills:
                problems.append(f"{prefix}: stack {vals.get('STACK')} B / local "
                                f"{vals.get('LOCAL')} B (spills)")
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
        if args.keep_sass:
            with open(os.path.join(out, prefix + ".sass"), "w") as f:
                f.write(sass)
        ops, wide = sass_facts(sass)
        line += (f", registers {'/'.join(regs)}, HGMMA {ops['HGMMA']}, HMMA {ops['HMMA']}, "
                 f"DEPBAR {ops['WARPGROUP.DEPBAR']} ({ops['HGMMA>DEPBAR']} right after an HGMMA), "
                 f"LDGSTS {ops['LDGSTS']}, SYNCS {ops['SYNCS']}, UBLKRED {ops['UBLKRED']}, "
                 f"BAR {ops['BAR']}, LDL/STL {ops['LDL']}/{ops['STL']}, RED/STG {dict(wide)}")
        log(line)
        summary.append(line)
        if op in ("fwd", "bwd") and not ops["HGMMA"]:
            problems.append(f"{prefix}: no HGMMA in the SASS")
        if ops["HGMMA"] > 2 and ops["HGMMA>DEPBAR"] >= ops["HGMMA"]:
            problems.append(f"{prefix}: every HGMMA is followed by a DEPBAR (serialized wgmma)")
        elif ops["HGMMA"] > 2 and 2 * ops["WARPGROUP.DEPBAR"] > ops["HGMMA"]:
            # ptxas's C7514 fallback does not always put a wait after every HGMMA, but it
            # multiplies the waits (ws2 with one wgmma wait moved: 7 -> 112 for 112 HGMMA).
            problems.append(f"{prefix}: {ops['WARPGROUP.DEPBAR']} WARPGROUP.DEPBAR for "
                            f"{ops['HGMMA']} HGMMA (ptxas inserted wgmma waits, C7514)")
        if (ops["LDL"] or ops["STL"]) and not args.allow_spills:
            problems.append(f"{prefix}: local memory (LDL {ops['LDL']}, STL {ops['STL']})")
        # (the two-pool backward adds each row's dsink term with one scalar RED per kernel
        # function; a pair_lockstep build holds two, one per launch: 2-CTA clusters or not)
        scalar_red = sum(n for k, n in wide.items() if k.startswith("RED") and k.endswith(".F32"))
        if scalar_red > (max(1, len(regs)) if op == "bwd2" else 0):
            problems.append(f"{prefix}: scalar fp32 RED")
        unset = ldgsts_unset_uniforms(sass)
        if unset:
            problems.append(f"{prefix}: {len(unset)} LDGSTS read uniform registers nothing "
                            f"sets (misencoded cache-hinted cp.async), e.g. {unset[0]}")
        if det and any(k.startswith("RED") for k in wide):
            problems.append(f"{prefix}: RED in a deterministic kernel")

    log(f"done in {time.time() - t_start:.1f}s")
    if problems:
        raise SystemExit("check_kernel_build: FAILED\n  " + "\n  ".join(problems))
    log("OK")


if __name__ == "__main__":
    main()
