"""Score masking for packed GQA rows: KV range end, the right limit (bottom-right causal
alignment, or a window's right edge) and a sliding window's left edge (visibility.py
states which keys a row sees)."""

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
    right: Int32 = 0,
    left: Int32 = -1,
    window: cutlass.Constexpr[bool] = False,
):
    """Set S to -inf where key col >= kv_end, or (causal) key > query position + right,
    or (window, left >= 0) key < query position - left.

    tScS: identity coordinates (row, col) of acc_S within the tile. Packed row r is query
    token r // group, which sits at KV position causal_offset + r // group
    (causal_offset = kv_len - q_len).
    """
    acc_S_mn = rows_cols_view(acc_S)
    tScS_mn = rows_cols_view(tScS)
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        limit = kv_end - col_start
        pos = causal_offset + (row_start + tScS_mn[r, 0][0]) // group - col_start
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, pos + 1 + right)
        if cutlass.const_expr(window):
            # Keys before pos - left are masked; left < 0 (unbounded) masks none. (pos -
            # min(left, pos + 1): the same columns, without pos - left passing below int32
            # for a window of ~2**31 tokens.)
            first = pos - cutlass.min(left, pos + 1)
            if left < 0:
                first = Int32(0)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = tScS_mn[0, c][1]
                if (col >= limit) | (col < first):
                    acc_S_mn[r, c] = -Float32.inf
        else:
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                if tScS_mn[0, c][1] >= limit:
                    acc_S_mn[r, c] = -Float32.inf
