"""The host (planner) and device (kernel) definitions of which KV tiles a block of rows
loads and masks agree on random inputs, and agree with a brute-force count of the keys
each row sees (host @cute.jit evaluation, no GPU)."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import numpy as np
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from podcute.kernels.visibility import (  # noqa: E402
    left_mask_until,
    left_mask_until_host,
    tile_bounds,
    tile_bounds_host,
    visible_end,
    visible_end_host,
    visible_start_host,
)

N = 4000


@cute.jit
def _device_bounds(mIn: cute.Tensor, mOut: cute.Tensor, group: cutlass.Constexpr,
                   causal: cutlass.Constexpr, tile_n: cutlass.Constexpr, right: cutlass.Int32,
                   left: cutlass.Int32):
    for i in cutlass.range(mIn.shape[0], unroll=1):
        kv_len, q_len, row_start, row_end = mIn[i, 0], mIn[i, 1], mIn[i, 2], mIn[i, 3]
        kv_start = mIn[i, 4]
        kv_end = visible_end(kv_len, q_len, row_end, group, causal, right)
        n_min, n_max, mask_from = tile_bounds(kv_start, kv_end, kv_len, q_len, row_start,
                                              group, causal, tile_n, right)
        mOut[i, 0] = kv_end
        mOut[i, 1] = n_min
        mOut[i, 2] = n_max
        mOut[i, 3] = mask_from
        mOut[i, 4] = left_mask_until(kv_len, q_len, row_end, group, left, tile_n)


def _random_items(rng, group, causal, tile_n, right, left):
    q_len = rng.integers(1, 3000, N)
    kv_len = q_len + rng.integers(0, 5000, N) if causal and right == 0 else rng.integers(0, 8000, N)
    rows = q_len * group
    row_start = rng.integers(0, rows)
    row_end = np.minimum(row_start + rng.integers(1, 129, N), rows)
    ends = visible_end_host(kv_len, q_len, row_end, group, causal, right)
    starts = visible_start_host(kv_len, q_len, row_start, group, left)
    kv_start = (rng.integers(starts, np.maximum(ends, starts + 1)) // tile_n) * tile_n
    return np.stack([kv_len, q_len, row_start, row_end, kv_start], 1).astype(np.int32)


@pytest.mark.parametrize("group,causal,tile_n,right,left", [
    (1, True, 128, 0, -1), (4, True, 128, 0, -1), (7, True, 64, 0, -1), (8, False, 128, 0, -1),
    (32, True, 128, 0, -1), (1, True, 128, 0, 300), (4, True, 64, 37, 5), (8, False, 128, 0, 1000),
    (2, True, 128, 4000, 0), (4, False, 128, 0, 2**31 - 1025)])
def test_host_and_device_bounds_agree(group, causal, tile_n, right, left):
    rng = np.random.default_rng(group * 10 + causal + left)
    items = _random_items(rng, group, causal, tile_n, right, left)
    out = torch.full((N, 5), -7, dtype=torch.int32)
    _device_bounds(from_dlpack(torch.from_numpy(items)), from_dlpack(out), group, causal, tile_n,
                   cutlass.Int32(right), cutlass.Int32(left))
    kv_len, q_len, row_start, row_end, kv_start = (items[:, j].astype(np.int64) for j in range(5))
    kv_end = visible_end_host(kv_len, q_len, row_end, group, causal, right)
    n_min, n_max, mask_from = tile_bounds_host(kv_start, kv_end, kv_len, q_len, row_start,
                                               group, causal, tile_n, right)
    until = left_mask_until_host(kv_len, q_len, row_end, group, left, tile_n)
    host = np.stack([kv_end, n_min, n_max, mask_from, until], 1)
    assert np.array_equal(out.numpy(), host)


def test_bounds_match_brute_force():
    """Tiles in [left_mask_until, mask_from) are wholly visible to every row of the block,
    kv_end is the last row's limit, visible_start the first row's, and [n_min, n_max)
    covers [kv_start, kv_end); with a window too (left/right edges, -1 = unbounded)."""
    rng = np.random.default_rng(3)
    for _ in range(600):
        group, tile_n = int(rng.choice([1, 3, 8])), int(rng.choice([16, 64]))
        causal = bool(rng.integers(0, 2))
        left = int(rng.choice([-1, 0, 1, 7, 50, 300]))
        right = 0 if causal else int(rng.choice([-1, 0, 3, 60]))
        bounded = causal or right >= 0  # the kernel's right-bound flag
        right = max(right, 0)
        q_len = int(rng.integers(1, 40))
        kv_len = q_len + int(rng.integers(0, 200)) if causal else int(rng.integers(0, 200))
        rows = q_len * group
        row_start = int(rng.integers(0, rows))
        row_end = int(rng.integers(row_start + 1, rows + 1))
        kv_end = int(visible_end_host(kv_len, q_len, row_end, group, bounded, right))
        start = int(visible_start_host(kv_len, q_len, row_start, group, left))
        kv_start = int(rng.integers(start, max(kv_end, start + 1))) // tile_n * tile_n
        n_min, n_max, mask_from = (int(x) for x in tile_bounds_host(
            kv_start, kv_end, kv_len, q_len, row_start, group, bounded, tile_n, right))
        until = int(left_mask_until_host(kv_len, q_len, row_end, group, left, tile_n))
        sees = np.zeros((rows, kv_len), bool)
        for r in range(rows):
            p = kv_len - q_len + r // group
            hi = min(p + right + 1, kv_len) if bounded else kv_len
            lo = max(p - left, 0) if left >= 0 else 0
            sees[r, lo:max(lo, hi)] = True
        block = sees[row_start:row_end]
        seen = block.any(0).nonzero()[0]
        if seen.size:
            assert kv_end == seen.max() + 1 and start <= seen.min()
        else:
            assert kv_end <= start or kv_end == 0 or not block.any()
        assert n_min * tile_n <= kv_start and n_max * tile_n >= kv_end
        for n in range(max(n_min, until), min(mask_from, n_max)):
            cols = slice(n * tile_n, (n + 1) * tile_n)
            assert block[:, cols].all() and (n + 1) * tile_n <= kv_end
