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
    tile_bounds,
    tile_bounds_host,
    visible_end,
    visible_end_host,
)

N = 4000


@cute.jit
def _device_bounds(mIn: cute.Tensor, mOut: cute.Tensor, group: cutlass.Constexpr,
                   causal: cutlass.Constexpr, tile_n: cutlass.Constexpr):
    for i in cutlass.range(mIn.shape[0], unroll=1):
        kv_len, q_len, row_start, row_end = mIn[i, 0], mIn[i, 1], mIn[i, 2], mIn[i, 3]
        kv_start = mIn[i, 4]
        kv_end = visible_end(kv_len, q_len, row_end, group, causal)
        n_min, n_max, mask_from = tile_bounds(kv_start, kv_end, kv_len, q_len, row_start,
                                              group, causal, tile_n)
        mOut[i, 0] = kv_end
        mOut[i, 1] = n_min
        mOut[i, 2] = n_max
        mOut[i, 3] = mask_from


def _random_items(rng, group, causal, tile_n):
    q_len = rng.integers(1, 3000, N)
    kv_len = q_len + rng.integers(0, 5000, N) if causal else rng.integers(0, 8000, N)
    rows = q_len * group
    row_start = rng.integers(0, rows)
    row_end = np.minimum(row_start + rng.integers(1, 129, N), rows)
    ends = visible_end_host(kv_len, q_len, row_end, group, causal)
    kv_start = (rng.integers(0, np.maximum(ends, 1)) // tile_n) * tile_n
    return np.stack([kv_len, q_len, row_start, row_end, kv_start], 1).astype(np.int32)


@pytest.mark.parametrize("group,causal,tile_n", [(1, True, 128), (4, True, 128), (7, True, 64),
                                                 (8, False, 128), (32, True, 128)])
def test_host_and_device_bounds_agree(group, causal, tile_n):
    rng = np.random.default_rng(group * 10 + causal)
    items = _random_items(rng, group, causal, tile_n)
    out = torch.full((N, 4), -7, dtype=torch.int32)
    _device_bounds(from_dlpack(torch.from_numpy(items)), from_dlpack(out), group, causal, tile_n)
    kv_len, q_len, row_start, row_end, kv_start = (items[:, j].astype(np.int64) for j in range(5))
    kv_end = visible_end_host(kv_len, q_len, row_end, group, causal)
    n_min, n_max, mask_from = tile_bounds_host(kv_start, kv_end, kv_len, q_len, row_start,
                                               group, causal, tile_n)
    host = np.stack([kv_end, n_min, n_max, mask_from], 1)
    assert np.array_equal(out.numpy(), host)


def test_bounds_match_brute_force():
    """Tiles before mask_from are wholly visible to every row of the block, kv_end is the
    last row's limit, and [n_min, n_max) covers [kv_start, kv_end)."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        group, tile_n = int(rng.choice([1, 3, 8])), int(rng.choice([16, 64]))
        causal = bool(rng.integers(0, 2))
        q_len = int(rng.integers(1, 40))
        kv_len = q_len + int(rng.integers(0, 200)) if causal else int(rng.integers(0, 200))
        rows = q_len * group
        row_start = int(rng.integers(0, rows))
        row_end = int(rng.integers(row_start + 1, rows + 1))
        kv_end = int(visible_end_host(kv_len, q_len, row_end, group, causal))
        kv_start = int(rng.integers(0, max(kv_end, 1))) // tile_n * tile_n
        n_min, n_max, mask_from = (int(x) for x in tile_bounds_host(
            kv_start, kv_end, kv_len, q_len, row_start, group, causal, tile_n))
        sees = np.zeros((rows, kv_len), bool)
        for r in range(rows):
            limit = kv_len - q_len + r // group + 1 if causal else kv_len
            sees[r, :max(0, min(limit, kv_len))] = True
        block = sees[row_start:row_end]
        assert kv_end == (block.any(0).nonzero()[0].max() + 1 if block.any() else 0)
        assert n_min * tile_n <= kv_start and n_max * tile_n >= kv_end
        for n in range(n_min, min(mask_from, n_max)):
            cols = slice(n * tile_n, (n + 1) * tile_n)
            assert block[:, cols].all() and (n + 1) * tile_n <= kv_end
