"""The fused POD attention kernel for sm_90a: prefill and decode work in one launch.

Every CTA of a persistent grid (one CTA per SM) runs the list of work items the planner
gave it (`docs/design.md`). An item is a tile of packed (query token, query head) rows of
one (request, KV head) against a range of that request's KV tokens. The planner
interleaves both kinds in every list, and neighbouring SMs start on different kinds, so
tensor-core-bound prefill tiles and HBM-bound decode splits run side by side on the chip.

CTA = 1 producer warpgroup + `num_mma_warpgroups` (2) MMA warpgroups, FA3's structure:
  * producer (warpgroup 0, few registers): gathers Q rows with cp.async and streams K/V
    tiles into a multi-stage mbarrier pipeline: TMA boxes of whole tiles when a page
    holds them, boxes of 16 page slots for pages of 16-64 tokens, else a cp.async gather
    of page rows; a decode item's copies carry an L2 evict-first policy
    (`KernelConfig.decode_kv_evict_first`, `copies_by_kind`): read once in the launch,
    they leave L2 before the prefill's K/V, which each row tile reads again;
  * MMA warpgroups (the rest of the registers), each with its own 64 rows of Q:
    S = Q K^T (wgmma SS), mask only on tiles that need it, online softmax in registers,
    O += P V (wgmma RS).
      - prefill item (up to 128 rows): each warpgroup owns 64 rows; both read every
        K/V stage, so a K/V tile crosses L2 once per 128 rows; S of tile n overlaps P V
        of tile n-1 (intra-warpgroup), O is rescaled while S runs, and one warpgroup's
        softmax overlaps the other's GEMMs (inter-warpgroup ping-pong on named barriers);
      - decode item (up to 64 rows, the whole GQA group x q_len): both warpgroups hold
        the same rows and take alternate KV tiles (the owner of a tile releases its
        stage for both; no overlap within a tile, the work is memory-bound), then fold
        their softmax states together in shared memory, so both stream HBM.
    Each warpgroup releases Q after its last S GEMM, so the producer loads the next
    item's Q and first K/V tiles while the item's last P V and epilogue run. Epilogue
    (`epilogue`): O through a shared-memory staging tile to `out` in 16-byte pieces (and
    `lse`), or for a split of a long KV range fp32 partials; the CTA that finishes a
    split group's last piece merges them (`split_merge`): one launch.
"""

from dataclasses import dataclass
from functools import partial
from typing import Optional, Union

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warp, warpgroup

from podcute import layouts
from podcute.kernels.args import PlanTensors, PodTensors
from podcute.kernels.barriers import NamedBarrier
from podcute.kernels.combine import fold_state, fold_warps, stash_state
from podcute.kernels.config import (FP8_HEAD_DIMS, FP8_KV_DTYPES, REGISTERS_PER_SM,
                                    SMEM_BYTES_PER_SM, SUPPORTED_HEAD_DIMS, WARPGROUP_THREADS,
                                    KernelConfig)
from podcute.kernels.decode_fp8 import ITEM_ROWS, WARP_KV_ROWS, Fp8WarpDecode
from podcute.kernels.dequant import Dequant, q_fragment_to_fp16, q_tile_to_fp16
from podcute.kernels.dtypes import DTYPES
from podcute.kernels.epilogue import (staging_tile, store_fragments, store_lse, store_partial,
                                      store_rows)
from podcute.kernels.gather import RowGather
from podcute.kernels.metadata import IParam, Param, WorkCol
from podcute.kernels.paged_kv import (KvTmaAtoms, PagedKV, copy_kv_boxes, make_kv_tma_atoms,
                                      tma_kv_tiles)
from podcute.kernels.pod_kernel import PodKernelBase
from podcute.kernels.ptx import kept_in_loop, l2_evict_first_policy, l2_policy_read_once
from podcute.kernels.mma_utils import acc_as_operand_a_layout, rows_cols_view, warpgroup_gemm
from podcute.kernels.softmax import LOG2_E, OnlineSoftmax, rescale_rows, softcap_scores
from podcute.kernels.smem import smem_atom, tile_smem_layout, zero_columns
from podcute.kernels.visibility import left_mask_until
from podcute.kernels.work import WorkItem

# What a producer warp does for each item (bits of `produce_items`' roles).
ROLE_Q, ROLE_COPY, ROLE_CONVERT = 1, 2, 4

WG_ROWS = 64  # rows of one MMA warpgroup: one m64 wgmma


# fp8: the converting warps form groups of 3 warps, group g converting the K/V tiles whose
# pipeline count is g mod the group count (the 16-bit stages of that parity), each group in
# its own order: one group for every tile made each MMA warpgroup wait on the other's
# stage releases.
CONVERTER_GROUP_THREADS = 3 * 32
# An fp8 TMA stage is freed by 4 arrivals: one per warp of the MMA warpgroup that read it
# (the warp-level decode path, `warp_decode`), or a converter group's 3 warps, its first
# arriving twice.
FP8_STAGE_ARRIVALS = 4


@dataclass(frozen=True)
class WarpRoles:
    """What the producer warps of a configuration do (thread ids from 0: the producer
    warpgroups come first, the MMA warpgroups after them)."""

    # Groups of converting warps with fp8: one per producer warpgroup (each 16-bit stage
    # parity its own group), else 0.
    converter_groups: int
    # Threads of a cp.async K/V gather (the first producer warpgroup, or its first warps
    # next to the converters of an fp8 cache); 0 with TMA.
    num_loaders: int
    # Thread id of the first converting thread (after the copy warps).
    first_converter: int
    # (first warp, warps) of the warps that load Q: the first warpgroup; with fp8 TMA
    # and two producer warpgroups the warp past the converter groups (warp 7), so that no
    # converter waits for the Q stage of the next item; with one (D 256) the TMA warp.
    q_loaders: tuple

    @property
    def num_converters(self) -> int:
        """Producer threads that dequantise fp8 tiles: groups of 3 warps after the TMA
        warp (warps 1-6, or 1-3 with one producer warpgroup) or after the cp.async gather
        (warps 2-7, or 1-3); 0 without fp8."""
        return self.converter_groups * CONVERTER_GROUP_THREADS

    @staticmethod
    def of(cfg: KernelConfig) -> "WarpRoles":
        groups = cfg.num_producer_warpgroups if cfg.fp8 else 0
        # (a gather beside converters: the warps they leave, 8 - 6 or 4 - 3)
        loaders = 0 if cfg.tma_kv else 32 * groups if cfg.fp8 else WARPGROUP_THREADS
        first_converter = 32 if cfg.tma_kv else loaders
        q_loaders = (0, 4)
        if cfg.fp8 and cfg.tma_kv:
            q_warp = (first_converter + groups * CONVERTER_GROUP_THREADS) // 32
            q_loaders = (q_warp if q_warp < 4 * groups else 0, 1)
        return WarpRoles(groups, loaders, first_converter, q_loaders)


def staging_row(cfg: KernelConfig) -> int:
    """Elements per row of a warpgroup's O staging tile (64 x D in q's dtype): D plus 16
    bytes, so the quads of a warp store to distinct banks."""
    return cfg.head_dim + 16 // cfg.elem_bytes


def staging_bytes(cfg: KernelConfig) -> int:
    """One MMA warpgroup's O staging tile (its 64 rows, q's dtype, padded rows); 0 without
    staging."""
    return 64 * staging_row(cfg) * cfg.elem_bytes if cfg.o_staging else 0


