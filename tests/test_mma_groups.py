"""`mma_utils.warp_gemm_by_columns` (the two-block P V of the warp-level kernel) reads B one
ldmatrix column group at a time and runs the MMAs of that group's columns right after:
every MMA must read registers its group's ldmatrix filled, and write the accumulator
columns of the same output columns. Checked host-side on coordinate tensors (each
register's (n, k) coordinate), for several threads and every head dim and key width the
kernel uses, against the same tiled MMA and ldmatrix copy the kernel builds."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402

from podcute.kernels.config import KernelConfig  # noqa: E402
from podcute.kernels.mma_utils import column_groups  # noqa: E402
from podcute.kernels.pod_fwd_sm80 import PodAttentionSm80  # noqa: E402

FOUND = {}


def _coords(t):
    """The coordinates a static coordinate tensor holds (its origin plus its layout)."""
    return sorted(tuple(a + b for a, b in zip(t.iterator, t.layout(i)))
                  for i in range(cute.size(t)))


@cute.jit
def _groups(kernel: cutlass.Constexpr, rows: cutlass.Constexpr[int],
            keys: cutlass.Constexpr[int], tidx: cutlass.Constexpr[int]):
    d = kernel.head_dim
    _, tiled_mma_pv = kernel._tiled_mmas()
    thr_mma = tiled_mma_pv.get_slice(tidx)
    copy_v = cute.make_tiled_copy_B(kernel._ldsm(True), tiled_mma_pv).get_slice(tidx)
    tOcB = thr_mma.partition_B(cute.make_identity_tensor((d, keys)))  # B = V^T: (D, keys)
    tOcO = thr_mma.partition_C(cute.make_identity_tensor((rows, d)))
    tOcB_copy = copy_v.retile(tOcB)  # the registers each ldmatrix fills, by (group, K)
    groups = cute.size(tOcB_copy.shape[1])
    acc_g, tOcB_g = column_groups(tOcO, tOcB, groups)
    FOUND["shape"] = (groups, cute.size(tOcB.shape[2]))
    for g in cutlass.range_constexpr(groups):
        for k in cutlass.range_constexpr(cute.size(tOcB.shape[2])):
            FOUND[("copy", g, k)] = _coords(tOcB_copy[None, g, k])
            FOUND[("mma", g, k)] = _coords(tOcB_g[None, (None, g), k])
        FOUND[("out", g)] = sorted({c[1] for c in _coords(acc_g[None, None, (None, g)])})
        FOUND[("b_cols", g)] = sorted({c[0] for c in _coords(tOcB_g[None, (None, g), 0])})


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("keys", [32, 64])
def test_pv_column_groups_read_what_their_ldmatrix_filled(head_dim, keys):
    cfg = KernelConfig.select("bfloat16", head_dim, 4, False, True, 16, arch="sm_90")
    kernel = PodAttentionSm80(cfg)
    for tidx in (0, 5, 38, 127):
        FOUND.clear()
        _groups(kernel, cfg.tile_m_prefill, keys, tidx)
        groups, num_k = FOUND["shape"]
        assert groups == head_dim // 16 and num_k == keys // 16
        seen = set()
        for g in range(groups):
            for k in range(num_k):
                copied, read = FOUND[("copy", g, k)], FOUND[("mma", g, k)]
                assert copied == read, (tidx, g, k, copied, read)
                seen.update(read)
            # the MMAs of group g accumulate into the output columns of the B columns they
            # read: the same two n8 column blocks, 2g and 2g + 1
            blocks = {c // 8 for c in FOUND[("out", g)]}
            assert blocks == {c // 8 for c in FOUND[("b_cols", g)]} == {2 * g, 2 * g + 1}, (
                tidx, g, FOUND[("out", g)], FOUND[("b_cols", g)])
        # together the groups cover this thread's whole B fragment, once
        assert len(seen) == 8 * groups * num_k
