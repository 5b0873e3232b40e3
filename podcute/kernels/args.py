"""What one launch hands a POD kernel, as two bundles that travel together from the
compiled entry point down to the roles that read them: the caller's tensors
(`PodTensors`) and the plan's (`PlanTensors`).

The compiled function's signature (what `launch.launch` calls and `compile._fake_args`
fakes) is the two bundles flattened, then the grid size and the stream:
``(*PodTensors, *PlanTensors, num_ctas, stream)``. Inside the kernel every function takes
the bundle and reads the fields it needs (``plan.mWork``, ``io.mO``), so a new plan tensor
is one field here, one buffer in the planner and its reads.

The planner's side is `planning.types.PlanBuffers`, the torch twin of `PlanTensors` (the
same fields, in the same order). No torch and no cutlass here (the annotations are
strings), so the planner imports it cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:
    import cutlass.cute as cute
    from cutlass import Int32


class PodTensors(NamedTuple):
    """The caller's tensors of one launch (every kernel family reads them the same way)."""

    mQ: cute.Tensor  # [T, Hq, D]
    mK: cute.Tensor  # [pages, page_size, Hkv, D]: launch() passes HND as this view
    mV: cute.Tensor
    mO: cute.Tensor  # [T, Hq, D]
    mLSE: Optional[cute.Tensor]  # [T, Hq] fp32 (any strides) or None
    mSinks: Optional[cute.Tensor]  # [Hq] fp32 sink logits (has_sinks) or None
    mKScale: Optional[cute.Tensor]  # fp8 cache: [Hkv] or [1] fp32 dequant scales, or None
    mVScale: Optional[cute.Tensor]
    # The second K/V source, or None: request 0's K/V, [1, kv_len, Hkv, D] (ragged_kv), or
    # a second cache like mK/mV (second_cache: requests [0, IParam.SECOND_CACHE_REQUESTS)).
    mK2: Optional[cute.Tensor]
    mV2: Optional[cute.Tensor]


class PlanTensors(NamedTuple):
    """The plan's buffers (metadata.py defines their columns and words), whole: the same
    for every plan of a planner's buffer epoch, so a captured launch replays with whatever
    plan() wrote last."""

    mWork: cute.Tensor  # [items, WORK_COLS] int32 (metadata.WorkCol)
    mCtaPtr: cute.Tensor  # [grid + 1] int32: CTA c runs items [mCtaPtr[c], mCtaPtr[c + 1])
    mQStart: cute.Tensor  # [B + 1] int32
    mKvLen: cute.Tensor  # [B] int32
    mPageStart: cute.Tensor  # [B] int32: request b's pages are mPageList[mPageStart[b]:]
    mPageList: cute.Tensor  # flat int32 page indices (the plan's own, checked copy)
    mPartialO: cute.Tensor  # [slots, partial_rows, D] fp32
    mPartialLSE: cute.Tensor  # [slots, partial_rows] fp32
    mMerge: cute.Tensor  # [merges, MERGE_COLS] int32 (metadata.MergeCol)
    mSlotMerge: cute.Tensor  # [slots] int32: merge row of each split slot
    mMergeSem: cute.Tensor  # [merges] int32 semaphores, zero between launches
    mParams: cute.Tensor  # [NUM_PARAMS] fp32 (metadata.Param)
    mIParams: cute.Tensor  # the same words as int32 (metadata.IParam)
    # int32 lists of a `shared_prefix` plan (planning/sharing.py): each shared-prefix
    # tile's query tokens (from mQStart of its request) and each sharer merge's (slot,
    # partial row) prefix terms (from MergeCol.TERMS_FIRST)
    mShared: cute.Tensor
    page_shift: Int32  # log2(page_size): page sizes are powers of two
