"""Score masking for packed GQA rows: KV range end and bottom-right causal alignment."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from podcute.kernels.mma_utils import rows_cols_view


@cute.jit
def apply_mask(
    acc_S: cute.Tensor,
    tScS: cute.Tensor,
    row_start: Int32,
    col_start: Int32,
    kv_end: Int32,
    causal_offset: Int32,
    group: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):
    """Set S to -inf where key col >= kv_end, or (causal) key > query position.

    tScS: identity coordinates (row, col) of acc_S within the tile. Packed row r is query
    token r // group, which sits at KV position causal_offset + r // group
    (causal_offset = kv_len - q_len).
    """
    acc_S_mn = rows_cols_view(acc_S)
    tScS_mn = rows_cols_view(tScS)
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        limit = kv_end - col_start
        if cutlass.const_expr(causal):
            row = row_start + tScS_mn[r, 0][0]
            limit = cutlass.min(limit, causal_offset + row // group + 1 - col_start)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            if tScS_mn[0, c][1] >= limit:
                acc_S_mn[r, c] = -Float32.inf
