"""MMA helpers of both kernels: fragment views of the accumulators and the GEMM loops.

The sm90 fp32 accumulator of an m64nNk16 wgmma holds, per thread, values
((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N); a warp-level m16n8k16 mma.sync holds
((2 cols, 2 rows), MMA_M, MMA_N) with one n8 column group per MMA_N. Either way a row
lives on a quad of 4 threads. Softmax wants the accumulator as a (rows, cols) matrix;
the P@V GEMM wants it as its register A operand ((2, 2, 2), MMA_M, K/16). Both are pure
re-indexings of the same registers.
"""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup


def acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator -> ((2, M), (2, V, N)): rows x cols of one thread
    (mma.sync's ((2, 2), M, N): V = 1)."""
    if cute.rank(acc_layout.shape[0]) == 2:
        acc_layout = _with_unit_col_groups(acc_layout)
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


def _with_unit_col_groups(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2), M, N) -> ((2, 2, 1), M, N): mma.sync's accumulator in wgmma's shape."""
    inner = cute.make_layout((*acc_layout.shape[0], 1), stride=(*acc_layout.stride[0], 0))
    return cute.make_layout((inner.shape, acc_layout.shape[1], acc_layout.shape[2]),
                            stride=(inner.stride, acc_layout.stride[1], acc_layout.stride[2]))


def acc_as_operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator of S -> ((2, 2, 2), M, (V/2, N)) A operand of P@V;
    mma.sync's ((2, 2), M, N) -> ((2, 2, 2), M, N/2).

    A k16 slice of the A operand is two adjacent 8-column groups of the accumulator, so
    the column-group mode V splits into (2, V/2); V is even for every tile_n we use
    (mma.sync: the N mode of n8 groups splits likewise).
    """
    if cute.rank(acc_layout.shape[0]) == 2:
        split = cute.logical_divide(acc_layout, (None, None, 2))
        return cute.make_layout(
            ((split.shape[0][0], split.shape[0][1], split.shape[2][0]), split.shape[1],
             split.shape[2][1]),
            stride=((split.stride[0][0], split.stride[0][1], split.stride[2][0]),
                    split.stride[1], split.stride[2][1]),
        )
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
    k_blocks: cutlass.Constexpr[int] = 0,
):
    """Issue acc (+)= A @ B as wgmma over the K blocks (the first `k_blocks`, where the
    rest hold zeros in both operands; 0: all), then commit (caller waits)."""
    warpgroup.fence()
    # A fresh atom per call: reusing one after .set() breaks SSA dominance in the DSL.
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    num_k = cute.size(tCrA.shape[2])
    for k in cutlass.range_constexpr(min(num_k, k_blocks) if k_blocks else num_k):
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def warp_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
              copy_A, tCsA, tCrA_copy, copy_B, tCsB: cute.Tensor, tCrB_copy: cute.Tensor):
    """acc += A @ B with warp-level MMAs, each K block's fragments read from shared memory
    with ldmatrix (`copy_A` None: A is in registers already), the next block's read issued
    before this block's MMAs."""
    num_k = cute.size(tCrB.shape[2])
    if const_expr(copy_A is not None):
        cute.copy(copy_A, tCsA[None, None, 0], tCrA_copy[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_copy[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k + 1 < num_k):
            if const_expr(copy_A is not None):
                cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_copy[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_copy[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


def column_groups(acc: cute.Tensor, tCrB: cute.Tensor, groups: int):
    """(acc, B fragment) viewed as (V, M, (n, group)) and (V, (n, group), K): `groups`
    runs of consecutive MMA_N columns, group g being the columns that mode 1 index g of
    B's ldmatrix view (`ThrCopy.retile`) fills."""
    per_group = cute.size(tCrB.shape[1]) // groups
    return (cute.logical_divide(acc, (None, None, per_group)),
            cute.logical_divide(tCrB, (None, per_group, None)))


@cute.jit
def warp_gemm_by_columns(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
                         tCrB: cute.Tensor, copy_B, tCsB: cute.Tensor, tCrB_copy: cute.Tensor):
    """acc += A @ B with warp-level MMAs, A in registers and B read from shared memory one
    ldmatrix column group at a time, all K blocks of it: B's registers in flight are a
    few column groups' (ptxas reads ahead as registers allow), not a whole K block's of
    all of N (at D 128 a K block of P V's B is 32 registers; two in flight beside a
    128-row item's O spilled). Each accumulator sums its K blocks in the same order as
    `warp_gemm`'s."""
    num_k = cute.size(tCrB.shape[2])
    groups = cute.size(tCrB_copy.shape[1])
    acc_g, tCrB_g = column_groups(acc, tCrB, groups)
    for g in cutlass.range_constexpr(groups):
        for k in cutlass.range_constexpr(num_k):
            cute.copy(copy_B, tCsB[None, g, k], tCrB_copy[None, g, k])
        for k in cutlass.range_constexpr(num_k):
            cute.gemm(tiled_mma, acc_g[None, None, (None, g)], tCrA[None, None, k],
                      tCrB_g[None, (None, g), k], acc_g[None, None, (None, g)])
