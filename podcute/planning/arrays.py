"""numpy helpers shared by the input checks and the work expansion."""

from __future__ import annotations

import numpy as np

from podcute.kernels.metadata import WORK_COLS

_ROW = np.dtype((np.void, WORK_COLS * 4))  # a work row as one element: fast row gathers


def _rows(a: np.ndarray) -> np.ndarray:
    """1-D view of an [n, WORK_COLS] int32 array with one element per row."""
    return a.view(_ROW).reshape(-1)


def _ragged_arange(counts: np.ndarray, total: int) -> np.ndarray:
    """concat(arange(c) for c in counts), vectorised."""
    starts = counts.cumsum() - counts
    return np.arange(total, dtype=np.int64) - starts.repeat(counts)
