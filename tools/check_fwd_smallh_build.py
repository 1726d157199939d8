#!/usr/bin/env python
"""Prove that the few-heads forward (sparse_mla_fwd_smallh) builds on a machine without a GPU.

    python tools/check_fwd_smallh_build.py [--out /tmp/jax_dsa_fwd_smallh_check] [--only bf16_d576]

1. compiles the four specializations (bf16/f16 x Dqk 512/576) of compile_fwd_smallh for sm_90a
   (CUTE_DSL_ARCH=sm_90a) and exports each with export_to_c into --out (prefix
   jax_dsa_fwdsmallh_<dtype>_d<Dqk>, the name tools/build_kernels.py would give a "smallh" variant);
2. keeps each module's cubin (CUTE_DSL_KEEP=cubin) and reports, per kernel inside it (one per padded
   head count NP = 8/16/24/32): registers, stack frame, local memory (cuobjdump --dump-resource-usage),
   and from the SASS (nvdisasm) the HGMMA shapes and counts and any local-memory instruction
   (LDL/STL); it also prints the dynamic shared memory of each NP variant;
3. fails on spills / local memory / missing HGMMA (--allow-spills to accept spills).

cuobjdump / nvdisasm are looked up on PATH, in CUDA_HOME/bin and in /tmp/cudatools (e.g.
`pip install --target /tmp/cudatools nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump`); without them
the register count comes from the cubin's .nv.info and the SASS checks are skipped.
Nothing in the source tree is written.
"""

import argparse
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = [("bf16", 512), ("bf16", 576), ("f16", 512), ("f16", 576)]
SMEM_LIMIT = 232448  # sm_90 opt-in maximum per block (227 KB), static + dynamic


def log(msg):
    print(f"[check_fwd_smallh] {msg}", flush=True)


