"""One work item of the plan, as the kernel reads it (layout in docs/design.md)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class WorkItem:
    """Packed rows [row_start, row_end) of (request, kv_head) against KV [kv_start, kv_end)."""

    req: Int32
    kv_head: Int32
    row_start: Int32
    row_end: Int32
    kv_start: Int32
    kv_end: Int32
    split_slot: Int32  # -1: write out/lse; >= 0: write fp32 partials for the merge
    q_start: Int32
    q_len: Int32
    kv_len: Int32
    page_start: Int32

    @staticmethod
    def load(mWork: cute.Tensor, mQStart: cute.Tensor, mKvLen: cute.Tensor,
             mPageStart: cute.Tensor, idx: Int32) -> "WorkItem":
        req = mWork[idx, 0]
        q_start = mQStart[req]
        return WorkItem(
            req=req,
            kv_head=mWork[idx, 1],
            row_start=mWork[idx, 2],
            row_end=mWork[idx, 3],
            kv_start=mWork[idx, 4],
            kv_end=mWork[idx, 5],
            split_slot=mWork[idx, 6],
            q_start=q_start,
            q_len=mQStart[req + 1] - q_start,
            kv_len=mKvLen[req],
            page_start=mPageStart[req],
        )

    def n_block_range(self, tile_n: int):
        """KV tiles [n_min, n_max) the item covers (empty when kv_end <= kv_start)."""
        n_min = self.kv_start // tile_n
        n_max = cutlass.max((self.kv_end + tile_n - 1) // tile_n, n_min)
        return n_min, n_max
