"""Online softmax over register tiles of S, shared by the prefill and decode work."""

import math
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from podcute.kernels.mma_utils import rows_cols_view

LOG2_E = math.log2(math.e)


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running row max (of raw scores) and per-thread partial row sums.

    Each row of the 64-row tile lives on a quad of 4 threads; row maxima are reduced
    across the quad every tile (they shift the exponent), row sums only at the end.
    """

    row_max: cute.Tensor
    row_sum: cute.Tensor
    scale_log2: Float32  # sm_scale * log2(e): exp(x * sm_scale) == exp2(x * scale_log2)

    @staticmethod
    def create(num_rows: cutlass.Constexpr[int], scale_log2: Float32) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        return OnlineSoftmax(row_max, row_sum, scale_log2)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def update(self, acc_S: cute.Tensor, row_scale: cute.Tensor) -> None:
        """Turn scores into unnormalised probabilities in place; write O's rescale factors
        (for the rows' previous maxima) into `row_scale`. The caller owns `row_scale`, so
        it can carry the factors into the next tile's GEMM shadow."""
        acc_S_mn = rows_cols_view(acc_S)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            scores = acc_S_mn[r, None].load()
            prev_max = self.row_max[r]
            cur_max = scores.reduce(cute.ReductionOp.MAX, prev_max, 0)
            cur_max = cute.arch.warp_reduction_max(cur_max, threads_in_group=4)
            self.row_max[r] = cur_max
            # A row with every key masked so far keeps max -inf: shift by 0 instead so
            # exp2 gives exact zeros rather than NaN from (-inf) - (-inf).
            safe_max = cur_max
            if cur_max == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * self.scale_log2
            probs = cute.math.exp2(scores * self.scale_log2 - max_scaled, fastmath=True)
            scale = cute.math.exp2(prev_max * self.scale_log2 - max_scaled, fastmath=True)
            row_scale[r] = scale
            self.row_sum[r] = self.row_sum[r] * scale + probs.reduce(
                cute.ReductionOp.ADD, Float32(0.0), 0
            )
            acc_S_mn[r, None].store(probs)

    @cute.jit
    def summed(self) -> cutlass.Boolean:
        """True, computed from every row's running sum: an instruction that must follow
        the whole update. (A sum is >= 0 or NaN, so the total is never -1; a compiler
        cannot know that and fold the test.)"""
        total = self.row_sum[0]
        for r in cutlass.range_constexpr(1, cute.size(self.row_sum)):
            total = total + self.row_sum[r]
        return total != Float32(-1.0)

    @cute.jit
    def merge(self, other_max: cute.Tensor, other_sum: cute.Tensor) -> tuple:
        """Fold another running softmax of the same rows over disjoint keys into this one
        (the decode combine of two warpgroups). `other_sum` is the other thread's partial
        sum, like this one's. Returns the per-row factors for (this O, the other O)."""
        scale_self = cute.make_rmem_tensor_like(self.row_max, Float32)
        scale_other = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            m_self, m_other = self.row_max[r], other_max[r]
            m = cutlass.max(m_self, m_other)
            safe_max = m  # both -inf (no key seen by either): factors exp2(-inf) = 0
            if m == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * self.scale_log2
            s_self = cute.math.exp2(m_self * self.scale_log2 - max_scaled, fastmath=True)
            s_other = cute.math.exp2(m_other * self.scale_log2 - max_scaled, fastmath=True)
            self.row_max[r] = m
            self.row_sum[r] = self.row_sum[r] * s_self + other_sum[r] * s_other
            scale_self[r] = s_self
            scale_other[r] = s_other
        return scale_self, scale_other

    @cute.jit
    def finalize(self, logit_scale: Float32, sink: Optional[cute.Tensor] = None) -> tuple:
        """Return (O's normaliser, natural-log LSE) per row; `logit_scale` turns a raw
        score into its logit (sm_scale, or the soft cap). With `sink` (a per-row logit,
        -inf for none) the sink joins the denominator as a key with no value
        (docs/contract.md), and the LSE includes it. Rows that saw no key get 0 and
        -inf (or the sink's logit)."""
        inv_sum = cute.make_rmem_tensor_like(self.row_sum, Float32)
        lse = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            inv = Float32(0.0)
            row_lse = -Float32.inf
            if const_expr(sink is None):
                if total > Float32(0.0):
                    inv = cute.arch.rcp_approx(total)
                    row_lse = self.row_max[r] * logit_scale + cute.math.log(total, fastmath=True)
            else:
                # Shift by max(row max, sink) so neither exponent overflows.
                m = self.row_max[r] * logit_scale
                m_all = cutlass.max(m, sink[r])
                if m_all > -Float32.inf:
                    w = cute.math.exp(m - m_all, fastmath=True)  # 0 for a row with no key
                    total_all = total * w + cute.math.exp(sink[r] - m_all, fastmath=True)
                    inv = w * cute.arch.rcp_approx(total_all)
                    row_lse = m_all + cute.math.log(total_all, fastmath=True)
            inv_sum[r] = inv
            lse[r] = row_lse
        return inv_sum, lse


@cute.jit
def softcap_scores(acc_S: cute.Tensor, scale: Float32):
    """Logit soft-capping: S <- tanh(S * scale) in place, scale = sm_scale / softcap (the
    softmax then scales by softcap: softcap * tanh(s * sm_scale / softcap), Gemma 2's cap)."""
    # tanh.approx per element (the intrinsic is scalar-only): one MUFU op, like exp2.
    for i in cutlass.range_constexpr(cute.size(acc_S)):
        acc_S[i] = cute.math.tanh(acc_S[i] * scale, approx=True)


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    """Multiply each accumulator row by its factor (O rescale after a max update)."""
    acc_mn = rows_cols_view(acc)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = acc_mn[r, c] * row_scale[r]
