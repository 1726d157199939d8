"""Constants shared by the Python side, the CuTe DSL kernels and the C++ handlers.

Defined here once. The kernels import this module when they are compiled, and ffi/build.py
writes every name of `CPP` into the generated header jax_dsa_constants.h (as `constexpr` values
in namespace jax_dsa), so that the handlers check the same limits. Plain Python: no jax import.
"""

# The kernels' value width (d_v) and the head dims they are built for.
D_V = 512
HEAD_DIMS = (512, 576)
# The head dims whose backward adds dkv in a permuted column order (one shuffle per value pair
# makes each RED line-wide; ffi/kernels/sm90/scatter_layout.permuted_column), undone by
# jax_dsa/cute/ffi.py: all of them.
PERMUTED_DKV_DIMS = HEAD_DIMS
# The atomic backward's forms are also built for a dkv accumulator beyond the H200's 60 MB L2
# (export suffix `_long`, tuned per head dim: ffi/build.py LONG_BWD_TUNING), run when the fp32
# dkv holds at least LONG_DKV_MIN_BYTES.
LONG_DKV_MIN_BYTES = 64 << 20
# The most query heads one call may have (the 64-head tiles pad H inside the kernel).
MAX_HEADS = 128
# H up to this runs the small-heads forward (heads on wgmma's N side).
SMALL_HEADS = 32

# The grouped backward: a union entry is its kv row | membership bits << MEMBER_SHIFT, so the
# kv rows must be < 2^MEMBER_SHIFT and a group has at most 31 - MEMBER_SHIFT = 8 tokens.
MEMBER_SHIFT = 23
GROUPS = (2, 4, 8)
# The list-union kernel's hash tables (slots per group, ascending; one export each) and the
# most entries (G * K) it takes: a load factor <= 3/4 in the largest table.
UNION_TABLES = (2048, 4096, 8192)
UNION_CAPACITY = 6144

# The lightning indexer's kernels: the head dim, the most heads per call (one wgmma N tile) and
# the most entries the top-k kernel selects per token. The top-k is built for each size of
# INDEXER_TOPK_SIZES (its shared-memory candidate buffer holds twice that many entries); a call
# runs the smallest that holds its topk (a smaller buffer lets more CTAs share an SM).
INDEXER_DIM = 128
INDEXER_MAX_HEADS = 64
INDEXER_TOPK_SIZES = (512, 1024, 2048, 4096)
INDEXER_MAX_TOPK = INDEXER_TOPK_SIZES[-1]
# The indexer loss's backward kernel: the most entries per token (its shared-memory score row).
INDEXER_LOSS_MAX_K = 4096

# Written into jax_dsa_constants.h by ffi/build.py (C++ name: k + CamelCase).
CPP = ("D_V", "LONG_DKV_MIN_BYTES", "MAX_HEADS", "SMALL_HEADS",
       "MEMBER_SHIFT", "GROUPS", "UNION_TABLES", "UNION_CAPACITY", "INDEXER_DIM",
       "INDEXER_MAX_HEADS", "INDEXER_TOPK_SIZES", "INDEXER_MAX_TOPK", "INDEXER_LOSS_MAX_K")
