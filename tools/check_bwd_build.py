#!/usr/bin/env python
"""Prove that the sparse MLA backward builds on a machine without a GPU.

    python tools/check_bwd_build.py [--out /tmp/jax_dsa_bwd_check] [--only bf16_d576 ...]

1. compiles the four backward specializations (bf16/f16 x Dqk 512/576) with CuTe DSL for sm_90a
   (CUTE_DSL_ARCH=sm_90a) and exports each with export_to_c into --out;
2. reads each kernel's cubin (kept with CUTE_DSL_KEEP=cubin) and prints its register count and
   stack frame (a frame > 0 means local-memory spills; --allow-spills to accept them);
3. writes a jax_dsa_kernels.h listing the exports (JAX_DSA_BWD_SPECS), compiles
   ffi/sparse_mla_bwd.cc against it, jax's FFI headers and CUDA's runtime headers, and links a
   throw-away shared library the way tools/build_kernels.py does (-Wl,--no-undefined), then
   checks that JaxDsaSparseMlaBwdSm90 / JaxDsaBwdInit are exported and every export is used.

Nothing in the source tree is written. Needs nvidia-cutlass-dsl, jax, g++ and CUDA's
cuda_runtime.h + libcudart_static.a (CUDA_HOME), like tools/build_kernels.py.
"""

import argparse
import glob
import os
import shutil
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = [("bf16", 512), ("bf16", 576), ("f16", 512), ("f16", 576)]


def log(msg):
    print(f"[check_bwd_build] {msg}", flush=True)


def run(cmd):
    log(" ".join(cmd) if len(" ".join(cmd)) < 300 else " ".join(cmd)[:300] + " ...")
    subprocess.run(cmd, check=True)


def cubin_resources(path):
    """(registers, stack frame bytes) of the kernel in a cubin, from its .nv.info attributes
    (EIATTR_REGCOUNT = 0x2f, EIATTR_FRAME_SIZE = 0x11)."""
    d = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    regs = frame = None
    for s in secs:
        name = d[stro + s[0]: d.index(b"\0", stro + s[0])].decode()
        if name != ".nv.info":
            continue
        p, end = s[4], s[4] + s[5]
        while p < end:
            fmt, attr = d[p], d[p + 1]
            if fmt == 0x04:  # attribute with a payload
                sz, = struct.unpack_from("<H", d, p + 2)
                if sz >= 8 and attr in (0x2F, 0x11):
                    _, val = struct.unpack_from("<II", d, p + 4)
                    if attr == 0x2F:
                        regs = val
                    else:
                        frame = val
                p += 4 + sz
            elif fmt == 0x03:
                p += 4
            elif fmt == 0x02:
                p += 4
            elif fmt == 0x01:
                p += 2
            else:
                break
    return regs, frame


def find_toolchain():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import build_kernels  # the project's build script: reuse its CUDA / runtime lookup

        return build_kernels.find_cuda(), build_kernels.find_dialect_runtime()
    finally:
        sys.path.pop(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/jax_dsa_bwd_check")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to build")
    ap.add_argument("--allow-spills", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    dump = os.path.join(out, "dump")
    os.makedirs(dump)
    # Read by CuTe DSL when it is imported: keep every kernel's cubin for the resource report.
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump

    import jax

    (cuda_inc, cudart), dialect_rt = find_toolchain()
    ffi_inc = jax.ffi.include_dir()

    sys.path.insert(0, ROOT)
    import cutlass
    from jax_dsa.kernels.sm90.sparse_mla_bwd import compile_bwd

    dtypes = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}
    prefixes, problems = [], []
    for dname, d in SPECS:
        prefix = f"jax_dsa_bwd_{dname}_d{d}"
        if args.only and not any(o in prefix for o in args.only):
            continue
        before = set(glob.glob(os.path.join(dump, "*.cubin")))
        t0 = time.time()
        compiled = compile_bwd(dtypes[dname], d)
        compiled.export_to_c(out, prefix, prefix)
        prefixes.append(prefix)
        cubins = sorted(set(glob.glob(os.path.join(dump, "*.cubin"))) - before)
        res = cubin_resources(cubins[0]) if cubins else (None, None)
        log(f"exported {prefix} in {time.time() - t0:.1f}s: {res[0]} registers, "
            f"{res[1]} B stack frame")
        if res[1] and not args.allow_spills:
            problems.append(f"{prefix}: {res[1]} B of local memory (spills)")

    lines = ["// Generated by tools/check_bwd_build.py (scratch build).", "#pragma once"]
    lines += [f'#include "{p}.h"' for p in prefixes]
    lines.append("#define JAX_DSA_BWD_SPECS(X) " + " ".join(f"X({p})" for p in prefixes))
    with open(os.path.join(out, "jax_dsa_kernels.h"), "w") as f:
        f.write("\n".join(lines) + "\n")

    cc = os.path.join(ROOT, "ffi", "sparse_mla_bwd.cc")
    obj = os.path.join(out, "ffi_sparse_mla_bwd.o")
    run([args.cxx, "-std=c++17", "-O2", "-fPIC", "-c", cc, "-o", obj, "-I", out,
         "-isystem", ffi_inc, "-isystem", cuda_inc, "-Wall", "-Werror"])
    syms = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    unused = [p for p in prefixes if f"_mlir_{p}_cuda_init" not in syms]
    if unused:
        problems.append(f"exports not used by the handler: {unused}")

    vscript = os.path.join(out, "exports.map")
    with open(vscript, "w") as f:
        f.write("{ global: JaxDsa*; local: *; };\n")
    lib = os.path.join(out, "libjax_dsa_bwd_check.so")
    kobjs = [os.path.join(out, p + ".o") for p in prefixes]
    run([args.cxx, "-shared", "-o", lib, *kobjs, obj, dialect_rt, cudart,
         "-ldl", "-lrt", "-lpthread", "-static-libgcc",
         "-Wl,--exclude-libs,ALL", f"-Wl,--version-script={vscript}",
         "-Wl,--no-undefined", "-Wl,-O1", "-Wl,--gc-sections", "-s"])
    exported = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True,
                              text=True, check=True).stdout.split()
    for sym in ("JaxDsaSparseMlaBwdSm90", "JaxDsaBwdInit", "JaxDsaBwdNumKernels"):
        if sym not in exported:
            problems.append(f"{sym} not exported from {lib}")
    log(f"linked {lib} ({os.path.getsize(lib) / 1e6:.1f} MB) in {time.time() - t_start:.1f}s")
    if problems:
        raise SystemExit("check_bwd_build: FAILED\n  " + "\n  ".join(problems))
    log(f"OK: {', '.join(prefixes)}")


if __name__ == "__main__":
    main()
