"""The fused POD attention kernel for sm_90a: prefill and decode work in one launch.

Every CTA of a persistent grid runs the list of work items the planner gave it
(`docs/design.md`). An item is a tile of packed (query token, query head) rows of one
(request, KV head) against a range of that request's KV tokens. Prefill items are
row tiles of long requests over their whole (causal) KV range; decode items hold a
request's whole GQA group (x its q_len) in one tile over one KV split. The planner
interleaves both kinds in every CTA list and two CTAs share each SM, so tensor-core
bound prefill tiles and HBM-bound decode splits run side by side on every SM.

CTA = 2 warpgroups:
  * producer (warpgroup 0, 56 registers): gathers Q rows with cp.async and streams K/V
    tiles into a multi-stage mbarrier pipeline: one TMA box per tile when a page holds
    whole KV tiles (page_size % tile_n == 0), else a cp.async gather of page rows;
  * consumer (warpgroup 1, 200 registers): S = Q K^T (wgmma, SS), mask only on tiles
    that need it, online softmax in registers, O += P V (wgmma, RS), epilogue to `out`
    or, for a split of a long KV range, to fp32 partials; the CTA that finishes a split
    group's last piece merges them (`split_merge`), so a batch is one launch.
"""

from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from podcute import layouts
from podcute.kernels.config import TileConfig
from podcute.kernels.gather import RowGather
from podcute.kernels.mask import apply_mask
from podcute.kernels.mma_utils import acc_as_operand_a_layout, rows_cols_view, warpgroup_gemm
from podcute.kernels.softmax import LOG2_E, OnlineSoftmax, rescale_rows
from podcute.kernels.split_merge import finish_split
from podcute.kernels.work import WorkItem

WARPGROUP = 128


