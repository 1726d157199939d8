#!/usr/bin/env python
"""Build jax_dsa's native library: every kernel the configuration can select, and the handlers.

    CUTE_DSL_ARCH=sm_90a python ffi/build.py --out jax_dsa/_lib     (setup.py runs this)

1. compiles each kernel specialization of EXPORTS with CuTe DSL (no GPU needed) and exports it
   with `export_to_c` (a header + a PIC object holding the cubin) into --build-dir;
2. writes jax_dsa_kernels.h (includes those headers and lists them per op) and
   jax_dsa_constants.h (the constants of jax_dsa/cute/constants.py, shared with Python);
3. compiles ffi/*.cc against jax's FFI headers and CUDA's runtime headers;
4. links libjax_dsa_sm90.so with the CuTe DSL wheel's libcuda_dialect_runtime_static.a and
   CUDA's libcudart_static.a; only the JaxDsa* entry points are exported, and the result needs
   only libc/libstdc++ (libcuda is opened at run time by the static CUDA runtime).

nvidia-cutlass-dsl is a build-time dependency only.
"""

import argparse
import glob
import importlib
import os
import subprocess
import sys
import time

FFI_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(FFI_DIR)
LIB_NAME = "libjax_dsa_sm90.so"
DTYPES = ("bf16", "f16")
# Exit status when this machine lacks what the build needs (CUDA's runtime headers and static
# library, a C++ compiler): setup.py then installs the reference-only package and says so.
NO_TOOLCHAIN = 3


class MissingToolchain(SystemExit):
    def __init__(self, message):
        print(f"[build] {message}", file=sys.stderr, flush=True)
        super().__init__(NO_TOOLCHAIN)


def _constants():
    sys.path.insert(0, ROOT)
    from jax_dsa.cute import constants

    return constants


# The atomic backward's `_long` builds, which the handler runs when the fp32 dkv accumulator
# holds at least LONG_DKV_MIN_BYTES (beyond the H200's 60 MB L2): evict-last dKV REDs at Dqk 512
# (-2 to -5 % at S 64K) and Q / dO / O / dQ evict-first (-3 to -7 % at the V4 layer shapes,
# H100); at 576 three dKV chunks in WG0 and ds_empty after WG1's last scatter
# (the default's four chunks and early release are 2.4 % slower at S 128K) and the next block's
# rows prefetched into the L2 (-3 % at V3.2 S 128K, H100; flat at 512); at both, a token's two
# head blocks as one 2-CTA cluster in lockstep (pair_lockstep: -10 % at V3.2 S 128K, -6 % at
# V4-Pro S 64K, H100; docs/kernel_log.md).
LONG_BWD_TUNING = {512: dict(red_evict_last=True, stream_evict_first=True, pair_lockstep=True),
                   576: dict(wg0_chunks=3, early_release=False, l2_prefetch=True,
                             pair_lockstep=True)}


