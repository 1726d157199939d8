"""Where the CUDA binary tools (nvdisasm, cuobjdump) are: PATH, CUDA_HOME/bin, CUDA_PATH/bin or
/usr/local/cuda*/bin. Without a CUDA toolkit: `pip install --target DIR nvidia-cuda-nvdisasm
nvidia-cuda-cuobjdump` and put DIR/nvidia/*/bin on PATH."""
import glob
import os
import shutil


def find_tool(name):
    cands = [shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands += sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"), reverse=True)
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)
