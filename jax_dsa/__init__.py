"""jax_dsa: DeepSeek sparse attention (sparse MLA) for JAX, with Hopper kernels in CuTe DSL."""
from jax_dsa import cute, indices
from jax_dsa.api import Plan, explain, sparse_mla
from jax_dsa.indexer import indexer_scores, indexer_topk
from jax_dsa.training import attention_target, indexer_loss

__version__ = "0.1.0"
__all__ = ["sparse_mla", "explain", "Plan", "indexer_topk", "indexer_scores", "attention_target",
           "indexer_loss", "indices", "cute", "flax", "__version__"]


def __getattr__(name):
    if name == "flax":  # needs flax (an optional dependency): imported on first use
        import importlib
        return importlib.import_module("jax_dsa.flax")
    raise AttributeError(f"module 'jax_dsa' has no attribute {name!r}")
