#!/usr/bin/env python
"""Ahead-of-time build of jax_dsa's GPU kernels into one self-contained shared library.

    CUTE_DSL_ARCH=sm_90a python tools/build_kernels.py --out jax_dsa/_lib
    ... --experimental --only wgp --add   # candidates added to the exports already built

1. compiles every kernel specialization with CuTe DSL (no GPU needed) and exports each with
   `export_to_c` (a header + a PIC object holding the cubin) into --build-dir;
2. generates jax_dsa_kernels.h (includes those headers, lists the specializations);
3. compiles ffi/*.cc against jax's FFI headers and CUDA's runtime headers;
4. links lib<name>.so with the CuTe DSL wheel's libcuda_dialect_runtime_static.a and CUDA's
   libcudart_static.a; only the JaxDsa* entry points are exported. The result needs only
   libc/libstdc++ (libcuda is opened at run time by the static CUDA runtime).

nvidia-cutlass-dsl is a build-time dependency only.
"""

import argparse
import functools
import glob
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB_NAME = "libjax_dsa_sm90.so"

# Forward variants: export-prefix tag -> (kernel module, compile function). By default the FFI
# handler runs "smallh2" (two consumers; "smallh" has one) for H <= 32 and "ws2" above;
# JAX_DSA_FWD_IMPL=<tag> forces another one.
# (sparse_mla_fwd.py holds the contract and the base class of ws / ws2; the earlier mma.sync
# and plain wgmma forward kernels are in git history.)
FWD_VARIANTS = {
    "ws2": ("sparse_mla_fwd_ws2", "compile_fwd_ws2"),
    "ws": ("sparse_mla_fwd_ws", "compile_fwd_ws"),
    "smallh": ("sparse_mla_fwd_smallh", "compile_fwd_smallh"),
    "smallh2": ("sparse_mla_fwd_smallh", "compile_fwd_smallh2"),
    "simt": ("sparse_mla_fwd_simt", "compile_fwd_simt"),
}
# Backward variants, each exported in atomic and deterministic form: "wg" (wgmma, the default).
BWD_VARIANTS = {
    "wg": ("sparse_mla_bwd_wgmma", "compile_bwd_wgmma"),
}
# Entries are (module, compile function[, its keyword arguments]), so a tuning candidate can be
# the same kernel with another parameter (e.g. {"wg0_chunks": 2}).
# Experimental variants (not defaults): built only with --experimental, selected with
# JAX_DSA_FWD_IMPL / JAX_DSA_BWD_IMPL=<tag>; their GPU status goes in docs/performance.md (the
# ones measured slower, e.g. ws2c and wgc, were removed: git history).
# (ws2q and wgt became the v11 defaults, wgk3 the v12 one, wgr the v15 one, ws2g and wgf the
# v16 ones; wga, wgk2, ws2u, ws2v, ws2uv, ws2k, wgr2, wgr4, ws2i (twice), the grouped
# wgg2m / wgg4m / wgg8m and the RED warpgroup wgq / wgg2q / wgg4q / wgg8q / wgg4q2 / wgg4q3
# measured no faster: docs/performance.md.)
EXPERIMENTAL_FWD = {}
EXPERIMENTAL_BWD = {
    # the v14 dKV chunk pairs instead of the rolling chunk pipeline (the default since v15)
    "wgp": ("sparse_mla_bwd_wgmma", "compile_bwd_wgmma", {"rolling_chunks": False}),
}
# A grouped candidate is tagged wgg<G><suffix> (e.g. wgg4m, in git history): JAX_DSA_BWD_IMPL set
# to it groups the calls with H * G = 64 and runs that export there (ffi GroupedBwdTag).

# The grouped backward (default at H = 32, 16 and 8; jax_dsa._core._backward_group): G tokens of
# 64 / G heads run as one 64-row token over the union of their lists (jax_dsa.grouping), called
# per call through its own FFI handler. Atomic form only (deterministic=True never groups); each
# group size also gets its list-union kernel (ffi/group_union.cc).
GROUPED_BWD = {
    "wgg2": ("sparse_mla_bwd_wgmma", "compile_bwd_wgmma", {"group": 2}),
    "wgg4": ("sparse_mla_bwd_wgmma", "compile_bwd_wgmma", {"group": 4}),
    "wgg8": ("sparse_mla_bwd_wgmma", "compile_bwd_wgmma", {"group": 8}),
}


