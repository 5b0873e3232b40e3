"""What both POD kernels (`pod_fwd_sm90.py`, `pod_fwd_sm80.py`) read the same way from a
variant's flags and the plan's parameter words: which KV tiles need a mask and the mask
itself with the window's edges, the parameter that turns a raw score into its logit, and
the sink logit of each row."""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from podcute import layouts
from podcute.kernels.mask import apply_mask
from podcute.kernels.metadata import IParam, Param
from podcute.kernels.mma_utils import rows_cols_view
from podcute.kernels.work import WorkItem


class PodKernelBase:
    """Mixed into each kernel class, which sets `cfg` (its KernelConfig) and `group`."""

    def window_right(self, mIParams: cute.Tensor):
        """The right limit's offset from the query position (0: causal)."""
        if const_expr(self.cfg.window):
            return mIParams[IParam.WINDOW_RIGHT]
        return 0

    def needs_mask(self, n_block: Int32, mask_from: Int32, mask_until: Int32):
        """Whether KV tile n_block holds a key some row must not see: tiles >= mask_from
        on the right, < mask_until left of a window (visibility.py)."""
        needs = n_block >= mask_from
        if const_expr(self.cfg.window):
            needs = needs | (n_block < mask_until)
        return needs

    def mask_scores(self, acc_S: cute.Tensor, tScS: cute.Tensor, item: WorkItem, row_offset,
                    col_start: Int32, mIParams: cute.Tensor):
        """mask.apply_mask of the item's rows from row_start + `row_offset` on the KV tile
        at `col_start`, with the variant's causal flag and the plan's window edges."""
        left = Int32(-1)
        if const_expr(self.cfg.window):
            left = mIParams[IParam.WINDOW_LEFT]
        apply_mask(acc_S, tScS, item.row_start + row_offset, col_start, item.kv_end,
                   item.kv_len - item.q_len, self.group, self.cfg.causal,
                   self.window_right(mIParams), left, self.cfg.window)

    @property
    def logit_param(self) -> int:
        """The parameter that turns a raw score into its logit (metadata.Param)."""
        return Param.SOFTCAP if self.cfg.softcap else Param.SM_SCALE

    @cute.jit
    def row_sinks(self, mSinks: Optional[cute.Tensor], tOcO: cute.Tensor, item: WorkItem,
                  row_offset: Int32):
        """The sink logit of each of this thread's rows (their query heads'), -inf for a
        split piece (the merge adds the sink once); None without sinks."""
        if const_expr(mSinks is None):
            return None
        tOcO_mn = rows_cols_view(tOcO)
        sink = cute.make_rmem_tensor(cute.size(tOcO_mn, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(tOcO_mn, mode=[0])):
            sink[r] = mSinks[layouts.packed_head(item.row_start + row_offset + tOcO_mn[r, 0][0],
                                                 item.kv_head, self.group)]
            if item.split_slot >= 0:
                sink[r] = -Float32.inf
        return sink
