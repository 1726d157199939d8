#!/usr/bin/env python
"""Do two exported kernel objects hold the same machine code?

    python tools/compare_exports.py A.o B.o [--diff]

An export of tools/build_kernels.py (<prefix>.o) embeds the kernel's cubin; exports of the same
kernel under different prefixes (a candidate "jax_dsa_bwdwgk3_*" and the default it becomes,
"jax_dsa_bwdwg_*") differ in bytes only by those names. This takes the cubin out of each
object, disassembles it with nvdisasm (found as tools/check_kernel_build.py finds it), removes
the jax_dsa_* names and compares the SASS: "SAME" means the GPU-tested candidate and the new
default are the same kernel. Exit status 0 when the same, 1 when not.
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
from check_kernel_build import find_tool  # noqa: E402

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
    return re.sub(r"jax_dsa_[a-z0-9_]+", "", text).splitlines()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--diff", action="store_true", help="print a unified diff when they differ")
    args = ap.parse_args()
    nvdisasm = find_tool("nvdisasm")
    if not nvdisasm:
        raise SystemExit("nvdisasm not found (pip install --target /tmp/cudatools "
                         "nvidia-cuda-nvdisasm)")
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
