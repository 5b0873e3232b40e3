"""Swizzled shared-memory tiles of 16-bit data, for both kernels.

A tile's swizzle goes onto its shared-memory pointer (`get_tensor(swizzle=...)`), which the
DSL applies to byte addresses: CUTLASS's atoms (S<3,4,3> for 128-byte rows, S<2,4,3> for
64-byte ones) XOR 16-byte chunks with the row, so tiles are 1024-byte aligned. The same
tile serves wgmma (sm_90a) and ldmatrix / cp.async (the warp-level kernel): the 8 rows an
ldmatrix reads and the rows a warp's 16-byte copies write fall in distinct banks.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import cute as _cute_ir
from cutlass.cutlass_dsl import dsl_user_op
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def smem_atom(dtype, cols: int):
    """The swizzle atom of a row-major (.., cols) tile: 8 rows x the widest swizzle that
    divides a row (64 columns of 16-bit data at D 64 and 128)."""
    return warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )


def tile_smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None,
                     atom_cols: Optional[int] = None):
    """Swizzled K-major smem layout of a (rows, cols) tile (+ stages): column blocks of
    `atom_cols` (the swizzle width), each rows x atom_cols contiguous."""
    atom = smem_atom(dtype, cols if atom_cols is None else atom_cols)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


@dsl_user_op
def swizzled_address(ptr, *, loc=None, ip=None) -> Int32:
    """The shared-memory byte address a pointer into a swizzled tile refers to, for inline
    PTX: `toint` gives the address before the swizzle, which the DSL's own loads and
    stores apply (its `apply_swizzle` op, used here too)."""
    return _cute_ir.apply_swizzle(ptr.value, loc=loc, ip=ip).toint(loc=loc, ip=ip)


@cute.jit
def zero_columns(sX: cute.Tensor, first_col: cutlass.Constexpr[int], tidx: Int32,
                 num_threads: cutlass.Constexpr[int]):
    """Zero columns [first_col, cols) of every row (and stage) of the (rows, cols[, stages])
    shared-memory tile `sX`, in 16-byte pieces (`first_col` a multiple of one), the
    `num_threads` threads from `tidx` sharing them: the columns past a caller's head dim
    in a wider tile (KernelConfig.head_dim_io), which no copy writes afterwards. The
    caller fences and syncs before the tile is read."""
    elems = 16 // (sX.element_type.width // 8)
    rows, cols = cute.size(sX, mode=[0]), cute.size(sX, mode=[1])
    stages = cute.size(sX, mode=[2]) if const_expr(cute.rank(sX) == 3) else 1
    chunks = (cols - first_col) // elems
    zero = cute.make_rmem_tensor((1, elems), sX.element_type)
    zero.fill(0)
    for i in cutlass.range(tidx, rows * chunks * stages, num_threads, unroll=1):
        c = first_col // elems + i % chunks
        r = (i // chunks) % rows
        if const_expr(cute.rank(sX) == 3):
            cute.autovec_copy(zero, cute.local_tile(sX[None, None, i // (chunks * rows)],
                                                    (1, elems), (r, c)))
        else:
            cute.autovec_copy(zero, cute.local_tile(sX, (1, elems), (r, c)))
