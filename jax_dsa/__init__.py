"""jax_dsa: DeepSeek sparse attention (sparse MLA) for JAX, with Hopper kernels in CuTe DSL."""
from jax_dsa import indices
from jax_dsa.api import sparse_mla

__version__ = "0.1.0"
__all__ = ["sparse_mla", "indices", "__version__"]
