"""One work item of the plan, as the kernel reads it (columns in metadata.py)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from podcute.layouts import RAGGED_REQUEST
from podcute.kernels.args import PlanTensors
from podcute.kernels.metadata import (DECODE_INDEX_MASK, KIND_BITS, KIND_MASK,
                                      SHARE_FIELD_MASK, SHARE_RANK_SHIFT, SHARE_ROW_SHIFT,
                                      IParam, Kind, WorkCol)
from podcute.kernels.visibility import tile_bounds


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
    is_decode: cutlass.Boolean  # Kind.DECODE: the MMA warpgroups split the KV tiles
    decode_index: Int32  # a decode item's ordinal among its CTA's decode items
    q_start: Int32
    q_len: Int32
    kv_len: Int32
    page_start: Int32
    # A `shared_prefix` plan's sharer's own piece: its first partial row in its slot, and
    # its merge's offset from the slot's (metadata.SHARE_*); 0 (a constant) otherwise.
    partial_row: Int32 = 0
    merge_rank: Int32 = 0

    @staticmethod
    def load(plan: PlanTensors, idx: Int32, shared: bool = False) -> "WorkItem":
        """Item `idx` of the plan: its work row and its request's lengths and pages
        (`shared`: a shared_prefix variant, whose kind word also holds the share fields)."""
        mWork = plan.mWork
        req = mWork[idx, WorkCol.REQ]
        q_start = plan.mQStart[req]
        kind = mWork[idx, WorkCol.KIND]
        decode_index = kind >> KIND_BITS
        partial_row = merge_rank = 0
        if shared:
            decode_index = decode_index & DECODE_INDEX_MASK
            partial_row = (kind >> SHARE_ROW_SHIFT) & SHARE_FIELD_MASK
            merge_rank = (kind >> SHARE_RANK_SHIFT) & SHARE_FIELD_MASK
        return WorkItem(
            req=req,
            kv_head=mWork[idx, WorkCol.KV_HEAD],
            row_start=mWork[idx, WorkCol.ROW_START],
            row_end=mWork[idx, WorkCol.ROW_END],
            kv_start=mWork[idx, WorkCol.KV_START],
            kv_end=mWork[idx, WorkCol.KV_END],
            split_slot=mWork[idx, WorkCol.SPLIT_SLOT],
            is_decode=(kind & KIND_MASK) == Int32(Kind.DECODE),
            decode_index=decode_index,
            q_start=q_start,
            q_len=plan.mQStart[req + 1] - q_start,
            kv_len=plan.mKvLen[req],
            page_start=plan.mPageStart[req],
            partial_row=partial_row,
            merge_rank=merge_rank,
        )

    def is_prefix_tile(self, mIParams: cute.Tensor):
        """Whether this item is a shared-prefix tile (a shared_prefix variant's request at
        or past IParam.VIRTUAL_REQUESTS): its query rows come from the token list."""
        return self.req >= mIParams[IParam.VIRTUAL_REQUESTS]

    def reads_ragged(self, ragged_kv: bool):
        """Whether this item's K/V come from a `ragged_kv` variant's ragged source (its
        request layouts.RAGGED_REQUEST); None in a variant without one (compile time)."""
        return self.req == Int32(RAGGED_REQUEST) if ragged_kv else None

    def reads_second(self, cfg, mIParams: cute.Tensor):
        """Whether this item's K/V come from the variant's second source: the ragged
        source (`ragged_kv`) or the second cache (`second_cache`: requests below
        IParam.SECOND_CACHE_REQUESTS, a plan word); None in a variant without one
        (compile time)."""
        if cfg.second_cache:
            return self.req < mIParams[IParam.SECOND_CACHE_REQUESTS]
        return self.reads_ragged(cfg.ragged_kv)

    def tile_bounds(self, row_start, group: int, causal: bool, tile_n: int, right=0):
        """(n_min, n_max, mask_from) of this item's KV tiles for rows from `row_start`
        (visibility.tile_bounds: the one device definition)."""
        return tile_bounds(self.kv_start, self.kv_end, self.kv_len, self.q_len, row_start,
                           group, causal, tile_n, right)
