"""The base both POD kernels (`pod_fwd_sm90.py`, `pod_fwd_sm80.py`) stand on: the compiled
entry point and its two argument bundles (`args.py`), the unpacking of a variant's
configuration, and what both read the same way from a variant's flags and the plan's
parameter words: which KV tiles need a mask and the mask itself with the window's edges,
the parameter that turns a raw score into its logit, the sink logit of each row, and the
split-KV merge after an item's partials."""

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from podcute import layouts
from podcute.kernels.args import PlanTensors, PodTensors
from podcute.kernels.barriers import NamedBarrier
from podcute.kernels.config import KernelConfig
from podcute.kernels.dtypes import DTYPES
from podcute.kernels.mask import apply_mask
from podcute.kernels.metadata import IParam, Param
from podcute.kernels.mma_utils import rows_cols_view
from podcute.kernels.split_merge import finish_split
from podcute.kernels.work import WorkItem


class PodKernelBase:
    """A POD kernel family: a subclass says which configurations it builds
    (`can_implement`) and launches its `kernel` (`launch_kernel`); the entry point, the
    configuration's common facts and the shared device pieces are here."""

    # A merge loads this many splits at once: a 16-split prefill merge then takes a
    # quarter of the round trips of 2 at a time (8 spilled 4 bytes in 4 of 72 sm_90a
    # variants). A sharer's merge (shared_prefix variants) loads this many terms: 8
    # covers S1's 7 prefix pieces and its own slot in one round trip a row pass, where
    # 2 at a time took four, each behind its term lookup. The subclass may lower them
    # where the merge's registers would move its tile loops' allocation.
    merge_splits = 4
    shared_merge_splits = 8

    def __init__(self, cfg: KernelConfig):
        ok, why = cfg.can_implement()  # (the common checks, then this family's)
        if ok and cfg.kernel_class() is not type(self):
            ok, why = False, f"{cfg.arch} is served by {cfg.kernel_class().__name__}"
        if not ok:
            raise ValueError(f"{type(self).__name__}: {why}")
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.head_dim = cfg.head_dim
        self.group = cfg.group
        self.causal = cfg.causal
        self.tile_m = cfg.tile_m_prefill  # rows of sQ: the largest item's
        self.tile_n = cfg.tile_n
        self.num_stages = cfg.num_stages

    @classmethod
    def can_implement(cls, cfg: KernelConfig) -> tuple[bool, str]:
        """(True, "") if this kernel family builds `cfg`, else (False, why): what the
        family needs beyond KernelConfig.can_implement's common checks (which call it)."""
        raise NotImplementedError

    @classmethod
    def smem_bytes(cls, cfg: KernelConfig) -> int:
        """Shared memory one CTA of `cfg` takes (the family's SharedStorage)."""
        raise NotImplementedError

    @cute.jit
    def __call__(
        self,
        # PodTensors, flattened (args.py says what each is)
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
        mLSE: Optional[cute.Tensor], mSinks: Optional[cute.Tensor],
        mKScale: Optional[cute.Tensor], mVScale: Optional[cute.Tensor],
        mK2: Optional[cute.Tensor], mV2: Optional[cute.Tensor],
        # PlanTensors, flattened
        mWork: cute.Tensor, mCtaPtr: cute.Tensor, mQStart: cute.Tensor, mKvLen: cute.Tensor,
        mPageStart: cute.Tensor, mPageList: cute.Tensor, mPartialO: cute.Tensor,
        mPartialLSE: cute.Tensor, mMerge: cute.Tensor, mSlotMerge: cute.Tensor,
        mMergeSem: cute.Tensor, mParams: cute.Tensor, mIParams: cute.Tensor,
        mShared: cute.Tensor, page_shift: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """The compiled function: `(*PodTensors, *PlanTensors, num_ctas, stream)`, flat,
        as TVM-FFI passes torch tensors; bundled here once for everything below."""
        self.launch_kernel(
            PodTensors(mQ, mK, mV, mO, mLSE, mSinks, mKScale, mVScale, mK2, mV2),
            PlanTensors(mWork, mCtaPtr, mQStart, mKvLen, mPageStart, mPageList, mPartialO,
                        mPartialLSE, mMerge, mSlotMerge, mMergeSem, mParams, mIParams,
                        mShared, page_shift),
            num_ctas, stream)

    def launch_kernel(self, io: PodTensors, plan: PlanTensors, num_ctas: Int32,
                      stream: cuda.CUstream):
        """Build the shared storage and launch `kernel` on `num_ctas` CTAs (traced inside
        `__call__`)."""
        raise NotImplementedError

    def launch_options(self, num_ctas: Int32, stream: cuda.CUstream) -> dict:
        """The `.launch()` arguments of a persistent grid of `num_ctas` CTAs."""
        return dict(
            grid=[num_ctas, 1, 1],
            block=[self.cfg.num_threads, 1, 1],
            stream=stream,
            # The register cap setmaxnreg needs (ptxas drops it without one), and the
            # CTAs an SM holds.
            min_blocks_per_mp=self.cfg.ctas_per_sm,
            # Saying so keeps compilation free of device queries (cross-compiles without
            # a GPU); the CTAs want the SM's shared memory, not L1.
            preferred_smem_carveout=100,
        )

    @cute.jit
    def q_rows(self, mQ: cute.Tensor, item: WorkItem) -> cute.Tensor:
        """The item's request's packed Q rows (layouts.packed_rows)."""
        return layouts.packed_rows(mQ, item.q_start, item.q_len, item.kv_head, self.group)

    @cute.jit
    def copy_q(self, q_gather, sQ: cute.Tensor, mQ: cute.Tensor, mQ_rows: cute.Tensor,
               plan: PlanTensors, item: WorkItem, packed_row):
        """Gather the item's Q rows into sQ: tile row r from the item's packed row
        `packed_row(r)` of `mQ_rows` (`q_rows`, made by the caller where its registers are
        cheapest). A shared-prefix tile's packed rows are its sharers' instead (their
        tokens from the plan's list, planning/sharing.py)."""

        def own_row(m, r):
            return mQ_rows[packed_row(r), None]

        if const_expr(self.cfg.shared_prefix):
            if item.is_prefix_tile(plan.mIParams):
                # (origins moved once: per row only the token lookup and the head)
                mQ_heads = cute.domain_offset((0, item.kv_head * self.group, 0), mQ)
                mTokens = cute.domain_offset((item.q_start,), plan.mShared)

                def tile_row(m, r):
                    tok, g = layouts.packed_coord(packed_row(r), self.group)
                    return mQ_heads[mTokens[tok], g, None]

                q_gather.copy_rows(sQ, tile_row)
            else:
                q_gather.copy_rows(sQ, own_row)
        else:
            q_gather.copy_rows(sQ, own_row)

    @cute.jit
    def merge_split(self, io: PodTensors, plan: PlanTensors, item: WorkItem, tidx: Int32,
                    num_threads: cutlass.Constexpr[int]):
        """After a split piece's partials are written: the group's last piece merges them
        into out (split_merge.finish_split), on the `num_threads` computing threads."""
        if item.split_slot >= 0:
            finish_split(io, plan, item.split_slot, self.group, self.cfg.vo_dim, tidx,
                         num_threads, barrier_id=NamedBarrier.MMA,
                         merge_rank=item.merge_rank, shared=self.cfg.shared_prefix,
                         splits_in_flight=self.shared_merge_splits
                         if self.cfg.shared_prefix else self.merge_splits)

    def window_right(self, mIParams: cute.Tensor):
        """The right limit's offset from the query position (0: causal)."""
        if const_expr(self.cfg.window):
            return mIParams[IParam.WINDOW_RIGHT]
        return 0

    def needs_mask(self, n_block: Int32, mask_from: Int32, mask_until: Int32):
        """Whether KV tile n_block holds a key some row must not see: tiles >= mask_from
        on the right, < mask_until left of a window (visibility.py)."""
        needs = n_block >= mask_from
        if const_expr(self.cfg.window):
            needs = needs | (n_block < mask_until)
        return needs

    def mask_scores(self, acc_S: cute.Tensor, tScS: cute.Tensor, item: WorkItem, row_offset,
                    col_start: Int32, mIParams: cute.Tensor):
        """mask.apply_mask of the item's rows from row_start + `row_offset` on the KV tile
        at `col_start`, with the variant's causal flag and the plan's window edges."""
        left = Int32(-1)
        if const_expr(self.cfg.window):
            left = mIParams[IParam.WINDOW_LEFT]
        apply_mask(acc_S, tScS, item.row_start + row_offset, col_start, item.kv_end,
                   item.kv_len - item.q_len, self.group, self.cfg.causal,
                   self.window_right(mIParams), left, self.cfg.window)

    @property
    def logit_param(self) -> int:
        """The parameter that turns a raw score into its logit (metadata.Param)."""
        return Param.SOFTCAP if self.cfg.softcap else Param.SM_SCALE

    @cute.jit
    def row_sinks(self, mSinks: Optional[cute.Tensor], tOcO: cute.Tensor, item: WorkItem,
                  row_offset: Int32):
        """The sink logit of each of this thread's rows (their query heads'), -inf for a
        split piece (the merge adds the sink once); None without sinks."""
        if const_expr(mSinks is None):
            return None
        tOcO_mn = rows_cols_view(tOcO)
        sink = cute.make_rmem_tensor(cute.size(tOcO_mn, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(tOcO_mn, mode=[0])):
            sink[r] = mSinks[layouts.packed_head(item.row_start + row_offset + tOcO_mn[r, 0][0],
                                                 item.kv_head, self.group)]
            if item.split_slot >= 0:
                sink[r] = -Float32.inf
        return sink
