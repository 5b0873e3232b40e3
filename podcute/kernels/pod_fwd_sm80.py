"""The portable POD attention kernel: warp-level tensor cores (mma.sync m16n8k16), for
sm_80 (A100), sm_86 (A10/A40), sm_89 (L4/L40S), sm_120a (RTX 50) and plain sm_90.

The same contract, plan and work-item format as the sm_90a kernel (`pod_fwd_sm90.py`):
every CTA of a persistent grid runs the list of work items the planner gave it, an item
being packed (query token, query head) rows of one (request, KV head) against a range of
that request's KV tokens. What differs is how the tensor cores are fed.

CTA = 4 warps (FlashAttention-2's structure), each warp owning 16 of a 64-row item's rows,
or two blocks of 16 (rows 16 w and 64 + 16 w) of a 128-row prefill item
(`KernelConfig.tile_m_prefill`, where its Q tile fits):
  * every thread both copies and computes: Q rows and K/V page rows come by cp.async
    (`gather.RowGather`, the page of each row looked up one tile ahead), into swizzled
    shared-memory tiles;
  * S = Q K^T and O += P V are mma.sync over fragments read with ldmatrix (V through
    ldmatrix.trans);
  * decode items' K/V copies carry an L2 evict-first policy
    (`KernelConfig.decode_kv_evict_first`, `RowGather.copy_rows`): read once in the
    launch, they leave L2 before the prefill's K/V, which each row tile reads again;
  * two K/V stages (`KernelConfig.num_stages`, where two CTAs of them fit an SM): tile
    n + 2 loads while tile n is computed, so a decoding CTA, whose one busy warp would
    otherwise wait out HBM latency twice a tile, keeps 32-64 KB in flight; one stage
    (the 100 KB SMs): V of tile n loads while S of tile n and its softmax run, K of tile
    n + 1 while P V of tile n runs;
  * the online softmax, masking, soft cap, sinks, epilogue stores and the split-KV
    merge are the shared pieces (`softmax`, `mask`, `epilogue`, `split_merge`): a split
    piece writes fp32 partials and the CTA finishing a group's last piece merges it, in
    the launch.
Items of at most 16 rows (decode items) split each tile by keys instead: warp w takes
keys [16 w, 16 w + 16) with all the rows, keeps its own online softmax and O, and the
warps fold into warp 0 at the end (`combine.fold_warps`, through the K stages). With the
rows on one warp, a decoding CTA's MMAs ran on one warp and bounded it to about half the
HBM share of an SM whose other CTA is in prefill. Items of 17-64 rows keep the rows
split: a warp whose rows all lie past the item's only copies. Items of 65-128 rows give
each warp two blocks, so that every K/V fragment read from shared memory feeds two MMAs
(with 16 rows a warp, the ldmatrix reads of a tile's K and V by all 4 warps bound the
loop), and take each tile's keys in two halves of 32 (S and P of 32 rows x 64 keys
beside their O would leave the rest of the loop too few registers).
Each path (`run_item`) holds only its own rows' O and softmax state.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from podcute import layouts
from podcute.kernels.args import PlanTensors, PodTensors
from podcute.kernels.barriers import NamedBarrier
from podcute.kernels.combine import fold_warps
from podcute.kernels.config import ARCH_SMEM, CTA_RESERVED_SMEM, WARP_HEAD_DIMS, KernelConfig
from podcute.kernels.epilogue import store_fragments, store_lse, store_partial
from podcute.kernels.gather import RowGather
from podcute.kernels.metadata import IParam, Param
from podcute.kernels.paged_kv import PagedKV
from podcute.kernels.pod_kernel import PodKernelBase
from podcute.kernels.ptx import kept_in_loop, l2_evict_first_policy
from podcute.kernels.mma_utils import (acc_as_operand_a_layout, rows_cols_view, warp_gemm,
                                       warp_gemm_by_columns)
from podcute.kernels.softmax import LOG2_E, OnlineSoftmax, rescale_rows, softcap_scores
from podcute.kernels.smem import tile_smem_layout
from podcute.kernels.visibility import left_mask_until
from podcute.kernels.work import WorkItem

WARP_ROWS = 16  # rows of one warp's M block: one m16 mma.sync
BLOCK_ROWS = 64  # one M block of each of the 4 warps (rows 16 w + 64 m of a tile)


@dataclass(frozen=True)
class WarpFragments:
    """One thread's side of both GEMMs: the tiled MMAs, the ldmatrix copies with their
    shared-memory sources and register destinations, the MMA fragments, S's coordinates,
    O and P."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    copy_q: cute.ThrCopy
    copy_k: cute.ThrCopy
    copy_v: cute.ThrCopy
    tSrQ: cute.Tensor
    tSsQ: cute.Tensor
    tSrQ_copy: cute.Tensor
    tSrK: cute.Tensor
    tSsK: tuple  # per key range of a tile: (CPY, CPY_N, CPY_K, stage)
    tSrK_copy: cute.Tensor
    tOrVt: cute.Tensor
    tOsVt: tuple  # per key range of a tile: (CPY, CPY_N, CPY_K, stage)
    tOrVt_copy: cute.Tensor
    tScS: cute.Tensor
    acc_O: cute.Tensor
    rP: cute.Tensor
    tOrP: cute.Tensor


