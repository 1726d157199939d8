"""Build hook: compile the CuTe DSL kernels and the FFI library while the package is built.

Set JAX_DSA_SKIP_KERNELS=1 to build a reference-only package (no GPU kernels).
"""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if os.environ.get("JAX_DSA_SKIP_KERNELS"):
            return
        # An editable install imports from the source tree, so the library goes there.
        pkg = os.path.join(ROOT if getattr(self, "editable_mode", False) else self.build_lib,
                           "jax_dsa")
        env = dict(os.environ)
        env.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU present
        cmd = [sys.executable, os.path.join(ROOT, "ffi", "build.py"),
               "--out", os.path.join(pkg, "_lib"), "--build-dir", os.path.join(ROOT, "build", "kernels")]
        if subprocess.call(cmd, env=env) != 0:
            # SystemExit, not an Exception: setuptools would swallow an Exception in editable mode
            # and install a package without its kernels.
            raise SystemExit("jax_dsa: building the CuTe DSL kernels failed (see the log above); "
                             "set JAX_DSA_SKIP_KERNELS=1 for a reference-only install")


setup(cmdclass={"build_py": BuildPyWithKernels})