def exports():
    """[(op, export prefix, kernel module, compile function, keyword arguments)] of every
    specialization the handlers can launch. The prefix is what ffi/*.cc look kernels up by:
    jax_dsa_<kernel>_<dtype>_d<Dqk> (op fwd: <kernel> is what FwdConfig.kernel names)."""
    c = _constants()
    out = []
    for dt in DTYPES:
        for d in c.HEAD_DIMS:
            spec = dict(dtype=dt, d_qk=d)
            out.append(("fwd", f"jax_dsa_fwd_pingpong_{dt}_d{d}", "fwd_pingpong",
                        "compile_fwd_pingpong", spec))
            out.append(("fwd", f"jax_dsa_fwd_small_heads_{dt}_d{d}", "fwd_small_heads",
                        "compile_fwd_small_heads", spec))
            out.append(("fwd_split", f"jax_dsa_fwd_pingpong_split_{dt}_d{d}", "fwd_pingpong",
                        "compile_fwd_pingpong", dict(spec, split=True)))
            out.append(("fwd2", f"jax_dsa_fwd_two_pool_{dt}_d{d}", "fwd_pingpong",
                        "compile_fwd_two_pool", spec))
            out.append(("bwd", f"jax_dsa_bwd_{dt}_d{d}", "bwd", "compile_bwd", spec))
            out.append(("bwd", f"jax_dsa_bwd_det_{dt}_d{d}", "bwd", "compile_bwd",
                        dict(spec, deterministic=True)))
            out.append(("bwd2", f"jax_dsa_bwd_two_pool_{dt}_d{d}", "bwd",
                        "compile_bwd_two_pool", spec))
            for g in c.GROUPS:  # the grouped backward: atomic form only
                out.append(("bwd", f"jax_dsa_bwd_g{g}_{dt}_d{d}", "bwd", "compile_bwd",
                            dict(spec, group=g)))
            # the atomic forms for a dkv beyond the L2 (`_long`: LONG_BWD_TUNING)
            long = dict(spec, **LONG_BWD_TUNING[d])
            out.append(("bwd", f"jax_dsa_bwd_{dt}_d{d}_long", "bwd", "compile_bwd", long))
            out.append(("bwd2", f"jax_dsa_bwd_two_pool_{dt}_d{d}_long", "bwd",
                        "compile_bwd_two_pool", long))
            for g in c.GROUPS:
                out.append(("bwd", f"jax_dsa_bwd_g{g}_{dt}_d{d}_long", "bwd", "compile_bwd",
                            dict(long, group=g)))
    for dt in DTYPES:  # the split forward's combine of its parts (d_v 512, any Dqk)
        out.append(("combine", f"jax_dsa_fwd_combine_{dt}", "fwd_combine",
                    "compile_fwd_combine", dict(dtype=dt)))
    for d in c.HEAD_DIMS:  # the deterministic backward's fixed-order dkv sum (fp32 only)
        out.append(("reduce", f"jax_dsa_dkv_reduce_d{d}", "dkv_reduce", "compile_dkv_reduce",
                    dict(d_qk=d)))
    for dt in DTYPES:  # the lightning indexer's scores
        out.append(("indexer", f"jax_dsa_indexer_scores_{dt}", "indexer_scores",
                    "compile_indexer_scores", dict(dtype=dt)))
    for k in c.INDEXER_TOPK_SIZES:  # the top-k, one candidate-buffer size each
        out.append(("select", f"jax_dsa_indexer_topk_k{k}", "indexer_topk",
                    "compile_indexer_topk", dict(max_k=k)))
    for dt in DTYPES:  # the indexer loss (the per-token KL) and its backward
        for part in ("fwd", "bwd"):
            out.append((f"loss_{part}", f"jax_dsa_indexer_loss_{part}_{dt}", "indexer_loss",
                        f"compile_indexer_loss_{part}", dict(dtype=dt)))
    for dt in DTYPES:  # the indexer's training target (attention mass per head block),
        for d in c.HEAD_DIMS:  # 64 heads per CTA (H <= 64) or 128 (a token's rows read once)
            for heads in (64, 128):
                out.append(("target", f"jax_dsa_attention_target_h{heads}_{dt}_d{d}",
                            "attention_target", "compile_attention_target",
                            dict(dtype=dt, d_qk=d, heads=heads)))
    # each token's list in row order, for the backward past the L2 (BwdConfig.sort_rows)
    out.append(("rows", "jax_dsa_rows_order", "rows_order", "compile_rows_order", {}))
    for g in c.GROUPS:  # the grouped backward's list union, with every hash-table size
        for t in c.UNION_TABLES:
            out.append(("union", f"jax_dsa_group_union_g{g}_t{t}", "group_union",
                        "compile_group_union", dict(group=g, table=t)))
    return out


def log(msg):
    print(f"[build] {msg}", flush=True)


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
    raise MissingToolchain(
        "need CUDA's cuda_runtime.h and libcudart_static.a "
        "(set CUDA_HOME); searched: " + ", ".join(cands)
    )


def find_dialect_runtime():
    import nvidia_cutlass_dsl  # noqa: F401  (namespace package of the wheel)

    for base in nvidia_cutlass_dsl.__path__:
        hits = glob.glob(os.path.join(base, "**", "libcuda_dialect_runtime_static.a"), recursive=True)
        if hits:
            return hits[0]
    raise MissingToolchain("libcuda_dialect_runtime_static.a not found in nvidia-cutlass-dsl")


def compile_kernel(module, fn, kwargs):
    """Compile one specialization (imports the kernel module from ffi/kernels/sm90)."""
    import cutlass

    sys.path.insert(0, FFI_DIR)
    sys.path.insert(0, ROOT)
    kwargs = dict(kwargs)
    if "dtype" in kwargs:
        kwargs["dtype"] = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[kwargs["dtype"]]
    compile_fn = getattr(importlib.import_module(f"kernels.sm90.{module}"), fn)
    return compile_fn(**kwargs)