@dataclass(frozen=True)
class KvSource:
    """Where K/V tiles come from and go: the cache (and the ragged source), the shared
    stages, the page table, and the pages of this thread's gathered rows of the next tile
    to copy (their slots are recomputed at the copy: a register a row fewer through the
    tile loops)."""

    mK: cute.Tensor
    mV: cute.Tensor
    mK2: Optional[cute.Tensor]
    mV2: Optional[cute.Tensor]
    sK: cute.Tensor  # (tile_n, D, stage)
    sV: cute.Tensor
    paged: PagedKV
    gather: RowGather
    pages: cute.Tensor
    mIParams: cute.Tensor  # (a second_cache variant: which requests read the second)
    # copies under an L2 evict-first policy (`KernelConfig.decode_kv_evict_first`)
    evict_first: bool = False


class PodAttentionSm80(PodKernelBase):
    # (its tile loops sit at the 255-register limit on sm_90: the merge keeps its 2 splits
    # in flight, split_merge.SPLITS_IN_FLIGHT)
    merge_splits = shared_merge_splits = 2

    def __init__(self, cfg: KernelConfig):
        super().__init__(cfg)
        self.num_threads = cfg.num_threads
        # 16-row M blocks of a warp in a prefill item: 1 (64-row items) or 2 (128-row
        # items: K/V fragments read from shared memory feed twice the MMAs).
        self.m_blocks = self.tile_m // BLOCK_ROWS
        assert BLOCK_ROWS == WARP_ROWS * self.num_threads // 32 and self.m_blocks in (1, 2)
        assert cfg.tile_m_decode == BLOCK_ROWS

    @classmethod
    def can_implement(cls, cfg: KernelConfig) -> tuple[bool, str]:
        """What this kernel needs beyond KernelConfig.can_implement's common checks: 4
        warps of 16 rows (2 x 16 in a 128-row prefill item) over 64-token K/V tiles, a Q
        tile and 1 or 2 K/V stages (one: FlashAttention-2's order, V loads under S and the
        next K under P V; two: tile n + 2 loads under tile n), page rows gathered by
        cp.async, and the SM's shared memory for `ctas_per_sm` CTAs."""
        if not cfg.warp_mma:
            return False, f"{cfg.arch} runs the sm_90a kernel, not the warp-level one"
        if cfg.fp8:
            return False, f"fp8 KV caches need the sm_90a kernel (arch {cfg.arch})"
        if cfg.head_dim not in WARP_HEAD_DIMS:
            return False, (f"head_dim {cfg.head_dim} on {cfg.arch} (the warp-level kernel "
                           f"serves {WARP_HEAD_DIMS})")
        if (cfg.tile_m_prefill not in (64, 128)
                or (cfg.tile_m_decode, cfg.tile_n) != (64, 64)):
            return False, ("the warp-level kernel runs 64- or 128-row prefill items and "
                           "64-row decode items over 64-token tiles")
        if (cfg.kv_box, cfg.num_mma_warpgroups) != (0, 1) or cfg.num_stages not in (1, 2):
            return False, ("the warp-level kernel gathers K/V rows into 1 or 2 stages, "
                           "4 warps")
        if cfg.tile_m_prefill == 128 and cfg.num_stages < 2:
            # (its tile loop takes a tile's keys in two halves; one stage refills K after
            # the whole tile's S)
            return False, "128-row prefill items need two K/V stages"
        per_sm, per_cta = ARCH_SMEM[cfg.arch]
        if (cls.smem_bytes(cfg) > per_cta
                or (cls.smem_bytes(cfg) + CTA_RESERVED_SMEM) * cfg.ctas_per_sm > per_sm):
            return False, (f"{cls.smem_bytes(cfg)} B of shared memory x {cfg.ctas_per_sm} CTAs "
                           f"on {cfg.arch} ({per_sm} B an SM, {per_cta} B a CTA)")
        if not 1 <= cfg.ctas_per_sm <= 2:
            # 128 threads x the ~200 registers the fragments of D 128 take: 2 CTAs an SM.
            return False, f"ctas_per_sm {cfg.ctas_per_sm} (1 or 2)"
        k_stages = cfg.num_stages * cfg.tile_n * cfg.head_dim * cfg.elem_bytes
        if 4 * cfg.combine_floats > k_stages:
            return False, (f"the fold of a key-split item ({4 * cfg.combine_floats} B in "
                           f"{cfg.combine_rounds} rounds) must fit the K stages ({k_stages} B)")
        return True, ""

    @classmethod
    def smem_bytes(cls, cfg: KernelConfig) -> int:
        """Q, K and V tiles (and 1 KB of alignment slack): `launch_kernel`'s
        SharedStorage; the split items' fold borrows the K stages."""
        return ((cfg.tile_m_prefill + 2 * cfg.num_stages * cfg.tile_n) * cfg.head_dim
                * cfg.elem_bytes + 1024)

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

    def _one_warp_mma(self):
        """One warp's m16 x n16 MMA (the split items' GEMMs): its C fragment of 16 x D is
        laid out as each warp's 16 rows of `_tiled_mmas`'s (the same atom, the same N
        steps), so a split item's O lives in `acc_O` and warp 0's is the item's rows."""
        atom = warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        return cute.make_tiled_mma(atom, (1, 1, 1), permutation_mnk=(16, 16, 16))

    def _ldsm(self, transpose: bool):
        return cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), self.dtype)

    def launch_kernel(self, io: PodTensors, plan: PlanTensors, num_ctas: Int32,
                      stream: cuda.CUstream):
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
        self.kernel(io, plan, tiled_mma_qk, tiled_mma_pv, sQ_layout, sKV_layout).launch(
            **self.launch_options(num_ctas, stream))

    @cute.kernel
    def kernel(
        self,
        io: PodTensors,
        plan: PlanTensors,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
    ):
        tile_n, d, stages = self.tile_n, self.head_dim, self.num_stages
        tidx = cute.arch.thread_idx()[0]
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        # The K stages, free at the end of an item, hold the fold of a split item's warps.
        sScratch = cute.make_tensor(
            cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
            cute.make_layout((self.cfg.combine_floats // self.num_threads, self.num_threads),
                             stride=(self.num_threads, 1)))
        # V^T view (D, tile_n, stage) of the row-major V stages: the B operand of P V.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((d, tile_n, stages), order=(1, 0, 2)))

        # (a narrower head dim: its K/V tiles' other columns written as zeros with every
        # tile, since a key-split item's fold takes the K stages' memory as its scratch)
        kv_gather = RowGather.create(self.dtype, tile_n, d, self.num_threads, tidx,
                                     cols=self.cfg.io_dim, zero_rest=True)
        # Pages of this thread's K/V rows: the current tile's, looked up one tile ahead
        # (the page-table load's latency hides under the tile's S GEMM).
        pages = cute.make_rmem_tensor(kv_gather.rows_per_thread, Int32)
        kv = KvSource(io.mK, io.mV, io.mK2, io.mV2, sK, sV,
                      PagedKV.create(plan.mPageList, plan.page_shift, tile_n), kv_gather, pages,
                      plan.mIParams)
        # Decode items read their K/V rows once in the launch; a prefill request's K/V is
        # read by each of its row tiles.
        kv_once = dataclasses.replace(kv, evict_first=self.cfg.decode_kv_evict_first)

        warp_id = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta = cute.arch.block_idx()[0]
        for i in cutlass.range(plan.mCtaPtr[cta], plan.mCtaPtr[cta + 1], unroll=1):
            item = WorkItem.load(plan, i, self.cfg.shared_prefix)
            n_rows = item.row_end - item.row_start
            # Each path holds only its own rows' O and softmax state (a 128-row item's O
            # is 128 registers a thread: live through the other paths, it would leave
            # their loops none).
            if n_rows <= WARP_ROWS:
                # Decode items (and any item of at most 16 rows): every warp takes 16 keys
                # of each tile with all of the rows, and the warps fold at the end.
                self.run_item(0, item, io, plan, sQ, kv_once, sVt, sScratch, tiled_mma_qk,
                              tiled_mma_pv, tidx, warp_id)
            else:
                if const_expr(self.m_blocks == 1):
                    self.run_item(1, item, io, plan, sQ, kv, sVt, sScratch, tiled_mma_qk,
                                  tiled_mma_pv, tidx, warp_id)
                else:
                    # Items of at most 64 rows keep to each warp's first 16-row block:
                    # the second would only add MMAs on rows never stored.
                    if n_rows <= BLOCK_ROWS:
                        self.run_item(1, item, io, plan, sQ, kv, sVt, sScratch, tiled_mma_qk,
                                      tiled_mma_pv, tidx, warp_id)
                    else:
                        self.run_item(2, item, io, plan, sQ, kv, sVt, sScratch, tiled_mma_qk,
                                      tiled_mma_pv, tidx, warp_id)
            self.merge_split(io, plan, item, tidx, self.num_threads)
            # (no copy is in flight past n_max, but every warp must be done with sQ, sK
            # and sV before the next item's copies overwrite them)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

    @cute.jit
    def run_item(self, m_blocks: cutlass.Constexpr[int], item: WorkItem, io: PodTensors,
                 plan: PlanTensors, sQ: cute.Tensor, kv: "KvSource", sVt: cute.Tensor,
                 sScratch: cute.Tensor, tiled_mma_qk: cute.TiledMma,
                 tiled_mma_pv: cute.TiledMma, tidx: Int32, warp_id: Int32):
        """One work item: its Q rows and first K/V tiles, the tile loop, the epilogue.
        m_blocks: 16-row blocks of each warp (1: items of <= 64 rows, 2: of <= 128), or 0:
        an item of <= 16 rows split over the warps by keys (`attend_split`)."""
        tile_n, d, stages = self.tile_n, self.head_dim, self.num_stages
        mParams, mIParams = plan.mParams, plan.mIParams
        rows = BLOCK_ROWS * max(m_blocks, 1)  # rows of O: the tile's, or warp 0's 16 x 4
        # (addresses from a volatile tidx: computed per item, not hoisted out of the item
        # loop, where each path's would hold registers through the other paths)
        tidx = kept_in_loop(tidx)
        n_min, n_max, mask_from = item.tile_bounds(
            item.row_start, self.group, self.causal, tile_n, self.window_right(mIParams))
        mask_until = Int32(0)
        if const_expr(self.cfg.window):
            mask_until = left_mask_until(
                item.kv_len, item.q_len, item.row_end, self.group,
                mIParams[IParam.WINDOW_LEFT], tile_n)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((rows, d)), Float32)
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((rows, d)))
        softmax = OnlineSoftmax.create(cute.size(rows_cols_view(acc_O), mode=[0]),
                                       mParams[self.logit_param] * LOG2_E)
        row_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        softmax.reset()
        acc_O.fill(0.0)
        q_rows = WARP_ROWS if const_expr(m_blocks == 0) else rows
        sQ_rows = cute.local_tile(sQ, (q_rows, d), (0, 0))
        self.load_q(io.mQ, sQ_rows, RowGather.create(self.dtype, q_rows, d, self.num_threads,
                                                  tidx, cols=self.cfg.io_dim, zero_rest=True),
                    item, plan)
        # Prologue: K (and with two stages V) of the first `stages` tiles; Q goes with the
        # first. One commit group a tile, empty past n_max, so the wait in the loop counts
        # the same on every path. (The pages are set first: the compiler cannot see that
        # they are only read where looked up, and would keep a previous item's through
        # every path.)
        kv.pages.fill(0)
        for s in cutlass.range_constexpr(stages):
            if n_min + s < n_max:
                self.lookup_pages(kv, item, n_min + s)
                self.load_kv(kv, item, n_min + s, s, load_k=True, load_v=stages > 1)
            cute.arch.cp_async_commit_group()
        if const_expr(stages > 1):
            if n_min + stages < n_max:
                self.lookup_pages(kv, item, n_min + stages)
        if const_expr(m_blocks == 0):
            self.attend_split(acc_O, softmax, row_scale, kv, item, n_min, n_max, mask_from,
                              mask_until, mParams, mIParams, sQ_rows, sVt, sScratch, tidx,
                              warp_id)
        else:
            # A warp whose rows all lie past the item's (one of 17-63 rows) only copies:
            # its MMAs would repeat the last row, and their ldmatrix reads take
            # shared-memory bandwidth from the SM's other CTA.
            self.attend(m_blocks, tiled_mma_qk, tiled_mma_pv, sQ_rows, sVt, acc_O, tidx,
                        softmax, row_scale, kv, item, n_min, n_max, mask_from, mask_until,
                        warp_id * WARP_ROWS < item.row_end - item.row_start, mParams,
                        mIParams)
        self.epilogue(acc_O, softmax, tOcO, item, io, plan, tidx)

    @cute.jit
    def attend_split(self, acc_O: cute.Tensor, softmax: OnlineSoftmax,
                     row_scale: cute.Tensor, kv: "KvSource", item: WorkItem, n_min: Int32,
                     n_max: Int32, mask_from: Int32, mask_until: Int32, mParams: cute.Tensor,
                     mIParams: cute.Tensor, sQ_rows: cute.Tensor, sVt: cute.Tensor,
                     sScratch: cute.Tensor, tidx: Int32, warp_id: Int32):
        """An item of at most 16 rows, split over the warps by keys: warp w takes keys
        [16 w, 16 w + 16) of every tile with all the rows (one m16 M block), keeping its own
        online softmax and O (in `acc_O`: `_one_warp_mma`), and at the end warps 1-3 fold
        into warp 0 (`combine.fold_warps`), whose rows the epilogue stores. A decode
        item's one warp of MMAs would otherwise bound its CTA to about a tile per 1.3 us:
        less than the HBM share of an SM whose other CTA is in prefill."""
        d = self.head_dim
        # (addresses from a volatile lane: computed here, not held through the other paths)
        lane = kept_in_loop(tidx % 32)
        tiled_mma = self._one_warp_mma()
        thr_mma = tiled_mma.get_slice(lane)
        copy_q = cute.make_tiled_copy_A(self._ldsm(False), tiled_mma).get_slice(lane)
        copy_k = cute.make_tiled_copy_B(self._ldsm(False), tiled_mma).get_slice(lane)
        copy_v = cute.make_tiled_copy_B(self._ldsm(True), tiled_mma).get_slice(lane)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_rows))
        sK_keys = cute.local_tile(kv.sK[None, None, 0], (WARP_ROWS, d), (warp_id, 0))
        sVt_keys = cute.local_tile(sVt[None, None, 0], (d, WARP_ROWS), (0, warp_id))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_keys))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_keys))
        acc_shape_S = thr_mma.partition_shape_C((WARP_ROWS, WARP_ROWS))
        tScS = thr_mma.partition_C(cute.make_identity_tensor((WARP_ROWS, WARP_ROWS)))
        rP = cute.make_rmem_tensor(acc_shape_S, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a_layout(rP.layout))
        assert acc_O.shape == thr_mma.partition_shape_C((WARP_ROWS, d))
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            stage = self.tile_arrived(kv, item, n_block, n_min, n_max)
            sK_keys = cute.local_tile(kv.sK[None, None, stage], (WARP_ROWS, d), (warp_id, 0))
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_S.fill(0.0)
            # (Q's fragments from shared memory with K's: held in registers they would
            # take 32 of the registers the variant's other paths leave this one)
            warp_gemm(tiled_mma, acc_S, tSrQ, tSrK, copy_q, copy_q.partition_S(sQ_rows),
                      copy_q.retile(tSrQ), copy_k,
                      copy_k.partition_S(sK_keys), copy_k.retile(tSrK))
            self.score_tile(acc_S, tScS, item, n_block, mask_from, mask_until, mParams,
                            mIParams, col_offset=warp_id * WARP_ROWS)
            softmax.update(acc_S, row_scale)
            rescale_rows(acc_O, row_scale)
            rP.store(acc_S.load().to(self.dtype))
            self.scores_done(kv, item, n_block, n_max)
            sVt_keys = cute.local_tile(sVt[None, None, stage], (d, WARP_ROWS), (0, warp_id))
            warp_gemm(tiled_mma, acc_O, tOrP, tOrVt, None, None, None, copy_v,
                      copy_v.partition_S(sVt_keys), copy_v.retile(tOrVt))
            self.tile_done(kv, item, n_block, n_max, stage)
        # Every warp is done with the K stages (and no copy into them is in flight: the
        # loop issues none past n_max), which now take the warps' states.
        cute.arch.barrier()
        fold_warps(softmax, rows_cols_view(acc_O), sScratch, tidx, self.cfg.combine_rounds,
                   NamedBarrier.MMA, warps=self.num_threads // 32)

    @cute.jit
    def warp_fragments(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                       sQ: cute.Tensor, sK: cute.Tensor, sVt: cute.Tensor,
                       acc_O: cute.Tensor, sub_n: cutlass.Constexpr[int],
                       tidx: Int32) -> WarpFragments:
        """Thread tidx's side of both GEMMs over the CTA's tiles, a tile's keys taken
        `sub_n` at a time."""
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        copy_q = cute.make_tiled_copy_A(self._ldsm(False), tiled_mma_qk).get_slice(tidx)
        copy_k = cute.make_tiled_copy_B(self._ldsm(False), tiled_mma_qk).get_slice(tidx)
        copy_v = cute.make_tiled_copy_B(self._ldsm(True), tiled_mma_pv).get_slice(tidx)
        d, stages, rows = self.head_dim, self.num_stages, cute.size(sQ, mode=[0])
        # (sub_n, D, stage) / (D, sub_n, stage) views of each key range of the stages
        sK_subs = [cute.local_tile(sK, (sub_n, d, stages), (h, 0, 0))
                   for h in range(self.tile_n // sub_n)]
        sVt_subs = [cute.local_tile(sVt, (d, sub_n, stages), (0, h, 0))
                    for h in range(self.tile_n // sub_n)]
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK_subs[0][None, None, 0]))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt_subs[0][None, None, 0]))
        rP = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((rows, sub_n)), self.dtype)
        return WarpFragments(
            tiled_mma_qk, tiled_mma_pv, copy_q, copy_k, copy_v,
            # (CPY, CPY_M/N, CPY_K, stage) views: the tile loop picks its stage.
            tSrQ, copy_q.partition_S(sQ), copy_q.retile(tSrQ),
            tSrK, tuple(copy_k.partition_S(x) for x in sK_subs), copy_k.retile(tSrK),
            tOrVt, tuple(copy_v.partition_S(x) for x in sVt_subs), copy_v.retile(tOrVt),
            thr_mma_qk.partition_C(cute.make_identity_tensor((rows, sub_n))),
            acc_O, rP, cute.make_tensor(rP.iterator, acc_as_operand_a_layout(rP.layout)),
        )

    @cute.jit
    def attend(self, m_blocks: cutlass.Constexpr[int], tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, sQ: cute.Tensor, sVt: cute.Tensor,
               acc_O: cute.Tensor, tidx: Int32, softmax: OnlineSoftmax,
               row_scale: cute.Tensor, kv: "KvSource", item: WorkItem, n_min: Int32,
               n_max: Int32, mask_from: Int32, mask_until: Int32, busy,
               mParams: cute.Tensor, mIParams: cute.Tensor):
        """The item's KV tiles n_min..n_max (their first `stages` already in flight): S,
        the online softmax and O += P V, each warp over its m_blocks 16-row blocks of sQ's
        rows, and the copies of the tiles after them.

        Two blocks take a tile's keys in two halves, each its own S, softmax step and P V:
        S and P of 32 rows x 64 keys beside their O (128 registers at D 128) would leave
        the K/V fragments and the item's state too few registers (ptxas spilled ~0.5 KB).
        K and V are still read from shared memory once a tile."""
        stages = self.num_stages
        halves = m_blocks  # key ranges of a tile: 1, or 2 beside two blocks
        assert halves == 1 or stages > 1  # (one stage refills K after all of a tile's S)
        f = self.warp_fragments(tiled_mma_qk, tiled_mma_pv, sQ, kv.sK, sVt, acc_O,
                                self.tile_n // halves, tidx)
        # (Q's fragments are read at the first tile, P under `busy`: set here, so that the
        # compiler, which cannot tell, keeps no previous item's through the other paths)
        if const_expr(self.cfg.q_in_registers and m_blocks == 1):
            f.tSrQ.fill(0)
        f.rP.fill(0)
        if const_expr(m_blocks > 1):
            busy = True  # (the item has more than 64 rows: every warp has some)
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            stage = self.tile_arrived(kv, item, n_block, n_min, n_max)
            for h in cutlass.range_constexpr(halves):
                if busy:
                    # Q's fragments: read per K block with K's (from shared memory every
                    # tile), or once per item into registers (`KernelConfig.q_in_registers`;
                    # one block's: two blocks' would take 64 of the registers O leaves).
                    q_operand = (None, None, None)
                    if const_expr(self.cfg.q_in_registers and m_blocks == 1):
                        if n_block == n_min:
                            cute.copy(f.copy_q, f.tSsQ, f.tSrQ_copy)
                    else:
                        q_operand = (f.copy_q, f.tSsQ, f.tSrQ_copy)
                    acc_S = cute.make_rmem_tensor(f.rP.shape, Float32)
                    acc_S.fill(0.0)
                    warp_gemm(f.tiled_mma_qk, acc_S, f.tSrQ, f.tSrK, *q_operand, f.copy_k,
                              f.tSsK[h][None, None, None, stage], f.tSrK_copy)
                    self.score_tile(acc_S, f.tScS, item, n_block, mask_from, mask_until,
                                    mParams, mIParams, col_offset=h * (self.tile_n // halves))
                    softmax.update(acc_S, row_scale)
                    rescale_rows(f.acc_O, row_scale)
                    f.rP.store(acc_S.load().to(self.dtype))
                if const_expr(h == halves - 1):
                    self.scores_done(kv, item, n_block, n_max)
                if busy:
                    tOsVt = f.tOsVt[h][None, None, None, stage]
                    # (two blocks at D > 64: a K block of V's fragments is 24-32 registers;
                    # two of them in flight beside O of 32 rows spilled)
                    if const_expr(m_blocks > 1 and self.head_dim > 64):
                        warp_gemm_by_columns(f.tiled_mma_pv, f.acc_O, f.tOrP, f.tOrVt,
                                             f.copy_v, tOsVt, f.tOrVt_copy)
                    else:
                        warp_gemm(f.tiled_mma_pv, f.acc_O, f.tOrP, f.tOrVt, None, None, None,
                                  f.copy_v, tOsVt, f.tOrVt_copy)
            self.tile_done(kv, item, n_block, n_max, stage)

    # ---- the K/V pipeline (both tile loops) -------------------------------------------

    @cute.jit
    def tile_arrived(self, kv: "KvSource", item: WorkItem, n_block: Int32, n_min: Int32,
                     n_max: Int32):
        """Wait until K (and V) of tile n_block (and Q) have landed and every warp is done
        with the stage the copies after it refill; with one stage V's copy goes out now
        (under S and the softmax) and the next tile's pages are looked up. Returns the
        tile's stage."""
        stages = self.num_stages
        cute.arch.cp_async_wait_group(stages - 1)
        cute.arch.barrier()
        if const_expr(stages == 1):
            self.load_kv(kv, item, n_block, 0, load_k=False, load_v=True)
            cute.arch.cp_async_commit_group()
            if n_block + 1 < n_max:
                self.lookup_pages(kv, item, n_block + 1)
        return (n_block - n_min) % stages if const_expr(stages > 1) else 0

    @cute.jit
    def scores_done(self, kv: "KvSource", item: WorkItem, n_block: Int32, n_max: Int32):
        """One stage: V has landed and every warp is done with K, whose next tile's copy
        goes out now (under P V)."""
        if const_expr(self.num_stages == 1):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if n_block + 1 < n_max:
                self.load_kv(kv, item, n_block + 1, 0, load_k=True, load_v=False)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def tile_done(self, kv: "KvSource", item: WorkItem, n_block: Int32, n_max: Int32,
                  stage):
        """Two stages: every warp is done with this stage; tile n_block + stages refills it,
        and the pages of the tile after it are looked up (used a tile later)."""
        stages = self.num_stages
        if const_expr(stages > 1):
            cute.arch.barrier()
            if n_block + stages < n_max:
                self.load_kv(kv, item, n_block + stages, stage, load_k=True, load_v=True)
            cute.arch.cp_async_commit_group()
            if n_block + stages + 1 < n_max:
                self.lookup_pages(kv, item, n_block + stages + 1)

    # ---- copies -----------------------------------------------------------------------

    @cute.jit
    def load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, q_gather: RowGather, item: WorkItem,
               plan: PlanTensors):
        """cp.async of the item's packed Q rows into sQ; rows past its end repeat its last
        row (valid memory, never stored)."""
        mQ_rows = self.q_rows(mQ, item)
        last_row = item.row_end - 1
        self.copy_q(q_gather, sQ, mQ, mQ_rows, plan, item,
                    lambda r: cutlass.min(item.row_start + r, last_row))

    @cute.jit
    def lookup_pages(self, kv: "KvSource", item: WorkItem, n_block: Int32):
        """The page of each K/V row this thread copies for tile n_block (page 0 on the
        ragged source); tokens past kv_end clamp to the item's last (paged_kv.py)."""
        ragged = item.reads_ragged(self.cfg.ragged_kv)
        for m in cutlass.range_constexpr(kv.gather.rows_per_thread):
            page, slot = kv.paged.locate(item, kv.paged.token(item, n_block, kv.gather.row(m)))
            kv.pages[m] = layouts.ragged_locate(page, slot, Int32(0), ragged)[0]

    @cute.jit
    def load_kv(self, kv: "KvSource", item: WorkItem, n_block: Int32, stage,
                load_k: cutlass.Constexpr[bool], load_v: cutlass.Constexpr[bool]):
        """cp.async of the looked-up rows of K and/or V tile n_block into stage `stage`."""
        if const_expr(load_k):
            self.copy_kv_tile(kv.mK, kv.mK2, kv.sK[None, None, stage], kv, item, n_block,
                              self.cfg.io_dim)
        if const_expr(load_v):
            self.copy_kv_tile(kv.mV, kv.mV2, kv.sV[None, None, stage], kv, item, n_block,
                              self.cfg.vo_dim)

    @cute.jit
    def copy_kv_tile(self, mKV: cute.Tensor, mKV2: Optional[cute.Tensor],
                     sX: cute.Tensor, kv: "KvSource", item: WorkItem, n_block: Int32,
                     cols: cutlass.Constexpr[int]):
        """One K or V tile (rows of `cols` columns) from the looked-up rows (of the cache,
        or of the ragged source for its request)."""
        second = item.reads_second(self.cfg, kv.mIParams)

        def row(m, r):
            token = kv.paged.token(item, n_block, kv.gather.row(m))
            return kv.paged.source_row(mKV, mKV2, second, self.cfg.ragged_kv, kv.pages[m],
                                       token, item.kv_head)

        kv.gather.with_cols(cols).copy_rows(
            sX, row, l2_evict_first_policy() if const_expr(kv.evict_first) else None)

    # ---- scores -----------------------------------------------------------------------

    @cute.jit
    def score_tile(self, acc_S: cute.Tensor, tScS: cute.Tensor, item: WorkItem, n_block: Int32,
                   mask_from: Int32, mask_until: Int32, mParams: cute.Tensor,
                   mIParams: cute.Tensor, col_offset=0):
        """Scores of KV tile n_block (its columns from `col_offset`) before the softmax:
        soft-capped (a variant's flag), then masked on the tiles that hold a key some row
        must not see."""
        if const_expr(self.cfg.softcap):
            softcap_scores(acc_S, mParams[Param.SOFTCAP_SCALE])
        if self.needs_mask(n_block, mask_from, mask_until):
            self.mask_scores(acc_S, tScS, item, 0, n_block * self.tile_n + col_offset,
                             mIParams)

    # ---- epilogue ---------------------------------------------------------------------

    @cute.jit
    def epilogue(self, acc_O: cute.Tensor, softmax: OnlineSoftmax, tOcO: cute.Tensor,
                 item: WorkItem, io: PodTensors, plan: PlanTensors, tidx: Int32):
        """Normalise O and write it (and the LSE) for the item's rows, or fp32 partials of a
        split piece (`epilogue.py`)."""
        inv_sum, lse = softmax.finalize(plan.mParams[self.logit_param],
                                        self.row_sinks(io.mSinks, tOcO, item, Int32(0)))
        rescale_rows(acc_O, inv_sum)
        n_rows = item.row_end - item.row_start
        if item.split_slot >= 0:
            store_partial(acc_O, lse, tOcO, plan.mPartialO, plan.mPartialLSE, item.split_slot,
                          Int32(0), n_rows, tidx, item.partial_row)
        else:
            if const_expr(io.mLSE is not None):
                gLSE = layouts.packed_lse(io.mLSE, item.q_start, item.q_len, item.kv_head,
                                          self.group)
                store_lse(lse, tOcO, gLSE, item.row_start, n_rows, tidx)
            gO = layouts.packed_rows(io.mO, item.q_start, item.q_len, item.kv_head,
                                     self.group)
            store_fragments(acc_O, tOcO, gO, item.row_start, n_rows, self.cfg.vo_io)