def tile_smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None):
    """Swizzled K-major smem layout of a (rows, cols) tile (+ stages), as wgmma reads it."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


class PodAttentionSm90:
    # setmaxnreg budget: two CTAs of 256 threads per SM share 64K registers, so a CTA
    # starts at 128 per thread (launch cap) and moves them to the consumer warpgroup.
    producer_regs = 56
    consumer_regs = 200
    ctas_per_sm = 2

    def __init__(self, dtype, head_dim: int, group: int, causal: bool, has_lse: bool,
                 tma_kv: bool):
        self.dtype = dtype
        self.tile = TileConfig.for_head_dim(head_dim)
        self.head_dim = head_dim
        self.group = group
        self.causal = causal
        self.has_lse = has_lse
        self.tma_kv = tma_kv  # launch() picks it only when page_size % tile_n == 0
        self.num_threads = 2 * WARPGROUP

    def _tiled_mmas(self):
        tile_m, tile_n, d = self.tile.tile_m, self.tile.tile_n, self.head_dim
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (tile_m, tile_n),
        )
        # P comes from registers (RS wgmma); V is read transposed (MN-major) from smem.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (tile_m, d), warpgroup.OperandSource.RMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [total_q, Hq, D]
        mK: cute.Tensor,  # [pages, page_size, Hkv, D]: launch() passes HND as this view
        mV: cute.Tensor,
        mO: cute.Tensor,  # [total_q, Hq, D]
        mLSE: Optional[cute.Tensor],  # [total_q, Hq] fp32 or None
        mWork: cute.Tensor,  # [items, 8] int32
        mCtaPtr: cute.Tensor,  # [grid + 1] int32
        mQStart: cute.Tensor,  # [B + 1] int32
        mKvLen: cute.Tensor,  # [B] int32
        mPageStart: cute.Tensor,  # [B] int32
        mPageList: cute.Tensor,  # flat int32 page indices
        mPartialO: cute.Tensor,  # [slots, tile_m, D] fp32
        mPartialLSE: cute.Tensor,  # [slots, tile_m] fp32
        mMerge: cute.Tensor,  # [merges, 6] int32
        mSlotMerge: cute.Tensor,  # [slots] int32: merge row of each split slot
        mMergeSem: cute.Tensor,  # [merges] int32 semaphores, zero between launches
        sm_scale: Float32,
        page_size: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tile_m, tile_n, d = self.tile.tile_m, self.tile.tile_n, self.head_dim
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = tile_smem_layout(self.dtype, tile_m, d)
        sK_layout = tile_smem_layout(self.dtype, tile_n, d, self.tile.num_stages)
        sV_layout = tile_smem_layout(self.dtype, tile_n, d, self.tile.num_stages)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.tile.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.tile.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            merge_flag: cute.struct.MemRange[Int32, 1]

        self.shared_storage = SharedStorage
        tma_atom_k = tma_atom_v = None
        if const_expr(self.tma_kv):
            # Boxes of (tile_n, D) over (slot, dim, kv_head, page): a tile is a piece of one
            # page of one head, addressed by (tile within page, head, physical page).
            box = (tile_n, d)
            op = cpasync.CopyBulkTensorTileG2SOp()
            tma_atom_k, mK = cpasync.make_tiled_tma_atom(
                op, layouts.kv_tma_view(mK), cute.select(sK_layout, mode=[0, 1]), box)
            tma_atom_v, mV = cpasync.make_tiled_tma_atom(
                op, layouts.kv_tma_view(mV), cute.select(sV_layout, mode=[0, 1]), box)
        self.kernel(
            mQ, mK, mV, mO, mLSE, mWork, mCtaPtr, mQStart, mKvLen, mPageStart, mPageList,
            mPartialO, mPartialLSE, mMerge, mSlotMerge, mMergeSem, sm_scale, page_size,
            tma_atom_k, tma_atom_v, tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            # The register cap setmaxnreg needs (ptxas drops it without one).
            min_blocks_per_mp=self.ctas_per_sm,
            # Both CTAs of an SM need the full shared-memory carveout; saying so also
            # keeps compilation free of device queries (cross-compiles without a GPU).
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
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
        sm_scale: Float32,
        page_size: Int32,
        tma_atom_k: Optional[cute.CopyAtom],
        tma_atom_v: Optional[cute.CopyAtom],
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP)
        pipeline_q = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1,
            producer_group=producers, consumer_group=consumers, defer_sync=True,
        )
        pipeline_k = self._make_kv_pipeline(storage.mbar_k.data_ptr(), producers, consumers)
        pipeline_v = self._make_kv_pipeline(storage.mbar_v.data_ptr(), producers, consumers)
        if const_expr(self.tma_kv):
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_atom_k)
                cpasync.prefetch_descriptor(tma_atom_v)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        cta = cute.arch.block_idx()[0]
        item_begin = mCtaPtr[cta]
        item_end = mCtaPtr[cta + 1]

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self.produce(
                mQ, mK, mV, mWork, mQStart, mKvLen, mPageStart, mPageList, page_size,
                tma_atom_k, tma_atom_v, sQ, sK, sV, pipeline_q, pipeline_k, pipeline_v,
                item_begin, item_end,
            )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                mO, mLSE, mWork, mQStart, mKvLen, mPageStart, mPartialO, mPartialLSE,
                mMerge, mSlotMerge, mMergeSem, storage.merge_flag.get_tensor(cute.make_layout(1)),
                sm_scale, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV,
                pipeline_q, pipeline_k, pipeline_v, item_begin, item_end,
            )

    def _make_kv_pipeline(self, barriers, producers, consumers):
        if const_expr(self.tma_kv):
            # One elected thread arms the barrier with the tile's bytes; one thread per
            # consumer warp releases a stage.
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers, num_stages=self.tile.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP // 32),
                tx_count=self.tile.tile_n * self.head_dim * self.dtype.width // 8,
                defer_sync=True,
            )
        return pipeline.PipelineCpAsync.create(
            barrier_storage=barriers, num_stages=self.tile.num_stages,
            producer_group=producers, consumer_group=consumers, defer_sync=True,
        )

    @cute.jit
    def produce(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mWork: cute.Tensor,
        mQStart: cute.Tensor,
        mKvLen: cute.Tensor,
        mPageStart: cute.Tensor,
        mPageList: cute.Tensor,
        page_size: Int32,
        tma_atom_k: Optional[cute.CopyAtom],
        tma_atom_v: Optional[cute.CopyAtom],
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        item_begin: Int32,
        item_end: Int32,
    ):
        tile_m, tile_n, d = self.tile.tile_m, self.tile.tile_n, self.head_dim
        tidx = cute.arch.thread_idx()[0]
        q_gather = RowGather.create(self.dtype, tile_m, d, WARPGROUP, tidx)
        kv_gather = RowGather.create(self.dtype, tile_n, d, WARPGROUP, tidx)
        page_divisor = cute.FastDivmodDivisor(page_size)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.tile.num_stages
        )
        for i in cutlass.range(item_begin, item_end, unroll=1):
            item = WorkItem.load(mWork, mQStart, mKvLen, mPageStart, i)
            # Q: rows past the item's end repeat its last row (valid memory, never stored).
            mQ_rows = layouts.packed_rows(mQ, item.q_start, item.q_len, item.kv_head, self.group)
            last_row = item.row_end - 1
            pipeline_q.producer_acquire(q_state)
            q_gather.copy_rows(
                sQ, lambda r: mQ_rows[cutlass.min(item.row_start + r, last_row), None]
            )
            cute.arch.cp_async_commit_group()
            pipeline_q.producer_commit(q_state)
            q_state.advance()

            n_min, n_max = item.n_block_range(tile_n)
            if const_expr(self.tma_kv):
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                    kv_state = self.produce_kv_tma(
                        mK, mV, mPageList, page_divisor, tma_atom_k, tma_atom_v, sK, sV,
                        pipeline_k, pipeline_v, kv_state, item, n_min, n_max,
                    )
            else:
                kv_state = self.produce_kv_gather(
                    mK, mV, mPageList, page_divisor, kv_gather, sK, sV,
                    pipeline_k, pipeline_v, kv_state, item, n_min, n_max,
                )

    @cute.jit
    def produce_kv_tma(self, mK, mV, mPageList, page_divisor, tma_atom_k, tma_atom_v,
                       sK, sV, pipeline_k, pipeline_v, kv_state, item: WorkItem,
                       n_min: Int32, n_max: Int32):
        """One TMA box per K and V tile, issued by one warp (page_size % tile_n == 0)."""
        tile_n = self.tile.tile_n
        tKsK, tKgK = self._tma_tiles(tma_atom_k, mK, sK, item.kv_head)
        tVsV, tVgV = self._tma_tiles(tma_atom_v, mV, sV, item.kv_head)
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            # A tile lies inside one page that the request owns: its first token is
            # < kv_end, so no page-table entry past the request's pages is read.
            page_idx, slot = divmod(n_block * tile_n, page_divisor)
            page = mPageList[item.page_start + page_idx]
            tile_in_page = slot // tile_n
            pipeline_k.producer_acquire(kv_state)
            cute.copy(tma_atom_k, tKgK[None, tile_in_page, page], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
            pipeline_v.producer_acquire(kv_state)
            cute.copy(tma_atom_v, tVgV[None, tile_in_page, page], tVsV[None, kv_state.index],
                      tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))
            kv_state.advance()
        return kv_state

    def _tma_tiles(self, tma_atom, mX_tma, sX, kv_head):
        """(smem stages, gmem tiles indexed by (tile within page, page)) for one KV head."""
        gX = cute.local_tile(mX_tma[None, None, kv_head, None],
                             (self.tile.tile_n, self.head_dim), (None, 0, None))
        return cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1),
            cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2),
        )

    @cute.jit
    def produce_kv_gather(self, mK, mV, mPageList, page_divisor, kv_gather, sK, sV,
                          pipeline_k, pipeline_v, kv_state, item: WorkItem,
                          n_min: Int32, n_max: Int32):
        """cp.async gather of K/V page rows by the whole producer warpgroup.

        Rows past kv_end re-read the item's last token (layouts.clamp_token): the
        consumer masks them, and no garbage/NaN slot is ever read.
        """
        tile_n = self.tile.tile_n
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            first_token = n_block * tile_n
            pipeline_k.producer_acquire(kv_state)
            kv_gather.copy_rows(
                sK[None, None, kv_state.index],
                lambda r: layouts.kv_row_clamped(
                    mK, mPageList, item.page_start, first_token, r, item.kv_end,
                    item.kv_head, page_divisor,
                ),
            )
            cute.arch.cp_async_commit_group()
            pipeline_k.producer_commit(kv_state)
            pipeline_v.producer_acquire(kv_state)
            kv_gather.copy_rows(
                sV[None, None, kv_state.index],
                lambda r: layouts.kv_row_clamped(
                    mV, mPageList, item.page_start, first_token, r, item.kv_end,
                    item.kv_head, page_divisor,
                ),
            )
            cute.arch.cp_async_commit_group()
            pipeline_v.producer_commit(kv_state)
            kv_state.advance()
        return kv_state

    @cute.jit
    def consume(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mWork: cute.Tensor,
        mQStart: cute.Tensor,
        mKvLen: cute.Tensor,
        mPageStart: cute.Tensor,
        mPartialO: cute.Tensor,
        mPartialLSE: cute.Tensor,
        mMerge: cute.Tensor,
        mSlotMerge: cute.Tensor,
        mMergeSem: cute.Tensor,
        sFlag: cute.Tensor,
        sm_scale: Float32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        item_begin: Int32,
        item_end: Int32,
    ):
        tile_m, tile_n, d = self.tile.tile_m, self.tile.tile_n, self.head_dim
        tidx = cute.arch.thread_idx()[0] - WARPGROUP
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        # V^T view (D, tile_n) of the row-major V tile: the MN-major B operand of P @ V.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((d, tile_n, self.tile.num_stages), order=(1, 0, 2))
        )
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        acc_shape_S = thr_mma_qk.partition_shape_C((tile_m, tile_n))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((tile_m, d)), Float32)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((tile_m, d)))
        softmax = OnlineSoftmax.create(
            cute.size(rows_cols_view(acc_O), mode=[0]), sm_scale * LOG2_E
        )

        # P of the previous KV tile, as the register A operand of the P V wgmma.
        rP = cute.make_rmem_tensor(acc_shape_S, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a_layout(rP.layout))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        # K and V stages are filled in step; V is consumed one tile behind K.
        k_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.tile.num_stages
        )
        v_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.tile.num_stages
        )
        for i in cutlass.range(item_begin, item_end, unroll=1):
            item = WorkItem.load(mWork, mQStart, mKvLen, mPageStart, i)
            n_min, n_max = item.n_block_range(tile_n)
            causal_offset = item.kv_len - item.q_len
            # Tiles from mask_from on hold a key past kv_end or past the first row's
            # causal limit; earlier tiles are fully visible to every row of the item.
            visible = item.kv_end
            if const_expr(self.causal):
                visible = cutlass.min(visible, causal_offset + item.row_start // self.group + 1)
            mask_from = visible // tile_n

            softmax.reset()
            acc_O.fill(0.0)
            pipeline_q.consumer_wait(q_state)
            # cp.async wrote sQ/sK/sV through the generic proxy; wgmma reads via the async one.
            cute.arch.fence_view_async_shared()
            mask_tile = partial(
                apply_mask, tScS=tScS, row_start=item.row_start, kv_end=item.kv_end,
                causal_offset=causal_offset, group=self.group, causal=self.causal,
            )
            if n_max > n_min:
                # Intra-warpgroup overlap: S of tile n is computed (wgmma) while P V of
                # tile n-1 runs, and the softmax of tile n overlaps that P V.
                acc_S = self.qk_tile(tiled_mma_qk, tSrQ, tSrK, acc_shape_S, pipeline_k, k_state)
                warpgroup.wait_group(0)
                pipeline_k.consumer_release(k_state)
                k_state.advance()
                if n_min >= mask_from:
                    mask_tile(acc_S, col_start=n_min * tile_n)
                softmax.update(acc_S)  # O is still zero: nothing to rescale
                rP.store(acc_S.load().to(self.dtype))
                for n_block in cutlass.range(n_min + 1, n_max, unroll=1):
                    acc_S = self.qk_tile(
                        tiled_mma_qk, tSrQ, tSrK, acc_shape_S, pipeline_k, k_state
                    )
                    self.pv_tile(tiled_mma_pv, acc_O, tOrP, tOrVt, pipeline_v, v_state)
                    warpgroup.wait_group(1)  # S done; P V still running
                    pipeline_k.consumer_release(k_state)
                    k_state.advance()
                    if n_block >= mask_from:
                        mask_tile(acc_S, col_start=n_block * tile_n)
                    row_scale = softmax.update(acc_S)
                    warpgroup.wait_group(0)  # P V done: O and rP are free
                    pipeline_v.consumer_release(v_state)
                    v_state.advance()
                    rescale_rows(acc_O, row_scale)
                    rP.store(acc_S.load().to(self.dtype))
                if const_expr(self.tma_kv):
                    # A TMA box brings the whole page tail: slots past kv_len may hold
                    # garbage (NaN), and P = 0 times NaN is NaN, so zero those V rows.
                    if n_max * tile_n > item.kv_end:
                        pipeline_v.consumer_wait(v_state)
                        self.zero_rows(sV[None, None, v_state.index],
                                       item.kv_end - (n_max - 1) * tile_n, tidx)
                self.pv_tile(tiled_mma_pv, acc_O, tOrP, tOrVt, pipeline_v, v_state)
                warpgroup.wait_group(0)
                pipeline_v.consumer_release(v_state)
                v_state.advance()
            pipeline_q.consumer_release(q_state)
            q_state.advance()

            inv_sum, lse = softmax.finalize(sm_scale)
            rescale_rows(acc_O, inv_sum)
            self.epilogue(acc_O, lse, tOcO, item, mO, mLSE, mPartialO, mPartialLSE, tidx)
            if item.split_slot >= 0:
                finish_split(
                    mO, mLSE, mPartialO, mPartialLSE, mMerge, mSlotMerge, mMergeSem, mQStart,
                    sFlag, item.split_slot, self.group, d, tidx, WARPGROUP, barrier_id=2,
                )

    @cute.jit
    def qk_tile(self, tiled_mma_qk, tSrQ, tSrK, acc_shape_S, pipeline_k, k_state):
        """Wait for K tile `k_state` and issue S = Q K^T (asynchronous; caller waits)."""
        pipeline_k.consumer_wait(k_state)
        cute.arch.fence_view_async_shared()
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        warpgroup_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], True)
        return acc_S

    @cute.jit
    def pv_tile(self, tiled_mma_pv, acc_O, tOrP, tOrVt, pipeline_v, v_state):
        """Wait for V tile `v_state` and issue O += P V (asynchronous; caller waits)."""
        pipeline_v.consumer_wait(v_state)
        cute.arch.fence_view_async_shared()
        warpgroup_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False)

    @cute.jit
    def zero_rows(self, sX: cute.Tensor, first_row: Int32, tidx: Int32):
        """Zero rows [first_row, tile_n) of a (tile_n, D) smem tile (consumer warpgroup)."""
        d = self.head_dim
        for i in cutlass.range(tidx, self.tile.tile_n * d, WARPGROUP, unroll=1):
            row = i // d
            if row >= first_row:
                sX[row, i % d] = self.dtype(0.0)
        # Every consumer thread's zeros must land before the warpgroup's wgmma reads V
        # (the caller's proxy fence orders them for the async proxy).
        cute.arch.barrier(barrier_id=1, number_of_threads=WARPGROUP)

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        tOcO: cute.Tensor,
        item: WorkItem,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mPartialO: cute.Tensor,
        mPartialLSE: cute.Tensor,
        tidx: Int32,
    ):
        """Write this thread's rows of O (and LSE, from one thread of each row's quad)."""
        tOcO_mn = rows_cols_view(tOcO)
        n_rows = item.row_end - item.row_start
        quad_leader = tidx % 4 == 0
        if item.split_slot >= 0:
            acc_O_mn = rows_cols_view(acc_O)
            gO = layouts.partial_rows(mPartialO, item.split_slot)
            gLSE = layouts.partial_lse(mPartialLSE, item.split_slot)
            for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                row = tOcO_mn[r, 0][0]
                if row < n_rows:
                    for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                        gO[row, tOcO_mn[0, c][1]] = acc_O_mn[r, c]
                    if quad_leader:
                        gLSE[row] = lse[r]
        else:
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))
            rO_mn = rows_cols_view(rO)
            gO = layouts.packed_rows(mO, item.q_start, item.q_len, item.kv_head, self.group)
            for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
                row = tOcO_mn[r, 0][0]
                if row < n_rows:
                    packed_row = item.row_start + row
                    for c in cutlass.range_constexpr(cute.size(rO_mn, mode=[1])):
                        gO[packed_row, tOcO_mn[0, c][1]] = rO_mn[r, c]
                    if const_expr(mLSE is not None):
                        if quad_leader:
                            gLSE = layouts.packed_lse(
                                mLSE, item.q_start, item.q_len, item.kv_head, self.group
                            )
                            gLSE[packed_row] = lse[r]