def find_tool(name):
    cands = [shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands += glob.glob(f"/tmp/cudatools/nvidia/*/bin/{name}")
    cands += glob.glob(f"/usr/local/cuda*/bin/{name}")
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nv_info_regs(path):
    """Fallback without cuobjdump: max EIATTR_REGCOUNT (0x2f) / EIATTR_FRAME_SIZE (0x11) in .nv.info."""
    d = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    regs, frames = [], []
    for s in secs:
        name = d[stro + s[0]: d.index(b"\0", stro + s[0])].decode()
        if not name.startswith(".nv.info"):
            continue
        p, end = s[4], s[4] + s[5]
        while p < end:
            fmt, attr = d[p], d[p + 1]
            if fmt == 0x04:
                sz, = struct.unpack_from("<H", d, p + 2)
                if sz >= 8 and attr in (0x2F, 0x11):
                    _, val = struct.unpack_from("<II", d, p + 4)
                    (regs if attr == 0x2F else frames).append(val)
                p += 4 + sz
            elif fmt in (0x02, 0x03):
                p += 4
            elif fmt == 0x01:
                p += 2
            else:
                break
    return regs, frames


def kernel_tag(fn_name):
    m = re.search(r"_(\d+)$", fn_name)
    return f"kernel#{m.group(1)}" if m else fn_name[-40:]


def report_cubin(cubin, cuobjdump, nvdisasm, problems, prefix, allow_spills):
    if cuobjdump:
        out = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
        for fn, res in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", out):
            vals = dict(kv.split(":") for kv in res.split())
            log(f"  {kernel_tag(fn)}: {vals['REG']} registers, stack {vals['STACK']} B, "
                f"local {vals['LOCAL']} B, static shared {vals['SHARED']} B")
            if (int(vals["STACK"]) or int(vals["LOCAL"])) and not allow_spills:
                problems.append(f"{prefix} {kernel_tag(fn)}: stack/local memory (spills)")
    else:
        regs, frames = nv_info_regs(cubin)
        log(f"  registers {regs}, stack frames {frames} (no cuobjdump: per-kernel names unknown)")
        if any(frames) and not allow_spills:
            problems.append(f"{prefix}: stack frame > 0 (spills)")
    if not nvdisasm:
        log("  nvdisasm not found: SASS checks skipped")
        return
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    funcs = re.split(r"\n//-+ \.text\.(\S+) -+\n", sass)
    for fn, body in zip(funcs[1::2], funcs[2::2]):
        hg = re.findall(r"HGMMA\.(\S+)", body)
        shapes = {}
        for h in hg:
            shapes[h] = shapes.get(h, 0) + 1
        local = re.findall(r"\b(LDL|STL)\b", body)
        n_ldgsts = len(re.findall(r"\bLDGSTS\b", body))
        n_bar = len(re.findall(r"\bBAR\.", body))
        log(f"  {kernel_tag(fn)} SASS: HGMMA {shapes}, LDGSTS {n_ldgsts}, BAR {n_bar}, "
            f"LDL/STL {len(local)}")
        if not hg:
            problems.append(f"{prefix} {kernel_tag(fn)}: no HGMMA in SASS")
        if local and not allow_spills:
            problems.append(f"{prefix} {kernel_tag(fn)}: local memory instructions in SASS")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/jax_dsa_fwd_smallh_check")
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to build")
    ap.add_argument("--allow-spills", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    dump = os.path.join(out, "dump")
    os.makedirs(dump)
    # Read by CuTe DSL when it is imported.
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump

    sys.path.insert(0, ROOT)
    import cutlass
    import cutlass.cute as cute
    from jax_dsa.kernels.sm90.sparse_mla_fwd_smallh import (
        SparseMlaFwdSmallHSm90, _SmallHKernel, compile_fwd_smallh)

    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    log(f"cuobjdump {cuobjdump}; nvdisasm {nvdisasm}")
    dtypes = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}
    problems = []

    # Dynamic shared memory of each NP variant (the 1 KB static reservation comes on top).
    @cute.jit
    def smem_of(np_: cutlass.Constexpr, d: cutlass.Constexpr):
        k = _SmallHKernel(cutlass.BFloat16, d, 512, np_)
        _, sQ_layout, sKV_layout, _, _ = k.layouts()
        n = k.storage(sQ_layout, sKV_layout).size_in_bytes()
        sizes[(d, np_)] = n

    sizes = {}
    for d in (512, 576):
        for np_ in SparseMlaFwdSmallHSm90.NPS:
            smem_of(np_, d)
            n = sizes[(d, np_)]
            log(f"Dqk {d} NP {np_}: dynamic shared memory {n} B (+1024 B static)")
            if n + 1024 > SMEM_LIMIT:
                problems.append(f"Dqk {d} NP {np_}: {n} + 1024 B shared memory > {SMEM_LIMIT}")

    prefixes = []
    for dname, d in SPECS:
        prefix = f"jax_dsa_fwdsmallh_{dname}_d{d}"
        if args.only and not any(o in prefix for o in args.only):
            continue
        before = set(glob.glob(os.path.join(dump, "*.cubin")))
        t0 = time.time()
        compiled = compile_fwd_smallh(dtypes[dname], d)
        compiled.export_to_c(out, prefix, prefix)
        prefixes.append(prefix)
        for ext in (".h", ".o"):
            if not os.path.isfile(os.path.join(out, prefix + ext)):
                problems.append(f"{prefix}{ext} not written")
        log(f"exported {prefix} in {time.time() - t0:.1f}s")
        cubins = sorted(set(glob.glob(os.path.join(dump, "*.cubin"))) - before)
        if not cubins:
            problems.append(f"{prefix}: no cubin kept")
        for cb in cubins:
            report_cubin(cb, cuobjdump, nvdisasm, problems, prefix, args.allow_spills)

    # The exported wrapper must take the same arguments as the wgmma kernel's (same FFI handler).
    for p in prefixes:
        hdr = open(os.path.join(out, p + ".h")).read()
        m = re.search(r"cute_dsl_" + p + r"_wrapper\(([^)]*)\)", hdr)
        if m:
            log(f"{p} wrapper({' '.join(m.group(1).split())})")
    log(f"total {time.time() - t_start:.1f}s")
    if problems:
        raise SystemExit("check_fwd_smallh_build: FAILED\n  " + "\n  ".join(problems))
    log(f"OK: {', '.join(prefixes)}")


if __name__ == "__main__":
    main()
