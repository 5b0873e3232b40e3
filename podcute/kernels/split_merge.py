"""Exact merge of split-KV partials: out = sum_s exp(lse_s - lse) * O_s, lse = logsumexp_s.

One CTA per merge group (request, kv head, row range) of the plan; a thread handles
4 columns of one packed row. Splits whose rows saw no key carry lse = -inf and weigh 0.
"""

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from podcute import layouts

MERGE_THREADS = 128
COLS_PER_THREAD = 4


class SplitMerge:
    def __init__(self, dtype, head_dim: int, group: int, has_lse: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.group = group
        self.has_lse = has_lse

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mMerge: cute.Tensor,  # [merges, 6] int32: req, kv_head, row_start, row_end, slot0, splits
        mQStart: cute.Tensor,
        mPartialO: cute.Tensor,
        mPartialLSE: cute.Tensor,
        num_merge: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(mO, mLSE, mMerge, mQStart, mPartialO, mPartialLSE).launch(
            grid=[num_merge, 1, 1], block=[MERGE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mMerge: cute.Tensor,
        mQStart: cute.Tensor,
        mPartialO: cute.Tensor,
        mPartialLSE: cute.Tensor,
    ):
        tidx = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        req = mMerge[bid, 0]
        kv_head = mMerge[bid, 1]
        row_start = mMerge[bid, 2]
        n_rows = mMerge[bid, 3] - row_start
        first_slot = mMerge[bid, 4]
        num_splits = mMerge[bid, 5]
        q_start = mQStart[req]
        q_len = mQStart[req + 1] - q_start
        gO = layouts.packed_rows(mO, q_start, q_len, kv_head, self.group)

        threads_per_row = self.head_dim // COLS_PER_THREAD
        rows_per_pass = MERGE_THREADS // threads_per_row
        col0 = (tidx % threads_per_row) * COLS_PER_THREAD
        acc = cute.make_rmem_tensor(COLS_PER_THREAD, Float32)
        for row0 in cutlass.range(0, n_rows, rows_per_pass, unroll=1):
            row = row0 + tidx // threads_per_row
            if row < n_rows:
                lse_max = -Float32.inf
                for s in cutlass.range(num_splits, unroll=1):
                    lse_max = cutlass.max(lse_max, mPartialLSE[first_slot + s, row])
                # All -inf: the row saw no key at all; shift by 0 so weights are exact 0.
                shift = lse_max
                if lse_max == -Float32.inf:
                    shift = Float32(0.0)
                acc.fill(0.0)
                total = Float32(0.0)
                for s in cutlass.range(num_splits, unroll=1):
                    w = cute.math.exp(mPartialLSE[first_slot + s, row] - shift, fastmath=True)
                    total = total + w
                    for j in cutlass.range_constexpr(COLS_PER_THREAD):
                        acc[j] = acc[j] + w * mPartialO[first_slot + s, row, col0 + j]
                inv = Float32(0.0)
                if total > Float32(0.0):
                    inv = Float32(1.0) / total
                for j in cutlass.range_constexpr(COLS_PER_THREAD):
                    gO[row_start + row, col0 + j] = (acc[j] * inv).to(self.dtype)
                if const_expr(mLSE is not None):
                    if tidx % threads_per_row == 0:
                        row_lse = -Float32.inf
                        if total > Float32(0.0):
                            row_lse = shift + cute.math.log(total, fastmath=True)
                        gLSE = layouts.packed_lse(mLSE, q_start, q_len, kv_head, self.group)
                        gLSE[row_start + row] = row_lse
