"""Which keys a block of packed query rows sees, written once for the host (numpy, used
by the planner) and once for the device (traced into the kernel); tests/test_visibility.py
checks the two agree on random inputs.

Packed row ``r`` of a request is query token ``r // group``, at KV position
``p = kv_len - q_len + r // group`` (bottom-right alignment). It sees keys
``0 <= t < kv_len`` with, on the right, ``t <= p + right`` when ``causal`` (the kernel's
flag for "the right side is bounded": ``right`` is 0 for plain causal attention, a
window's right edge otherwise) and, on the left, ``t >= p - left`` when ``left >= 0``
(a sliding window; -1 = unbounded). ``right`` and ``left`` are runtime values.
"""

import numpy as np


# ---- host -------------------------------------------------------------------------------


def visible_end_host(kv_len, q_len, row_end, group: int, causal: bool, right=0):
    """Exclusive end of the keys any row < ``row_end`` sees: the planner never gives a
    work item keys beyond it (they are never loaded). numpy arrays or ints."""
    if not causal:
        return kv_len
    return np.minimum(kv_len, np.maximum(0, kv_len - q_len + (row_end - 1) // group + 1 + right))


def visible_start_host(kv_len, q_len, row_start, group: int, left: int):
    """First key any row >= ``row_start`` sees (0 without a left window edge): keys before
    it are never loaded."""
    if left < 0:
        return np.zeros_like(np.asarray(kv_len))
    return np.clip(kv_len - q_len + row_start // group - left, 0, kv_len)


def load_start_host(kv_len, q_len, row_start, group: int, left: int, kv_end, tile_n: int):
    """Where the KV range of rows from ``row_start`` (ending at ``kv_end``) starts: the
    tile holding the first key any of them sees, never past the tile of kv_end (an empty
    range stays empty). numpy arrays."""
    first = visible_start_host(kv_len, q_len, row_start, group, left)
    return np.minimum(first // tile_n, kv_end // tile_n) * tile_n


def tile_bounds_host(kv_start, kv_end, kv_len, q_len, row_start, group: int, causal: bool,
                     tile_n: int, right=0):
    """(n_min, n_max, mask_from) of rows from ``row_start`` over keys [kv_start, kv_end):
    KV tiles [n_min, n_max) are loaded; tiles >= mask_from hold a key past kv_end or past
    the first row's right limit and are masked, earlier ones are wholly visible (on the
    right: see left_mask_until_host for the left edge)."""
    n_min = kv_start // tile_n
    n_max = np.maximum((kv_end + tile_n - 1) // tile_n, n_min)
    visible = kv_end
    if causal:
        visible = np.minimum(visible,
                             np.maximum(0, kv_len - q_len + row_start // group + 1 + right))
    return n_min, n_max, visible // tile_n


def left_mask_until_host(kv_len, q_len, row_end, group: int, left: int, tile_n: int):
    """Tiles below this one hold a key left of some row < ``row_end``'s window (those
    tiles are masked); 0 without a left edge."""
    if left < 0:
        return np.zeros_like(np.asarray(kv_len))
    lo = np.maximum(kv_len - q_len + (row_end - 1) // group - left, 0)
    return (lo + tile_n - 1) // tile_n


# ---- device -----------------------------------------------------------------------------


def visible_end(kv_len, q_len, row_end, group: int, causal: bool, right=0):
    """Device twin of :func:`visible_end_host` (Int32 values, traced)."""
    import cutlass

    if not causal:
        return kv_len
    return cutlass.min(kv_len, cutlass.max(0, kv_len - q_len + (row_end - 1) // group + 1 + right))


def tile_bounds(kv_start, kv_end, kv_len, q_len, row_start, group: int, causal: bool,
                tile_n: int, right=0):
    """Device twin of :func:`tile_bounds_host` (Int32 values, traced)."""
    import cutlass

    n_min = kv_start // tile_n
    n_max = cutlass.max((kv_end + tile_n - 1) // tile_n, n_min)
    visible = kv_end
    if causal:
        visible = cutlass.min(visible,
                              cutlass.max(0, kv_len - q_len + row_start // group + 1 + right))
    return n_min, n_max, visible // tile_n


def left_mask_until(kv_len, q_len, row_end, group: int, left, tile_n: int):
    """Device twin of :func:`left_mask_until_host`; ``left`` is a runtime Int32."""
    import cutlass

    # max(p_last - left, 0) without forming p_last - left, which a window of ~2**31 tokens
    # would take below int32 (p_last >= -2**23: q_len is bounded, left is not).
    p_last = cutlass.max(kv_len - q_len + (row_end - 1) // group, 0)
    lo = p_last - cutlass.min(left, p_last)
    # (a product, not a branch: this is traced outside any @cute.jit scope)
    return (lo + tile_n - 1) // tile_n * cutlass.Int32(left >= 0)
