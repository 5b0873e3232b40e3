"""Folding online-softmax states of the same rows over disjoint keys, through shared
memory: the hand-over of (row maxima, partial row sums, O) between warps or warpgroups
that took different KV tiles (or different keys of each tile) of one item.

Each thread stashes its state in its own fp32 column of a (values, threads) scratch, and
the thread that folds it reads the same fragment positions from that column: one column
a thread keeps the stores and loads free of bank conflicts. O goes over in `rounds`
chunks of columns where the scratch cannot hold all of it (the row statistics travel
with the first chunk).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from podcute.kernels.softmax import OnlineSoftmax


@cute.jit
def stash_state(sScratch: cute.Tensor, col: Int32, softmax: OnlineSoftmax,
                acc_O_mn: cute.Tensor, j: cutlass.Constexpr[int], cols: cutlass.Constexpr[int]):
    """Scratch column `col` <- this thread's O values of column chunk j (`cols` wide) and,
    with j == 0, its row maxima and partial row sums after them."""
    n_r = cute.size(acc_O_mn, mode=[0])
    stats = cols * n_r
    for r in cutlass.range_constexpr(n_r):
        for c in cutlass.range_constexpr(cols):
            sScratch[r * cols + c, col] = acc_O_mn[r, j * cols + c]
    if const_expr(j == 0):
        for r in cutlass.range_constexpr(n_r):
            sScratch[stats + r, col] = softmax.row_max[r]
            sScratch[stats + n_r + r, col] = softmax.row_sum[r]


@cute.jit
def fold_state(sScratch: cute.Tensor, col: Int32, softmax: OnlineSoftmax,
               acc_O_mn: cute.Tensor, j: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
               scale_self: cute.Tensor, scale_other: cute.Tensor):
    """Fold the state `stash_state` left in scratch column `col` (same rows, other keys)
    into this thread's: with j == 0 the row statistics, which set the factors
    `scale_self` / `scale_other` every chunk of the state uses."""
    n_r = cute.size(acc_O_mn, mode=[0])
    stats = cols * n_r
    if const_expr(j == 0):
        other_max = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        other_sum = cute.make_rmem_tensor_like(softmax.row_sum, Float32)
        for r in cutlass.range_constexpr(n_r):
            other_max[r] = sScratch[stats + r, col]
            other_sum[r] = sScratch[stats + n_r + r, col]
        s_self, s_other = softmax.merge(other_max, other_sum)
        scale_self.store(s_self.load())
        scale_other.store(s_other.load())
    for r in cutlass.range_constexpr(n_r):
        for c in cutlass.range_constexpr(cols):
            acc_O_mn[r, j * cols + c] = (acc_O_mn[r, j * cols + c] * scale_self[r]
                                         + sScratch[r * cols + c, col] * scale_other[r])


@cute.jit
def fold_warps(softmax: OnlineSoftmax, acc_O_mn: cute.Tensor, sScratch: cute.Tensor,
               tidx: Int32, rounds: cutlass.Constexpr[int], barrier_id: cutlass.Constexpr[int],
               warps: cutlass.Constexpr[int] = 4):
    """Warps 1..warps-1 of a group of `warps` (threads 0 .. 32 warps - 1, each warp holding
    the same rows' state over other keys) hand their states to warp 0, each thread in
    scratch column tidx, in `rounds` chunks of O's columns; warp 0 folds them in warp order (the
    factors of each warp's fold, set with the first chunk, serve the later ones). The
    caller owns the scratch from before the call until warp 0 is done."""
    threads = 32 * warps
    cols = cute.size(acc_O_mn, mode=[1]) // rounds
    n_r = cute.size(acc_O_mn, mode=[0])
    factors = cute.make_rmem_tensor((n_r, 2, warps), Float32)  # (row, self | other, warp)
    for j in cutlass.range_constexpr(rounds):
        if const_expr(j > 0):  # warp 0 has read the previous chunk
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if tidx >= 32:
            stash_state(sScratch, tidx, softmax, acc_O_mn, j, cols)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if tidx < 32:
            for w in cutlass.range_constexpr(1, warps):
                fold_state(sScratch, tidx + 32 * w, softmax, acc_O_mn, j, cols,
                           factors[None, 0, w], factors[None, 1, w])
