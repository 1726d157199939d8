"""The shared-memory layout of the backward's dKV transpose scratch (bwd.py,
SparseMlaBwdSm90._scatter_smem, used at Dqk 512). Plain Python, no CuTe import: the kernel
evaluates scratch_offset on DSL integers, tests/test_scatter_transpose.py on Python ints (it
runs without nvidia-cutlass-dsl, which only the kernel build needs).
"""


def scratch_offset(row, col):
    """Float offset of (row, col) in a warp's 16 x 32 fp32 transpose scratch (_scatter_smem):
    row-major, the 16-byte chunk index XOR-ed with 2 (row % 4). Shared memory serves 8-byte
    accesses per half-warp and 16-byte ones per quarter-warp: a half-warp's accumulator-order
    write covers 4 rows x 32 bytes, which this XOR spreads over all 32 banks, and a
    quarter-warp's read is one 128-byte row segment."""
    return row * 32 + ((col // 4) ^ (2 * (row % 4))) * 4 + col % 4


SCRATCH_WARP_FLOATS = 16 * 32
SCRATCH_BYTES = 8 * SCRATCH_WARP_FLOATS * 4  # 8 warps