def _export_one(prefix, build_dir):
    """Compile and export one specialization (also the body of a worker process)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    t0 = time.time()
    _, _, module, fn, kwargs = next(e for e in exports() if e[1] == prefix)
    compile_kernel(module, fn, kwargs).export_to_c(build_dir, prefix, prefix)
    return time.time() - t0


def export_kernels(build_dir, prefixes, workers=1):
    """Export `prefixes` into build_dir, in `workers` processes (each compile uses one core)."""
    if workers <= 1:
        for prefix in prefixes:
            log(f"exported {prefix} in {_export_one(prefix, build_dir):.1f}s")
        return
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked MLIR state
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(_export_one, p, build_dir): p for p in prefixes}
        for fut in concurrent.futures.as_completed(futures):
            log(f"exported {futures[fut]} in {fut.result():.1f}s")


def write_headers(build_dir, prefixes):
    """jax_dsa_kernels.h: every export's header and one X-macro list per op;
    jax_dsa_constants.h: the shared constants."""
    ops = {e[1]: e[0] for e in exports()}
    lines = ["// Generated by ffi/build.py. Do not edit.", "#pragma once"]
    lines += [f'#include "{p}.h"' for p in prefixes]
    for op in ("fwd", "fwd_split", "combine", "fwd2", "bwd", "bwd2", "reduce", "union", "rows",
               "indexer", "select", "target", "loss_fwd", "loss_bwd"):
        listed = " ".join(f"X({p})" for p in prefixes if ops[p] == op)
        lines.append(f"#define JAX_DSA_{op.upper()}_SPECS(X) {listed}")
    with open(os.path.join(build_dir, "jax_dsa_kernels.h"), "w") as f:
        f.write("\n".join(lines) + "\n")

    c = _constants()
    lines = ["// Generated by ffi/build.py from jax_dsa/cute/constants.py. Do not edit.",
             "#pragma once", "#include <cstdint>", "namespace jax_dsa {"]
    for name in c.CPP:
        value = getattr(c, name)
        cpp = "k" + "".join(w.capitalize() for w in name.lower().split("_"))
        if isinstance(value, tuple):
            lines.append(f"constexpr int64_t {cpp}[] = {{{', '.join(map(str, value))}}};")
        else:
            lines.append(f"constexpr int64_t {cpp} = {value};")
    lines.append("}  // namespace jax_dsa")
    with open(os.path.join(build_dir, "jax_dsa_constants.h"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "jax_dsa", "_lib"))
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "kernels"))
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4),
                    help="kernels compiled in parallel processes (default: the CPU count, at "
                         "most 4)")
    ap.add_argument("--relink", action="store_true",
                    help="reuse the kernel exports already in --build-dir (after an edit of "
                         "the handlers)")
    args = ap.parse_args()

    arch = os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if arch != "sm_90a":
        raise SystemExit(f"build: CUTE_DSL_ARCH must be sm_90a, got {arch}")
    t_start = time.time()
    os.makedirs(args.build_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)

    import shutil

    if shutil.which(args.cxx) is None:
        raise MissingToolchain(f"no C++ compiler {args.cxx!r} (set CXX)")
    import jax

    ffi_inc = jax.ffi.include_dir()
    cuda_inc, cudart = find_cuda()
    dialect_rt = find_dialect_runtime()
    log(f"CUDA headers {cuda_inc}; cudart {cudart}; dialect runtime {dialect_rt}")

    prefixes = [e[1] for e in exports()]
    if args.relink:
        missing = [p for p in prefixes
                   if not os.path.isfile(os.path.join(args.build_dir, p + ".o"))]
        if missing:
            raise SystemExit(f"build: --relink, but these exports are not built: {missing}")
    else:
        for stale in glob.glob(os.path.join(args.build_dir, "jax_dsa_*")):
            os.remove(stale)  # an export no longer listed must not be linked in
        export_kernels(args.build_dir, prefixes, args.jobs)
    write_headers(args.build_dir, prefixes)

    kernel_objs = [os.path.join(args.build_dir, p + ".o") for p in sorted(prefixes)]
    ffi_objs = []
    for cc in sorted(glob.glob(os.path.join(FFI_DIR, "*.cc"))):
        obj = os.path.join(args.build_dir, "ffi_" + os.path.basename(cc)[:-3] + ".o")
        run([args.cxx, "-std=c++17", "-O2", "-fPIC", "-c", cc, "-o", obj, "-I", FFI_DIR,
             "-I", args.build_dir, "-isystem", ffi_inc, "-isystem", cuda_inc, "-Wall"])
        ffi_objs.append(obj)
    objs = kernel_objs + ffi_objs

    # Every export must be referenced by a handler, or the linker would silently drop it.
    ffi_syms = subprocess.run(["nm", *ffi_objs], capture_output=True, text=True,
                              check=True).stdout
    missing = [p for p in prefixes if f"_mlir_{p}_cuda_init" not in ffi_syms]
    if missing:
        raise SystemExit(f"build: exports not used by any FFI handler: {missing}")

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
        raise SystemExit(f"build: unexpected runtime dependencies {bad}")


if __name__ == "__main__":
    main()
