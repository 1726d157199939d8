#!/usr/bin/env python
"""Do two exported kernel objects hold the same machine code?

    python dev/compare_exports.py A.o B.o [--diff]

An export of ffi/build.py (<prefix>.o) embeds the kernel's cubin; exports of the same kernel
under different prefixes, or from a module that was moved or renamed, differ in bytes only by
names. This takes the cubin out of each object, disassembles it with nvdisasm (found as
dev/check_kernel_build.py finds it), removes the export prefixes and the kernel entry names
(which spell the module path and class name) and compares the SASS: "SAME" means both are the
same machine code. Exit status 0 when the same, 1 when not.

    python dev/compare_exports.py --dirs OLD_BUILD NEW_BUILD --map old=new ...

compares every pair of exports of two build directories (names mapped by substring).
"""
import argparse
import difflib
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_tools import find_tool  # noqa: E402

EM_CUDA = 190
SHT_NOBITS = 8


def embedded_cubin(path):
    """The first 64-bit CUDA ELF image inside the object file (its bytes)."""
    data = open(path, "rb").read()
    pos = data.find(b"\x7fELF", 1)
    while pos >= 0:
        head = data[pos:pos + 64]
        if len(head) == 64 and head[4] == 2 and struct.unpack_from("<H", head, 18)[0] == EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            for i in range(shnum):  # sections may lie after the section header table
                sh = pos + shoff + i * shentsize
                kind, = struct.unpack_from("<I", data, sh + 4)
                offset, size = struct.unpack_from("<QQ", data, sh + 0x18)
                if kind != SHT_NOBITS:
                    end = max(end, offset + size)
            return data[pos:pos + end]
        pos = data.find(b"\x7fELF", pos + 1)
    raise SystemExit(f"{path}: no embedded cubin found")


def sass(path, nvdisasm):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(embedded_cubin(path))
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    text = re.sub(r"kernel_cutlass_[A-Za-z0-9_]+", "KERNEL", text)
    return re.sub(r"jax_dsa_[a-z0-9_]+", "", text).splitlines()


def compare_dirs(old_dir, new_dir, renames, nvdisasm):
    """Every jax_dsa_*.o of new_dir against old_dir's export of the same (renamed) prefix."""
    import glob

    bad = 0
    for new in sorted(glob.glob(os.path.join(new_dir, "jax_dsa_*.o"))):
        name = os.path.basename(new)
        old_name = name
        for old_part, new_part in renames:
            old_name = old_name.replace(new_part, old_part)
        old = os.path.join(old_dir, old_name)
        if not os.path.isfile(old):
            print(f"NEW   {name} (no {old_name} in {old_dir})")
            bad += 1
            continue
        same = sass(old, nvdisasm) == sass(new, nvdisasm)
        print(f"{'SAME ' if same else 'DIFF '} {name} <- {old_name}")
        bad += not same
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", nargs="?")
    ap.add_argument("b", nargs="?")
    ap.add_argument("--dirs", nargs=2, metavar=("OLD", "NEW"),
                    help="compare every export of NEW with its counterpart in OLD")
    ap.add_argument("--map", nargs="*", default=[], metavar="OLD=NEW",
                    help="with --dirs: prefix substrings renamed between OLD and NEW")
    ap.add_argument("--diff", action="store_true", help="print a unified diff when they differ")
    args = ap.parse_args()
    nvdisasm = find_tool("nvdisasm")
    if not nvdisasm:
        raise SystemExit("nvdisasm not found (pip install --target <dir> nvidia-cuda-nvdisasm "
                         "and put its bin on PATH)")
    if args.dirs:
        return compare_dirs(*args.dirs, [m.split("=", 1) for m in args.map], nvdisasm)
    a, b = sass(args.a, nvdisasm), sass(args.b, nvdisasm)
    if a == b:
        print(f"SAME ({len(a)} SASS lines)")
        return 0
    diff = list(difflib.unified_diff(a, b, args.a, args.b, lineterm="", n=1))
    print(f"DIFFERENT ({len(diff)} diff lines)")
    if args.diff:
        print("\n".join(diff))
    return 1


if __name__ == "__main__":
    sys.exit(main())
