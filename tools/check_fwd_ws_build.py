#!/usr/bin/env python
"""Prove that the warp-specialized sparse MLA forward (sparse_mla_fwd_ws) builds without a GPU.

    python tools/check_fwd_ws_build.py [--out /tmp/jax_dsa_fwd_ws_check] [--only bf16_d576 ...]

For each specialization (bf16/f16 x Dqk 512/576):
1. compiles compile_fwd_ws for sm_90a (CUTE_DSL_ARCH=sm_90a) and exports it with export_to_c
   into --out (prefix jax_dsa_fwd_ws_<dtype>_d<Dqk>, the naming tools/build_kernels.py would use
   for a variant tagged "ws");
2. keeps the cubin (CUTE_DSL_KEEP=cubin,ptx) and reports registers, stack frame (local memory)
   and static shared memory, from cuobjdump --dump-resource-usage when a cuobjdump is found
   (CUOBJDUMP, PATH, CUDA_HOME/bin, /tmp/*/nvidia/cu*/bin), else from the cubin's .nv.info;
3. with cuobjdump, checks the SASS: HGMMA present (wgmma), USETMAXREG present (register
   reallocation kept), no LDL/STL (no local memory);
4. reports the dynamic shared memory the launch asks for (must be <= 227 KB).

Nothing in the source tree is written. Exit status 1 when a check fails.
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
SMEM_LIMIT = 227 * 1024


def log(msg):
    print(f"[check_fwd_ws_build] {msg}", flush=True)


def find_cuobjdump():
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", "cuobjdump"))
    cands += sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"), reverse=True)
    cands += sorted(glob.glob("/tmp/*/nvidia/cu*/bin/cuobjdump"), reverse=True)
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def find_tool(name):
    cands = [os.environ.get(name.upper()), shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands += sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"), reverse=True)
    cands += sorted(glob.glob(f"/tmp/*/nvidia/cu*/bin/{name}"), reverse=True)
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nvinfo_resources(path):
    """(registers, stack frame bytes) from the cubin's .nv.info (EIATTR_REGCOUNT 0x2f,
    EIATTR_FRAME_SIZE 0x11)."""
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
            if fmt == 0x04:
                sz, = struct.unpack_from("<H", d, p + 2)
                if sz >= 8 and attr in (0x2F, 0x11):
                    val = struct.unpack_from("<II", d, p + 4)[1]
                    if attr == 0x2F:
                        regs = val
                    else:
                        frame = val
                p += 4 + sz
            elif fmt in (0x02, 0x03):
                p += 4
            elif fmt == 0x01:
                p += 2
            else:
                break
    return regs, frame


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/jax_dsa_fwd_ws_check")
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to build")
    ap.add_argument("--keep-sass", action="store_true", help="write <prefix>.sass into --out")
    args = ap.parse_args()

    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    dump = os.path.join(out, "dump")
    os.makedirs(dump)
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = "cubin,ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump

    sys.path.insert(0, ROOT)
    import cutlass
    from jax_dsa.kernels.sm90.sparse_mla_fwd_ws import SparseMlaFwdWsSm90, compile_fwd_ws

    cuobjdump = find_cuobjdump()
    nvdisasm = find_tool("nvdisasm")
    ptxas = find_tool("ptxas")
    log(f"cuobjdump: {cuobjdump}, nvdisasm: {nvdisasm}, ptxas: {ptxas}")
    dtypes = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}
    problems = []
    for dname, d in SPECS:
        prefix = f"jax_dsa_fwd_ws_{dname}_d{d}"
        if args.only and not any(o in prefix for o in args.only):
            continue
        before = set(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True))
        t0 = time.time()
        compiled = compile_fwd_ws(dtypes[dname], d)
        compiled.export_to_c(out, prefix, prefix)
        dt = time.time() - t0
        if not os.path.isfile(os.path.join(out, prefix + ".o")):
            problems.append(f"{prefix}: export_to_c wrote no object")
        cubins = sorted(set(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True))
                        - before)
        if not cubins:
            problems.append(f"{prefix}: no cubin kept")
            log(f"{prefix}: compiled+exported in {dt:.1f}s (no cubin kept)")
            continue
        cubin = cubins[-1]
        regs, frame = nvinfo_resources(cubin)
        info = f"{regs} registers, {frame} B stack frame"
        if cuobjdump:
            res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin],
                                 capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
            if m:
                regs, frame = int(m.group(1)), int(m.group(2))
                info = (f"REG {m.group(1)} STACK {m.group(2)} static SHARED {m.group(3)} "
                        f"LOCAL {m.group(4)}")
                if int(m.group(4)):
                    problems.append(f"{prefix}: {m.group(4)} B local memory")
        if nvdisasm or cuobjdump:
            if nvdisasm:  # cuobjdump -sass itself needs nvdisasm on PATH
                sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True,
                                      text=True).stdout
            else:
                sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True,
                                      text=True).stdout
            if args.keep_sass:
                with open(os.path.join(out, prefix + ".sass"), "w") as f:
                    f.write(sass)
            n_hgmma = len(re.findall(r"\bHGMMA\.", sass))
            n_setmax = len(re.findall(r"\bUSETMAXREG\b", sass))
            n_local = len(re.findall(r"\b(LDL|STL)(\.\w+)*\b", sass))
            n_ldgsts = len(re.findall(r"\bLDGSTS\b", sass))
            info += (f"; SASS: {n_hgmma} HGMMA, {n_setmax} USETMAXREG, {n_ldgsts} LDGSTS, "
                     f"{n_local} LDL/STL")
            if n_hgmma == 0:
                problems.append(f"{prefix}: no HGMMA in SASS")
            if n_setmax == 0:
                problems.append(f"{prefix}: no USETMAXREG in SASS")
            if n_local:
                problems.append(f"{prefix}: {n_local} local memory accesses in SASS")
        ptx = cubin[: -len(".cubin")] + ".ptx"
        if ptxas and os.path.isfile(ptx):
            # Re-assemble the kept PTX with -v for the advisories (wgmma serialization etc.).
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-O3", ptx, "-o",
                                os.path.join(out, prefix + ".ptxas.cubin")],
                               capture_output=True, text=True)
            txt = r.stdout + r.stderr
            used = re.search(r"Used (\d+) registers", txt)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
            notes = sorted(set(re.findall(r"\((C\d+)\) ([^\n]*?) in function", txt)))
            info += (f"; ptxas -v: {used.group(1) if used else '?'} registers, "
                     f"spills {spill.groups() if spill else '?'}")
            for code, msg in notes:
                log(f"{prefix}: ptxas {code}: {msg[:160]}")
                if "serializ" in msg:
                    problems.append(f"{prefix}: wgmma serialized ({msg[:120]})")
        if frame:
            problems.append(f"{prefix}: {frame} B stack frame (spills)")
        k = SparseMlaFwdWsSm90(dtypes[dname], d)
        elem = 2
        stage = k.bn * d * elem
        smem = k.bm * d * elem + 2 * stage + (0 if k.p_in_rope else 2 * k.bm * k.bn * elem)
        smem_note = f"~{smem / 1024:.1f} KB dynamic smem (+ ~1 KB flags/barriers)"
        if smem + 2048 > SMEM_LIMIT:
            problems.append(f"{prefix}: shared memory {smem} B too large")
        log(f"{prefix}: compiled+exported in {dt:.1f}s; {info}; {smem_note}")

    if problems:
        log("FAILED:\n  " + "\n  ".join(problems))
        raise SystemExit(1)
    log("OK")


if __name__ == "__main__":
    main()
