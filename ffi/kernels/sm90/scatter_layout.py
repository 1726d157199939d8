"""Index arithmetic of the backward's dKV scatter (bwd.py): the row-pair exchange into the
permuted column layout (SparseMlaBwdSm90._scatter). Plain Python, no CuTe import: the kernel
evaluates these on DSL values, tests/test_scatter_layout.py on NumPy arrays (it runs without
nvidia-cutlass-dsl, which only the kernel build needs).
"""


def flat(rho, g2, g1, g0, c):
    """Index of accumulator value v[rho][g2][g1][g0][c] of a 64 x 64 dKV chunk: in lane
    l = 4 q + s of warp w, chunk row 16 w + q + 8 rho, column 8 (4 g2 + 2 g1 + g0) + 2 s + c."""
    return (((rho * 2 + g2) * 2 + g1) * 2 + g0) * 2 + c


def permuted_column(col):
    """Where logical dkv column `col` sits in the permuted layout that the backward kernels
    write (each 16-column group reordered from (g0, s, c) to (s, g0, c), so lane s holds four
    consecutive floats): 16 (col // 16) + 4 s + 2 g0 + c for col % 16 = 8 g0 + 2 s + c."""
    g0, s, c = (col % 16) // 8, (col % 8) // 2, col % 2
    return 16 * (col // 16) + 4 * s + 2 * g0 + c


def pair_rows_exchange(v, odd, select, shuffle_xor4):
    """One shuffle per value pair between lanes l and l ^ 4 (rows q and q ^ 1 of a warp's
    accumulator, `odd` = q % 2), after which each RED of the warp covers 4 rows x 128 bytes of
    the permuted layout. v: the 32 accumulator values (flat order); select(p, a, b) = a if p
    else b, shuffle_xor4(x) = x of lane l ^ 4. Returns out[(rho, second, g2)] = the 4 floats
    this lane adds to chunk row 16 w + 2 (q // 2) + second + 8 rho at permuted columns
    32 g2 + 4 (l % 8) + [0, 4): for the even row (second = 0) the even lane keeps its g1 = 0
    values and the odd lane takes the even lane's g1 = 1 values, and the reverse for the odd
    row."""
    out = {}
    for rho in range(2):
        for g2 in range(2):
            first, second = [], []
            for g0 in range(2):
                for c in range(2):
                    v0, v1 = v[flat(rho, g2, 0, g0, c)], v[flat(rho, g2, 1, g0, c)]
                    recv = shuffle_xor4(select(odd, v0, v1))
                    first.append(select(odd, recv, v0))
                    second.append(select(odd, v1, recv))
            out[(rho, 0, g2)] = first
            out[(rho, 1, g2)] = second
    return out
