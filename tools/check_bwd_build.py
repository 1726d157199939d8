#!/usr/bin/env python
"""Prove that the sparse MLA backward (jax_dsa/kernels/sm90/sparse_mla_bwd.py) builds on a
machine without a GPU, and report what ptxas made of it.

    python tools/check_bwd_v2_build.py [--out /tmp/jax_dsa_bwd_v2_check] [--only bf16_d576 ...]
                                       [--no-link] [--keep-sass]

1. compiles the four specializations (bf16/f16 x Dqk 512/576) for sm_90a (CUTE_DSL_ARCH=sm_90a,
   ptxas -v) and exports each with export_to_c into --out (prefix jax_dsa_bwd_<dt>_d<D>, the
   names ffi/sparse_mla_bwd.cc looks up, so the scratch library below is exactly what the
   handler would launch);
2. from the kept cubin: registers, stack frame, spill stores/loads (cuobjdump
   --dump-resource-usage), static+dynamic shared memory, and SASS facts: HGMMA / HMMA counts,
   RED instructions by vector width (REDG ... F32, F32x2, F32x4), LDL/STL (local memory);
   fails on local memory, on any scalar fp32 RED, or when no F32x4 RED is present;
3. writes a jax_dsa_kernels.h listing the exports, compiles ffi/sparse_mla_bwd.cc (unchanged)
   against it and links a throw-away shared library (-Wl,--no-undefined), which proves that v2's
   compiled callable has exactly v1's argument list.

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
SPECS = [("bf16", 512), ("bf16", 576), ("f16", 512), ("f16", 576)]


def log(msg):
    print(f"[check_bwd_v2_build] {msg}", flush=True)


def find_tool(name):
    cands = [os.environ.get(name.upper()), shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands += sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"), reverse=True)
    cands += sorted(glob.glob(f"/tmp/*/nvidia/cu*/bin/{name}"), reverse=True)
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def sass_facts(sass):
    ops = collections.Counter()
    reds = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(1)
        base = op.split(".")[0]
        ops[base] += 1
        if base in ("RED", "REDG", "ATOMG", "ATOM"):
            w = re.search(r"\.(F32x4|F32x2|F32|F16x2|BF16x2)\b", op)
            reds[f"{base}.{w.group(1) if w else op}"] += 1
    return ops, reds


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/jax_dsa_bwd_v2_check")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to build")
    ap.add_argument("--no-link", action="store_true", help="skip the FFI handler link step")
    ap.add_argument("--keep-sass", action="store_true", help="write <prefix>.sass into --out")
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
    from jax_dsa.kernels.sm90.sparse_mla_bwd import compile_bwd

    cuobjdump = find_tool("cuobjdump")
    nvdisasm = find_tool("nvdisasm")
    log(f"cuobjdump: {cuobjdump}, nvdisasm: {nvdisasm}")
    if nvdisasm:  # cuobjdump -sass runs nvdisasm from PATH
        os.environ["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + os.environ["PATH"]
    dtypes = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}
    prefixes, problems = [], []
    for dname, d in SPECS:
        prefix = f"jax_dsa_bwd_{dname}_d{d}"
        if args.only and not any(o in prefix for o in args.only):
            continue
        before = set(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True))
        t0 = time.time()
        compiled = compile_bwd(dtypes[dname], d, options="--ptxas-options '-v'")
        compiled.export_to_c(out, prefix, prefix)
        prefixes.append(prefix)
        dt = time.time() - t0
        cubins = sorted(set(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True))
                        - before)
        if not cubins:
            problems.append(f"{prefix}: no cubin kept")
            log(f"{prefix}: compiled+exported in {dt:.1f}s (no cubin kept)")
            continue
        cubin = cubins[-1]
        log(f"{prefix}: compiled+exported in {dt:.1f}s; cubin {os.path.basename(cubin)}")
        if not cuobjdump:
            problems.append("no cuobjdump found: SASS facts not checked")
            continue
        res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin],
                             capture_output=True, text=True).stdout
        for line in res.splitlines():
            if "REG:" in line or "Function" in line:
                log("  " + line.strip())
        m = re.search(r"STACK:(\d+)", res)
        if m and int(m.group(1)) > 0:
            problems.append(f"{prefix}: stack frame {m.group(1)} B (local memory)")
        sass = subprocess.run([nvdisasm, "-c", cubin] if nvdisasm else
                              [cuobjdump, "-sass", cubin], capture_output=True,
                              text=True).stdout
        if "/*0000*/" not in sass:
            problems.append(f"{prefix}: could not disassemble the cubin (nvdisasm missing?)")
        if args.keep_sass:
            with open(os.path.join(out, prefix + ".sass"), "w") as f:
                f.write(sass)
        ops, reds = sass_facts(sass)
        log(f"  SASS: HGMMA {ops['HGMMA']}, HMMA {ops['HMMA']}, LDSM {ops['LDSM']}, "
            f"SHFL {ops['SHFL']}, LDGSTS {ops['LDGSTS']}, LDL {ops['LDL']}, STL {ops['STL']}, "
            f"BAR {ops['BAR']}")
        log(f"  RED/ATOM by width: {dict(reds)}")
        if ops["LDL"] or ops["STL"]:
            problems.append(f"{prefix}: local memory (LDL {ops['LDL']}, STL {ops['STL']})")
        if not any(k.endswith("F32x4") for k in reds):
            problems.append(f"{prefix}: no 16-byte (F32x4) RED in the SASS")
        scalar = {k: v for k, v in reds.items() if k.endswith(".F32")}
        if scalar:
            problems.append(f"{prefix}: scalar fp32 RED present: {scalar}")

    if prefixes and not args.no_link:
        import jax

        sys.path.insert(0, os.path.join(ROOT, "tools"))
        import build_kernels  # reuse the project's CUDA / runtime lookup

        cuda_inc, cudart = build_kernels.find_cuda()
        dialect_rt = build_kernels.find_dialect_runtime()
        lines = ["// Generated by tools/check_bwd_v2_build.py (scratch build).", "#pragma once"]
        lines += [f'#include "{p}.h"' for p in prefixes]
        lines.append("#define JAX_DSA_BWD_SPECS(X) " + " ".join(f"X({p})" for p in prefixes))
        with open(os.path.join(out, "jax_dsa_kernels.h"), "w") as f:
            f.write("\n".join(lines) + "\n")
        cc = os.path.join(ROOT, "ffi", "sparse_mla_bwd.cc")
        obj = os.path.join(out, "ffi_sparse_mla_bwd.o")
        subprocess.run([args.cxx, "-std=c++17", "-O2", "-fPIC", "-c", cc, "-o", obj, "-I", out,
                        "-isystem", jax.ffi.include_dir(), "-isystem", cuda_inc,
                        "-Wall", "-Werror"], check=True)
        vscript = os.path.join(out, "exports.map")
        with open(vscript, "w") as f:
            f.write("{ global: JaxDsa*; local: *; };\n")
        lib = os.path.join(out, "libjax_dsa_bwd_v2_check.so")
        subprocess.run([args.cxx, "-shared", "-o", lib,
                        *[os.path.join(out, p + ".o") for p in prefixes], obj, dialect_rt,
                        cudart, "-ldl", "-lrt", "-lpthread", "-static-libgcc",
                        "-Wl,--exclude-libs,ALL", f"-Wl,--version-script={vscript}",
                        "-Wl,--no-undefined", "-Wl,-O1", "-Wl,--gc-sections", "-s"],
                       check=True)
        exported = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True,
                                  text=True, check=True).stdout.split()
        for sym in ("JaxDsaSparseMlaBwdSm90", "JaxDsaBwdInit", "JaxDsaBwdNumKernels"):
            if sym not in exported:
                problems.append(f"{sym} not exported from {lib}")
        log(f"linked the unchanged FFI handler with the v2 exports: {lib}")

    log(f"done in {time.time() - t_start:.1f}s")
    if problems:
        raise SystemExit("check_bwd_v2_build: FAILED\n  " + "\n  ".join(problems))
    log(f"OK: {', '.join(prefixes)}")


if __name__ == "__main__":
    main()
