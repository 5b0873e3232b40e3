"""Which keys a block of packed query rows sees, written once for the host (numpy, used
by the planner) and once for the device (traced into the kernel); tests/test_visibility.py
checks the two agree on random inputs.

Packed row ``r`` of a request is query token ``r // group``, at KV position
``kv_len - q_len + r // group`` (bottom-right alignment); with ``causal`` it sees keys
``t <= that position``, without it every ``t < kv_len``.
"""

import numpy as np


# ---- host -------------------------------------------------------------------------------


def visible_end_host(kv_len, q_len, row_end, group: int, causal: bool):
    """Exclusive end of the keys any row < ``row_end`` sees: the planner never gives a
    work item keys beyond it (they are never loaded). numpy arrays or ints."""
    if not causal:
        return kv_len
    return np.minimum(kv_len, kv_len - q_len + (row_end - 1) // group + 1)


def tile_bounds_host(kv_start, kv_end, kv_len, q_len, row_start, group: int, causal: bool,
                     tile_n: int):
    """(n_min, n_max, mask_from) of rows from ``row_start`` over keys [kv_start, kv_end):
    KV tiles [n_min, n_max) are loaded; tiles >= mask_from hold a key past kv_end or past
    the first row's causal limit and are masked, earlier ones are wholly visible."""
    n_min = kv_start // tile_n
    n_max = np.maximum((kv_end + tile_n - 1) // tile_n, n_min)
    visible = kv_end
    if causal:
        visible = np.minimum(visible, kv_len - q_len + row_start // group + 1)
    return n_min, n_max, visible // tile_n


# ---- device -----------------------------------------------------------------------------


def visible_end(kv_len, q_len, row_end, group: int, causal: bool):
    """Device twin of :func:`visible_end_host` (Int32 values, traced)."""
    import cutlass

    if not causal:
        return kv_len
    return cutlass.min(kv_len, kv_len - q_len + (row_end - 1) // group + 1)


def tile_bounds(kv_start, kv_end, kv_len, q_len, row_start, group: int, causal: bool,
                tile_n: int):
    """Device twin of :func:`tile_bounds_host` (Int32 values, traced)."""
    import cutlass

    n_min = kv_start // tile_n
    n_max = cutlass.max((kv_end + tile_n - 1) // tile_n, n_min)
    visible = kv_end
    if causal:
        visible = cutlass.min(visible, kv_len - q_len + row_start // group + 1)
    return n_min, n_max, visible // tile_n
