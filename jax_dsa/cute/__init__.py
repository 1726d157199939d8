"""The Hopper (sm_90a) kernels as seen from JAX: the kernel policy (`Config`, `select`), the
FFI wrappers of the built library (`jax_dsa.cute.ffi`) and the local forward / backward on the
kernels (`jax_dsa.cute.kernel`)."""
from jax_dsa.cute.config import BwdConfig, Config, FwdConfig, select

__all__ = ["BwdConfig", "Config", "FwdConfig", "select"]