def _group_of(entry):
    """The group size of a grouped backward variant's table entry, else None."""
    return entry[2].get("group") if len(entry) > 2 else None


def bwd_forms(entry):
    """The deterministic flags a backward variant is exported with: grouped ones atomic only."""
    return (False,) if _group_of(entry) else (False, True)


def union_groups(experimental):
    """Group sizes that need a list-union kernel: those of the grouped backward variants."""
    entries = list(GROUPED_BWD.values()) + (list(EXPERIMENTAL_BWD.values()) if experimental else [])
    return sorted({_group_of(e) for e in entries if _group_of(e)})
# (dtype name, Dqk); one export per variant and spec.
FWD_SPECS = [("bf16", 512), ("bf16", 576), ("f16", 512), ("f16", 576)]


def log(msg):
    print(f"[build_kernels] {msg}", flush=True)


def run(cmd):
    log(" ".join(cmd) if len(" ".join(cmd)) < 400 else " ".join(cmd)[:400] + " ...")
    subprocess.run(cmd, check=True)


def find_cuda():
    """Return (include_dir, libcudart_static.a)."""
    cands = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.environ[env])
    cands += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    # The pip wheel nvidia-cuda-runtime(-cuXX) ships headers and (in some versions) the static lib.
    for sp in sys.path:
        cands += glob.glob(os.path.join(sp, "nvidia", "cuda_runtime"))
        cands += glob.glob(os.path.join(sp, "nvidia", "cu1*"))
    for c in cands:
        inc = os.path.join(c, "include")
        libs = [os.path.join(c, d, "libcudart_static.a") for d in ("lib64", "lib", "lib/x64")]
        libs += glob.glob(os.path.join(c, "targets", "*", "lib", "libcudart_static.a"))
        lib = next((p for p in libs if os.path.isfile(p)), None)
        if os.path.isfile(os.path.join(inc, "cuda_runtime.h")) and lib:
            return inc, lib
    raise SystemExit(
        "build_kernels: need CUDA's cuda_runtime.h and libcudart_static.a "
        "(set CUDA_HOME); searched: " + ", ".join(cands)
    )


def find_dialect_runtime():
    import nvidia_cutlass_dsl  # noqa: F401  (namespace package of the wheel)

    for base in nvidia_cutlass_dsl.__path__:
        hits = glob.glob(os.path.join(base, "**", "libcuda_dialect_runtime_static.a"), recursive=True)
        if hits:
            return hits[0]
    raise SystemExit("build_kernels: libcuda_dialect_runtime_static.a not found in nvidia-cutlass-dsl")


def compile_fn(mod_name, fn_name, kwargs=None):
    """The compile function of a variant table entry, with its keyword arguments bound."""
    import importlib

    fn = getattr(importlib.import_module(f"jax_dsa.kernels.sm90.{mod_name}"), fn_name)
    return functools.partial(fn, **kwargs) if kwargs else fn


def _variants(stable, experimental, use_experimental):
    """(tag, compile function, table entry) triples; experimental modules that do not exist are
    skipped."""
    out = [(tag, compile_fn(*entry), entry) for tag, entry in stable.items()]
    for tag, entry in (experimental.items() if use_experimental else ()):
        if not os.path.isfile(os.path.join(ROOT, "jax_dsa", "kernels", "sm90", entry[0] + ".py")):
            log(f"experimental {entry[0]} not present: skipped")
            continue
        out.append((tag, compile_fn(*entry), entry))
    return out


