"""The portable POD attention kernel: warp-level tensor cores (mma.sync m16n8k16), for
sm_80 (A100), sm_86 (A10/A40), sm_89 (L4/L40S), sm_120a (RTX 50) and plain sm_90.

The same contract, plan and work-item format as the sm_90a kernel (`pod_fwd_sm90.py`):
every CTA of a persistent grid runs the list of work items the planner gave it, an item
being packed (query token, query head) rows of one (request, KV head) against a range of
that request's KV tokens. What differs is how the tensor cores are fed.

CTA = 4 warps (FlashAttention-2's structure), each warp owning 16 of the item's 64 rows:
  * every thread both copies and computes: Q rows and K/V page rows come by cp.async
    (`gather.RowGather`, the page of each row looked up one tile ahead), into swizzled
    shared-memory tiles;
  * S = Q K^T and O += P V are mma.sync over fragments read with ldmatrix (V through
    ldmatrix.trans);
  * two K/V stages (`KernelConfig.num_stages`, where two CTAs of them fit an SM): tile
    n + 2 loads while tile n is computed, so a decoding CTA, whose one busy warp would
    otherwise wait out HBM latency twice a tile, keeps 32-64 KB in flight; one stage
    (the 100 KB SMs): V of tile n loads while S of tile n and its softmax run, K of tile
    n + 1 while P V of tile n runs;
  * the online softmax, masking, soft cap, sinks, epilogue stores and the split-KV
    merge are the shared pieces (`softmax`, `mask`, `epilogue`, `split_merge`): a split
    piece writes fp32 partials and the CTA finishing a group's last piece merges it, in
    the launch.
Prefill and decode items run the same loop here (a decode item's rows fill the first
warps; the others only copy K/V tiles for them).
"""

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from podcute import layouts
from podcute.kernels.barriers import NamedBarrier
from podcute.kernels.config import KernelConfig
from podcute.kernels.dtypes import DTYPES
from podcute.kernels.epilogue import store_fragments, store_lse, store_partial
from podcute.kernels.gather import RowGather
from podcute.kernels.metadata import IParam, Param
from podcute.kernels.pod_kernel import PodKernelBase
from podcute.kernels.mma_utils import acc_as_operand_a_layout, rows_cols_view, warp_gemm
from podcute.kernels.softmax import LOG2_E, OnlineSoftmax, rescale_rows, softcap_scores
from podcute.kernels.smem import tile_smem_layout
from podcute.kernels.split_merge import finish_split
from podcute.kernels.visibility import left_mask_until
from podcute.kernels.work import WorkItem

WARP_ROWS = 16  # rows of one warp: one m16 mma.sync


