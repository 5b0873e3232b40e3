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
    """One split-KV merge group: its rows and its slots [FIRST_SLOT, + NUM_SPLITS).

    The columns from OWN_ROW on are read only by a `shared_prefix` kernel variant
    (planning/sharing.py, docs/notes/shared-prefix.md), and written by a plan that runs one:
    a sharer's merge reads its own slots from partial row OWN_ROW on, first its prefix
    partials, the TERMS_COUNT (slot, row) pairs of mTerms from TERMS_FIRST, and completes
    after WAIT pieces (= NUM_SPLITS + TERMS_COUNT; = NUM_SPLITS in a merge without terms).
    A shared prefix piece's merge row is a *feed* row (FEED_COUNT > 0): it is never merged
    itself; the piece counts into the sharers' merges [FEED_FIRST, + FEED_COUNT)."""

    REQ = 0
    KV_HEAD = 1
    ROW_START = 2
    ROW_END = 3
    FIRST_SLOT = 4
    NUM_SPLITS = 5
    OWN_ROW = 6
    WAIT = 7
    TERMS_FIRST = 8
    TERMS_COUNT = 9
    FEED_FIRST = 10
    FEED_COUNT = 11


MERGE_COLS = len(MergeCol)


class Kind(IntEnum):
    PREFILL = 0  # up to tile_m_prefill rows, every MMA warpgroup on its own rows
    DECODE = 1  # up to tile_m_decode rows, the MMA warpgroups split the KV tiles


KIND_BITS = 1
KIND_MASK = (1 << KIND_BITS) - 1
# A decode item's ordinal sits in bits [KIND_BITS, SHARE_ROW_SHIFT). A sharer's own piece
# (a `shared_prefix` plan) also carries SHARE_OWN_BIT, the partial row its rows start at in
# its slot (SHARE_ROW_SHIFT) and its merge's offset from the slot's (SHARE_RANK_SHIFT):
# the own pieces of the requests that share one prefix tile pack into one slot each.
SHARE_ROW_SHIFT = 16
SHARE_RANK_SHIFT = 23
SHARE_OWN_BIT = 30
SHARE_FIELD_MASK = (1 << 7) - 1  # row and rank: < 128 (a tile's rows)
DECODE_INDEX_MASK = (1 << (SHARE_ROW_SHIFT - KIND_BITS)) - 1


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
    # A `shared_prefix` plan: requests from this index on are shared-prefix tiles, whose
    # query rows are the token list mQTokens[mQStart[r]:mQStart[r + 1]] (sharing.py).
    VIRTUAL_REQUESTS = 7


NUM_FLOAT_PARAMS = 4
NUM_PARAMS = 8  # float words, then int words (room for later variants' values)
