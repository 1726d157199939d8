"""Build hook: compile the CuTe DSL kernels and the FFI library (ffi/build.py) while the package
is built.

JAX_DSA_SKIP_KERNELS=1 builds a reference-only package (no GPU kernels). A machine that cannot
build them (no CUDA runtime headers / libcudart_static.a, no C++ compiler) gets the
reference-only package too, with a message saying so; any other build failure stops the
install.
"""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
NO_TOOLCHAIN = 3  # ffi/build.py's exit status when this machine lacks the toolchain


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if os.environ.get("JAX_DSA_SKIP_KERNELS"):
            print("jax_dsa: JAX_DSA_SKIP_KERNELS is set: installing without the Hopper kernels "
                  "(the pure-JAX reference runs everywhere)")
            return
        # An editable install imports from the source tree, so the library goes there.
        pkg = os.path.join(ROOT if getattr(self, "editable_mode", False) else self.build_lib,
                           "jax_dsa")
        env = dict(os.environ)
        env.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU present
        cmd = [sys.executable, os.path.join(ROOT, "ffi", "build.py"),
               "--out", os.path.join(pkg, "_lib"),
               "--build-dir", os.path.join(ROOT, "build", "kernels")]
        rc = subprocess.call(cmd, env=env)
        if rc == NO_TOOLCHAIN:
            print("jax_dsa: WARNING: this machine cannot build the Hopper kernels (see the "
                  "message above): installing without them; the pure-JAX reference runs "
                  "everywhere (jax_dsa.explain says what a call runs)", file=sys.stderr)
        elif rc != 0:
            # SystemExit, not an Exception: setuptools would swallow an Exception in editable
            # mode and install a package without its kernels.
            raise SystemExit("jax_dsa: building the CuTe DSL kernels failed (see the log "
                             "above); set JAX_DSA_SKIP_KERNELS=1 for a reference-only install")


setup(cmdclass={"build_py": BuildPyWithKernels})