class PodAttentionSm80(PodKernelBase):
    def __init__(self, cfg: KernelConfig):
        ok, why = cfg.can_implement()
        if not ok or not cfg.warp_mma:
            raise ValueError(f"PodAttentionSm80: {why or 'not a warp-level configuration'}")
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.head_dim = cfg.head_dim
        self.group = cfg.group
        self.causal = cfg.causal
        self.tile_m = cfg.tile_m_prefill
        self.tile_n = cfg.tile_n
        self.num_threads = cfg.num_threads
        self.num_stages = cfg.num_stages
        assert self.tile_m == WARP_ROWS * self.num_threads // 32

    def _tiled_mmas(self):
        """Both GEMMs: the CTA's warps stacked along M (16 rows each); N in steps of 16 so
        one ldmatrix x4 feeds two n8 MMAs of B."""
        warps = self.num_threads // 32
        atom = warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        tiled_mma_qk = cute.make_tiled_mma(atom, (warps, 1, 1),
                                           permutation_mnk=(warps * 16, 16, 16))
        tiled_mma_pv = cute.make_tiled_mma(atom, (warps, 1, 1),
                                           permutation_mnk=(warps * 16, 16, 16))
        return tiled_mma_qk, tiled_mma_pv

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, Hq, D]
        mK: cute.Tensor,  # [pages, page_size, Hkv, D] (launch() passes HND as this view)
        mV: cute.Tensor,
        mO: cute.Tensor,  # [T, Hq, D]
        mLSE: Optional[cute.Tensor],  # [T, Hq] fp32 or None
        mSinks: Optional[cute.Tensor],  # [Hq] fp32 sink logits (has_sinks) or None
        mKScale: Optional[cute.Tensor],  # (fp8 caches: the sm_90a kernel only)
        mVScale: Optional[cute.Tensor],
        mKRagged: Optional[cute.Tensor],  # ragged_kv: request 0's K/V, [1, kv_len, Hkv, D]
        mVRagged: Optional[cute.Tensor],
        mWork: cute.Tensor,  # [items, WORK_COLS] int32 (metadata.WorkCol)
        mCtaPtr: cute.Tensor,  # [grid + 1] int32
        mQStart: cute.Tensor,  # [B + 1] int32
        mKvLen: cute.Tensor,  # [B] int32
        mPageStart: cute.Tensor,  # [B] int32
        mPageList: cute.Tensor,  # flat int32 page indices (plan-owned)
        mPartialO: cute.Tensor,  # [slots, tile_m, D] fp32
        mPartialLSE: cute.Tensor,  # [slots, tile_m] fp32
        mMerge: cute.Tensor,  # [merges, MERGE_COLS] int32 (metadata.MergeCol)
        mSlotMerge: cute.Tensor,  # [slots] int32
        mMergeSem: cute.Tensor,  # [merges] int32 semaphores, zero between launches
        mParams: cute.Tensor,  # [NUM_PARAMS] fp32 (metadata.Param)
        mIParams: cute.Tensor,  # the same words as int32 (metadata.IParam)
        page_shift: Int32,  # log2(page_size)
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        d = self.head_dim
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = tile_smem_layout(self.dtype, self.tile_m, d)
        sKV_layout = tile_smem_layout(self.dtype, self.tile_n, d, stages=self.num_stages)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            mQ, mK, mV, mKRagged, mVRagged, mO, mLSE, mSinks, mWork, mCtaPtr, mQStart, mKvLen,
            mPageStart, mPageList, mPartialO, mPartialLSE, mMerge, mSlotMerge, mMergeSem, mParams, mIParams,
            page_shift, tiled_mma_qk, tiled_mma_pv, sQ_layout, sKV_layout,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.cfg.ctas_per_sm,
            # Saying so keeps compilation free of device queries (cross-compiles without
            # a GPU): the CTAs of an SM want its shared memory, not L1.
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKRagged: Optional[cute.Tensor],
        mVRagged: Optional[cute.Tensor],
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],
        mWork: cute.Tensor,
        mCtaPtr: cute.Tensor,
        mQStart: cute.Tensor,
        mKvLen: cute.Tensor,
        mPageStart: cute.Tensor,
        mPageList: cute.Tensor,
        mPartialO: cute.Tensor,
        mPartialLSE: cute.Tensor,
        mMerge: cute.Tensor,
        mSlotMerge: cute.Tensor,
        mMergeSem: cute.Tensor,
        mParams: cute.Tensor,
        mIParams: cute.Tensor,
        page_shift: Int32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
    ):
        tile_n, d, stages = self.tile_n, self.head_dim, self.num_stages
        tidx = cute.arch.thread_idx()[0]
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        # V^T view (D, tile_n, stage) of the row-major V stages: the B operand of P V.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((d, tile_n, stages), order=(1, 0, 2)))

        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt[None, None, 0]))
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                   self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                     self.dtype)
        copy_q = cute.make_tiled_copy_A(ldsm, tiled_mma_qk).get_slice(tidx)
        copy_k = cute.make_tiled_copy_B(ldsm, tiled_mma_qk).get_slice(tidx)
        copy_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma_pv).get_slice(tidx)
        # (CPY, CPY_M/N, CPY_K, stage) views: the tile loop picks its stage.
        tSsQ, tSrQ_copy = copy_q.partition_S(sQ), copy_q.retile(tSrQ)
        tSsK, tSrK_copy = copy_k.partition_S(sK), copy_k.retile(tSrK)
        # Q's fragments: read per K block with K's (from shared memory every tile), or
        # once per item into registers (`KernelConfig.q_in_registers`).
        q_operand = (None, None, None) if const_expr(self.cfg.q_in_registers) else (
            copy_q, tSsQ, tSrQ_copy)
        tOsVt = copy_v.partition_S(sVt)
        tOrVt_copy = copy_v.retile(tOrVt)

        acc_shape_S = thr_mma_qk.partition_shape_C((self.tile_m, tile_n))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, d)), Float32)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, tile_n)))
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, d)))
        softmax = OnlineSoftmax.create(cute.size(rows_cols_view(acc_O), mode=[0]),
                                       mParams[self.logit_param] * LOG2_E)
        row_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        rP = cute.make_rmem_tensor(acc_shape_S, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a_layout(rP.layout))

        q_gather = RowGather.create(self.dtype, self.tile_m, d, self.num_threads, tidx)
        kv_gather = RowGather.create(self.dtype, tile_n, d, self.num_threads, tidx)
        page_divisor = layouts.PageShift(page_shift)
        # Pages and slots of this thread's K/V rows: the current tile's, looked up one tile
        # ahead (the page-table load's latency hides under the tile's S GEMM).
        pages = cute.make_rmem_tensor(kv_gather.rows_per_thread, Int32)
        slots = cute.make_rmem_tensor(kv_gather.rows_per_thread, Int32)

        warp_id = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta = cute.arch.block_idx()[0]
        for i in cutlass.range(mCtaPtr[cta], mCtaPtr[cta + 1], unroll=1):
            item = WorkItem.load(mWork, mQStart, mKvLen, mPageStart, i)
            n_min, n_max, mask_from = item.tile_bounds(
                item.row_start, self.group, self.causal, tile_n, self.window_right(mIParams))
            mask_until = Int32(0)
            if const_expr(self.cfg.window):
                mask_until = left_mask_until(
                    item.kv_len, item.q_len, item.row_end, self.group,
                    mIParams[IParam.WINDOW_LEFT], tile_n)
            # A warp whose 16 rows all lie past the item's (a decode item's 1-16 rows fill
            # the first warp) only copies: its MMAs would repeat the last row, and their
            # ldmatrix reads take shared-memory bandwidth from the SM's other CTA.
            busy = warp_id * WARP_ROWS < item.row_end - item.row_start
            softmax.reset()
            acc_O.fill(0.0)
            self.load_q(mQ, sQ, q_gather, item)
            # Prologue: K (and with two stages V) of the first `stages` tiles; Q goes with
            # the first. One commit group a tile, empty past n_max, so the wait in the
            # loop counts the same on every path.
            for s in cutlass.range_constexpr(stages):
                if n_min + s < n_max:
                    self.lookup_pages(pages, slots, kv_gather, mPageList, page_divisor, item,
                                      n_min + s)
                    self.load_kv(mK, mKRagged, sK[None, None, s], kv_gather, pages, slots, item)
                    if const_expr(stages > 1):
                        self.load_kv(mV, mVRagged, sV[None, None, s], kv_gather, pages, slots,
                                     item)
                cute.arch.cp_async_commit_group()
            if const_expr(stages > 1):
                if n_min + stages < n_max:
                    self.lookup_pages(pages, slots, kv_gather, mPageList, page_divisor, item,
                                      n_min + stages)
            for n_block in cutlass.range(n_min, n_max, unroll=1):
                stage = (n_block - n_min) % stages if const_expr(stages > 1) else 0
                # K (and V) of this tile (and Q) have landed; every warp is done with the
                # stage the copies below refill.
                cute.arch.cp_async_wait_group(stages - 1)
                cute.arch.barrier()
                if const_expr(stages == 1):
                    self.load_kv(mV, mVRagged, sV[None, None, 0], kv_gather, pages, slots,
                                 item)
                    cute.arch.cp_async_commit_group()
                    if n_block + 1 < n_max:
                        self.lookup_pages(pages, slots, kv_gather, mPageList, page_divisor,
                                          item, n_block + 1)
                if busy:
                    if const_expr(self.cfg.q_in_registers):
                        if n_block == n_min:
                            cute.copy(copy_q, tSsQ, tSrQ_copy)
                    acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                    acc_S.fill(0.0)
                    warp_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, *q_operand, copy_k,
                              tSsK[None, None, None, stage], tSrK_copy)
                    self.score_tile(acc_S, tScS, item, n_block, mask_from, mask_until,
                                    mParams, mIParams)
                    softmax.update(acc_S, row_scale)
                    rescale_rows(acc_O, row_scale)
                    rP.store(acc_S.load().to(self.dtype))
                if const_expr(stages == 1):
                    # V has landed; every warp is done with K.
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                    if n_block + 1 < n_max:
                        self.load_kv(mK, mKRagged, sK[None, None, 0], kv_gather, pages, slots,
                                     item)
                    cute.arch.cp_async_commit_group()
                if busy:
                    warp_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt, None, None, None, copy_v,
                              tOsVt[None, None, None, stage], tOrVt_copy)
                if const_expr(stages > 1):
                    # Every warp is done with this stage: tile n_block + stages refills it,
                    # and the pages of the tile after it are looked up (used a tile later).
                    cute.arch.barrier()
                    if n_block + stages < n_max:
                        self.load_kv(mK, mKRagged, sK[None, None, stage], kv_gather, pages,
                                     slots, item)
                        self.load_kv(mV, mVRagged, sV[None, None, stage], kv_gather, pages,
                                     slots, item)
                    cute.arch.cp_async_commit_group()
                    if n_block + stages + 1 < n_max:
                        self.lookup_pages(pages, slots, kv_gather, mPageList, page_divisor,
                                          item, n_block + stages + 1)
            self.epilogue(acc_O, softmax, tOcO, item, mO, mLSE, mSinks, mParams, mPartialO,
                          mPartialLSE, tidx)
            if item.split_slot >= 0:
                finish_split(mO, mLSE, mPartialO, mPartialLSE, mMerge, mSlotMerge, mMergeSem,
                             mQStart, item.split_slot, self.group, d, tidx,
                             self.num_threads, barrier_id=NamedBarrier.MMA, mSinks=mSinks)
            # Every copy has landed and every warp is done with sQ, sK and sV before the
            # next item's copies overwrite them.
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

    # ---- copies -----------------------------------------------------------------------

    @cute.jit
    def load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, q_gather: RowGather, item: WorkItem):
        """cp.async of the item's packed Q rows into sQ; rows past its end repeat its last
        row (valid memory, never stored)."""
        mQ_rows = layouts.packed_rows(mQ, item.q_start, item.q_len, item.kv_head, self.group)
        last_row = item.row_end - 1
        q_gather.copy_rows(
            sQ, lambda m, r: mQ_rows[cutlass.min(item.row_start + r, last_row), None])

    @cute.jit
    def lookup_pages(self, pages: cute.Tensor, slots: cute.Tensor, kv_gather: RowGather,
                     mPageList: cute.Tensor, page_divisor, item: WorkItem, n_block: Int32):
        """(page, slot) of each K/V row this thread copies for tile n_block; tokens past
        kv_end clamp to the item's last (layouts.clamp_token: no page-table entry past
        the request's pages is read, and those rows hold finite values that the mask and
        P = 0 discard)."""
        ragged = item.reads_ragged(self.cfg.ragged_kv)
        for m in cutlass.range_constexpr(kv_gather.rows_per_thread):
            token = layouts.clamp_token(n_block * self.tile_n, kv_gather.row(m), item.kv_end)
            page, slot = layouts.kv_locate(mPageList, item.page_start, token, page_divisor)
            pages[m], slots[m] = layouts.ragged_locate(page, slot, token, ragged)

    @cute.jit
    def load_kv(self, mKV: cute.Tensor, mKVRagged: Optional[cute.Tensor], sX: cute.Tensor,
                kv_gather: RowGather, pages: cute.Tensor, slots: cute.Tensor, item: WorkItem):
        """cp.async of one K or V tile from the looked-up rows (of the cache, or of the
        ragged source for its request)."""
        ragged = item.reads_ragged(self.cfg.ragged_kv)
        kv_gather.copy_rows(
            sX, lambda m, r: layouts.kv_row_in(mKV, mKVRagged, ragged, pages[m], slots[m],
                                               item.kv_head))

    # ---- scores -----------------------------------------------------------------------

    @cute.jit
    def score_tile(self, acc_S: cute.Tensor, tScS: cute.Tensor, item: WorkItem, n_block: Int32,
                   mask_from: Int32, mask_until: Int32, mParams: cute.Tensor,
                   mIParams: cute.Tensor):
        """Scores of KV tile n_block before the softmax: soft-capped (a variant's flag),
        then masked on the tiles that hold a key some row must not see."""
        if const_expr(self.cfg.softcap):
            softcap_scores(acc_S, mParams[Param.SOFTCAP_SCALE])
        if self.needs_mask(n_block, mask_from, mask_until):
            self.mask_scores(acc_S, tScS, item, 0, n_block * self.tile_n, mIParams)

    # ---- epilogue ---------------------------------------------------------------------

    @cute.jit
    def epilogue(self, acc_O: cute.Tensor, softmax: OnlineSoftmax, tOcO: cute.Tensor,
                 item: WorkItem, mO: cute.Tensor, mLSE: Optional[cute.Tensor],
                 mSinks: Optional[cute.Tensor], mParams: cute.Tensor, mPartialO: cute.Tensor,
                 mPartialLSE: cute.Tensor, tidx: Int32):
        """Normalise O and write it (and the LSE) for the item's rows, or fp32 partials of a
        split piece (`epilogue.py`)."""
        inv_sum, lse = softmax.finalize(mParams[self.logit_param],
                                        self.row_sinks(mSinks, tOcO, item, Int32(0)))
        rescale_rows(acc_O, inv_sum)
        n_rows = item.row_end - item.row_start
        if item.split_slot >= 0:
            store_partial(acc_O, lse, tOcO, mPartialO, mPartialLSE, item.split_slot, Int32(0),
                          n_rows, tidx)
        else:
            if const_expr(mLSE is not None):
                gLSE = layouts.packed_lse(mLSE, item.q_start, item.q_len, item.kv_head,
                                          self.group)
                store_lse(lse, tOcO, gLSE, item.row_start, n_rows, tidx)
            gO = layouts.packed_rows(mO, item.q_start, item.q_len, item.kv_head, self.group)
            store_fragments(acc_O, tOcO, gO, item.row_start, n_rows)