def export_jobs(experimental=False):
    """[(export prefix, compile thunk)] of every specialization, in link order."""
    import cutlass

    sys.path.insert(0, ROOT)
    dtypes = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}
    jobs = []
    for tag, compile_fn, _ in _variants(FWD_VARIANTS, EXPERIMENTAL_FWD, experimental):
        for dname, d in FWD_SPECS:
            jobs.append((f"jax_dsa_fwd{tag}_{dname}_d{d}",
                         lambda f=compile_fn, dt=dtypes[dname], d=d: f(dt, d)))
    for tag, compile_fn, entry in _variants({**BWD_VARIANTS, **GROUPED_BWD}, EXPERIMENTAL_BWD,
                                            experimental):
        for dname, d in FWD_SPECS:  # the backward has the same (dtype, Dqk) list
            for det in bwd_forms(entry):
                jobs.append((f"jax_dsa_bwd{tag}{'det' if det else ''}_{dname}_d{d}",
                             lambda f=compile_fn, dt=dtypes[dname], d=d, det=det:
                             f(dt, d, deterministic=det)))
    from jax_dsa.kernels.sm90.sparse_mla_dkv_reduce import compile_dkv_reduce

    for d in sorted({d for _, d in FWD_SPECS}):  # the deterministic dkv reduction (fp32 only)
        jobs.append((f"jax_dsa_dkvreduce_d{d}", lambda d=d: compile_dkv_reduce(d)))
    # The list union of each grouped backward's group size (ffi/group_union.cc).
    jobs += union_exports(union_groups(experimental))
    return jobs


def union_exports(groups):
    """[(export prefix, compile thunk)] of the list-union kernels: each group size with every
    hash-table size (group_union.TABLES; the handler picks per call, ffi/group_union.cc)."""
    if not groups:
        return []
    from jax_dsa.kernels.sm90.group_union import TABLES, compile_group_union

    return [(f"jax_dsa_groupunion_g{g}_t{t}", lambda g=g, t=t: compile_group_union(g, t))
            for g in groups for t in TABLES]


