"""CuTe layouts of podcute's tensors (imported as ``podcute.layouts``).

Plain Python helpers, called while tracing ``@cute.jit`` / ``@cute.kernel`` code.
"""

from .paged_kv import (
    KV_LAYOUTS,
    RAGGED_REQUEST,
    PageShift,
    canonical_kv,
    clamp_token,
    kv_locate,
    kv_row,
    kv_row_at,
    kv_row_clamped,
    kv_row_in,
    kv_tma_view,
    ragged_locate,
    split_token,
)
from .ragged import (packed_coord, packed_head, packed_lse, packed_rows, partial_lse,
                     partial_rows)

__all__ = [
    "KV_LAYOUTS",
    "RAGGED_REQUEST",
    "PageShift",
    "canonical_kv",
    "clamp_token",
    "kv_locate",
    "kv_row",
    "kv_row_at",
    "kv_row_clamped",
    "kv_row_in",
    "kv_tma_view",
    "ragged_locate",
    "split_token",
    "packed_coord",
    "packed_head",
    "packed_lse",
    "packed_rows",
    "partial_lse",
    "partial_rows",
]
