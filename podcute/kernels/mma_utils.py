"""Warpgroup MMA helpers: fragment views of the sm90 accumulator and the GEMM issue loop.

The sm90 fp32 accumulator of an m64nNk16 wgmma holds, per thread, values
((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N). Softmax wants it as a (rows, cols)
matrix; the P@V GEMM wants it as its register A operand ((2, 2, 2), MMA_M, K/16).
Both are pure re-indexings of the same registers.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator -> ((2, M), (2, V, N)): rows x cols of one thread."""
    flat = cute.make_layout(acc_layout.shape)
    shape = (
        (flat.shape[0][1], flat.shape[1]),
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
    )
    stride = (
        (flat.stride[0][1], flat.stride[1]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def rows_cols_view(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_rows_cols_layout(acc.layout))


def acc_as_operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator of S -> ((2, 2, 2), M, (V/2, N)) A operand of P@V.

    A k16 slice of the A operand is two adjacent 8-column groups of the accumulator, so
    the column-group mode V splits into (2, V/2); V is even for every tile_n we use.
    """
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )


@cute.jit
def warpgroup_gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
):
    """Issue acc (+)= A @ B as wgmma over the K blocks, then commit (caller waits)."""
    warpgroup.fence()
    # A fresh atom per call: reusing one after .set() breaks SSA dominance in the DSL.
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
