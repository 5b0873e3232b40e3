"""The one kernel configuration: every static choice the planner, the compile key, launch
and the kernel share, chosen in one place (:meth:`KernelConfig.select`).

No torch and no cutlass here, so the host planner can import it cheaply (a check that
needs a kernel family's own facts imports its class on first use: `kernel_class`). A
variant is one `KernelConfig`; everything per batch (lengths, pages, scales) is runtime
data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The head dims of the compiled tiles. A caller's head dim may be any multiple of 8 up to
# 256 (`HEAD_DIM_STEP`, `MAX_HEAD_DIM`): it runs on the next tile (`tile_head_dim`), its
# missing columns zero in shared memory and never stored (`KernelConfig.head_dim_io`).
# Values may be narrower or wider than queries and keys (DeepSeek's prefill: 192 / 128):
# the tile serves the wider of the two (`KernelConfig.head_dim_vo`).
SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
HEAD_DIM_STEP, MAX_HEAD_DIM = 8, 256
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # powers of two: the kernel takes log2
# sm_90a: the Hopper kernel (wgmma, TMA, setmaxnreg; pod_fwd_sm90.py). The others: the
# warp-level mma.sync kernel (pod_fwd_sm80.py) for Ampere, Ada and consumer Blackwell,
# and plain sm_90, the same instructions on Hopper (the portable kernel, forced by
# option: PODAttention(arch="sm_90") or PODCUTE_ARCH=sm_90).
SUPPORTED_ARCHS = ("sm_90a", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120a")
WARP_MMA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120a")
# Shared memory per SM and the most one CTA may opt into (bytes), per architecture.
ARCH_SMEM = {"sm_80": (164 * 1024, 163 * 1024), "sm_86": (100 * 1024, 99 * 1024),
             "sm_89": (100 * 1024, 99 * 1024), "sm_90": (228 * 1024, 227 * 1024),
             "sm_90a": (228 * 1024, 227 * 1024), "sm_120a": (100 * 1024, 99 * 1024)}
# Shared memory the CUDA runtime reserves for each resident CTA, out of the SM's.
CTA_RESERVED_SMEM = 1024
# Where the warp-level kernel cuts prefill into 128-row items (two 16-row blocks a warp)
# when their Q tile fits: measured on the H200 (plain sm_90) only. Elsewhere the 64-row
# kernel compiles without a spill where the 128-row variants spill a few words.
WIDE_PREFILL_ARCHS = ("sm_90",)
# Head dims of the warp-level kernel (its O accumulator of 64 x D over 128 threads: D 256
# would take 128 registers a thread for O alone).
WARP_HEAD_DIMS = (64, 96, 128)
SUPPORTED_DTYPES = ("bfloat16", "float16")
# KV cache element types besides q's own: fp8 caches are dequantised in shared memory to
# fp16, the MMAs' type (kv_dtype "" means the cache is in q's dtype).
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_HEAD_DIMS = (64, 96, 128, 256)


def check_fp8_kv(head_dim: int, kv_dtype: str) -> None:
    """ValueError naming what is wrong (NotImplementedError for a head dim it lacks)
    unless an fp8 cache of `kv_dtype` can serve `head_dim` (KernelConfig.select and the API's constructor, before any device check)."""
    if kv_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {FP8_KV_DTYPES}, got {kv_dtype!r}")
    if head_dim not in FP8_HEAD_DIMS:
        # (the tiles' own widths: a narrower head dim on an fp8 cache would have TMA boxes
        # wider than the cache's rows, which no GPU run has checked yet)
        raise NotImplementedError(f"fp8 KV caches at head_dim {head_dim} are not supported by "
                                  f"podcute (supported: head_dim in {FP8_HEAD_DIMS})")


def tile_head_dim(head_dim: int) -> int:
    """The compiled head dim (a tile of SUPPORTED_HEAD_DIMS) that serves a caller's
    `head_dim`, the smallest at least as wide; ValueError unless `head_dim` is a multiple
    of HEAD_DIM_STEP up to MAX_HEAD_DIM (the one rule: checks.check_head_dim asks it)."""
    if (type(head_dim) is not int or head_dim % HEAD_DIM_STEP
            or not 0 < head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"head_dim must be a multiple of {HEAD_DIM_STEP} up to "
                         f"{MAX_HEAD_DIM}, got {head_dim}")
    return min(t for t in SUPPORTED_HEAD_DIMS if t >= head_dim)


def arch_head_dims(arch: str) -> tuple:
    """The head dims `arch`'s kernel serves."""
    return WARP_HEAD_DIMS if arch in WARP_MMA_ARCHS else SUPPORTED_HEAD_DIMS


# Features a variant may carry, as named in a feature spec ("window+sinks"): the
# KernelConfig flag of each. The model features, and the second K/V sources: "ragged"
# (`ragged_kv`, FlashInfer's legacy POD wrapper) and "cache2" (`second_cache`, its BatchPOD
# wrapper with separate prefill and decode caches).
FEATURES = {"window": "window", "softcap": "softcap", "sinks": "has_sinks",
            "ragged": "ragged_kv", "cache2": "second_cache", "shared": "shared_prefix"}

WARPGROUP_THREADS = 128
# Hopper: 227 KB of shared memory per CTA (opt-in), 64K 32-bit registers per SM.
SMEM_BYTES_PER_SM = 227 * 1024
REGISTERS_PER_SM = 64 * 1024


def feature_flags(spec: str) -> dict:
    """KernelConfig flags of a feature spec: "" (none) or names joined by "+"
    ("window+sinks"); ValueError for an unknown name. KernelConfig.features inverts it."""
    names = [n for n in spec.split("+") if n]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}: features are {tuple(FEATURES)}, "
                         "joined by '+'")
    return {flag: name in names for name, flag in FEATURES.items()}


