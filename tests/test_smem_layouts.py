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
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

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


ROWS = (0, 1, 2, 5, 7, 8, 13, 63)
BASE = 1 << 14


@cute.jit
def _addresses(cols: cutlass.Constexpr[int], out: cute.Tensor):
    """out[stage, row index, chunk, 0/1]: the swizzled address and the plain one."""
    from podcute.kernels.smem import swizzled_address

    layout = tile_smem_layout(cutlass.BFloat16, 64, cols, stages=2)
    base = cute.make_ptr(cutlass.BFloat16, BASE, cute.AddressSpace.smem, assumed_align=1024)
    sX = cute.make_tensor(cute.recast_ptr(base, layout.inner, dtype=cutlass.BFloat16),
                          layout.outer)
    for stage in cutlass.range_constexpr(2):
        for i in cutlass.range_constexpr(len(ROWS)):
            for chunk in cutlass.range_constexpr(cols // 8):
                tile = sX[None, None, stage]
                ptr = tile.iterator + cute.crd2idx((ROWS[i], chunk * 8), tile.layout)
                out[stage, i, chunk, 0] = swizzled_address(ptr)
                out[stage, i, chunk, 1] = ptr.toint()


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_swizzled_address_is_where_the_tile_keeps_a_chunk(head_dim):
    """`smem.swizzled_address` (the cp.async with an L2 hint, in PTX) finds each 16-byte
    chunk where the tile's swizzle puts it: 128-byte rows (S<3,4,3>) XOR a row's 8 chunks
    with the row mod 8, 64-byte column blocks (S<2,4,3>, D 96) their 4 chunks with
    (row // 2) mod 4; the rest of the address (row block, column block, stage) as laid
    out."""
    import torch
    from cutlass.cute.runtime import from_dlpack

    out = torch.zeros(2, len(ROWS), head_dim // 8, 2, dtype=torch.int32)
    _addresses(head_dim, from_dlpack(out))
    wide = head_dim % 64 == 0
    checked = 0
    for stage in range(2):
        for i, row in enumerate(ROWS):
            for chunk in range(head_dim // 8):
                swizzled, plain = out[stage, i, chunk].tolist()
                at = (plain - BASE) % (128 if wide else 64) // 16  # chunk within its row
                moved = at ^ (row % 8 if wide else row // 2 % 4)
                assert swizzled == plain + 16 * (moved - at), (stage, row, chunk)
                checked += swizzled != plain
    assert checked > 0  # (the test would pass on an unswizzled address otherwise)