def _export_one(prefix, build_dir, experimental):
    """Compile and export one specialization (also the body of a worker process)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    t0 = time.time()
    thunk = dict(export_jobs(experimental))[prefix]
    thunk().export_to_c(build_dir, prefix, prefix)
    return time.time() - t0


def export_kernels(build_dir, only=None, experimental=False, workers=1):
    """Export the selected specializations into build_dir; returns their prefixes. With
    workers > 1 they compile in that many processes (each compile uses one core)."""
    prefixes = [p for p, _ in export_jobs(experimental)
                if not only or any(o in p for o in only)]
    if workers <= 1:
        for prefix in prefixes:
            log(f"exported {prefix} in {_export_one(prefix, build_dir, experimental):.1f}s")
        return prefixes
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked MLIR state
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(_export_one, p, build_dir, experimental): p for p in prefixes}
        for fut in concurrent.futures.as_completed(futures):
            log(f"exported {futures[fut]} in {fut.result():.1f}s")
    return prefixes


def write_index_header(build_dir, prefixes):
    lines = ["// Generated by tools/build_kernels.py. Do not edit.", "#pragma once"]
    lines += [f'#include "{p}.h"' for p in prefixes]
    fwd = [p for p in prefixes if p.startswith("jax_dsa_fwd")]
    lines.append("#define JAX_DSA_FWD_SPECS(X) " + " ".join(f"X({p})" for p in fwd))
    bwd = [p for p in prefixes if p.startswith("jax_dsa_bwd")]
    lines.append("#define JAX_DSA_BWD_SPECS(X) " + " ".join(f"X({p})" for p in bwd))
    red = [p for p in prefixes if p.startswith("jax_dsa_dkvreduce")]
    lines.append("#define JAX_DSA_REDUCE_SPECS(X) " + " ".join(f"X({p})" for p in red))
    union = [p for p in prefixes if p.startswith("jax_dsa_groupunion")]
    lines.append("#define JAX_DSA_UNION_SPECS(X) " + " ".join(f"X({p})" for p in union))
    with open(os.path.join(build_dir, "jax_dsa_kernels.h"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "jax_dsa", "_lib"))
    ap.add_argument("--build-dir", default=os.path.join(ROOT, ".kbuild"))
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--only", nargs="*", help="substrings of the export prefixes to build")
    ap.add_argument("--experimental", action="store_true",
                    help="also build the not-yet-validated candidate variants (EXPERIMENTAL_*)")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4),
                    help="kernels compiled in parallel processes (default: the CPU count, at "
                         "most 4)")
    ap.add_argument("--relink", action="store_true",
                    help="reuse the kernel exports already in --build-dir (after an edit of ffi/)")
    ap.add_argument("--add", action="store_true",
                    help="export the --only selection (e.g. --experimental --only wgp) into "
                         "--build-dir next to the exports already there, then link them all")
    args = ap.parse_args()

    arch = os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if arch != "sm_90a":
        raise SystemExit(f"build_kernels: CUTE_DSL_ARCH must be sm_90a, got {arch}")
    t_start = time.time()
    os.makedirs(args.build_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    if not args.relink and not args.add:
        for ext in ("*.h", "*.o", "*.map"):  # stale exports would otherwise be linked in
            for stale in glob.glob(os.path.join(args.build_dir, ext)):
                os.remove(stale)

    import jax

    ffi_inc = jax.ffi.include_dir()
    cuda_inc, cudart = find_cuda()
    dialect_rt = find_dialect_runtime()
    log(f"CUDA headers {cuda_inc}; cudart {cudart}; dialect runtime {dialect_rt}")

    if args.add:
        export_kernels(args.build_dir, args.only, args.experimental, args.jobs)
    if args.relink or args.add:
        prefixes = [os.path.basename(h)[:-2] for h in glob.glob(os.path.join(args.build_dir, "*.h"))
                    if os.path.basename(h).startswith("jax_dsa_") and h.endswith(".h")
                    and not h.endswith("jax_dsa_kernels.h")]
    else:
        prefixes = export_kernels(args.build_dir, args.only, args.experimental, args.jobs)
    write_index_header(args.build_dir, prefixes)

    kernel_objs = sorted(os.path.join(args.build_dir, p + ".o") for p in prefixes)
    ffi_objs = []
    for cc in sorted(glob.glob(os.path.join(ROOT, "ffi", "*.cc"))):
        obj = os.path.join(args.build_dir, "ffi_" + os.path.basename(cc)[:-3] + ".o")
        run([args.cxx, "-std=c++17", "-O2", "-fPIC", "-c", cc, "-o", obj,
             "-I", args.build_dir, "-isystem", ffi_inc, "-isystem", cuda_inc, "-Wall"])
        ffi_objs.append(obj)
    objs = kernel_objs + ffi_objs

    # Every export must be referenced by a handler, or the linker would silently drop it.
    ffi_syms = subprocess.run(["nm", *ffi_objs], capture_output=True, text=True, check=True).stdout
    missing = [p for p in prefixes if f"_mlir_{p}_cuda_init" not in ffi_syms]
    if missing:
        raise SystemExit(f"build_kernels: exports not used by any FFI handler: {missing}")

    # Export only the JaxDsa* entry points; everything else (incl. the static CUDA runtime)
    # stays local so it can never interpose on, or be interposed by, XLA's own CUDA runtime.
    vscript = os.path.join(args.build_dir, "exports.map")
    with open(vscript, "w") as f:
        f.write("{ global: JaxDsa*; local: *; };\n")
    out = os.path.join(args.out, LIB_NAME)
    tmp = out + ".tmp"
    run([args.cxx, "-shared", "-o", tmp, *objs, dialect_rt, cudart,
         "-ldl", "-lrt", "-lpthread", "-static-libgcc",
         "-Wl,--exclude-libs,ALL", f"-Wl,--version-script={vscript}",
         "-Wl,--no-undefined", "-Wl,-O1", "-Wl,--gc-sections", "-s"])
    os.replace(tmp, out)

    needed = subprocess.run(["readelf", "-d", out], capture_output=True, text=True).stdout
    needed = [l.split("[")[1].rstrip("]") for l in needed.splitlines() if "(NEEDED)" in l]
    exported = subprocess.run(["nm", "-D", "--defined-only", out], capture_output=True, text=True).stdout
    exported = sorted(l.split()[-1] for l in exported.splitlines() if l.strip())
    allowed = ("libc.so", "libstdc++.so", "libm.so", "libdl.so", "librt.so", "libpthread.so",
               "ld-linux", "libcuda.so")
    bad = [n for n in needed if not n.startswith(allowed)]
    log(f"built {out} ({os.path.getsize(out) / 1e6:.1f} MB) in {time.time() - t_start:.1f}s")
    log(f"NEEDED: {needed}; exported: {exported}")
    if bad:
        raise SystemExit(f"build_kernels: unexpected runtime dependencies {bad}")


if __name__ == "__main__":
    main()