@dataclass(frozen=True)
class KernelConfig:
    """Static facts of one compiled kernel variant.

    Tiling (fixed per arch / dtype / head_dim; the planner cuts work with these):
      * ``tile_m_prefill``: packed rows of a prefill item, ``num_mma_warpgroups`` x 64
        (each MMA warpgroup owns 64 rows and both share every K/V stage);
      * ``tile_m_decode``: packed rows of a decode item (one warpgroup's rows; the two
        MMA warpgroups take alternate KV tiles of the item and combine at the end);
      * ``tile_n``: KV tokens per pipeline stage; ``num_stages``: K/V pipeline depth;
      * ``ctas_per_sm`` and the ``setmaxnreg`` split between the producer warpgroup and
        the MMA warpgroups.
    Feature flags (per variant): GQA group, causal, LSE output, page class (``kv_box``:
    the KV rows of one TMA box: 128 when pages hold whole KV tiles, 16 for pages of 16,
    32 or 64 tokens (one box per 16 slots of a page); 0 for pages of 1-8 tokens, whose
    rows a cp.async gather resolves), and the model features: ``window`` (a sliding
    window whose bounds the kernel reads from the plan), ``softcap`` (tanh soft-capping of
    the logits, its cap from the plan) and ``has_sinks`` (a per-head sink logit tensor).
    Each feature off compiles to exactly the code without it.
    """

    arch: str
    dtype: str
    head_dim: int
    group: int
    causal: bool
    has_lse: bool
    kv_box: int
    tile_m_prefill: int
    tile_m_decode: int
    tile_n: int
    num_stages: int
    num_mma_warpgroups: int
    ctas_per_sm: int
    producer_regs: int
    mma_regs: int
    window: bool = False
    softcap: bool = False
    has_sinks: bool = False
    # Shared-memory economies of head_dim 256 (whose Q and K/V stages take 192 KB): the
    # decode combine hands O over in `combine_rounds` column chunks, and without
    # `o_staging` the epilogue stores O fragments directly. The warp-level kernel's fold of
    # a key-split item's warps goes in `combine_rounds` chunks too: as few as its K
    # stages, the fold's scratch, hold.
    combine_rounds: int = 1
    o_staging: bool = True
    # fp8 KV cache ("" = the cache is in q's dtype): TMA (or the gather) brings fp8 tiles
    # into `fp8_stages` staging stages; the producer warps that issue no copies convert
    # each into the 16-bit stage the MMA warpgroups read (kernels/dequant.py).
    kv_dtype: str = ""
    fp8_stages: int = 0
    # A second K/V source (FlashInfer's legacy POD wrapper: one prefill over contiguous
    # ragged K/V beside a paged decode batch, in one launch): request 0 of the plan reads
    # its K/V rows from the ragged tensors, seen as one page holding its tokens
    # (layouts.ragged_locate); every other request reads the paged cache.
    ragged_kv: bool = False
    # A second paged cache (FlashInfer's BatchPOD with separate prefill and decode caches,
    # in one launch): requests [0, IParam.SECOND_CACHE_REQUESTS) of the plan read their
    # K/V from it, through the same page table and page size; the others from the first.
    second_cache: bool = False
    # Shared prefixes read once (planning/sharing.py): the plan's requests from
    # IParam.VIRTUAL_REQUESTS on are prefix tiles whose query rows come from several
    # requests (a token list), a sharer's own pieces write partials at a row offset, and
    # merges take prefix terms (metadata.MergeCol).
    shared_prefix: bool = False
    # The caller's head dim where it is narrower than the tile's (`head_dim`): its rows
    # fill the first `head_dim_io` columns of each tile, the rest stay zero in shared
    # memory (never copied, so Q K^T and P V see zeros there) and are never stored. 0: the
    # caller's head dim is the tile's.
    head_dim_io: int = 0
    # The columns of V and out rows where they differ from those of q and K (a value head
    # dim of its own, e.g. 192 / 128): V rows fill the first `head_dim_vo` columns of each
    # V tile (the rest zero, so P V's columns past it are zeros, never stored), and out,
    # the partials' merges and the LSE-merged rows have that many. 0: q's head dim.
    head_dim_vo: int = 0
    # Decode items copy K/V with an L2 evict-first policy (their rows are read once in the
    # launch), so that streaming them does not push out the K/V of the batch's prefill
    # requests, which each row tile of a request reads again (docs/notes/l2-hint.md,
    # measured 2026-12-05 on 8d3e745: 3-13 % off the mixed batches on an H100, both kernels).
    # The warp-level kernel: its items of <= 16 rows; sm_90a: its decode items (every
    # gathered copy carries a policy, evict-normal for prefill items).
    decode_kv_evict_first: bool = True
    # sm_90a prefill loop: K's stage released behind a test of the row sums, so that ptxas
    # cannot hoist the P V wait above the softmax's exp2s: the warpgroup's softmax then runs
    # under its own P V GEMM (docs/notes/sm90a-kernel.md). select() turns it on where it
    # measured faster: 16-bit caches with 128- and 256-column tiles (F1 4-10 % on an H100);
    # at D 64 it measured 2-5 % slower (there the exp2s take about as long as the GEMMs),
    # and D 96 and fp8 caches are unmeasured ($PODCUTE_TEST_SOFTMAX_UNDER_PV=0 / 1 overrides it,
    # podcute.testing.kernel_flags).
    softmax_under_pv: bool = False

    # ---- derived ----------------------------------------------------------------------

    @property
    def elem_bytes(self) -> int:
        return 2

    @property
    def io_dim(self) -> int:
        """The caller's query-key head dim: the columns of q and K rows."""
        return self.head_dim_io or self.head_dim

    @property
    def vo_dim(self) -> int:
        """The caller's value head dim: the columns of V and out rows."""
        return self.head_dim_vo or self.io_dim

    @property
    def pv_cols(self) -> int:
        """Columns of O the P V GEMM computes: the tile's, or on a wide tile (D 256, direct
        O stores) with a narrower value head dim the 64-column blocks that hold it (192 /
        128: 128, half the MMAs and half the O accumulator). Narrower tiles keep the whole
        width (their O staging and combine are laid out for it; the MMAs saved are few)."""
        if (self.head_dim_vo and not self.o_staging and self.arch not in WARP_MMA_ARCHS):
            return min(self.head_dim, -(-self.vo_dim // 64) * 64)
        return self.head_dim

    @property
    def qk_blocks(self) -> int:
        """k16 blocks of the sm_90a S GEMM that hold the caller's query-key columns (the
        rest are zero in both operands: skipped). The warp-level kernel runs them all:
        skipped there, its 128-row variant at D 72 spilled 4 bytes."""
        return -(-self.io_dim // 16)

    @property
    def mma_cols(self) -> tuple[int, int]:
        """Columns of MMA work a key: (Q K^T's, P V's). The tile's on the warp-level
        kernel; sm_90a skips zero k-blocks and narrows P V (qk_blocks, pv_cols)."""
        if self.arch in WARP_MMA_ARCHS:
            return self.head_dim, self.head_dim
        return 16 * self.qk_blocks, self.pv_cols

    @property
    def vo_io(self) -> int:
        """vo_dim where the tile is wider, else 0 (the stores' "every column")."""
        return 0 if self.vo_dim == self.head_dim else self.vo_dim

    @property
    def fp8(self) -> bool:
        return bool(self.kv_dtype)

    @property
    def warp_decode(self) -> bool:
        """fp8 decode items of at most `decode_fp8.ITEM_ROWS` packed rows run on warp-level
        MMAs that read the fp8 staging straight into registers (kernels/decode_fp8.py):
        TMA pages (a 128-byte-swizzled staging) at head_dim 128. Larger decode items and
        prefill items take the converters and wgmma."""
        return self.fp8 and self.tma_kv and self.head_dim == 128

    @property
    def mma_dtype(self) -> str:
        """The MMAs' operand type: q's, or fp16 beside an fp8 cache (fp8 -> fp16 is one
        instruction a pair, -> bf16 five; bf16 queries are scaled into fp16's range)."""
        return "float16" if self.fp8 else self.dtype

    @property
    def q_in_registers(self) -> bool:
        """S = Q K^T takes Q from registers (an RS wgmma; each MMA warpgroup loads its rows
        once per item and frees the Q stage at once): fp8 variants. Their 64-token tiles
        make an SS m64n64k16 wgmma read 4 KB of shared memory per 32 tensor-core cycles,
        the whole 128 B/clk an SM has, and the TMA writes and the converters' reads and
        writes (48 KB a tile) come on top; Q from registers takes 32 of the 160 KB a
        64-token tile moves. The two-stage warp-level kernel too (each warp loads its 16
        rows' fragments at an item's first tile): every warp of it reads a tile's whole
        K and V, so Q is 16 of the 176 KB of shared memory a 64-token tile costs a CTA,
        and the registers it takes are those the two-stage loop freed. Not fp8 at D 256:
        there Q's 64 registers beside O's 128 exceed what a thread has; its MMA
        warpgroups convert their Q rows to fp16 in shared memory instead
        (`dequant.q_tile_to_fp16`) and read them there."""
        return (self.fp8 and self.head_dim <= 128) or (self.warp_mma and self.num_stages > 1)

    @property
    def warp_mma(self) -> bool:
        """The warp-level (mma.sync) kernel: no producer warpgroup, every warp copies and
        computes; else the sm_90a kernel."""
        return self.arch in WARP_MMA_ARCHS

    @property
    def num_producer_warpgroups(self) -> int:
        """Producer warpgroups: an fp8 variant's second converter group needs a second,
        except at D 256, whose m64n256 P V wgmma takes 158 registers: ptxas compiles the
        whole kernel under the launch cap (128 a thread at 512 threads; setmaxnreg does
        not lift it), so D 256 keeps 384 threads (168) and one converter group. The
        warp-level kernel has none."""
        if self.warp_mma:
            return 0
        return 2 if self.fp8 and self.head_dim <= 128 else 1

    @property
    def num_producer_threads(self) -> int:
        """Threads of the producer warpgroups (thread ids 0 .. this; the MMA warpgroups
        follow)."""
        return self.num_producer_warpgroups * WARPGROUP_THREADS

    @property
    def num_mma_threads(self) -> int:
        return self.num_mma_warpgroups * WARPGROUP_THREADS

    @property
    def num_threads(self) -> int:
        return self.num_mma_threads + self.num_producer_threads

    @property
    def partial_rows(self) -> int:
        """Rows of one split-KV partial slot: the largest item."""
        return max(self.tile_m_prefill, self.tile_m_decode)

    @property
    def combine_chunk(self) -> int:
        """O values per thread in one round of the decode combine (the warp-level kernel's
        fold: a warp's 16 x D over its 32 lanes, the same D / 2 values a thread)."""
        return self.tile_m_decode * self.head_dim // WARPGROUP_THREADS // self.combine_rounds

    @property
    def combine_floats(self) -> int:
        """fp32 words of the decode-combine scratch: per thread of a warpgroup, one round's
        chunk of its O fragment (tile_m_decode x D / 128 in all) and its 2 row maxima + 2
        partial row sums."""
        return WARPGROUP_THREADS * (self.combine_chunk + 4)

    def kernel_class(self):
        """The kernel family that builds this configuration: the warp-level kernel
        (`pod_fwd_sm80.PodAttentionSm80`) or the sm_90a one (`pod_fwd_sm90`). Imported on
        first use (it brings in cutlass)."""
        if self.warp_mma:
            from podcute.kernels.pod_fwd_sm80 import PodAttentionSm80
            return PodAttentionSm80
        from podcute.kernels.pod_fwd_sm90 import PodAttentionSm90
        return PodAttentionSm90

    def smem_bytes(self) -> int:
        """Shared memory of one CTA: the kernel family's own accounting of its
        SharedStorage (`smem_bytes` of the kernel class)."""
        return self.kernel_class().smem_bytes(self)

    def can_implement(self) -> tuple[bool, str]:
        """(True, "") if this configuration is buildable, else (False, why): what every
        kernel needs, then what its kernel family needs (`can_implement` of the kernel
        class: tiles, stages, shared memory, registers)."""
        if self.arch not in SUPPORTED_ARCHS:
            return False, f"arch {self.arch} (supported: {', '.join(SUPPORTED_ARCHS)})"
        if self.dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {self.dtype} (supported: {SUPPORTED_DTYPES})"
        if self.group < 1:
            return False, f"group {self.group} must be >= 1"
        if self.head_dim_io and (self.head_dim_io % HEAD_DIM_STEP
                                 or not 0 < self.head_dim_io < self.head_dim):
            return False, (f"head_dim_io {self.head_dim_io} must be a multiple of "
                           f"{HEAD_DIM_STEP} below the tile's head_dim {self.head_dim}")
        if self.head_dim_vo and (self.head_dim_vo % HEAD_DIM_STEP
                                 or not 0 < self.head_dim_vo <= self.head_dim
                                 or self.head_dim_vo == self.io_dim):
            return False, (f"head_dim_vo {self.head_dim_vo} must be a multiple of "
                           f"{HEAD_DIM_STEP} up to the tile's head_dim {self.head_dim}, "
                           f"other than the query-key head dim {self.io_dim}")
        if self.head_dim_vo and self.fp8:
            return False, "fp8 KV caches with a value head dim of its own (head_dim_vo)"
        if self.ragged_kv and self.second_cache:
            return False, "one second K/V source: ragged_kv or second_cache, not both"
        if self.shared_prefix and (self.ragged_kv or self.second_cache):
            return False, "shared_prefix: over one paged cache (no second K/V source)"
        # (combine_rounds splits a thread's O columns, D / 4 with 2 rows each in an m64
        # wgmma and an m16 mma.sync accumulator alike, into even chunks)
        o_cols = self.head_dim // 4
        if self.combine_rounds < 1 or o_cols % self.combine_rounds or \
                (o_cols // self.combine_rounds) % 2:
            return False, (f"combine_rounds {self.combine_rounds} must split a thread's "
                           f"{o_cols} O columns into even chunks")
        return self.kernel_class().can_implement(self)

    def launch_regs(self) -> int:
        """Registers per thread at kernel entry (the launch cap setmaxnreg needs)."""
        return REGISTERS_PER_SM // (self.ctas_per_sm * self.num_threads) // 8 * 8

    @property
    def features(self) -> str:
        """The feature spec of this variant ("" without any; feature_flags inverts it)."""
        return "+".join(name for name, flag in FEATURES.items() if getattr(self, flag))

    @property
    def tma_kv(self) -> bool:
        return self.kv_box > 0

    def with_flags(self, **flags) -> "KernelConfig":
        """The same tiling with other per-launch flags (what launch() specialises):
        causal, has_lse, window, softcap, has_sinks, ragged_kv, second_cache; None keeps a
        flag as it is."""
        allowed = ("causal", "has_lse", *FEATURES.values())
        unknown = set(flags) - set(allowed)
        if unknown:
            raise TypeError(f"with_flags: unknown flags {sorted(unknown)} (flags: {allowed})")
        changes = {k: bool(v) for k, v in flags.items() if v is not None}
        return dataclasses.replace(self, **changes)

    # ---- the selector -------------------------------------------------------------------

    @staticmethod
    def select(dtype: str = "bfloat16", head_dim: int = 128, group: int = 1,
               causal: bool = True, has_lse: bool = False, page_size: int = 16,
               arch: str = "sm_90a", *, window: bool = False, softcap: bool = False,
               has_sinks: bool = False, kv_dtype: str = "",
               ragged_kv: bool = False, second_cache: bool = False,
               shared_prefix: bool = False, head_dim_vo: int = 0) -> "KernelConfig":
        """The configuration podcute runs for these facts (raises ValueError if none).
        `kv_dtype`: "" for a cache in q's dtype, else its fp8 type (FP8_KV_DTYPES).
        `ragged_kv`, `second_cache`: the same tiling with a second K/V source (no fp8
        cache); `shared_prefix`: the same tiling, for plans that share prefixes.
        `head_dim_vo`: the value head dim where it differs from `head_dim` (0: the same)."""
        if shared_prefix:
            return KernelConfig.select(
                dtype, head_dim, group, causal, has_lse, page_size, arch, window=window,
                softcap=softcap, has_sinks=has_sinks, kv_dtype=kv_dtype,
                ragged_kv=ragged_kv, second_cache=second_cache, head_dim_vo=head_dim_vo,
            ).with_flags(shared_prefix=True)._checked()
        if ragged_kv or second_cache:
            return KernelConfig.select(
                dtype, head_dim, group, causal, has_lse, page_size, arch, window=window,
                softcap=softcap, has_sinks=has_sinks, kv_dtype=kv_dtype,
                head_dim_vo=head_dim_vo,
            ).with_flags(ragged_kv=ragged_kv, second_cache=second_cache)._checked()
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
        # The compiled tile serves the wider of the query-key and value head dims; a
        # narrower one is the tile's first columns (head_dim_io, head_dim_vo).
        vo = head_dim_vo if head_dim_vo and head_dim_vo != head_dim else 0
        tile = max(tile_head_dim(head_dim), tile_head_dim(vo) if vo else 0)
        io = 0 if head_dim == tile else head_dim
        if vo:
            if kv_dtype:
                raise NotImplementedError(
                    f"fp8 KV caches with a value head dim other than the query-key head "
                    f"dim (head_dim_vo {vo}, head_dim {head_dim}) are not supported")
            if arch in WARP_MMA_ARCHS and tile not in WARP_HEAD_DIMS:
                raise NotImplementedError(
                    f"head_dim {head_dim} with head_dim_vo {vo} has no kernel on {arch} (the "
                    f"warp-level kernel serves head dims up to {max(WARP_HEAD_DIMS)})")
            return dataclasses.replace(
                KernelConfig.select(dtype, tile, group, causal, has_lse, page_size, arch,
                                    window=window, softcap=softcap, has_sinks=has_sinks),
                head_dim_io=io, head_dim_vo=vo)._checked()
        if arch in WARP_MMA_ARCHS:
            return KernelConfig._select_warp(dtype, tile, group, causal, has_lse, arch,
                                             window, softcap, has_sinks, kv_dtype, io)
        if kv_dtype:
            return KernelConfig._select_fp8(dtype, tile, group, causal, has_lse, page_size,
                                            arch, window, softcap, has_sinks, kv_dtype, io)
        head_dim = tile
        # FA3's structure: one CTA per SM = a producer warpgroup + two MMA warpgroups of
        # 64 rows over 128-token K/V tiles. D 128: Q 32 KB + 2 stages x (K + V) 128 KB +
        # 34 KB decode-combine scratch + 17 KB O staging; D 96 fits 3 stages but takes 2
        # (an even count, see can_implement), D 64: 4 (the most shared memory allows, up to
        # 4: deeper buys decode nothing measurable).
        # Page class: TMA boxes of whole tiles when pages hold them; of 16 page slots (8
        # boxes a tile, each inside one page) for pages of 16..64 tokens; else a cp.async
        # row gather (pages of 1..8 tokens: boxes that small would cost more issue slots
        # than the copies they replace).
        # D 256: O alone is 128 registers a thread, so 64-token tiles (S and P of 32 and
        # 16), and its Q tile (64 KB) and two K/V stages (128 KB) leave shared memory only
        # for a 4-round decode combine and no O staging.
        wide = head_dim > 128
        tile = 64 if wide else 128
        kv_box = tile if page_size % tile == 0 else 16 if page_size % 16 == 0 else 0
        # setmaxnreg split (multiples of 8, at most 512 per thread slot of the three
        # warpgroups): a TMA producer needs few registers; a cp.async gather needs
        # more, taken from the MMA warpgroups.
        producer_regs, mma_regs = (24, 240) if kv_box else (40, 232)
        if wide:  # 4 TMA column blocks a box row: 24 spill; D 256's MMA fits in 232
            producer_regs, mma_regs = 40, 232
        # The gathering producer's 40 registers leave the MMA warpgroups 232, too few for
        # 128-token tiles (S, P and O fragments live together); its 64-token tiles (twice
        # the stages, the same bytes in flight) fit. Pages of 1-8 tokens are gather-bound.
        tile_n = 128 if kv_box and not wide else 64
        cfg = KernelConfig(
            arch=arch, dtype=dtype, head_dim=head_dim, group=group, causal=bool(causal),
            has_lse=bool(has_lse), kv_box=kv_box, tile_m_prefill=128, tile_m_decode=64,
            tile_n=tile_n, num_stages=2, num_mma_warpgroups=2, ctas_per_sm=1,
            producer_regs=producer_regs, mma_regs=mma_regs, window=bool(window),
            softcap=bool(softcap), has_sinks=bool(has_sinks),
            combine_rounds=4 if wide else 1, o_staging=not wide, head_dim_io=io,
            softmax_under_pv=head_dim >= 128,
        )
        # The deepest K/V pipeline shared memory holds (bytes in flight, whatever tile_n),
        # in steps of 2: one stage per MMA warpgroup (can_implement).
        max_stages = 4 * (128 // tile_n)
        while (cfg.num_stages + 2 <= max_stages and dataclasses.replace(
                cfg, num_stages=cfg.num_stages + 2).smem_bytes() <= SMEM_BYTES_PER_SM):
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages + 2)
        return cfg._checked()

    def _checked(self) -> "KernelConfig":
        ok, why = self.can_implement()
        if not ok:
            raise ValueError(f"podcute has no kernel for this configuration: {why}")
        return self

    @staticmethod
    def _select_fp8(dtype, head_dim, group, causal, has_lse, page_size, arch, window,
                    softcap, has_sinks, kv_dtype, io: int = 0) -> "KernelConfig":
        """An fp8 cache: 64-token tiles, because the fp8 staging stages need the shared
        memory of 128-token 16-bit stages; 2 16-bit stages (the converters refill one while
        the MMA warpgroups read the other) and as many fp8 stages (the bytes in flight) as
        fit, up to 8 (D 128: Q 32 KB + 2 x 32 KB 16-bit K/V + 4 x 16 KB fp8 K/V + 34 KB
        scratch + 17 KB staging; 6 fp8 stages, made room for by a 2-round decode combine and
        unstaged O stores, measured no faster). Two producer warpgroups, for two converter
        groups of 3 warps (`converter_groups`): the three spare warps of one warpgroup
        converted ~7 (bf16) / 9 (fp16) values a clock per SM, where the HBM stream brings
        ~18 (docs/notes/fp8.md). setmaxnreg 56 x 2 / 200 x 2 (512 threads launch with
        128): the converters keep 3 chunks' loads in flight in 56; the MMA warpgroups hold
        Q's fragments (`q_in_registers`, 32 registers) beside O, S and P, and spilled at
        192 with them (0 spills at 200)."""
        check_fp8_kv(head_dim, kv_dtype)
        wide = head_dim > 128
        # D 256 (`q_in_registers` off: Q 64 KB in shared memory): 32-token tiles, so that
        # two 16-bit stages (64 KB) and the fp8 staging fit beside Q; one producer
        # warpgroup (`num_producer_warpgroups`): 56 registers beside TMA (40 spilled 56
        # bytes), 72 beside the gather (56 spilled 4); the MMA warpgroups the rest.
        tile_n = 32 if wide else 64
        kv_box = tile_n if page_size % tile_n == 0 else 16 if page_size % 16 == 0 else 0
        producer_regs, mma_regs = 56, 200
        if wide:
            producer_regs, mma_regs = (56, 224) if kv_box else (72, 216)
        cfg = KernelConfig(
            arch=arch, dtype=dtype, head_dim=head_dim, group=group, causal=bool(causal),
            has_lse=bool(has_lse), kv_box=kv_box, tile_m_prefill=128, tile_m_decode=64,
            tile_n=tile_n, num_stages=2, num_mma_warpgroups=2, ctas_per_sm=1,
            producer_regs=producer_regs, mma_regs=mma_regs, window=bool(window),
            softcap=bool(softcap), has_sinks=bool(has_sinks), kv_dtype=kv_dtype, fp8_stages=2,
            combine_rounds=4 if wide else 1, o_staging=not wide, head_dim_io=io,
        )
        while (cfg.fp8_stages + 2 <= 8 and dataclasses.replace(
                cfg, fp8_stages=cfg.fp8_stages + 2).smem_bytes() <= SMEM_BYTES_PER_SM):
            cfg = dataclasses.replace(cfg, fp8_stages=cfg.fp8_stages + 2)
        return cfg._checked()

    @staticmethod
    def _select_warp(dtype, head_dim, group, causal, has_lse, arch, window, softcap,
                     has_sinks, kv_dtype, io: int = 0) -> "KernelConfig":
        """The warp-level kernel (every page size: its K/V rows are gathered): 64-row
        decode items (4 warps x 16) over 64-token tiles, two CTAs an SM, two K/V stages
        where two CTAs of them fit the SM's shared memory (D 128: 81 KB a CTA on sm_80 and
        sm_90; one stage, 49 KB, on the 100 KB SMs of sm_86/89/120a), and on
        WIDE_PREFILL_ARCHS 128-row prefill items (4 warps x 2 blocks of 16) where their Q
        tile fits too (97 KB a CTA at D 128): each K/V fragment read from shared memory
        then feeds two MMAs, where 16 rows a warp left the loop bound by those reads. Two
        CTAs come first: a lone CTA would leave its SM idle at every barrier; the second
        stage doubles the bytes a decoding CTA keeps in flight (its one busy warp waits on
        HBM latency, not on its MMAs)."""
        # (features the warp-level kernel lacks: NotImplementedError, as the API's own)
        if kv_dtype:
            raise NotImplementedError(f"fp8 KV caches need the sm_90a kernel; {arch} has none "
                                      f"(kv_dtype {kv_dtype!r})")
        if head_dim not in WARP_HEAD_DIMS:
            raise NotImplementedError(f"head_dim {io or head_dim} has no kernel on {arch} (the "
                                      f"warp-level kernel serves head dims up to "
                                      f"{max(WARP_HEAD_DIMS)})")
        cfg = KernelConfig(
            arch=arch, dtype=dtype, head_dim=head_dim, group=group, causal=bool(causal),
            has_lse=bool(has_lse), kv_box=0, tile_m_prefill=64, tile_m_decode=64, tile_n=64,
            num_stages=1, num_mma_warpgroups=1, ctas_per_sm=1, producer_regs=0, mma_regs=0,
            window=bool(window), softcap=bool(softcap), has_sinks=bool(has_sinks),
            o_staging=False, head_dim_io=io,
        )
        # (ctas, stages, prefill rows), best first; the fold of a key-split item's warps
        # in as few rounds as the K stages hold
        tries = [(2, 2, 64), (2, 1, 64), (1, 1, 64)]
        if arch in WIDE_PREFILL_ARCHS:
            tries.insert(0, (2, 2, 128))
        for ctas, stages, tile_m, rounds in [t + (r,) for t in tries for r in (1, 2, 4)]:
            staged = dataclasses.replace(cfg, num_stages=stages, ctas_per_sm=ctas,
                                         tile_m_prefill=tile_m, combine_rounds=rounds)
            if staged.can_implement()[0]:
                return staged._checked()
        return staged._checked()
