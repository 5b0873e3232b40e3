"""The plan metadata format, defined once: columns of a work row and of a merge row, the
work kinds, and the float parameters a launch reads from device memory.

Read by name everywhere (the planner writes ``work[:, WorkCol.KV_END]``, the kernel reads
``mWork[i, WorkCol.KV_END]``), so a column moves in one place. No torch, no cutlass.
"""

from enum import IntEnum


class WorkCol(IntEnum):
    """One work item: packed rows [ROW_START, ROW_END) of (REQ, KV_HEAD) against KV tokens
    [KV_START, KV_END). SPLIT_SLOT -1: the item writes out/lse itself; >= 0: it writes
    fp32 partials to that slot and the group's last split merges (docs/design.md)."""

    REQ = 0
    KV_HEAD = 1
    ROW_START = 2
    ROW_END = 3
    KV_START = 4
    KV_END = 5
    SPLIT_SLOT = 6
    # Kind (low KIND_BITS bits) | a decode item's ordinal among the decode items of its
    # CTA's list << KIND_BITS (the kernel's decode hand-over counts with it).
    KIND = 7


WORK_COLS = len(WorkCol)


class MergeCol(IntEnum):
    """One split-KV merge group: its rows and its slots [FIRST_SLOT, + NUM_SPLITS)."""

    REQ = 0
    KV_HEAD = 1
    ROW_START = 2
    ROW_END = 3
    FIRST_SLOT = 4
    NUM_SPLITS = 5


MERGE_COLS = len(MergeCol)


class Kind(IntEnum):
    PREFILL = 0  # up to tile_m_prefill rows, every MMA warpgroup on its own rows
    DECODE = 1  # up to tile_m_decode rows, the MMA warpgroups split the KV tiles


KIND_BITS = 1
KIND_MASK = (1 << KIND_BITS) - 1


class Param(IntEnum):
    """float32 values a launch reads from plan-owned device memory, so a CUDA graph
    captured with one plan replays with another plan's values."""

    SM_SCALE = 0
    # Soft-capping (a variant's `softcap` flag): the kernel keeps tanh(s * SOFTCAP_SCALE)
    # (SOFTCAP_SCALE = sm_scale / softcap) as its raw scores, whose logits are SOFTCAP x them.
    SOFTCAP_SCALE = 1
    SOFTCAP = 2


class IParam(IntEnum):
    """int32 values of the same plan-owned parameter words (the kernel reads the words
    [NUM_FLOAT_PARAMS, NUM_PARAMS) through an int32 view)."""

    # Sliding window (a variant's `window` flag), FlashAttention's convention: the query
    # at KV position p sees keys p - WINDOW_LEFT .. p + WINDOW_RIGHT; -1 = unbounded. The
    # planner folds causal into WINDOW_RIGHT (0).
    WINDOW_LEFT = 4
    WINDOW_RIGHT = 5
    # A `second_cache` variant: requests [0, SECOND_CACHE_REQUESTS) read their K/V from
    # the second paged cache (FlashInfer's BatchPOD with separate prefill and decode
    # caches), the others from the first.
    SECOND_CACHE_REQUESTS = 6


NUM_FLOAT_PARAMS = 4
NUM_PARAMS = 8  # float words, then int words (room for later variants' values)
