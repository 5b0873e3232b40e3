"""The shared-memory tiles of both kernels (kernels/smem.py) swizzle bytes, as CUTLASS's Hopper atoms do.

Both kernels put the swizzle on the shared-memory pointer (`get_tensor(swizzle=...)`),
which the DSL applies to byte addresses. The sm_90a tiles take theirs from CUTLASS's
Hopper helpers (proven on the GPU by TMA and wgmma reading what the other wrote); the
warp-level tiles must use the same byte-unit swizzle for the same row width. Written in
element units (S<3,3,3> for 16-bit data) it moves 8-byte halves of the 16-byte cp.async
and ldmatrix chunks: the H200 reported "misaligned address" (docs/gpu-runs.md)."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402
from cutlass.utils import LayoutEnum  # noqa: E402

from podcute.kernels.smem import tile_smem_layout  # noqa: E402

FOUND = {}


@cute.jit
def _swizzles(cols: cutlass.Constexpr[int]):
    for dtype in (cutlass.BFloat16, cutlass.Float16):
        ours = tile_smem_layout(dtype, 64, cols)
        hopper = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
        FOUND[(str(dtype), cols)] = (str(ours.inner), str(hopper.inner))


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_warp_tiles_swizzle_bytes_like_the_hopper_tiles(head_dim):
    FOUND.clear()
    _swizzles(head_dim)
    assert len(FOUND) == 2
    for key, (ours, hopper) in FOUND.items():
        assert ours == hopper, (key, ours, hopper)
        assert ours in ("S<3,4,3>", "S<2,4,3>"), (key, ours)