def stage(count: Int32, stages: int, producer: bool = False) -> pipeline.PipelineState:
    """Pipeline state of the `count`-th use of a `stages`-deep pipeline (a producer's phase
    starts flipped). Roles carry one Int32 per pipeline and build states on the fly: K
    and V advance together, and a full PipelineState per pipeline costs registers."""
    phase = (count // stages) % 2
    if const_expr(producer):
        phase = phase ^ 1
    return pipeline.PipelineState(stages, count, count % stages, phase)


@dataclass(frozen=True)
class Pipelines:
    """The CTA's mbarrier pipelines: Q (one stage), the 16-bit K and V stages the MMAs
    read, the fp8 staging stages the copies fill (None without fp8), and the decode
    combine's hand-over between the MMA warpgroups."""

    q: pipeline.PipelineAsync
    k: pipeline.PipelineAsync
    v: pipeline.PipelineAsync
    k8: Optional[pipeline.PipelineAsync]
    v8: Optional[pipeline.PipelineAsync]
    combine: pipeline.PipelineAsync


@dataclass(frozen=True)
class SmemTiles:
    """The CTA's Q tile and K/V stages, and an fp8 cache's staging stages as the copies
    write them (None without fp8)."""

    sQ: cute.Tensor  # (tile_m, D), q's type
    # sQ as the S GEMM reads it from shared memory: sQ, or beside an fp8 cache at D 256
    # (bf16 queries converted in place, `dequant.q_tile_to_fp16`) its fp16 view.
    sQ_mma: cute.Tensor
    sK: cute.Tensor  # (tile_n, D, stage), the MMAs' type
    sV: cute.Tensor
    sK8: Optional[cute.Tensor]  # (tile_n, D, fp8 stage)
    sV8: Optional[cute.Tensor]


@dataclass(frozen=True)
class WarpgroupGemms:
    """One MMA warpgroup's GEMMs of an item: S = Q K^T (Q from shared memory or
    registers) into a fresh accumulator, and O += P V with P from registers (`rP`, seen
    as the A operand by `tOrP`); K and V fragments index their stage last."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    acc_shape_S: tuple
    rP: cute.Tensor
    tOrP: cute.Tensor
    qk_blocks: int  # k16 blocks of Q K^T holding the caller's columns (KernelConfig)

    @cute.jit
    def qk(self, k_state: pipeline.PipelineState) -> cute.Tensor:
        """Issue S = Q K^T on K stage `k_state` (asynchronous; the caller waits)."""
        acc_S = cute.make_rmem_tensor(self.acc_shape_S, Float32)
        warpgroup_gemm(self.tiled_mma_qk, acc_S, self.tSrQ,
                       self.tSrK[None, None, None, k_state.index], True, self.qk_blocks)
        return acc_S

    @cute.jit
    def pv(self, acc_O: cute.Tensor, v_state: pipeline.PipelineState):
        """Issue O += P V on V stage `v_state` (asynchronous; the caller waits)."""
        warpgroup_gemm(self.tiled_mma_pv, acc_O, self.tOrP,
                       self.tOrVt[None, None, None, v_state.index], False)


class PodAttentionSm90(PodKernelBase):
    def __init__(self, cfg: KernelConfig):
        super().__init__(cfg)
        self.has_lse = cfg.has_lse
        self.tma_kv = cfg.tma_kv
        # fp8 cache: the element type K/V arrive in (staged, then converted to mma_dtype).
        self.fp8 = cfg.fp8
        self.kv_dtype = DTYPES[cfg.kv_dtype] if cfg.fp8 else self.dtype
        # The MMAs' operand type (the 16-bit K/V stages, P): q's, or fp16 beside an fp8
        # cache whatever q's type (fp8 -> fp16 is exact and cheap; bf16 queries are scaled
        # into fp16's range in registers, `dequant.q_fragment_to_fp16`).
        self.mma_dtype = DTYPES[cfg.mma_dtype]
        self.num_mma_wg = cfg.num_mma_warpgroups
        self.num_mma_threads = cfg.num_mma_threads
        self.roles = WarpRoles.of(cfg)
        # (every MMA warpgroup's 64 rows make sQ)
        assert cfg.tile_m_decode == WG_ROWS and self.tile_m == WG_ROWS * self.num_mma_wg
        assert self.num_mma_wg == 2, "decode KV alternation and ping-pong assume 2"

    @classmethod
    def can_implement(cls, cfg: KernelConfig) -> tuple[bool, str]:
        """What this kernel needs of a configuration beyond KernelConfig.can_implement's
        common checks: 64 rows an MMA warpgroup, whole-tile or 16-slot TMA boxes, an even
        stage count, the shared memory, the setmaxnreg split."""
        if cfg.warp_mma:
            return False, f"{cfg.arch} runs the warp-level kernel"
        if cfg.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {cfg.head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
        if cfg.kv_dtype and cfg.kv_dtype not in FP8_KV_DTYPES:
            return False, f"kv_dtype {cfg.kv_dtype} (supported: '' or {FP8_KV_DTYPES})"
        if cfg.fp8 and cfg.head_dim not in FP8_HEAD_DIMS:
            return False, f"fp8 KV caches at head_dim {cfg.head_dim} (supported: {FP8_HEAD_DIMS})"
        if cfg.fp8 != (cfg.fp8_stages >= 2):
            return False, "an fp8 cache needs >= 2 fp8 staging stages, a 16-bit cache none"
        if cfg.fp8 and (cfg.ragged_kv or cfg.second_cache):
            return False, "a second K/V source needs a 16-bit cache (kv_dtype '')"
        if cfg.tile_m_prefill != 64 * cfg.num_mma_warpgroups or cfg.tile_m_decode != 64:
            return False, "each MMA warpgroup owns 64 rows (one m64 wgmma)"
        if cfg.tile_n % 16 or cfg.tile_n > 256:
            return False, f"tile_n {cfg.tile_n} must be a multiple of 16 up to 256"
        if cfg.kv_box not in (0, 16, cfg.tile_n):
            return False, (f"kv_box {cfg.kv_box}: a TMA box is 16 rows, one whole tile "
                           f"({cfg.tile_n}) or 0 (gathered rows)")
        if cfg.num_stages < 2:
            return False, "the K/V pipeline needs >= 2 stages"
        if cfg.num_stages % cfg.num_mma_warpgroups:
            # Decode items alternate KV tiles between the MMA warpgroups: with an even
            # stage count each stage always serves one of them, so its full barrier's
            # parity never runs a phase ahead of the tile it waits for.
            return False, (f"num_stages {cfg.num_stages} must be a multiple of the "
                           f"{cfg.num_mma_warpgroups} MMA warpgroups")
        if cls.smem_bytes(cfg) * cfg.ctas_per_sm > SMEM_BYTES_PER_SM:
            return False, (f"{cls.smem_bytes(cfg)} B of shared memory x {cfg.ctas_per_sm} CTAs "
                           f"> {SMEM_BYTES_PER_SM}")
        for name, r in (("producer_regs", cfg.producer_regs), ("mma_regs", cfg.mma_regs)):
            if r % 8 or not 24 <= r <= 256:
                return False, f"{name} {r}: setmaxnreg takes multiples of 8 in [24, 256]"
        per_slot = (cfg.num_producer_warpgroups * cfg.producer_regs
                    + cfg.num_mma_warpgroups * cfg.mma_regs)
        roles = WarpRoles.of(cfg)
        if roles.first_converter + roles.num_converters > cfg.num_producer_threads:
            return False, (f"{roles.num_converters} converting threads after the copy warps "
                           f"do not fit in {cfg.num_producer_warpgroups} producer warpgroups")
        if WARPGROUP_THREADS * per_slot * cfg.ctas_per_sm > REGISTERS_PER_SM:
            regs = WARPGROUP_THREADS * per_slot
            return False, f"{regs} registers x {cfg.ctas_per_sm} CTAs > {REGISTERS_PER_SM}"
        # setmaxnreg.inc draws only on what the CTA's own warps gave back with .dec: the
        # split must fit in the registers the CTA was launched with, or the MMA warpgroups'
        # increase waits forever (a hang, not an error).
        launched = cfg.launch_regs() * (cfg.num_mma_warpgroups + cfg.num_producer_warpgroups)
        if per_slot > launched:
            return False, (f"setmaxnreg split {cfg.num_producer_warpgroups} x "
                           f"{cfg.producer_regs} + {cfg.num_mma_warpgroups} x "
                           f"{cfg.mma_regs} exceeds the {launched} registers a thread slot of "
                           f"each warpgroup was launched with ({cfg.launch_regs()} each)")
        # The launch cap (registers per thread at entry) must hold the larger role.
        if cfg.launch_regs() < cfg.producer_regs:
            return False, "the launch register cap is below the producer's"
        return True, ""

    @classmethod
    def smem_bytes(cls, cfg: KernelConfig) -> int:
        """Q tile + K/V stages + the fp8 staging + the decode-combine scratch (also
        warpgroup 0's O staging) + warpgroup 1's O staging + the gather's page lookups +
        barriers and alignment (`launch_kernel`'s SharedStorage)."""
        e, d = cfg.elem_bytes, cfg.head_dim
        q = cfg.tile_m_prefill * d * e
        kv = 2 * cfg.num_stages * cfg.tile_n * d * e
        scratch = max(4 * cfg.combine_floats, staging_bytes(cfg))
        pages = 2 * cfg.tile_n * 4
        fp8 = 2 * cfg.fp8_stages * cfg.tile_n * d
        return q + kv + fp8 + scratch + staging_bytes(cfg) + pages + 6 * 1024

    def _tiled_mmas(self):
        """One warpgroup's MMAs (each MMA warpgroup partitions its own 64-row slice)."""
        tile_n, d = self.tile_n, self.cfg.pv_cols
        q_source = (warpgroup.OperandSource.RMEM if self.cfg.q_in_registers
                    else warpgroup.OperandSource.SMEM)
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            Float32, (1, 1, 1), (WG_ROWS, tile_n), q_source,
        )
        # P comes from registers (RS wgmma); V is read transposed (MN-major) from smem.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.MN,
            Float32, (1, 1, 1), (WG_ROWS, d), warpgroup.OperandSource.RMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

    def launch_kernel(self, io: PodTensors, plan: PlanTensors, num_ctas: Int32,
                      stream: cuda.CUstream):
        tile_n, d = self.tile_n, self.head_dim
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = tile_smem_layout(self.dtype, self.tile_m, d)
        sK_layout = tile_smem_layout(self.mma_dtype, tile_n, d, self.num_stages)
        sV_layout = tile_smem_layout(self.mma_dtype, tile_n, d, self.num_stages)
        # Decode combine: one fp32 column per thread of a warpgroup (a round's chunk of its
        # O fragment, then its row maxima and partial row sums), so thread t of each
        # warpgroup, which holds the same (row, col) positions, meets its twin without
        # bank conflicts.
        rows_per_thread = 2  # an m64 accumulator gives each thread 2 rows
        scratch_layout = cute.make_layout(
            (self.cfg.combine_chunk + 2 * rows_per_thread, WARPGROUP_THREADS),
            stride=(WARPGROUP_THREADS, 1))
        # The scratch is also warpgroup 0's O staging tile; warpgroup 1 has its own.
        scratch_words = max(self.cfg.combine_floats, staging_bytes(self.cfg) // 4)
        staging_elems = max(staging_bytes(self.cfg) // self.cfg.elem_bytes, 8)
        # fp8 staging: row-major; 128-byte swizzled for the warp-level decode path (its
        # loads take 16-byte pieces of 8 rows at once, decode_fp8.py), else unswizzled (the
        # converters read 16-byte row pieces; 8 threads of a warp cover 128 contiguous
        # bytes, so no bank conflicts either way).
        fp8_stages = max(self.cfg.fp8_stages, 1)
        s8_layout = cute.make_layout((tile_n, d, fp8_stages), stride=(d, 1, tile_n * d))
        if const_expr(self.cfg.warp_decode):
            s8_layout = tile_smem_layout(self.kv_dtype, tile_n, d, fp8_stages)
        s8_elems = cute.cosize(s8_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_combine: cute.struct.MemRange[cutlass.Int64, 2]
            if const_expr(self.fp8):  # (16-bit variants: the same layout as without fp8)
                mbar_k8: cute.struct.MemRange[cutlass.Int64, 2 * fp8_stages]
                mbar_v8: cute.struct.MemRange[cutlass.Int64, 2 * fp8_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(sK_layout)],
                                  1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(sV_layout)],
                                  1024]
            if const_expr(self.fp8):
                sK8: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, s8_elems], 1024]
                sV8: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, s8_elems], 1024]
            scratch: cute.struct.Align[cute.struct.MemRange[Float32, scratch_words], 128]
            staging1: cute.struct.Align[cute.struct.MemRange[self.dtype, staging_elems], 128]
            pages: cute.struct.MemRange[Int32, 2 * self.tile_n]  # gather: page of each row

        self.shared_storage = SharedStorage
        tma_atoms = None
        if const_expr(self.tma_kv):
            # Boxes of (kv_box slots, one swizzle-atom column block) (docs/design.md).
            box = (self.cfg.kv_box, self.box_cols)
            box_layout = tile_smem_layout(self.kv_dtype, self.cfg.kv_box, self.box_cols)
            if const_expr(self.fp8 and not self.cfg.warp_decode):
                box_layout = cute.make_layout(box, stride=(d, 1))
            tma_atoms, io = make_kv_tma_atoms(io, box_layout, box,
                                              self.cfg.ragged_kv or self.cfg.second_cache)
        self.kernel(
            io, plan, tma_atoms, tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout,
            s8_layout, scratch_layout,
        ).launch(**self.launch_options(num_ctas, stream))

    @cute.kernel
    def kernel(
        self,
        io: PodTensors,  # (mK, mV and the ragged pair: TMA views with TMA)
        plan: PlanTensors,
        tma_atoms: Optional[KvTmaAtoms],
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        s8_layout: Union[cute.Layout, cute.ComposedLayout],  # (swizzled: warp_decode)
        scratch_layout: cute.Layout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP_THREADS)
        q_loaders = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                              32 * self.roles.q_loaders[1])
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads)
        pipeline_q = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1,
            producer_group=q_loaders, consumer_group=consumers, defer_sync=True,
        )
        pipeline_k = self._make_kv_pipeline(storage.mbar_k.data_ptr(), producers, consumers,
                                            self.box_pieces)
        pipeline_v = self._make_kv_pipeline(storage.mbar_v.data_ptr(), producers, consumers,
                                            self.box_pieces_v)
        pipeline_k8 = pipeline_v8 = None
        if const_expr(self.fp8):
            pipeline_k8 = self._make_fp8_pipeline(storage.mbar_k8.data_ptr())
            pipeline_v8 = self._make_fp8_pipeline(storage.mbar_v8.data_ptr())
        # Decode combine hand-over, warpgroup 1 -> warpgroup 0 through the scratch: an
        # mbarrier pipeline of one stage (every thread arrives, so each thread's scratch
        # accesses are ordered against the other warpgroup's; racecheck follows it).
        wg_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP_THREADS)
        pipeline_combine = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_combine.data_ptr(), num_stages=1,
            producer_group=wg_group, consumer_group=wg_group, defer_sync=True,
        )
        pipes = Pipelines(pipeline_q, pipeline_k, pipeline_v, pipeline_k8, pipeline_v8,
                          pipeline_combine)
        if const_expr(self.tma_kv):
            if warp_idx == 0:
                tma_atoms.prefetch()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # fp8 staging, as the copies write it (the converters and the warp-level decode
        # path read its words: `fp8_words`).
        sK8 = sV8 = None
        if const_expr(self.fp8):
            if const_expr(self.cfg.warp_decode):
                sK8 = storage.sK8.get_tensor(s8_layout.outer, swizzle=s8_layout.inner)
                sV8 = storage.sV8.get_tensor(s8_layout.outer, swizzle=s8_layout.inner)
            else:
                sK8 = storage.sK8.get_tensor(s8_layout)
                sV8 = storage.sV8.get_tensor(s8_layout)
        sQ_mma = sQ
        if const_expr(self.fp8 and not self.cfg.q_in_registers):
            sQ_mma = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner,
                                           dtype=self.mma_dtype)
        smem_tiles = SmemTiles(sQ, sQ_mma, sK, sV, sK8, sV8)
        if const_expr(self.cfg.head_dim_io or self.cfg.vo_io):
            # A head dim narrower than the tile: the columns past it are zero once, for
            # the whole launch (no copy writes them), so Q K^T and P V add zeros there.
            every = cute.arch.thread_idx()[0]
            narrow = [(sX, self.cfg.io_dim) for sX in (sQ, sK)] + [(sV, self.cfg.vo_dim)]
            if const_expr(self.fp8):
                narrow += [(sK8, self.cfg.io_dim), (sV8, self.cfg.vo_dim)]
            for sX, cols in narrow:
                if const_expr(cols < self.head_dim):
                    zero_columns(sX, cols, every, self.cfg.num_threads)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

        # This CTA's item list is read after setmaxnreg: a value live across the register
        # reallocation goes through local memory (a spill).
        cta = cute.arch.block_idx()[0]
        if warp_idx < self.cfg.num_producer_threads // 32:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            self.produce(
                io, plan, tma_atoms, smem_tiles, *self.fp8_words(storage),
                storage.pages.get_tensor(cute.make_layout((self.tile_n, 2))), pipes,
                plan.mCtaPtr[cta], plan.mCtaPtr[cta + 1],
            )
            # Stay until the MMA warpgroups are done: no warp of the CTA exits early
            # (compute-sanitizer's racecheck mis-orders named barriers across exited
            # warps; the idle warps cost nothing).
            cute.arch.barrier(barrier_id=NamedBarrier.CTA_END,
                              number_of_threads=self.cfg.num_threads)
        else:
            cute.arch.setmaxregister_increase(self.cfg.mma_regs)
            row = staging_row(self.cfg)
            self.consume(
                io, plan,
                storage.scratch.get_tensor(scratch_layout),
                staging_tile(storage.scratch.data_ptr(), self.dtype, WG_ROWS, self.head_dim, row),
                staging_tile(storage.staging1.data_ptr(), self.dtype, WG_ROWS, self.head_dim, row),
                tiled_mma_qk, tiled_mma_pv, smem_tiles, *self.fp8_words(storage), pipes,
            )
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.CTA_END,
                                     number_of_threads=self.cfg.num_threads)

    def fp8_words(self, storage) -> tuple:
        """The fp8 staging stages as int32 words, (tile_n, D / 4, stages) each of K and V
        (the readers apply the swizzle themselves); (None, None) without fp8. Made by each
        role after its setmaxnreg: a value live across it would go through local memory."""
        if const_expr(not self.fp8):
            return None, None
        row_words = self.head_dim // 4
        words = cute.make_layout((self.tile_n, row_words, self.cfg.fp8_stages),
                                 stride=(row_words, 1, self.tile_n * row_words))
        return tuple(cute.make_tensor(cute.recast_ptr(s.data_ptr(), dtype=Int32), words)
                     for s in (storage.sK8, storage.sV8))

    def _make_kv_pipeline(self, barriers, producers, consumers, pieces: int):
        if const_expr(self.fp8):
            # The 16-bit stages: each filled by one converter group (each thread arrives
            # after its stores and their proxy fence), read by every MMA thread.
            return pipeline.PipelineAsync.create(
                barrier_storage=barriers, num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         CONVERTER_GROUP_THREADS),
                consumer_group=consumers, defer_sync=True,
            )
        if const_expr(self.tma_kv):
            # One elected thread arms the barrier with the tile's bytes; one thread per
            # MMA warp releases a stage.
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers, num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_mma_threads // 32),
                tx_count=self.tile_n * pieces * self.box_cols * self.dtype.width // 8,
                defer_sync=True,
            )
        return pipeline.PipelineCpAsync.create(
            barrier_storage=barriers, num_stages=self.num_stages,
            producer_group=producers, consumer_group=consumers, defer_sync=True,
        )

    def _make_fp8_pipeline(self, barriers):
        """The fp8 staging stages: filled by TMA (one elected thread arms each with the
        tile's bytes) or by the cp.async loaders; released by the converting warps, or by
        the MMA warps on the warp-level decode path."""
        converters = CONVERTER_GROUP_THREADS  # (each stage: one group's)
        if const_expr(self.tma_kv):
            # One arrival per warp: a converter group's (its first warp twice) or, on the
            # warp-level decode path, the reading MMA warpgroup's (KernelConfig).
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers, num_stages=self.cfg.fp8_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         FP8_STAGE_ARRIVALS),
                tx_count=self.tile_n * self.head_dim * self.kv_dtype.width // 8,
                defer_sync=True,
            )
        return pipeline.PipelineCpAsync.create(
            barrier_storage=barriers, num_stages=self.cfg.fp8_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.roles.num_loaders),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, converters),
            defer_sync=True,
        )

    @property
    def box_pieces(self) -> int:
        """Column blocks a K box row is copied in: those holding the caller's columns
        (a block past them stays as zeroed at the start; one partly past them is
        zero-filled by TMA). fp8 boxes take whole rows."""
        return self.pieces_of(self.cfg.io_dim)

    @property
    def box_pieces_v(self) -> int:
        """The same for a V box row (the value head dim's columns)."""
        return self.pieces_of(self.cfg.vo_dim)

    def pieces_of(self, cols: int) -> int:
        if self.fp8:
            return 1
        return -(-cols // self.box_cols)

    @property
    def box_cols(self) -> int:
        """Columns of a K/V TMA box: one swizzle-atom column block of the 16-bit stage, or
        a whole fp8 row (fp8 staging is unswizzled)."""
        if self.fp8:
            return self.head_dim
        return cute.size(smem_atom(self.dtype, self.head_dim).outer, mode=[1])

    # ---- producer ---------------------------------------------------------------------

    @cute.jit
    def produce(self, io: PodTensors, plan: PlanTensors, tma_atoms: Optional[KvTmaAtoms],
                smem: SmemTiles, sK8w: Optional[cute.Tensor], sV8w: Optional[cute.Tensor],
                sPages: cute.Tensor, pipes: Pipelines, item_begin: Int32, item_end: Int32):
        """Q of every item by the producer warps `WarpRoles.q_loaders`; K/V tiles by TMA (warp 0)
        or a cp.async gather. With an fp8 cache the copies land in the fp8 staging stages and
        the other producer warps, a second warpgroup's included, convert each tile into
        the 16-bit stage (`convert_kv`). `sK8w`/`sV8w`: the fp8 stages as words
        (`fp8_words`); `sPages`: the gather's page lookups, (tile_n, 2)."""
        tile_n, d = self.tile_n, self.head_dim
        tidx = cute.arch.thread_idx()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        paged = PagedKV.create(plan.mPageList, plan.page_shift, tile_n)
        # Q rows resolve their own addresses (4 threads a row: few rows per thread; a lone
        # Q warp loops over its rows, 8 threads a row: fewer addresses live, no spill);
        # K/V rows read their pages from shared memory (8 threads a row: whole 128 B lines).
        first_q_warp, q_warps = self.roles.q_loaders
        q_gather = RowGather.create(self.dtype, self.tile_m, d, 32 * q_warps,
                                    tidx - 32 * first_q_warp,
                                    threads_per_row=8 if q_warps == 1 else 4,
                                    rolled=q_warps == 1, cols=self.cfg.io_dim)
        kv_gather = None
        if const_expr(not self.tma_kv):
            kv_gather = RowGather.create(self.kv_dtype, tile_n, d, self.roles.num_loaders, tidx,
                                         cols=self.cfg.io_dim)
        dequant = group = None
        if const_expr(self.fp8):
            group_threads = CONVERTER_GROUP_THREADS
            dequant = Dequant((tidx - self.roles.first_converter) % group_threads, group_threads,
                              self.cfg.kv_dtype, self.cfg.warp_decode)
            # This warp's converter group (converter_groups or more: an idle warp).
            group = (warp - self.roles.first_converter // 32) // (group_threads // 32)
        items = partial(
            self.produce_items, io, plan, paged, tma_atoms, smem, sK8w, sV8w, sPages, pipes,
            q_gather, kv_gather, dequant, group, item_begin, item_end)
        if const_expr(self.fp8 and self.tma_kv):
            # Disjoint warp roles, one item loop each: what one role's loop keeps live (the
            # converters' hoisted swizzled addresses) is then not live in the others' (64
            # registers: the Q loader spilled 8 bytes with one loop for all).
            if const_expr(first_q_warp == 0):  # one producer warpgroup: TMA warp loads Q
                if warp == 0:
                    items(roles=ROLE_Q | ROLE_COPY)
                else:
                    items(roles=ROLE_CONVERT)
            else:
                if warp == first_q_warp:
                    items(roles=ROLE_Q)
                elif warp == 0:
                    items(roles=ROLE_COPY)
                else:
                    items(roles=ROLE_CONVERT)
        else:
            items(roles=ROLE_Q | ROLE_COPY | ROLE_CONVERT)

    @cute.jit
    def produce_items(self, io: PodTensors, plan: PlanTensors, paged: PagedKV,
                      tma_atoms: Optional[KvTmaAtoms], smem: SmemTiles, sK8w, sV8w, sPages,
                      pipes: Pipelines, q_gather: RowGather, kv_gather: Optional[RowGather],
                      dequant: Optional[Dequant], group, item_begin: Int32, item_end: Int32,
                      roles: cutlass.Constexpr[int]):
        """The producer warps' work for each of the CTA's items in order, of the `roles`
        (ROLE_* bits) this warp plays: its Q rows, its K/V copies, its conversions. Every
        role counts the K/V tiles itself (each pipeline's count is the same in every role)."""
        tile_n = self.tile_n
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first_q_warp, q_warps = self.roles.q_loaders
        # Where the K/V copies land: the 16-bit stages, or the fp8 staging stages.
        sK_in, sV_in, pipe_k_in, pipe_v_in = smem.sK, smem.sV, pipes.k, pipes.v
        if const_expr(self.fp8):
            sK_in, sV_in, pipe_k_in, pipe_v_in = smem.sK8, smem.sV8, pipes.k8, pipes.v8
        kv_count = Int32(0)  # K/V tiles produced so far
        for i in cutlass.range(item_begin, item_end, unroll=1):
            item = WorkItem.load(plan, i, self.cfg.shared_prefix)
            load_q = partial(self.produce_q, io.mQ, smem.sQ, q_gather, pipes.q, item,
                             i - item_begin, plan)
            if const_expr(roles & ROLE_Q):
                if const_expr(q_warps == self.cfg.num_producer_threads // 32):
                    load_q()  # every producer warp
                else:
                    if warp >= first_q_warp and warp < first_q_warp + q_warps:
                        load_q()
            n_min, n_max, _ = item.tile_bounds(item.row_start, self.group, self.causal, tile_n)
            convert = partial(self.convert_kv, dequant, sK8w, sV8w, smem.sK, smem.sV, pipes,
                              kv_count, item, n_min, n_max, group)
            if const_expr(self.tma_kv):
                if const_expr(roles & ROLE_COPY):
                    if warp == 0:  # one warp issues the boxes
                        tma = partial(self.produce_kv_tma, paged=paged, sK=sK_in, sV=sV_in,
                                      pipeline_k=pipe_k_in, pipeline_v=pipe_v_in,
                                      kv_count=kv_count, item=item, n_min=n_min, n_max=n_max)
                        # The second source's item takes its own copy of the loop: a runtime
                        # choice inside it would cost the 24-register producer spills.
                        paged_copies = partial(tma, mK=io.mK, mV=io.mV, tma_atom_k=tma_atoms.k,
                                               tma_atom_v=tma_atoms.v)
                        if const_expr(self.cfg.ragged_kv or self.cfg.second_cache):
                            if item.reads_second(self.cfg, plan.mIParams):
                                self.second_source_copies(
                                    partial(tma, mK=io.mK2, mV=io.mV2, tma_atom_k=tma_atoms.k2,
                                            tma_atom_v=tma_atoms.v2), item)
                            else:
                                self.copies_by_kind(paged_copies, item)
                        else:
                            self.copies_by_kind(paged_copies, item)
                if const_expr(self.fp8 and roles & ROLE_CONVERT):
                    if warp != 0 and group < self.roles.converter_groups:
                        convert()
            else:
                l2_policy = None
                if const_expr(self.cfg.decode_kv_evict_first):
                    l2_policy = l2_policy_read_once(item.is_decode)
                gather = partial(self.produce_kv_gather, paged=paged, kv_gather=kv_gather,
                                 sK=sK_in, sV=sV_in, sPages=sPages, pipeline_k=pipe_k_in,
                                 pipeline_v=pipe_v_in, kv_count=kv_count, item=item,
                                 n_min=n_min, n_max=n_max, l2_policy=l2_policy)
                if const_expr(self.fp8):  # (one loop for all roles: roles is every bit)
                    if warp < self.roles.num_loaders // 32:  # loaders, then converters
                        gather(mK=io.mK, mV=io.mV)
                    else:
                        convert()
                else:  # the whole warpgroup
                    if const_expr(self.cfg.ragged_kv or self.cfg.second_cache):
                        if item.reads_second(self.cfg, plan.mIParams):
                            gather(mK=io.mK2, mV=io.mV2, ragged=self.cfg.ragged_kv)
                        else:
                            gather(mK=io.mK, mV=io.mV)
                    else:
                        gather(mK=io.mK, mV=io.mV)
            kv_count += n_max - n_min

    @cute.jit
    def copies_by_kind(self, copy_kv, item: WorkItem):
        """`copy_kv` (the item's TMA copies); with KernelConfig.decode_kv_evict_first a
        decode item's under an L2 evict-first policy: it holds every row of its request,
        so its K/V rows are read once in the launch, a prefill request's by each of its
        row tiles. (A copy of the loop per kind: a policy chosen at run time inside it
        spilled the 24-register producer.)"""
        if const_expr(self.cfg.decode_kv_evict_first):
            if item.is_decode:
                copy_kv(l2_policy=l2_evict_first_policy())
            else:
                copy_kv()
        else:
            copy_kv()

    @cute.jit
    def second_source_copies(self, copy_kv, item: WorkItem):
        """`copy_kv` over the second K/V source: the ragged one (no page table; its item is
        the legacy wrapper's prefill, so no L2 policy) or a second cache (copied as the
        first, `copies_by_kind`)."""
        if const_expr(self.cfg.ragged_kv):
            copy_kv(ragged=True)
        else:
            self.copies_by_kind(copy_kv, item)

    @property
    def copy_stages(self) -> int:
        """Stages of the pipeline the K/V copies fill (the fp8 staging, or the 16-bit)."""
        return self.cfg.fp8_stages if self.fp8 else self.num_stages

    @cute.jit
    def convert_kv(self, dequant: Dequant, sK8w: cute.Tensor, sV8w: cute.Tensor, sK: cute.Tensor,
                   sV: cute.Tensor, pipes: Pipelines, kv_count: Int32, item: WorkItem,
                   n_min: Int32, n_max: Int32, group: Int32):
        """Dequantise the item's staged fp8 K and V tiles of this converter group (those
        whose pipeline count is the group mod converter_groups; tile n_min is the
        kv_count-th of every pipeline) into their 16-bit stages. V rows past the item's
        keys become zeros, as zero_v_tail does for 16-bit TMA tiles.

        An item on the warp-level decode path (`warp_decodes`) reads the fp8 stages
        itself: the group still waits for each of its tiles and commits the 16-bit stage
        (empty) as the MMA warps' go-ahead, and the MMA warps free the fp8 stage. So every
        pipeline keeps one count for all items, and no group ever waits on a stage a
        phase ahead of its fill (each group sees every fill of its stages in order)."""
        groups = self.roles.converter_groups
        first = n_min + (group - kv_count % groups + groups) % groups
        convert = Int32(1)
        if const_expr(self.cfg.warp_decode):
            convert = 1 - self.warp_decodes(item)
        # (a freed TMA stage takes 4 arrivals: the group's first warp arrives twice)
        first_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == (
            self.roles.first_converter // 32 + group * (CONVERTER_GROUP_THREADS // 32))
        for n_block in cutlass.range(first, n_max, groups, unroll=1):
            count = kv_count + n_block - n_min
            s8 = stage(count, self.cfg.fp8_stages)
            s16 = stage(count, self.num_stages, producer=True)
            for sX8w, sX, pipe8, pipe, zero_from in (
                    (sK8w, sK, pipes.k8, pipes.k, Int32(self.tile_n)),
                    (sV8w, sV, pipes.v8, pipes.v, item.kv_end - n_block * self.tile_n)):
                pipe8.consumer_wait(s8)
                pipe.producer_acquire(s16)
                if convert != 0:
                    dequant.tile(sX8w[None, None, s8.index], sX[None, None, s16.index],
                                 zero_from)
                    # Generic-proxy stores, read by wgmma through the async proxy.
                    cute.arch.fence_view_async_shared()
                pipe.producer_commit(s16)
                if convert != 0:
                    pipe8.consumer_release(s8)
                    if const_expr(self.tma_kv):
                        if first_warp:
                            pipe8.consumer_release(s8)

    @cute.jit
    def produce_q(self, mQ, sQ, q_gather, pipeline_q, item: WorkItem, q_count: Int32,
                  plan: PlanTensors):
        """cp.async gather of an item's packed Q rows into sQ (its `q_count`-th Q stage use).
        A prefill item's rows fill the tile (each MMA warpgroup reads its 64); a decode
        item's rows go to both halves (both warpgroups hold all of them). Rows past the
        item's end repeat its last row (valid memory, never stored). A shared-prefix
        tile's rows are its sharers' (`copy_q`)."""
        mQ_rows = self.q_rows(mQ, item)
        last_row = item.row_end - 1
        row_mask = Int32(self.tile_m - 1)
        if item.is_decode:
            row_mask = Int32(WG_ROWS - 1)
        q_state = stage(q_count, 1, producer=True)
        pipeline_q.producer_acquire(q_state)
        self.copy_q(q_gather, sQ, mQ, mQ_rows, plan, item,
                    lambda r: cutlass.min(item.row_start + (r & row_mask), last_row))
        cute.arch.cp_async_commit_group()
        pipeline_q.producer_commit(q_state)

    @cute.jit
    def produce_kv_tma(self, mK, mV, paged: PagedKV, tma_atom_k, tma_atom_v, sK, sV,
                       pipeline_k, pipeline_v, kv_count: Int32, item: WorkItem,
                       n_min: Int32, n_max: Int32, ragged: cutlass.Constexpr[bool] = False,
                       l2_policy: Optional[Int64] = None):
        """TMA boxes of `kv_box` page slots x one swizzle column block for every K and V
        tile, issued by one warp (tile n_min is the pipeline's kv_count-th).

        Lane j resolves box j of a tile (its page and its box within the page); the
        warp loops over the boxes, and each copy is issued by one elected lane (a TMA
        copy elects its issuing thread, so per-lane coordinates must be broadcast).
        Every tile is armed with its full size: boxes past kv_end re-read the box of
        the item's last token (its own page), whose K scores the consumer masks and
        whose V rows it zeroes. No page-table entry past the request's pages is read.
        `ragged`: mK/mV are the ragged source, one page of the item's tokens (no page
        table; boxes past its end are zero-filled). `l2_policy`: the copies' L2 cache
        hint (KernelConfig.decode_kv_evict_first), or none.
        """
        kv_box = self.cfg.kv_box
        boxes = self.tile_n // kv_box
        tiler = (kv_box, self.box_cols)
        tKsK, tKgK = tma_kv_tiles(tma_atom_k, mK, sK, item.kv_head, tiler)
        tVsV, tVgV = tma_kv_tiles(tma_atom_v, mV, sV, item.kv_head, tiler)
        lane = cute.arch.lane_idx()
        # fp8: the warp's lanes look up the boxes of `ahead` tiles at once (lane l: box
        # l % boxes of tile l // boxes of the group), a group ahead: a 64-token fp8 tile
        # streams in a quarter of the time of a 16-bit one, and one dependent page-table
        # load per tile kept the decode stream of 16-token pages at ~0.78 of HBM's rate.
        # (16-bit variants keep the in-place lookup of one tile their sanitizer runs vouch
        # for.)
        ahead = 32 // boxes if self.fp8 else 1

        locate = partial(paged.box, item, lane % boxes, kv_box, ragged)
        lane_tile = lane // boxes if self.fp8 else 0
        next_page, next_box = Int32(0), Int32(0)  # (fp8: the next group's lookups)
        if const_expr(self.fp8):
            if n_min < n_max:
                next_page, next_box = locate(cutlass.min(n_min + lane_tile, n_max - 1))
        tile_page, tile_box = Int32(0), Int32(0)
        # (pieces: the column blocks of a K or V box row)
        copy_boxes = partial(copy_kv_boxes, boxes=boxes, whole_rows=self.fp8,
                             l2_policy=l2_policy)
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            if const_expr(self.fp8):
                in_group = (n_block - n_min) % ahead
                if in_group == 0:
                    tile_page, tile_box = next_page, next_box
                    next_page, next_box = locate(
                        cutlass.min(n_block + ahead + lane_tile, n_max - 1))
            else:
                in_group = Int32(0)
                tile_page, tile_box = locate(n_block)
            kv_state = stage(kv_count + n_block - n_min, self.copy_stages, producer=True)
            pipeline_k.producer_acquire(kv_state)
            copy_boxes(tma_atom_k, tKgK, tKsK, tile_page, tile_box, in_group * boxes,
                       kv_state.index, pipeline_k.producer_get_barrier(kv_state),
                       pieces=self.box_pieces)
            pipeline_v.producer_acquire(kv_state)
            copy_boxes(tma_atom_v, tVgV, tVsV, tile_page, tile_box, in_group * boxes,
                       kv_state.index, pipeline_v.producer_get_barrier(kv_state),
                       pieces=self.box_pieces_v)

    @cute.jit
    def produce_kv_gather(self, mK, mV, paged: PagedKV, kv_gather, sK, sV, sPages,
                          pipeline_k, pipeline_v, kv_count: Int32, item: WorkItem,
                          n_min: Int32, n_max: Int32, ragged: cutlass.Constexpr[bool] = False,
                          l2_policy: Optional[Int64] = None):
        """cp.async gather of K/V page rows by the whole producer warpgroup (tile n_min is
        the pipeline's kv_count-th).

        A tile's rows are resolved to pages once, one row per thread, into shared memory
        (`sPages`, double-buffered by tile parity): K and V and every thread copying a
        row share the lookup, and the next tile's lookups overlap this tile's copies.
        Rows past kv_end re-read the item's last token (layouts.clamp_token): the
        consumer masks them, and no garbage/NaN slot is ever read. `ragged`: mK/mV are
        the ragged source, one page of the item's tokens: rows need no lookup (the
        barrier stays, so sPages' double-buffering holds across items of both sources).
        """
        tidx = cute.arch.thread_idx()[0]
        if const_expr(not ragged):
            if n_min < n_max:
                self.lookup_pages(sPages, kv_count % 2, paged, item, n_min, tidx)
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            first_token = n_block * self.tile_n
            buf = (kv_count + n_block - n_min) % 2
            # This tile's lookups (every producer thread's) are in sPages[:, buf].
            cute.arch.barrier(barrier_id=NamedBarrier.PRODUCER,
                              number_of_threads=self.roles.num_loaders)

            def row_of(mKV):
                def gmem_row(m, r):
                    token = layouts.clamp_token(first_token, r, item.kv_end)
                    if const_expr(ragged):
                        return layouts.kv_row_at(mKV, 0, token, item.kv_head)
                    slot = paged.slot(token)
                    return layouts.kv_row_at(mKV, sPages[r, buf], slot, item.kv_head)
                return gmem_row

            kv_state = stage(kv_count + n_block - n_min, self.copy_stages, producer=True)
            pipeline_k.producer_acquire(kv_state)
            kv_gather.copy_rows(sK[None, None, kv_state.index], row_of(mK), l2_policy)
            cute.arch.cp_async_commit_group()
            pipeline_k.producer_commit(kv_state)
            pipeline_v.producer_acquire(kv_state)
            kv_gather.with_cols(self.cfg.vo_dim).copy_rows(sV[None, None, kv_state.index],
                                                           row_of(mV), l2_policy)
            cute.arch.cp_async_commit_group()
            pipeline_v.producer_commit(kv_state)
            # The other buffer was last read for the previous tile, before this tile's
            # barrier: the next tile's lookups may go in now.
            if const_expr(not ragged):
                if n_block + 1 < n_max:
                    self.lookup_pages(sPages, 1 - buf, paged, item, n_block + 1, tidx)

    @cute.jit
    def lookup_pages(self, sPages: cute.Tensor, buf: Int32, paged: PagedKV, item: WorkItem,
                     n_block: Int32, tidx: Int32):
        """Physical page of each row of KV tile n_block into sPages[:, buf], one row per
        producer thread (tokens clamped into the item's range, so no page-table entry
        past its pages is read)."""
        for r in cutlass.range(tidx, self.tile_n, self.roles.num_loaders, unroll=1):
            sPages[r, buf] = paged.page(item, paged.token(item, n_block, r))

    # ---- MMA warpgroups ---------------------------------------------------------------

    @cute.jit
    def consume(self, io: PodTensors, plan: PlanTensors, sScratch: cute.Tensor,
                sStage0: cute.Tensor, sStage1: cute.Tensor, tiled_mma_qk: cute.TiledMma,
                tiled_mma_pv: cute.TiledMma, smem: SmemTiles, sK8w: Optional[cute.Tensor],
                sV8w: Optional[cute.Tensor], pipes: Pipelines):
        """The MMA warpgroups' item loop: each item on wgmma (`item_wgmma`) or, an fp8
        decode item of few rows, on warp-level MMAs (`decode_item_warp`), then the split
        merge. `sScratch`: the decode combine's scratch; `sStage0`/`sStage1`: the
        warpgroups' O staging tiles."""
        tile_n, d = self.tile_n, self.head_dim
        # 0 .. num_mma_threads (the producer warpgroups come first)
        mma_tidx = cute.arch.thread_idx()[0] - self.cfg.num_producer_threads
        wg = cute.arch.make_warp_uniform(mma_tidx // WARPGROUP_THREADS)
        tidx = mma_tidx % WARPGROUP_THREADS
        acc_shape_S = tiled_mma_qk.get_slice(tidx).partition_shape_C((WG_ROWS, tile_n))
        # (O's columns: the tile's, or the value head dim's blocks, KernelConfig.pv_cols)
        acc_O = cute.make_rmem_tensor(
            tiled_mma_pv.get_slice(tidx).partition_shape_C((WG_ROWS, self.cfg.pv_cols)),
            Float32)
        # Soft-capped raw scores are tanh values whose logits are softcap x them.
        softmax = OnlineSoftmax.create(
            cute.size(rows_cols_view(acc_O), mode=[0]), plan.mParams[self.logit_param] * LOG2_E
        )
        # O's rescale factor of the latest tile, applied while the next S GEMM runs.
        row_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        # P of the previous own KV tile, as the register A operand of the P V wgmma.
        rP = cute.make_rmem_tensor(acc_shape_S, self.mma_dtype)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a_layout(rP.layout))
        # This warpgroup's O staging tile for the epilogue (None: direct stores).
        sStage = None
        if const_expr(self.cfg.o_staging):
            sStage = sStage0
            if wg == 1:
                sStage = sStage1
        # K and V stages are filled in step: tile n_min of an item is the kv_count-th use
        # of both pipelines (every MMA warpgroup counts every tile, own or not).
        kv_count = Int32(0)
        # Ping-pong: warpgroup 0 takes the first turn (warpgroup 1 pre-pays the arrival
        # it would otherwise make after issuing its GEMMs).
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.SCHEDULE,
                                     number_of_threads=self.num_mma_threads)

        # This CTA's items [mCtaPtr[cta], mCtaPtr[cta + 1]); the end is re-read (an L1 hit)
        # rather than held: the MMA warpgroups have no register to spare for it.
        i = cute.arch.make_warp_uniform(plan.mCtaPtr[cute.arch.block_idx()[0]])
        while i < plan.mCtaPtr[cute.arch.block_idx()[0] + 1]:
            item = WorkItem.load(plan, i, self.cfg.shared_prefix)
            decode = Int32(item.is_decode)
            # Rows of this warpgroup: its own 64 (prefill) or all of the item's (decode).
            row_offset = wg * WG_ROWS * (1 - decode)
            n_min, n_max, mask_from = self.item_tiles(item, wg, plan.mIParams)
            # Window: tiles below mask_until hold keys left of some row's window.
            mask_until = Int32(0)
            if const_expr(self.cfg.window):
                mask_until = left_mask_until(
                    item.kv_len, item.q_len,
                    cutlass.min(item.row_end, item.row_start + row_offset + WG_ROWS),
                    self.group, plan.mIParams[IParam.WINDOW_LEFT], tile_n)
            # The item's Q (both paths read it first).
            pipes.q.consumer_wait(stage(i - plan.mCtaPtr[cute.arch.block_idx()[0]], 1))
            item_wgmma = partial(
                self.item_wgmma, io, plan, i, kv_count, n_min, n_max, mask_from, mask_until,
                softmax, row_scale, acc_O, rP, tOrP, smem, acc_shape_S, tiled_mma_qk,
                tiled_mma_pv, sScratch, sStage, pipes, mma_tidx, tidx, wg)
            if const_expr(self.cfg.warp_decode):
                if self.warp_decodes(item) != 0:
                    self.decode_item_warp(
                        io, plan, i, kv_count, n_min, n_max, mask_from, mask_until, softmax,
                        row_scale, acc_O, smem.sQ, sK8w, sV8w, sScratch, pipes, tidx, wg)
                else:
                    item_wgmma()
            else:
                item_wgmma()
            # The item again (L1 hits), and its tile count recomputed: held through the
            # item's work, n_min and n_max would cost the MMA warps two registers.
            item = WorkItem.load(plan, i, self.cfg.shared_prefix)
            n_min, n_max, _ = self.item_tiles(item, wg, plan.mIParams)
            kv_count += n_max - n_min
            self.merge_split(io, plan, item, mma_tidx, self.num_mma_threads)
            i += 1

    @cute.jit
    def item_tiles(self, item: WorkItem, wg: Int32, mIParams: cute.Tensor):
        """(n_min, n_max, mask_from) of this warpgroup's rows of `item`: its own 64 of a
        prefill item, all of a decode item's."""
        row_offset = wg * WG_ROWS * (1 - Int32(item.is_decode))
        return item.tile_bounds(item.row_start + row_offset, self.group, self.causal,
                                self.tile_n, self.window_right(mIParams))

    @cute.jit
    def item_wgmma(self, io: PodTensors, plan: PlanTensors, i: Int32, kv_count: Int32,
                   n_min: Int32, n_max: Int32, mask_from: Int32, mask_until: Int32,
                   softmax: OnlineSoftmax, row_scale: cute.Tensor, acc_O: cute.Tensor,
                   rP: cute.Tensor, tOrP: cute.Tensor, smem: SmemTiles, acc_shape_S,
                   tiled_mma_qk, tiled_mma_pv, sScratch: cute.Tensor,
                   sStage: Optional[cute.Tensor], pipes: Pipelines, mma_tidx: Int32,
                   tidx: Int32, wg: Int32):
        """Item i on wgmma (every prefill item; decode items of 16-bit caches, and of fp8
        caches off the warp-level path): this warpgroup's mainloop, the decode combine, O
        normalised and written (the split merge follows in consume)."""
        d, tile_n = self.head_dim, self.tile_n
        # Marked warp-uniform (they are): with the warp-level decode path's branch in the
        # item loop, ptxas no longer proved it and kept the mainloop's stage indices and
        # wgmma descriptors in vector registers (F1 e4m3: +10% instructions, +6% time).
        kv_count, n_min, n_max, mask_from, mask_until = (
            cute.arch.make_warp_uniform(v)
            for v in (kv_count, n_min, n_max, mask_from, mask_until))
        if const_expr(self.cfg.q_in_registers):
            # This thread's slices of the MMAs from a tidx the compiler may not hoist out
            # of the item loop: what derives from it (mask coordinates, ldmatrix and
            # epilogue addresses) then holds registers only through this path. Hoisted
            # beside Q's 32 registers, they made the MMA warps spill even at 208.
            tidx = kept_in_loop(tidx)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((WG_ROWS, tile_n)))
        pv_cols = self.cfg.pv_cols
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((WG_ROWS, pv_cols)))
        # The GEMMs' shared-memory operands (descriptors made here, per item, rather than
        # held through the item loop, which the warp-level decode path shares).
        # This warpgroup's 64 rows of Q (a decode item's rows sit in both halves).
        sQ_wg = cute.local_tile(smem.sQ, (WG_ROWS, d), (wg, 0))
        # V^T view (pv_cols, tile_n) of the row-major (tile_n, D) V tile, its first pv_cols
        # columns: the MN-major B operand of P @ V.
        sVt = cute.composition(
            smem.sV, cute.make_layout((pv_cols, tile_n, self.num_stages),
                                      stride=(tile_n, 1, d * tile_n))
        )
        if const_expr(self.cfg.q_in_registers):
            tSrQ = cute.make_rmem_tensor(thr_mma_qk.partition_shape_A((WG_ROWS, d)),
                                         self.mma_dtype)
        else:
            tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(
                cute.local_tile(smem.sQ_mma, (WG_ROWS, d), (wg, 0))))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(smem.sK))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        item = WorkItem.load(plan, i, self.cfg.shared_prefix)
        decode = Int32(item.is_decode)
        row_offset = wg * WG_ROWS * (1 - decode)
        softmax.reset()
        q_state = stage(i - plan.mCtaPtr[cute.arch.block_idx()[0]], 1)  # (consume waited)
        q_up = Float32(1.0)
        if const_expr(self.cfg.q_in_registers):
            # Q into registers once (as the MMAs' fp16: q_up = 2^e, the scores' factor);
            # the stage is free for the next item's Q at once.
            copy_q = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                    self.dtype), tiled_mma_qk).get_slice(tidx)
            rQ = cute.make_rmem_tensor_like(tSrQ, self.dtype)
            cute.copy(copy_q, copy_q.partition_S(sQ_wg), copy_q.retile(rQ))
            pipes.q.consumer_release(q_state)
            q_up = q_fragment_to_fp16(rQ, tSrQ)
        elif const_expr(self.fp8 and self.dtype != self.mma_dtype):
            # bf16 rows beside an fp8 cache, read from shared memory: each warp scales
            # its 16 rows into fp16 in place (fenced and synced below, before any wgmma).
            q_up = q_tile_to_fp16(sQ_wg, cute.local_tile(smem.sQ_mma, (WG_ROWS, d), (wg, 0)),
                                  tidx // 32, tidx % 32)
        item_softmax, tanh_scale = softmax, None
        if const_expr(self.fp8):
            item_softmax, tanh_scale = self.raw_score_scales(softmax, plan.mParams, io.mKScale,
                                                             item.kv_head, q_up)
        acc_O.fill(0.0)
        if const_expr(not self.cfg.q_in_registers):
            # cp.async wrote sQ through the generic proxy; wgmma reads via the async one.
            cute.arch.fence_view_async_shared()
            if const_expr(self.fp8 and self.dtype != self.mma_dtype):
                # The wgmma reads all 64 rows: every warp's conversion must be done.
                cute.arch.barrier(barrier_id=Int32(NamedBarrier.WARPGROUP) + wg,
                                  number_of_threads=WARPGROUP_THREADS)
        # The mask re-reads the item (L1 hits) on the few tiles it touches rather than
        # hold its bounds in registers through the mainloop.
        mask_tile = partial(self.mask_tile, tScS=tScS, plan=plan, i=i, wg=wg)
        score_tile = partial(self.score_tile, mask_tile=mask_tile, mask_from=mask_from,
                             mask_until=mask_until, mParams=plan.mParams, mKScale=io.mKScale,
                             kv_head=item.kv_head, tanh_scale=tanh_scale)
        gemms = WarpgroupGemms(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, acc_shape_S, rP,
                               tOrP, self.cfg.qk_blocks)
        if decode != 0:
            self.mainloop_decode(gemms, acc_O, item_softmax, row_scale, score_tile, smem.sV,
                                  pipes, q_state, kv_count, n_min, n_max, item.kv_end,
                                  mma_tidx, wg)
        else:
            self.mainloop_prefill(gemms, acc_O, item_softmax, row_scale, score_tile, smem.sV,
                                  pipes, q_state, kv_count, n_min, n_max, item.kv_end,
                                  mma_tidx, wg)
        # Reload the item for the epilogue (an L1 hit) rather than keep every field
        # live through the mainloop: registers are what the MMA warpgroups lack.
        item = WorkItem.load(plan, i, self.cfg.shared_prefix)
        decode = Int32(item.is_decode)
        row_offset = wg * WG_ROWS * (1 - decode)
        if decode != 0:
            # Fold warpgroup 1's softmax state and O into warpgroup 0's.
            self.combine_decode(item_softmax, acc_O, sScratch, pipes.combine,
                                item.decode_index, tidx, wg)
        inv_sum, lse = softmax.finalize(
            self.lse_logit_scale(plan.mParams, io.mKScale, item.kv_head, softmax, item_softmax),
            self.row_sinks(io.mSinks, tOcO, item, row_offset))
        if const_expr(self.fp8):
            # v_scale multiplies every value: O's normaliser takes it (not the LSE).
            v_scale = self.kv_scale(io.mVScale, item.kv_head)
            for r in cutlass.range_constexpr(cute.size(inv_sum)):
                inv_sum[r] = inv_sum[r] * v_scale
        rescale_rows(acc_O, inv_sum)
        if decode * wg == 0:  # prefill: each warpgroup its rows; decode: warpgroup 0
            self.epilogue(acc_O, lse, thr_mma_pv, tOcO, sStage, item, row_offset, io, plan,
                          tidx)

    @cute.jit
    def mainloop_prefill(self, gemms: WarpgroupGemms, acc_O: cute.Tensor,
                         softmax: OnlineSoftmax, row_scale: cute.Tensor, score_tile, sV,
                         pipes: Pipelines, q_state, kv_count: Int32, n_min: Int32, n_max: Int32,
                         kv_end: Int32, mma_tidx: Int32, wg: Int32):
        """Every KV tile for this warpgroup's 64 rows (both MMA warpgroups read every
        stage), FlashAttention-3's order: on its turn a warpgroup issues S = Q K^T of tile
        n, rescales O while it runs, issues O += P V of tile n-1 and hands the turn over
        (ping-pong: its softmax then overlaps the other's GEMMs); S done -> K's release and
        the softmax of tile n (with `softmax_under_pv`, the softmax then K's release, and the
        softmax under the warpgroup's own P V GEMM too); P V done -> P of tile n. Q is
        released after the last S GEMM."""
        tile_n, stages = self.tile_n, self.num_stages
        schedule_barrier = Int32(NamedBarrier.SCHEDULE) + wg
        other_barrier = Int32(NamedBarrier.SCHEDULE) + 1 - wg
        if n_min < n_max:
            # First tile: S only (O is still zero).
            k_state = stage(kv_count, stages)
            pipes.k.consumer_wait(k_state)
            self.fence_gathered_kv()
            acc_S = gemms.qk(k_state)
            warpgroup.wait_group(0)
            pipes.k.consumer_release(k_state)
            score_tile(acc_S, n_block=n_min)
            softmax.update(acc_S, row_scale)
            gemms.rP.store(acc_S.load().to(self.mma_dtype))
            for n_block in cutlass.range(n_min + 1, n_max, unroll=1):
                k_state = stage(kv_count + n_block - n_min, stages)
                v_state = stage(kv_count + n_block - n_min - 1, stages)
                pipes.k.consumer_wait(k_state)
                self.fence_gathered_kv()
                cute.arch.barrier(barrier_id=schedule_barrier,
                                  number_of_threads=self.num_mma_threads)
                acc_S = gemms.qk(k_state)
                rescale_rows(acc_O, row_scale)  # no wgmma holds O now
                pipes.v.consumer_wait(v_state)
                gemms.pv(acc_O, v_state)
                cute.arch.barrier_arrive(barrier_id=other_barrier,
                                         number_of_threads=self.num_mma_threads)
                warpgroup.wait_group(1)  # S done; P V still running
                if const_expr(not self.cfg.softmax_under_pv):
                    pipes.k.consumer_release(k_state)
                score_tile(acc_S, n_block=n_block)
                softmax.update(acc_S, row_scale)
                if const_expr(self.cfg.softmax_under_pv):
                    # ptxas hoists a wgmma wait up to the mbarrier arrive before it: K
                    # released on a test of the row sums (always true) keeps every exp2 of
                    # this softmax ahead of the P V wait, under this warpgroup's P V GEMM.
                    if softmax.summed():
                        pipes.k.consumer_release(k_state)
                warpgroup.wait_group(0)  # P V done: rP is free
                pipes.v.consumer_release(v_state)
                gemms.rP.store(acc_S.load().to(self.mma_dtype))
        if const_expr(not self.cfg.q_in_registers):
            # Every S GEMM of this warpgroup has completed: the producer may refill sQ.
            pipes.q.consumer_release(q_state)
        if n_min < n_max:
            # Last tile's P V.
            rescale_rows(acc_O, row_scale)
            v_state = stage(kv_count + n_max - 1 - n_min, stages)
            pipes.v.consumer_wait(v_state)
            if const_expr(self.tma_kv and not self.fp8):
                # TMA boxes bring whole page pieces: slots past kv_len may hold garbage
                # (NaN), and P = 0 times NaN is NaN, so zero those V rows (the fp8
                # converters write them as zeros).
                if n_max * tile_n > kv_end:
                    self.zero_v_tail(sV[None, None, v_state.index],
                                     kv_end - (n_max - 1) * tile_n, mma_tidx, wg, Int32(0))
            self.fence_gathered_kv()
            gemms.pv(acc_O, v_state)
            warpgroup.wait_group(0)
            pipes.v.consumer_release(v_state)

    @cute.jit
    def mainloop_decode(self, gemms: WarpgroupGemms, acc_O: cute.Tensor,
                        softmax: OnlineSoftmax, row_scale: cute.Tensor, score_tile, sV,
                        pipes: Pipelines, q_state, kv_count: Int32, n_min: Int32, n_max: Int32,
                        kv_end: Int32, mma_tidx: Int32, wg: Int32):
        """Every other KV tile (from n_min + wg) for all the item's rows; the other MMA
        warpgroup takes the rest, and the owner releases a stage for both. No overlap
        within a tile: memory-bound work gains nothing from it, and releasing V right
        after its P V lets the producer refill the stage a tile earlier."""
        tile_n = self.tile_n
        for n_block in cutlass.range(n_min + wg, n_max, 2, unroll=1):
            # (marked warp-uniform: ptxas did not carry it through this loop, and kept the
            # stage index and the wgmma descriptors in vector registers)
            kv_state = stage(cute.arch.make_warp_uniform(kv_count + n_block - n_min),
                             self.num_stages)
            pipes.k.consumer_wait(kv_state)
            self.fence_gathered_kv()
            acc_S = gemms.qk(kv_state)
            warpgroup.wait_group(0)
            self.release(pipes.k, kv_state, 2)
            score_tile(acc_S, n_block=n_block)
            softmax.update(acc_S, row_scale)
            gemms.rP.store(acc_S.load().to(self.mma_dtype))  # S dies here, before O is rescaled
            rescale_rows(acc_O, row_scale)
            pipes.v.consumer_wait(kv_state)
            if const_expr(self.tma_kv and not self.fp8):
                if (n_block + 1) * tile_n > kv_end:  # the page tail: see mainloop_prefill
                    self.zero_v_tail(sV[None, None, kv_state.index], kv_end - n_block * tile_n,
                                     mma_tidx, wg, Int32(1))
            self.fence_gathered_kv()
            gemms.pv(acc_O, kv_state)
            warpgroup.wait_group(0)
            self.release(pipes.v, kv_state, 2)
        if const_expr(not self.cfg.q_in_registers):
            pipes.q.consumer_release(q_state)

    @cute.jit
    def score_tile(self, acc_S: cute.Tensor, n_block: Int32, mask_tile, mask_from: Int32,
                   mask_until: Int32, mParams: cute.Tensor, mKScale: Optional[cute.Tensor],
                   kv_head: Int32, col_offset: Int32 = 0,
                   tanh_scale: Optional[Float32] = None):
        """Scores of KV tile `n_block` before the softmax: soft-capped (a variant's flag),
        then masked if the tile holds a key some row must not see (tiles >= mask_from on
        the right, < mask_until left of a window). `acc_S` holds the tile's keys from
        `col_offset` on (a warp's share on the warp-level decode path, which also gives
        its own `tanh_scale`: its raw scores are scaled)."""
        if const_expr(self.cfg.softcap):
            # (an L1 hit, not a register held through the mainloop; an fp8 cache's
            # k_scale goes inside the tanh with sm_scale)
            if const_expr(tanh_scale is None):
                tanh_scale = self.k_scaled(mParams[Param.SOFTCAP_SCALE], mKScale, kv_head)
            softcap_scores(acc_S, tanh_scale)
        if self.needs_mask(n_block, mask_from, mask_until):
            mask_tile(acc_S, col_start=n_block * self.tile_n + col_offset)

    @cute.jit
    def mask_tile(self, acc_S: cute.Tensor, tScS: cute.Tensor, plan: PlanTensors, i: Int32,
                  wg: Int32, col_start: Int32):
        """Mask S of the KV tile at `col_start` for this warpgroup's rows of item `i`."""
        # (i marked warp-uniform: the loads' addresses then sit in uniform registers, which
        # the warp-level decode path's masked tiles need: at 192 registers it spilled 8 bytes)
        item = WorkItem.load(plan, cute.arch.make_warp_uniform(i), self.cfg.shared_prefix)
        row_offset = wg * WG_ROWS * (1 - Int32(item.is_decode))
        self.mask_scores(acc_S, tScS, item, row_offset, col_start, plan.mIParams)

    @cute.jit
    def raw_score_scales(self, softmax: OnlineSoftmax, mParams: cute.Tensor,
                         mKScale: cute.Tensor, kv_head: Int32, q_up: Float32):
        """(the item's softmax, the tanh's scale or None) for raw scores Q' K8^T of an fp8
        cache, Q' = Q / q_up: k_scale and q_up fold into the softmax's scale, or with a
        soft cap into the tanh's (`score_tile`; one register through the loop). q_up is
        recovered from them after (`lse_logit_scale`: a power of two, so exactly)."""
        if const_expr(self.cfg.softcap):
            return softmax, self.k_scaled(mParams[Param.SOFTCAP_SCALE], mKScale,
                                          kv_head) * q_up
        return OnlineSoftmax(softmax.row_max, softmax.row_sum,
                             self.k_scaled(softmax.scale_log2, mKScale, kv_head) * q_up), None

    @cute.jit
    def lse_logit_scale(self, mParams: cute.Tensor, mKScale: Optional[cute.Tensor],
                        kv_head: Int32, softmax: OnlineSoftmax, item_softmax: OnlineSoftmax):
        """Raw scores -> logits, for the LSE: sm_scale (soft-capped: the cap, the tanh
        took the rest), times an fp8 cache's k_scale and q_up, the power of two the
        queries were scaled down by (recovered from the item's softmax scale, which
        holds both: exactly). Re-read rather than held through the mainloop."""
        logit_scale = mParams[self.logit_param]
        if const_expr(self.fp8 and not self.cfg.softcap):
            q_up = item_softmax.scale_log2 / self.k_scaled(softmax.scale_log2, mKScale, kv_head)
            logit_scale = self.k_scaled(logit_scale, mKScale, kv_head) * q_up
        return logit_scale

    @cute.jit
    def kv_scale(self, mScale: cute.Tensor, kv_head: Int32) -> Float32:
        """An fp8 cache's dequantisation scale for `kv_head`: the tensor holds one per KV
        head or one for all (an L1 hit, re-read where it is used)."""
        return mScale[cutlass.min(kv_head, cute.size(mScale) - 1)]

    @cute.jit
    def k_scaled(self, scale: Float32, mKScale: Optional[cute.Tensor], kv_head: Int32):
        """A factor applied to raw scores, times an fp8 cache's k_scale: raw scores are
        Q K8^T, and S = (Q K8^T) k_scale is linear in it (exact up to one rounding). The
        factor itself without an fp8 cache."""
        if const_expr(self.fp8):
            return scale * self.kv_scale(mKScale, kv_head)
        return scale

    @cute.jit
    def fence_gathered_kv(self):
        """cp.async wrote the K/V stage through the generic proxy; wgmma reads it via the
        async one. TMA writes through the async proxy, and the fp8 converters fence their
        own stores: nothing to order."""
        if const_expr(not self.tma_kv and not self.fp8):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def release(self, pipe, state, count: Int32):
        """Release a K/V stage `count` times: 1 when every MMA warpgroup reads it, 2 when
        its decode owner releases for both (the other never waits on it)."""
        pipe.consumer_release(state)
        if count > 1:
            pipe.consumer_release(state)

    @cute.jit
    def zero_v_tail(self, sX: cute.Tensor, first_row: Int32, mma_tidx: Int32, wg: Int32,
                    decode: Int32):
        """Zero rows [first_row, tile_n) of a (tile_n, D) V stage before P V reads it: both
        MMA warpgroups together when both read the stage (prefill), else its owner."""
        d = self.head_dim
        if decode != 0:
            for i in cutlass.range(first_row * d + mma_tidx % WARPGROUP_THREADS,
                                   self.tile_n * d, WARPGROUP_THREADS, unroll=1):
                sX[i // d, i % d] = self.dtype(0.0)
            # Each writer orders its zeros for the async proxy (wgmma) before the barrier.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=Int32(NamedBarrier.WARPGROUP) + wg,
                              number_of_threads=WARPGROUP_THREADS)
        else:
            for i in cutlass.range(first_row * d + mma_tidx, self.tile_n * d,
                                   self.num_mma_threads, unroll=1):
                sX[i // d, i % d] = self.dtype(0.0)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=NamedBarrier.MMA, number_of_threads=self.num_mma_threads)

    @cute.jit
    def combine_decode(self, softmax: OnlineSoftmax, acc_O: cute.Tensor, sScratch: cute.Tensor,
                       pipeline_combine: pipeline.PipelineAsync, num_decode: Int32, tidx: Int32,
                       wg: Int32):
        """Warpgroup 1 hands its (row max, partial row sums, O) to warpgroup 0 through
        shared memory, thread t to thread t (same fragment positions); warpgroup 0 folds
        them into its own. O goes over in `combine_rounds` chunks of columns (the scratch
        holds one; the row statistics travel with the first). Round j of the hand-over is
        use num_decode * rounds + j of a one-stage mbarrier pipeline (num_decode: the
        item's ordinal among its CTA's decode items, from the plan: a counter held in
        registers would spill): warpgroup 1 acquires the scratch, writes and commits;
        warpgroup 0 waits and reads. Warpgroup 0 releases the scratch at the start of
        every round, its first included: the scratch is also its O staging tile, so the
        release says "my stores of every earlier item and my reads of the previous round
        are done". Warpgroup 1's acquire of use u waits for the (u+1)-th release (its
        producer state counts from 1: the first decode item of a list may follow prefill
        items whose O warpgroup 0 is still staging, while warpgroup 1, with no rows in
        the last prefill tile and no KV tile in the decode item, is already here)."""
        rounds = self.cfg.combine_rounds
        acc_O_mn = rows_cols_view(acc_O)
        cols = cute.size(acc_O_mn, mode=[1]) // rounds
        # (allocated here: a value first made inside the runtime branch cannot leave it)
        scale_self = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        scale_other = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        for j in cutlass.range_constexpr(rounds):
            use = num_decode * rounds + j
            if wg == 1:
                state = stage(use + 1, 1, producer=True)
                pipeline_combine.producer_acquire(state)
                stash_state(sScratch, tidx, softmax, acc_O_mn, j, cols)
                pipeline_combine.producer_commit(state)
            else:
                # Done with the previous use and every O staging since (or, before the
                # first use, every O staging of the list's earlier items).
                pipeline_combine.consumer_release(stage(use, 1))
                pipeline_combine.consumer_wait(stage(use, 1))
                fold_state(sScratch, tidx, softmax, acc_O_mn, j, cols, scale_self,
                           scale_other)

    @cute.jit
    def fold_warps(self, softmax: OnlineSoftmax, acc_O: cute.Tensor, sScratch: cute.Tensor,
                   tidx: Int32):
        """Warpgroup 0 after the combine of a warp-level decode item: warps 1-3 hand their
        states to warp 0 through the scratch (which warpgroup 0 holds from the combine's
        wait until its next release), each thread in its own column
        (`combine.fold_warps`)."""
        fold_warps(softmax, rows_cols_view(acc_O), sScratch, tidx, self.cfg.combine_rounds,
                   NamedBarrier.WARPGROUP)

    @cute.jit
    def warp_decodes(self, item: WorkItem) -> Int32:
        """1 if `item` takes the warp-level fp8 decode path (a `warp_decode` variant's
        decode item of at most ITEM_ROWS packed rows), else 0."""
        fits = Int32(item.row_end - item.row_start <= ITEM_ROWS)
        return Int32(item.is_decode) * fits

    @cute.jit
    def decode_item_warp(self, io: PodTensors, plan: PlanTensors, i: Int32, kv_count: Int32,
                         n_min: Int32, n_max: Int32, mask_from: Int32, mask_until: Int32,
                         softmax: OnlineSoftmax, row_scale: cute.Tensor, acc_O: cute.Tensor,
                         sQ: cute.Tensor, sK8w: cute.Tensor, sV8w: cute.Tensor,
                         sScratch: cute.Tensor, pipes: Pipelines, tidx: Int32, wg: Int32):
        """Decode item i on warp-level MMAs: each warpgroup takes every other KV tile (from
        n_min + wg, as on wgmma), each of its warps 16 of the tile's rows with every one
        of the item's rows, reading the fp8 stages itself (the converters' empty 16-bit
        commit is its go-ahead; kernels/decode_fp8.py). Then the warps' softmax states
        and O fold together, warpgroup 1's into warpgroup 0's (`combine_decode`, the same
        hand-over as on wgmma: both accumulators give a thread 2 rows of 32 values, and
        row r is register 4 k + 2 r + v either way), then warps 1-3's into warp 0's, which
        writes the rows."""
        tile_n = self.tile_n
        # (the lane's stage addresses are computed per item, not hoisted out of the item
        # loop, where they would hold registers through the wgmma paths too)
        lane = kept_in_loop(tidx % 32)
        dec = Fp8WarpDecode(self.cfg.kv_dtype, self.cfg.dtype)
        tiled_mma = dec.tiled_mma()
        thr_mma = tiled_mma.get_slice(lane)
        m = 2 * ITEM_ROWS  # (the MMAs' M: the item's rows, then zero rows)
        acc_shape_S = thr_mma.partition_shape_C((m, WARP_KV_ROWS))
        tScS = thr_mma.partition_C(cute.make_identity_tensor((m, WARP_KV_ROWS)))
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((m, self.head_dim)))
        acc_O_w = cute.make_tensor(acc_O.iterator, dec.acc_o_layout())  # (the registers of O)
        rP = cute.make_rmem_tensor(acc_shape_S, cutlass.Float16)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a_layout(rP.layout))

        item = WorkItem.load(plan, i, self.cfg.shared_prefix)
        q_state = stage(i - plan.mCtaPtr[cute.arch.block_idx()[0]], 1)  # (consume waited)
        tSrQ, q_up = dec.load_q(sQ, lane)
        pipes.q.consumer_release(q_state)  # Q is in registers: the next item's may load
        softmax.reset()
        acc_O.fill(0.0)
        item_softmax, tanh_scale = self.raw_score_scales(softmax, plan.mParams, io.mKScale,
                                                         item.kv_head, q_up)
        mask_tile = partial(self.mask_tile, tScS=tScS, plan=plan, i=i, wg=wg)
        for n_block in cutlass.range(n_min + wg, n_max, 2, unroll=1):
            # (re-derived each tile rather than held: the MMA warps run at their limit)
            row0 = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 * WARP_KV_ROWS
            count = kv_count + n_block - n_min
            kv_state = stage(count, self.num_stages)
            s8 = stage(count, self.cfg.fp8_stages)
            pipes.k.consumer_wait(kv_state)  # the converters' go-ahead (no data)
            pipes.k8.consumer_wait(s8)  # (complete already: orders the TMA's writes)
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            dec.scores(tiled_mma, acc_S, tSrQ, sK8w[None, None, s8.index].iterator.toint(),
                       row0, lane)
            pipes.k8.consumer_release(s8)
            self.release(pipes.k, kv_state, 2)
            self.score_tile(acc_S, n_block, mask_tile, mask_from, mask_until, plan.mParams,
                            io.mKScale, item.kv_head, row0, tanh_scale)
            item_softmax.update(acc_S, row_scale)
            rP.store(acc_S.load().to(cutlass.Float16))
            rescale_rows(acc_O_w, row_scale)
            pipes.v.consumer_wait(kv_state)
            pipes.v8.consumer_wait(s8)
            dec.accumulate(tiled_mma, acc_O_w, tOrP, sV8w[None, None, s8.index].iterator.toint(),
                           row0, plan.mWork[i, WorkCol.KV_END] - n_block * tile_n, lane)
            pipes.v8.consumer_release(s8)
            self.release(pipes.v, kv_state, 2)

        item = WorkItem.load(plan, i, self.cfg.shared_prefix)
        self.combine_decode(item_softmax, acc_O, sScratch, pipes.combine, item.decode_index,
                            tidx, wg)
        if wg == 0:
            self.fold_warps(item_softmax, acc_O, sScratch, tidx)
            if tidx < 32:
                inv_sum, lse = softmax.finalize(
                    self.lse_logit_scale(plan.mParams, io.mKScale, item.kv_head, softmax,
                                         item_softmax),
                    self.row_sinks(io.mSinks, tOcO, item, Int32(0)))
                v_scale = self.kv_scale(io.mVScale, item.kv_head)
                for r in cutlass.range_constexpr(cute.size(inv_sum)):
                    inv_sum[r] = inv_sum[r] * v_scale
                rescale_rows(acc_O, inv_sum)
                n_rows = item.row_end - item.row_start
                if item.split_slot >= 0:
                    dec.store_o(acc_O_w, layouts.partial_rows(plan.mPartialO, item.split_slot),
                                Int32(item.partial_row), n_rows, lane)
                    store_lse(lse, tOcO, layouts.partial_lse(plan.mPartialLSE, item.split_slot),
                              Int32(item.partial_row), n_rows, lane)
                else:
                    dec.store_o(acc_O_w, layouts.packed_rows(io.mO, item.q_start, item.q_len,
                                                             item.kv_head, self.group),
                                item.row_start, n_rows, lane)
                    if const_expr(io.mLSE is not None):
                        store_lse(lse, tOcO, layouts.packed_lse(io.mLSE, item.q_start, item.q_len,
                                                                item.kv_head, self.group),
                                  item.row_start, n_rows, lane)

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        thr_mma_pv: cute.ThrMma,
        tOcO: cute.Tensor,
        sStage: cute.Tensor,
        item: WorkItem,
        row_offset: Int32,
        io: PodTensors,
        plan: PlanTensors,
        tidx: Int32,
    ):
        """Write this warpgroup's rows of O and LSE: tile row `r` is packed row
        `row_start + row_offset + r` of the item (`epilogue.py`)."""
        n_rows = item.row_end - item.row_start
        if item.split_slot >= 0:
            store_partial(acc_O, lse, tOcO, plan.mPartialO, plan.mPartialLSE, item.split_slot,
                          row_offset, n_rows, tidx, item.partial_row)
        else:
            row_base = item.row_start + row_offset
            n_valid = n_rows - row_offset
            if const_expr(io.mLSE is not None):
                gLSE = layouts.packed_lse(io.mLSE, item.q_start, item.q_len, item.kv_head,
                                          self.group)
                store_lse(lse, tOcO, gLSE, row_base, n_valid, tidx)
            gO = layouts.packed_rows(io.mO, item.q_start, item.q_len, item.kv_head, self.group)
            # (the warpgroup index again from the warp: a register held since the kernel's
            # start would be spilled)
            wg_u = (cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
                    - self.cfg.num_producer_warpgroups)
            if const_expr(self.cfg.o_staging):
                store_rows(acc_O, thr_mma_pv, sStage, gO, row_base, n_valid,
                           Int32(NamedBarrier.WARPGROUP) + wg_u, self.cfg.vo_io)
            else:
                store_fragments(acc_O, tOcO, gO, row_base, n_valid, self.cfg.vo_io)
