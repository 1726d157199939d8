#!/usr/bin/env python
"""Prove that the wgmma sparse MLA backward (jax_dsa/kernels/sm90/sparse_mla_bwd_wgmma.py) builds
on a machine without a GPU, and report what ptxas made of it.

    python tools/check_bwd_wgmma_build.py [--out /tmp/jax_dsa_bwd_wgmma_check]
                                          [--only bf16_d576 ...] [--keep-sass] [--allow-spills]

1. compiles the eight specializations (bf16/f16 x Dqk 512/576 x deterministic False/True) for
   sm_90a (CUTE_DSL_ARCH=sm_90a, ptxas -v) and exports each with export_to_c into --out
   (prefix jax_dsa_bwdwg_<dt>_d<D>[_det]); checks that the .h / .o were written and prints the
   exported wrapper's argument list;
2. from the kept cubin: registers, stack frame, local memory (cuobjdump --dump-resource-usage),
   static + dynamic shared memory (the kernel's SharedStorage size, + 1 KB reserved, against the
   227 KB opt-in limit), and SASS facts (nvdisasm): HGMMA count and shapes, RED / ST vector
   widths, LDGSTS, SHFL, BAR, SYNCS (mbarrier), LDL / STL;
3. fails on a stack frame / local memory (unless --allow-spills), on missing HGMMA, on any scalar
   fp32 RED, on a missing 16-byte RED (atomic mode) or 16-byte ST (deterministic mode), or on
   shared memory above the limit.

cuobjdump / nvdisasm are looked up on PATH, in CUDA_HOME/bin and in /tmp/cudatools (e.g.
`pip install --target /tmp/cudatools nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump`).
Nothing in the source tree is written.
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
SPECS = [(dt, d, det) for det in (False, True) for dt in ("bf16", "f16") for d in (512, 576)]
SMEM_LIMIT = 232448  # sm_90 opt-in maximum per block (227 KB), static + dynamic


def log(msg):
    print(f"[check_bwd_wgmma] {msg}", flush=True)


def find_tool(name):
    cands = [os.environ.get(name.upper()), shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands += sorted(glob.glob(f"/tmp/cudatools/nvidia/*/bin/{name}"), reverse=True)
    cands += sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"), reverse=True)
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def sass_facts(sass):
    ops = collections.Counter()
    wide = collections.Counter()
    hgmma = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(1)
        base = op.split(".")[0]
        ops[base] += 1
        if base == "HGMMA":
            hgmma[op[len("HGMMA."):]] += 1
        if base in ("RED", "REDG", "ATOMG", "ATOM", "STG"):
            w = re.search(r"\.(F32x4|F32x2|F32|F16x2|BF16x2|128|64)\b", op)
            wide[f"{base}.{w.group(1) if w else op}"] += 1
    return ops, wide, hgmma


def smem_bytes(dtype, d, det):
    """Dynamic shared memory of one specialization (SharedStorage size)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    out = {}

    @cute.jit
    def probe():
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
        n = 0
        for shape in ((64, d), (64, 512), (64, d), (64, 64), (64, 64)):
            n += cute.cosize(cute.tile_to_shape(k_atom, shape, (0, 1))) * dtype.width // 8
        out["n"] = n + 2 * 64 * 4 + 4 * 8

    probe()
    return out["n"]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/jax_dsa_bwd_wgmma_check")
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to build")
    ap.add_argument("--keep-sass", action="store_true", help="write <prefix>.sass into --out")
    ap.add_argument("--allow-spills", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    dump = os.path.join(out, "dump")
    os.makedirs(dump)
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = "cubin,ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump

    sys.path.insert(0, ROOT)
    import cutlass
    from jax_dsa.kernels.sm90.sparse_mla_bwd_wgmma import compile_bwd_wgmma

    cuobjdump = find_tool("cuobjdump")
    nvdisasm = find_tool("nvdisasm")
    log(f"cuobjdump: {cuobjdump}, nvdisasm: {nvdisasm}")
    if nvdisasm:
        os.environ["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + os.environ["PATH"]
    dtypes = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}
    prefixes, problems, summary = [], [], []
    for dname, d, det in SPECS:
        prefix = f"jax_dsa_bwdwg_{dname}_d{d}" + ("_det" if det else "")
        if args.only and not any(o in prefix for o in args.only):
            continue
        smem = smem_bytes(dtypes[dname], d, det)
        if smem + 1024 + 1024 > SMEM_LIMIT:  # + alignment padding + 1 KB reserved
            problems.append(f"{prefix}: shared memory {smem} B (+2 KB) > {SMEM_LIMIT}")
        # the kept cubin is named after the kernel (not the export): start from an empty dump
        shutil.rmtree(dump, ignore_errors=True)
        os.makedirs(dump)
        t0 = time.time()
        compiled = compile_bwd_wgmma(dtypes[dname], d, deterministic=det,
                                     options="--ptxas-options '-v'")
        compiled.export_to_c(out, prefix, prefix)
        prefixes.append(prefix)
        dt = time.time() - t0
        for ext in (".h", ".o"):
            if not os.path.isfile(os.path.join(out, prefix + ext)):
                problems.append(f"{prefix}{ext} not written")
        hdr = open(os.path.join(out, prefix + ".h")).read() if os.path.isfile(
            os.path.join(out, prefix + ".h")) else ""
        m = re.search(r"cute_dsl_" + prefix + r"_wrapper\(([^)]*)\)", hdr)
        cubins = sorted(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True),
                        key=os.path.getmtime)
        log(f"{prefix}: compiled+exported in {dt:.1f}s; dynamic smem {smem} B "
            f"({smem / 1024:.1f} KB)")
        if m:
            log(f"  wrapper({' '.join(m.group(1).split())})")
        if not cubins:
            problems.append(f"{prefix}: no cubin kept")
            continue
        cubin = os.path.join(out, prefix + ".cubin")
        shutil.copyfile(cubins[-1], cubin)
        regs = "?"
        if cuobjdump:
            res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin],
                                 capture_output=True, text=True).stdout
            for fn, r in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", res):
                vals = dict(kv.split(":") for kv in r.split() if ":" in kv)
                regs = vals.get("REG", "?")
                log(f"  registers {vals.get('REG')}, stack {vals.get('STACK')} B, "
                    f"local {vals.get('LOCAL')} B, static shared {vals.get('SHARED')} B")
                if (int(vals.get("STACK", 0)) or int(vals.get("LOCAL", 0))) \
                        and not args.allow_spills:
                    problems.append(f"{prefix}: stack/local memory (spills)")
        else:
            problems.append("no cuobjdump found: resource usage not checked")
        if not nvdisasm:
            problems.append("no nvdisasm found: SASS not checked")
            continue
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
        if "/*0000*/" not in sass:
            problems.append(f"{prefix}: could not disassemble the cubin")
        if args.keep_sass:
            with open(os.path.join(out, prefix + ".sass"), "w") as f:
                f.write(sass)
        ops, wide, hg = sass_facts(sass)
        log(f"  SASS: HGMMA {ops['HGMMA']} {dict(hg)}")
        log(f"  SASS: LDGSTS {ops['LDGSTS']}, SHFL {ops['SHFL']}, BAR {ops['BAR']}, "
            f"SYNCS {ops['SYNCS']}, HMMA {ops['HMMA']}, LDSM {ops['LDSM']}, "
            f"LDL {ops['LDL']}, STL {ops['STL']}; RED/STG widths {dict(wide)}")
        summary.append(f"{prefix}: {regs} regs, smem {smem / 1024:.1f} KB, "
                       f"HGMMA {ops['HGMMA']}, LDL/STL {ops['LDL'] + ops['STL']}")
        if not ops["HGMMA"]:
            problems.append(f"{prefix}: no HGMMA in the SASS")
        if (ops["LDL"] or ops["STL"]) and not args.allow_spills:
            problems.append(f"{prefix}: local memory (LDL {ops['LDL']}, STL {ops['STL']})")
        scalar = {k: v for k, v in wide.items() if k.startswith("RED") and k.endswith(".F32")}
        if scalar:
            problems.append(f"{prefix}: scalar fp32 RED present: {scalar}")
        if det:
            if any(k.startswith("RED") for k in wide):
                problems.append(f"{prefix}: RED in the deterministic kernel")
            if not wide.get("STG.128"):
                problems.append(f"{prefix}: no 16-byte STG in the deterministic kernel")
        elif not any(k.startswith("RED") and k.endswith("F32x4") for k in wide):
            problems.append(f"{prefix}: no 16-byte (F32x4) RED in the SASS")

    log(f"done in {time.time() - t_start:.1f}s")
    for s in summary:
        log("  " + s)
    if problems:
        raise SystemExit("check_bwd_wgmma_build: FAILED\n  " + "\n  ".join(problems))
    log(f"OK: {', '.join(prefixes)}")


if __name__ == "__main__":
    main()
