"""Host planner: turns one mixed batch into the int32 work metadata the fused kernel runs.

Once per engine step (the kernel then runs once per layer with the same plan):

1. normalise the page format (block table or CSR) and the KV lengths (``kv_lens`` or
   FlashInfer's ``last_page_len``) into host numpy arrays and validate the values;
2. classify requests, with no label from the caller and in any order: *decode work* is a
   request whose packed rows fit one decode tile (``q_len * G <= tile_m_decode``, so
   speculative decoding with a few draft tokens is decode work too), anything longer is
   *prefill work*, ``q_len == 0`` (padding) is no work;
3. cut groups: prefill = (request, kv head, ``tile_m_prefill``-row tile), decode =
   (request, kv head); pre-split long KV ranges so each kind spreads over the whole grid
   (split-KV);
4. predict every piece's time with a roofline cost model (:class:`CostModel`), merge the
   two kinds into one stream by progress (so any stretch holds both, interleaved), and cut
   that stream into the CTA lists of a fixed persistent grid at equal-cost boundaries,
   splitting the piece under a boundary at a KV tile;
5. write everything, the page list included, into plan-owned buffers and send it with
   host->device copies on the current stream.

The tiling comes from the one :class:`~podcute.kernels.config.KernelConfig`, the metadata
columns from :mod:`podcute.kernels.metadata` (format in ``docs/design.md``).

CUDA graphs: every buffer the kernel touches (metadata, the page list copied from
whatever block table or CSR indices plan() was given, the float parameters such as
``sm_scale``, split partials, merge semaphores) is owned by the planner, allocated at
capacity, at a fixed address, and passed to the kernel whole (:attr:`Planner.kernel_args`,
the same tuple for every plan). A captured launch therefore replays correctly after any
later plan() that fits the capacities. Buffers grow on demand only until the first capture
(:meth:`Planner.freeze`); after it, a batch that does not fit raises
:class:`CapacityError` in plan(), never at replay.

Host/device traffic: index tensors on the CPU cost no GPU sync at all; index tensors on
the GPU are gathered with one device->host copy (one sync). The metadata and the page list
go to the device with non-blocking copies from pinned staging buffers on the current
stream (stream-ordered after any kernel that still reads the previous plan); the next
plan() waits for those copies (an event) before it rewrites the staging buffers.

Costs are float64 microseconds, so no batch the capacities allow can overflow them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from podcute import plan_native
from podcute.kernels.config import SUPPORTED_PAGE_SIZES, KernelConfig
from podcute.kernels.metadata import (KIND_BITS, KIND_MASK, MERGE_COLS, NUM_PARAMS, WORK_COLS,
                                      IParam, Kind, MergeCol, Param, WorkCol)
from podcute.kernels.visibility import load_start_host, visible_end_host

_ALIGN = 16  # int32 elements: metadata segments start on 64-byte boundaries
_ROW = np.dtype((np.void, WORK_COLS * 4))  # a work row as one element: fast row gathers

# Limits that keep every index the kernel computes inside int32 and the buffers sane.
MAX_KV_LEN = 2**31 - 1 - 1024  # token positions (+ one KV tile) stay int32
MAX_BATCH_SIZE = 2**20
MAX_NUM_TOKENS = 2**23
MAX_NUM_PAGES = 2**30  # page-list entries (page_start + page index stay int32)
MAX_WORK_ITEMS = 2**31 // WORK_COLS // 2


# float32's smallest normal and largest finite values: scales the kernel reads as float32
# must lie between them (a subnormal flushes to 0 in its fast math).
F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


class CapacityError(ValueError):
    """A batch does not fit the planner's buffers, which cannot grow: a CUDA graph holds
    their addresses (after :meth:`Planner.freeze`), or the size is past a hard limit."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _rows(a: np.ndarray) -> np.ndarray:
    """1-D view of an [n, WORK_COLS] int32 array with one element per row."""
    return a.view(_ROW).reshape(-1)


class _once:
    """A zero-argument function's value, computed on its first call (functools.cache
    without the cost of building a wrapper per plan)."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn):
        self._fn, self._value = fn, None

    def __call__(self):
        if self._fn is not None:
            self._value, self._fn = self._fn(), None
        return self._value


def _ragged_arange(counts: np.ndarray, total: int) -> np.ndarray:
    """concat(arange(c) for c in counts), vectorised."""
    starts = counts.cumsum() - counts
    return np.arange(total, dtype=np.int64) - starts.repeat(counts)


# --------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Predicted time of one work piece on one CTA (one CTA per SM).

    Rates are the H200 ceilings (docs/performance.md: 4.22 TB/s copy, 779 TFLOP/s bf16),
    divided over its 132 SMs:

    - prefill piece: the FLOPs of a ``tile_m_prefill``-row MMA over its KV tokens,
      4 * D * tile_m per KV token (over long prompts equal to the visible causal pairs,
      since every item stops at its diagonal tile), at ``mma_efficiency`` of the SM's peak
      (calibrated against a measured prefill run, docs/performance.md);
    - decode piece: the bytes it streams, K + V (2 * D * elem per KV token) plus Q in and
      O out (2 * D * elem per packed row), at ``decode_sm_bandwidth`` times the SM's share
      of the copy bandwidth (> 1 when fewer than all SMs stream at once, as in a mixed
      batch; the global HBM bound is kept by PlanSummary.predicted_us);
    - plus a fixed cost per piece (pipeline fill and drain, epilogue, next-item fetch).
    """

    tensor_flops_per_s: float = 779e12  # H200 dense bf16 matmul, measured
    hbm_bytes_per_s: float = 4.22e12  # H200 device-to-device copy (read + write), measured
    ref_num_sms: int = 132  # the chip the two rates were measured on
    # Calibrated on the H200 (docs/performance.md, "cost model"): F1 at page 128, 0.94 ms
    # for ~505 tiles of 128 x 128 per CTA, is ~0.76 of the matmul rate; D1 at page 128
    # streams its bytes at ~1.09x the SM's share of the copy bandwidth.
    mma_efficiency: float = 0.75
    # The warp-level kernel's (mma.sync) prefill: F1 at page 16 on the H200 forced to
    # the portable kernel took 2.07 ms with 64-row items (docs/performance.md) where 0.75
    # predicts 0.97; with 128-row items (two 16-row blocks a warp) ~1.7 ms.
    warp_mma_efficiency: float = 0.35
    warp_wide_mma_efficiency: float = 0.42
    decode_sm_bandwidth: float = 1.1
    prefill_item_overhead_us: float = 1.0
    decode_item_overhead_us: float = 2.0
    # A split piece carries at least this much variable work (2x the decode overhead), so
    # splitting never makes a piece mostly overhead.
    min_chunk_us: float = 4.0
    # Pre-split groups into pieces of <= (the kind's work per CTA) / chunks_per_cta, so a
    # kind reaches every CTA. More = finer interleave, more partials; bounds capacities().
    chunks_per_cta: int = 1
    elem_bytes: int = 2  # bf16 / fp16
    # The warp-level kernel pairs each SM's two CTAs by kind (`Planner._group_kinds`) only
    # on a chip with fewer HBM bytes per SM clock than this (`chip_hbm_bytes_per_sm_clock`):
    # on an H100 (12.8) that made the mixed batches 2-6 % faster, on the H200 (18.8)
    # 1-4 % slower (docs/notes/sm-pairing.md, measured 2026-12-05 on f7fa1d6).
    pair_kinds_below_bytes_per_sm_clock: float = 16.0

    def for_kernel(self, kernel) -> "CostModel":
        """This model with the MMA efficiency of `kernel` (a KernelConfig)'s prefill."""
        if not kernel.warp_mma:
            return self
        return dataclasses.replace(self, mma_efficiency=(
            self.warp_mma_efficiency if kernel.tile_m_prefill <= 64
            else self.warp_wide_mma_efficiency))

    def mma_flops_per_us(self) -> float:
        return self.tensor_flops_per_s / self.ref_num_sms * self.mma_efficiency * 1e-6

    def hbm_bytes_per_us(self) -> float:
        return self.hbm_bytes_per_s / self.ref_num_sms * self.decode_sm_bandwidth * 1e-6


DEFAULT_COST_MODEL = CostModel()
# chip_hbm_bytes_per_sm_clock of the two chips the pairing rule was measured on
H200_HBM_BYTES_PER_SM_CLOCK = 18.8  # 2 x 3201 MHz x 6144 bits / (132 SMs x 1980 MHz)
H100_HBM_BYTES_PER_SM_CLOCK = 12.8  # 2 x 2619 MHz x 5120 bits / (132 SMs x 1980 MHz), SXM


def chip_hbm_bytes_per_sm_clock(props) -> float | None:
    """A GPU's HBM peak (double data rate: 2 x memory clock x bus width) over its SMs and
    their clock, in bytes; `props`: torch.cuda.get_device_properties. None where the
    properties lack the clocks (older torch)."""
    try:
        mem_khz, bus_bits = props.memory_clock_rate, props.memory_bus_width
        sm_khz, sms = props.clock_rate, props.multi_processor_count
    except AttributeError:
        return None
    if min(mem_khz, bus_bits, sm_khz, sms) <= 0:
        return None
    return 2 * mem_khz * bus_bits / 8 / (sms * sm_khz)


@dataclass(frozen=True)
class PrefillTiling:
    """The row tile prefill requests are cut into, with the unit costs it gives:
    microseconds per KV token of a prefill item, per KV token (K + V) and per packed row
    (Q + O) of decode, per-piece overheads (`us`), and the smallest KV split piece of each
    kind in tiles (>= min_chunk_us of work)."""

    tile_m: int
    us: tuple
    min_tiles: tuple
    mt: np.ndarray = field(compare=False)  # min_tiles as an array (indexed by kind)

    @staticmethod
    def make(c: CostModel, kernel) -> "PrefillTiling":
        D, tn = kernel.head_dim, kernel.tile_n
        us_tile = 4.0 * D * kernel.tile_m_prefill * tn / c.mma_flops_per_us()
        kv_bytes = 1 if kernel.fp8 else c.elem_bytes  # an fp8 cache streams half the bytes
        us_tok = 2.0 * D * kv_bytes / c.hbm_bytes_per_us()
        us_row = 2.0 * D * c.elem_bytes / c.hbm_bytes_per_us()
        min_tiles = (max(1, math.ceil(c.min_chunk_us / us_tile)),
                     max(1, math.ceil(c.min_chunk_us / (us_tok * tn))))
        return PrefillTiling(
            kernel.tile_m_prefill,
            (us_tile / tn, us_tok, us_row, c.prefill_item_overhead_us,
             c.decode_item_overhead_us),
            min_tiles, np.array(min_tiles, dtype=np.int64))


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSummary:
    """What the planner decided for one batch (host numbers only).

    plan() returns a lazy one (:meth:`_lazy`): its fields are computed on first access, so
    a serving loop that never reads the summary does not pay for it (until then it holds
    its plan's per-row costs: about 9 bytes a work row)."""

    num_requests: int
    num_prefill_requests: int
    num_decode_requests: int
    num_prefill_items: int  # work rows after KV splitting
    num_decode_items: int
    num_split_items: int  # rows that write fp32 partials (prefill + decode)
    num_merges: int
    predicted_prefill_us: float  # max over CTAs of its prefill time
    predicted_decode_us: float  # max over CTAs of its decode time
    predicted_us: float  # max over SMs, and at least the batch's HBM time: see CostModel
    balance: float  # max / mean predicted time per CTA (1.0 = perfect)
    grid: int = 0

    @classmethod
    def _lazy(cls, compute) -> "PlanSummary":
        """A summary whose fields compute() returns (a dict) when one is first read. It is
        a PlanSummary like any other (str, repr, ==, dataclasses.asdict, replace)."""
        s = object.__new__(cls)
        s.__dict__["_compute"] = compute
        return s

    def __getattr__(self, name):
        # Reached only for an attribute not in __dict__: a lazy summary's fields before
        # their first read. Computing twice (two threads) is harmless: same values.
        compute = self.__dict__.get("_compute")
        if compute is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.__dict__.update(compute())
        self.__dict__.pop("_compute", None)
        return getattr(self, name)

    def __reduce__(self):  # pickle / copy the values, not the closure
        return type(self), tuple(getattr(self, f.name) for f in fields(self))

    def __str__(self) -> str:
        return (
            f"POD plan: {self.num_requests} requests "
            f"({self.num_prefill_requests} prefill, {self.num_decode_requests} decode) -> "
            f"{self.num_prefill_items} prefill + {self.num_decode_items} decode work items "
            f"on {self.grid} CTAs; {self.num_split_items} split-KV pieces, "
            f"{self.num_merges} merges\n"
            f"  predicted: {self.predicted_us:.1f} us (per-CTA max prefill "
            f"{self.predicted_prefill_us:.1f} us, decode {self.predicted_decode_us:.1f} us), "
            f"balance max/mean {self.balance:.3f}"
        )


# Batch-invariant plans split a request's KV range at fixed multiples of these many tokens
# (prefill, decode: Kind order), whatever else shares the batch.
INVARIANT_SPLIT_TOKENS = (8192, 4096)


@dataclass(frozen=True)
class PlanOptions:
    """What a plan computes besides the batch (docs/contract.md): the mask, soft-capping,
    and whether split points may depend on the batch. Validated by :meth:`make`."""

    causal: bool = True
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # as given (causal clips it to 0)
    softcap: float = 0.0  # 0: off
    batch_invariant: bool = False

    @staticmethod
    def make(causal=True, window_size=(-1, -1), softcap=0.0,
             batch_invariant=False) -> "PlanOptions":
        """Options from plan()'s arguments; TypeError/ValueError naming a bad one."""
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        if not isinstance(batch_invariant, (bool, np.bool_)):
            raise TypeError(f"batch_invariant must be a bool, got "
                            f"{type(batch_invariant).__name__}")
        if window_size is None:
            window_size = (-1, -1)
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            raise TypeError(f"window_size must be a pair (left, right) of ints, got "
                            f"{window_size!r}")
        for side, v in zip(("left", "right"), window_size):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"window_size {side} must be an int (-1: unbounded), got "
                                f"{type(v).__name__}")
            if not -1 <= v <= MAX_KV_LEN:
                raise ValueError(f"window_size {side} must be -1 (unbounded) or in [0, "
                                 f"{MAX_KV_LEN}], got {v}")
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float,
                                                                             np.floating)):
            raise TypeError(f"softcap must be a float (0: off), got {type(softcap).__name__}")
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap >= 0):
            raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap}")
        if 0 < softcap < 1e-30:
            raise ValueError(f"softcap {softcap} is too small for float32 (use 0 for off)")
        return PlanOptions(bool(causal), int(window_size[0]), int(window_size[1]), softcap,
                           bool(batch_invariant))

    @property
    def bounded_right(self) -> bool:
        """Keys right of a limit are masked (the kernel's `causal` flag)."""
        return self.causal or self.window_right >= 0

    @property
    def right(self) -> int:
        """The right limit's offset from the query position (0 when causal)."""
        return 0 if self.causal else max(self.window_right, 0)

    @property
    def has_window(self) -> bool:
        """The kernel reads window edges from the plan (its `window` flag)."""
        return self.window_left >= 0 or (not self.causal and self.window_right >= 0)

    def kernel_flags(self) -> dict:
        return dict(causal=self.bounded_right, window=self.has_window,
                    softcap=self.softcap > 0)

    @cached_property
    def variant(self) -> tuple:
        """kernel_flags() as a tuple, made once (launch's per-call dict key)."""
        return tuple(self.kernel_flags().values())


@dataclass(frozen=True)
class PlanConfig:
    num_qo_heads: int
    num_kv_heads: int
    group_size: int  # G = Hq // Hkv: query heads per KV head, packed into rows
    head_dim: int
    page_size: int
    kernel: KernelConfig  # tiling (and default flags) of the kernel this plan is cut for


@dataclass(eq=False)
class Plan:
    """Metadata of one batch. The device tensors are views of the planner's buffers:
    valid until the planner's next plan(), which rewrites them in place (stream-ordered).
    The kernel never reads these views: it gets the whole buffers (`kernel_args`), so
    they are made on first access (slicing tensors costs microseconds each)."""

    config: PlanConfig
    causal: bool
    sm_scale: float
    options: PlanOptions
    # --- host facts ---
    total_q: int
    batch_size: int
    num_items: int
    num_merge: int
    num_slots: int
    grid: int
    # Rows of a prefill item: the kernel's tile_m_prefill, or for a batch whose taller
    # groups would not fill the grid, tile_m_decode (Planner._choose_tiling).
    prefill_tile_m: int
    # Upper bound of the page indices that requests with queries read (-1: none), taken
    # from the plan's own copy of the pages (what the kernel reads); exact for CSR and
    # for block tables whose unused entries are not larger. check_pages().
    max_page_index: int
    buffer_epoch: int  # planner buffer generation: changes only when buffers are regrown
    summary: PlanSummary
    kernel_args: tuple = field(repr=False)  # the planner's whole buffers, kernel order
    # host arrays owned by this plan
    q_lens: np.ndarray = field(repr=False)
    kv_lens: np.ndarray = field(repr=False)
    needed_pages: np.ndarray = field(repr=False)  # pages read: ceil(kv_len / page); 0 if q_len 0
    _pages: "_PageSet" = field(repr=False, default=None)  # over the plan's page copy
    # () -> (item_cost_us, cta_cost_us, the lists' prefill time), computed on first call
    _costs: object = field(repr=False, default=None)
    # the planner's whole-buffer device views (name -> tensor) and this plan's page entries
    _buffers: dict = field(repr=False, default=None)
    _num_page_entries: int = field(repr=False, default=0)
    # launch's compiled kernels of this plan, by its flags (lse | sinks << 1 | ragged << 2):
    # a list index per run() instead of a dict lookup that hashes the whole configuration
    _kernels: list = field(repr=False, default_factory=lambda: [None] * 8)

    @property
    def item_cost_us(self) -> np.ndarray:  # predicted time of each work row
        return self._costs()[0]

    @property
    def cta_cost_us(self) -> np.ndarray:  # predicted time of each CTA list
        return self._costs()[1]

    # --- device views of this plan's metadata (docs/design.md) ---
    @cached_property
    def work(self) -> torch.Tensor:  # [num_items, WORK_COLS], rows grouped by CTA
        return self._buffers["work"][: self.num_items]

    @cached_property
    def cta_ptr(self) -> torch.Tensor:  # [grid + 1]: CTA c runs work[cta_ptr[c]:cta_ptr[c+1]]
        return self._buffers["cta_ptr"]

    @cached_property
    def merge(self) -> torch.Tensor:  # [num_merge, MERGE_COLS]
        return self._buffers["merge"][: self.num_merge]

    @cached_property
    def slot_merge(self) -> torch.Tensor:  # [num_slots]: merge row of each split slot
        return self._buffers["slot_merge"][: self.num_slots]

    @cached_property
    def merge_sem(self) -> torch.Tensor:  # [cap_merges] zeros; the merging CTA resets its entry
        return self._buffers["merge_sem"]

    @cached_property
    def q_start(self) -> torch.Tensor:  # [B + 1] (cu_seqlens_q)
        return self._buffers["q_start"][: self.batch_size + 1]

    @cached_property
    def kv_len(self) -> torch.Tensor:  # [B]
        return self._buffers["kv_len"][: self.batch_size]

    @cached_property
    def page_start(self) -> torch.Tensor:  # [B]: offset of request b's first page in page_list
        return self._buffers["page_start"][: self.batch_size]

    @cached_property
    def page_list(self) -> torch.Tensor:  # [num_page_entries]: the plan-owned copy of the pages
        return self._buffers["page_list"][: self._num_page_entries]

    @cached_property
    def params(self) -> torch.Tensor:  # float32 [NUM_PARAMS] (metadata.Param): sm_scale, ...
        return self._buffers["params"]

    def pages_within(self, num_pages: int) -> bool:
        """True if plan()'s bound already shows every page read is < num_pages (O(1))."""
        return self.max_page_index < num_pages

    def check_pages(self, num_pages: int, name: str = "block_table") -> None:
        """Raise ValueError if a request reads a page index >= num_pages (the KV cache's
        page count). O(1) unless plan()'s cheap bound is inconclusive."""
        if self.pages_within(num_pages):
            return
        b, page = self._pages.first_at_least(num_pages)
        if b >= 0:
            raise ValueError(f"{name}: request {b} reads page {page}, but the KV cache has only "
                             f"{num_pages} pages (k_cache.shape[0]); page indices must be in "
                             f"[0, {num_pages})")


# --------------------------------------------------------------------------------------
# Capacities
# --------------------------------------------------------------------------------------


class Layout(NamedTuple):
    """What a work expansion (Planner._layout_numpy, or plan_native's C) hands the rest of
    plan(): counts, the CTA list bounds, and what the lazy predictions read."""

    n: int  # work rows (written to the staging buffer, with the merges and slot list)
    num_merge: int
    num_slots: int
    ptr: np.ndarray  # int64 [grid + 1]
    pc: np.ndarray  # each row's cost (before the list-head swaps)
    kind: np.ndarray | None  # True: decode row; None: all rows of one kind
    swaps: tuple | None  # (list heads, rows they were swapped with)
    fixes: tuple | None  # (cut parts, their fixed costs, KV starts, KV ends)
    n0p: int  # prefill groups
    n0d: int  # decode groups
    n_prefill_req: int
    n_decode_req: int
    order: np.ndarray | None  # where each row went when the lists were grouped by kind


@dataclass(frozen=True)
class Capacities:
    batch: int
    tokens: int
    pages: int  # page-list entries (see Planner: block table B x max pages read, or CSR nnz)
    items: int
    merges: int
    slots: int


def capacities(max_batch_size, max_num_tokens, max_num_pages, num_qo_heads, num_kv_heads,
               tile_m, grid, chunks_per_cta=DEFAULT_COST_MODEL.chunks_per_cta) -> Capacities:
    """Buffer sizes that hold any batch with <= max_batch_size requests,
    <= max_num_tokens query tokens and <= max_num_pages page-list entries
    (s = chunks_per_cta, g = grid, tile_m = the smallest row tile):

    - groups: a request of q_len tokens has ceil(q_len*G / tile_m) <= q_len*G/tile_m + 1
      row tiles per KV head, so groups <= Hkv * (ceil(T*G / tile_m) + B);
    - pre-split (per kind): a group of variable work v gets <= ceil(v / c) pieces with
      c >= (the kind's work) / (g * s), so a kind gains <= s*g pieces, and only groups
      with v > c split, so <= s*g split groups per kind;
    - the CTA cut splits at most one piece per boundary: <= g - 1 more pieces and merges;
    - slots: a split group of n >= 2 pieces uses n <= 2 (n - 1) slots.
    So items <= groups + (2s + 1) g, merges <= (2s + 1) g, slots <= (4s + 2) g.
    """
    G = num_qo_heads // num_kv_heads
    pre = 2 * chunks_per_cta * grid
    groups = num_kv_heads * (-(-max_num_tokens * G // tile_m) + max_batch_size)
    return Capacities(max_batch_size, max_num_tokens, max_num_pages, groups + pre + grid,
                      pre + grid, 2 * pre + 2 * grid)


# --------------------------------------------------------------------------------------
# Host-side inputs
# --------------------------------------------------------------------------------------


def host_arrays(named: dict) -> dict:
    """numpy copies of the index inputs; GPU tensors are gathered with one copy."""
    out, on_gpu = {}, []
    for name, x in named.items():
        if x is None:
            out[name] = None
        elif type(x) is torch.Tensor and x.dtype is torch.int32 and x.is_cpu:
            out[name] = x.numpy()  # the common case, checked in one line
        elif isinstance(x, torch.Tensor):
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor (int32), got {x.dtype}")
            if x.device.type == "cpu":
                out[name] = x.numpy()
            else:
                on_gpu.append(name)
        else:
            a = np.asarray(x)
            if a.dtype.kind not in "iu":
                raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
            out[name] = a
    if on_gpu:
        # One device->host copy (and one sync) for everything the caller left on the GPU.
        ts = [named[n] for n in on_gpu]
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in ts]).cpu().numpy()
        off = 0
        for n, t in zip(on_gpu, ts):
            out[n] = flat[off: off + t.numel()].reshape(t.shape)
            off += t.numel()
    return out


# signed integer dtype -> (its unsigned twin, its max)
_UNSIGNED = {np.dtype(t): (np.dtype("u" + t), np.iinfo(t).max)
             for t in ("int8", "int16", "int32", "int64")}


def _min_max(a: np.ndarray) -> tuple[int, int]:
    """(a lower bound, the max) of a non-empty integer array: 0 when no entry is negative,
    else the min. One pass in the common case: viewed as unsigned, negative entries are
    the largest."""
    unsigned = _UNSIGNED.get(a.dtype)
    if unsigned is None:  # unsigned, or signed in a byte order the table lacks
        return (0 if a.dtype.kind == "u" else int(a.min())), int(a.max())
    top = int(a.view(unsigned[0]).max())
    if top <= unsigned[1]:
        return 0, top
    return int(a.min()), int(a.max())


class _PageSet:
    """The pages a batch reads: request b reads its first used[b] pages."""

    def __init__(self, block_table, csr, used):
        self.bt, self.csr, self.used = block_table, csr, used
        self._exact = None

    def _flat(self):
        """(request of each page read, page index): exact, O(pages read)."""
        used = self.used
        n = int(used.sum())
        req = np.arange(used.size).repeat(used)
        j = _ragged_arange(used, n)
        if self.bt is not None:
            return req, self.bt[req, j]
        indices, indptr = self.csr
        return req, indices[indptr[:-1][req] + j]

    def bounds(self, width=None):
        """(lower, upper) bound of the page indices read; (0, -1) if none. Cheap: a block
        table is scanned over its used columns (`width` = max(used) if known), unused
        entries included."""
        used = self.used
        if self.bt is not None:
            if width is None:
                width = int(used.max()) if used.size else 0
            if not width:
                return 0, -1
            return _min_max(self.bt[:, :width])
        if not used.size or not used.any():
            return 0, -1
        indices, indptr = self.csr
        if (used == indptr[1:] - indptr[:-1]).all():
            lo, self._exact = _min_max(indices[indptr[0]: indptr[-1]])
            return lo, self._exact
        _, pages = self._flat()
        self._exact = int(pages.max())
        return int(pages.min()), self._exact

    def first_negative(self):
        """(request, page) of the first negative page index read, or (-1, 0)."""
        req, pages = self._flat()
        bad = (pages < 0).nonzero()[0]
        return (int(req[bad[0]]), int(pages[bad[0]])) if bad.size else (-1, 0)

    def first_at_least(self, num_pages):
        """(request, page) of the first page index >= num_pages read, or (-1, 0)."""
        req, pages = self._flat()
        bad = (pages >= num_pages).nonzero()[0]
        return (int(req[bad[0]]), int(pages[bad[0]])) if bad.size else (-1, 0)


# --------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------


class Planner:
    """Owns the buffers of one attention configuration and fills them per batch.

    ``grid = num_sms * kernel.ctas_per_sm`` is fixed per planner (lists ``s``,
    ``s + num_sms``, ... are SM ``s``'s; the sm_90a kernel runs one CTA an SM). Within an
    SM, and between neighbouring SMs when an SM runs one CTA, lists alternate the kind
    they start with, so at any moment both kinds run across the chip. On a chip short of
    HBM bandwidth per SM (``hbm_bytes_per_sm_clock``, default the device's) each of the
    warp-level kernel's lists runs its kinds one after the other instead, lists ``s``
    prefill first and ``s + num_sms`` decode first (`_group_lists`).

    Capacities: ``max_batch_size`` requests, ``max_num_tokens`` query tokens and
    ``max_num_pages`` page-list entries (a block table costs B x the most pages any of its
    requests reads, CSR its ``kv_indices`` in use; default 2**20 entries, 4 MiB).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device="cuda", max_batch_size: int = 256, max_num_tokens: int = 16384,
                 max_num_pages: int | None = None, num_sms: int | None = None,
                 cost_model: CostModel = DEFAULT_COST_MODEL, dtype: str = "bfloat16",
                 kv_dtype: str = "", arch: str = "sm_90a",
                 hbm_bytes_per_sm_clock: float | None = None):
        if max_num_pages is None:
            max_num_pages = 1 << 20
        for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens),
                        ("max_num_pages", max_num_pages)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if hbm_bytes_per_sm_clock is not None and (
                isinstance(hbm_bytes_per_sm_clock, bool)
                or not isinstance(hbm_bytes_per_sm_clock, (int, float, np.number))
                or not hbm_bytes_per_sm_clock > 0):
            raise ValueError("hbm_bytes_per_sm_clock must be a positive number, got "
                             f"{hbm_bytes_per_sm_clock!r}")
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
        G = num_qo_heads // num_kv_heads
        kernel = KernelConfig.select(dtype, head_dim, G, page_size=page_size,  # names head_dim
                                     kv_dtype=kv_dtype, arch=arch)
        self.device = torch.device(device)
        props = (torch.cuda.get_device_properties(self.device)
                 if self.device.type == "cuda" else None)  # an H200 on a host-only planner
        if num_sms is None:
            num_sms = props.multi_processor_count if props is not None else 132
        if hbm_bytes_per_sm_clock is None:
            hbm_bytes_per_sm_clock = ((props is not None and chip_hbm_bytes_per_sm_clock(props))
                                      or H200_HBM_BYTES_PER_SM_CLOCK)
        self.config = PlanConfig(num_qo_heads, num_kv_heads, G, head_dim, page_size, kernel)
        self.cost = cost_model.for_kernel(kernel)
        self.num_sms = int(num_sms)
        self.grid = self.num_sms * kernel.ctas_per_sm
        self.buffer_epoch = 0
        self.frozen = False
        self._captured_options = None  # the options of the plan a CUDA graph captured
        self._on_cuda = self.device.type == "cuda"
        self._copy_done = None  # CUDA event: the staging buffers may be rewritten after it
        self._check_limits(max_batch_size, max_num_tokens, max_num_pages)
        self._split_floor = (0, 0, 0)
        self._allocate(max_batch_size, max_num_tokens, max_num_pages)
        # The work expansion in C (None: no C compiler here, or PODCUTE_PLANNER=numpy).
        self._native = plan_native.load()

        # The prefill row tiles a batch may be cut into: the kernel's, and for a kernel
        # whose prefill items are taller than its decode items, those of a decode item.
        kernels = [kernel]
        if kernel.warp_mma and kernel.tile_m_prefill > kernel.tile_m_decode:
            kernels.append(dataclasses.replace(kernel, tile_m_prefill=kernel.tile_m_decode))
        self._tilings = tuple(PrefillTiling.make(cost_model.for_kernel(k), k) for k in kernels)
        self._tiling = self._tilings[0]  # the current batch's (_build sets it)
        # Per kind, the work rows of one row tile before its REQ and rows: one per KV head.
        self._group_rows = np.zeros((2, num_kv_heads, WORK_COLS), dtype=np.int32)
        self._group_rows[:, :, WorkCol.KV_HEAD] = np.arange(num_kv_heads)
        self._group_rows[:, :, WorkCol.KIND] = np.array([Kind.PREFILL, Kind.DECODE])[:, None]
        self._bounds_unit = np.arange(1, self.grid, dtype=np.float64) / self.grid
        # Which kind each list starts with: its slot on the SM (lists s, s + num_sms, ...
        # share SM s), or, with one CTA per SM, its SM's parity.
        lists = np.arange(self.grid)
        slot = lists // self.num_sms if kernel.ctas_per_sm > 1 else lists
        self._odd = (slot & 1).astype(bool)
        # The warp-level kernel at two CTAs an SM, on a chip short of HBM bandwidth per SM
        # (CostModel.pair_kinds_below_bytes_per_sm_clock): in a batch of both kinds each
        # list runs its kinds one after the other (`_group_lists`), lists s prefill first
        # and s + num_sms decode first. The block scheduler puts CTAs 0..num_sms-1 one an
        # SM and the rest on the SMs' second slots in an order of its own
        # (`perf.experiments.exp_sm_pairs`), so either way each SM's two CTAs run different
        # kinds (taking the lists by %smid instead measured no faster, 2026-12-05). Elsewhere
        # each list interleaves the kinds, led by the kind its slot wants.
        self.hbm_bytes_per_sm_clock = float(hbm_bytes_per_sm_clock)
        self._group_kinds = (kernel.warp_mma and kernel.ctas_per_sm == 2
                            and self.hbm_bytes_per_sm_clock
                            < cost_model.pair_kinds_below_bytes_per_sm_clock)

    # ---- buffers ------------------------------------------------------------------------

    def _choose_tiling(self, q_len: np.ndarray, options) -> PrefillTiling:
        """The batch's prefill row tile: the kernel's, unless its prefill groups would not
        give every CTA one (the taller tiles' better MMA rate is then lost to the KV
        splits, partials and merges that spread fewer groups over the grid) and a shorter
        tile is served (the warp-level kernel's 128-row items: 64-row ones). Batch-
        invariant plans keep the kernel's (a row's result must not depend on the batch)."""
        if len(self._tilings) == 1 or options.batch_invariant:
            return self._tilings[0]
        rows = q_len * self.config.group_size
        wide = self._tilings[0].tile_m
        pre = rows[rows > self.config.kernel.tile_m_decode]
        groups = int(((pre + (wide - 1)) // wide).sum()) * self.config.num_kv_heads
        return self._tilings[0] if groups >= self.grid or not groups else self._tilings[1]

    def _check_limits(self, batch: int, tokens: int, pages: int) -> None:
        """CapacityError naming the argument when a capacity is past what the kernel's
        int32 indices (or a sane allocation) allow."""
        cfg = self.config
        for name, v, limit in (("max_batch_size (requests in a batch)", batch, MAX_BATCH_SIZE),
                               ("max_num_tokens (query tokens in a batch)", tokens, MAX_NUM_TOKENS),
                               ("max_num_pages (page-list entries of a batch)", pages,
                                MAX_NUM_PAGES)):
            if v > limit:
                raise CapacityError(f"{name} = {v} exceeds podcute's limit of {limit}")
        cap = capacities(batch, tokens, pages, cfg.num_qo_heads, cfg.num_kv_heads,
                         cfg.kernel.tile_m_decode, self.grid, self.cost.chunks_per_cta)
        if cap.items > MAX_WORK_ITEMS or tokens * cfg.group_size >= 2**31:
            raise CapacityError(
                f"max_num_tokens = {tokens} x num_qo_heads = {cfg.num_qo_heads} needs {cap.items} "
                f"work items, more than podcute's limit of {MAX_WORK_ITEMS}")

    def _allocate(self, max_batch_size: int, max_num_tokens: int, max_num_pages: int) -> None:
        # Normal tensors even when planned under torch.inference_mode(): later plans write
        # them in place, which an inference tensor refuses outside that mode.
        with torch.inference_mode(False):
            self._allocate_buffers(max_batch_size, max_num_tokens, max_num_pages)

    def _allocate_buffers(self, max_batch_size: int, max_num_tokens: int,
                          max_num_pages: int) -> None:
        cfg, grid = self.config, self.grid
        cap = capacities(max_batch_size, max_num_tokens, max_num_pages, cfg.num_qo_heads,
                         cfg.num_kv_heads, cfg.kernel.tile_m_decode, grid,
                         self.cost.chunks_per_cta)
        # (batch-invariant plans may have asked for more split room: _grow_splits)
        items, merges, slots = self._split_floor
        cap = dataclasses.replace(cap, items=max(cap.items, items),
                                  merges=max(cap.merges, merges), slots=max(cap.slots, slots))
        # One int32 buffer with fixed segment offsets -> one H2D copy of a prefix per plan;
        # the page list is a second buffer (its own capacity), sent with a second copy.
        segs, off = {}, 0
        for name, n in (("params", NUM_PARAMS), ("cta_ptr", grid + 1),
                        ("q_start", cap.batch + 1), ("kv_len", cap.batch),
                        ("page_start", cap.batch), ("merge", cap.merges * MERGE_COLS),
                        ("slot_merge", cap.slots), ("work", cap.items * WORK_COLS)):
            segs[name] = (off, n)
            off += _align(n)
        dev = self.device
        self._meta = torch.zeros(off, dtype=torch.int32, device=dev)
        self._page_list = torch.zeros(cap.pages, dtype=torch.int32, device=dev)
        if self._on_cuda:
            self._staging_t = torch.zeros(off, dtype=torch.int32, device="cpu", pin_memory=True)
            self._page_staging_t = torch.zeros(cap.pages, dtype=torch.int32, device="cpu",
                                                pin_memory=True)
        else:  # a host planner writes in place
            self._staging_t, self._page_staging_t = self._meta, self._page_list
        self._staging = self._staging_t.numpy()
        self._page_staging = self._page_staging_t.numpy()
        self._segs = segs
        self._merge_sem = torch.zeros(cap.merges, dtype=torch.int32, device=dev)
        D, tm = cfg.head_dim, cfg.kernel.partial_rows
        self._partial_o = torch.empty(cap.slots, tm, D, dtype=torch.float32, device=dev)
        self._partial_lse = torch.empty(cap.slots, tm, dtype=torch.float32, device=dev)
        self.capacity = cap
        self.buffer_epoch += 1
        # Views built once: slicing tensors per plan costs microseconds.
        self._d = {k: self._meta[o: o + n] for k, (o, n) in segs.items()}
        self._h = {k: self._staging[o: o + n] for k, (o, n) in segs.items()}
        self._d["merge"] = self._d["merge"].view(cap.merges, MERGE_COLS)
        self._d["work"] = self._d["work"].view(cap.items, WORK_COLS)
        self._d["iparams"] = self._d["params"]  # int32 words (metadata.IParam)
        self._d["params"] = self._d["params"].view(torch.float32)
        self._h["merge"] = self._h["merge"].reshape(cap.merges, MERGE_COLS)
        self._h["work"] = self._h["work"].reshape(cap.items, WORK_COLS)
        self._h["iparams"] = self._h["params"]
        self._h["params"] = self._h["params"].view(np.float32)
        d = self._d
        d["page_list"], d["merge_sem"] = self._page_list, self._merge_sem  # for Plan's views
        self._iota = np.arange(cap.batch + 1)  # request indices, sliced instead of made
        # The kernel's metadata arguments: whole buffers, the same tuple for every plan of
        # this buffer epoch (so a CUDA graph that captured them stays valid).
        self.kernel_args = (d["work"], d["cta_ptr"], d["q_start"], d["kv_len"],
                            d["page_start"], self._page_list, self._partial_o,
                            self._partial_lse, d["merge"], d["slot_merge"], self._merge_sem,
                            d["params"], d["iparams"], cfg.page_size.bit_length() - 1, grid)

    def _grow_splits(self, items: int, merges: int, slots: int) -> None:
        """Room for a batch-invariant plan's fixed-size splits (twice what it needs), or
        CapacityError when a CUDA graph holds the buffers."""
        cap = self.capacity
        if self.frozen or (self._on_cuda and torch.cuda.is_current_stream_capturing()):
            raise CapacityError(
                f"podcute plan: this batch-invariant batch splits its KV into {slots} pieces "
                f"({merges} merges, {items} work items) but the buffers hold {cap.slots} "
                f"({cap.merges}, {cap.items}) and cannot grow: a CUDA graph holds their "
                "addresses. Plan the longest batch before capturing.")
        self._sync_staging()
        self._split_floor = tuple(max(2 * x, c) for x, c in
                                  zip((items, merges, slots), self._split_floor))
        self._allocate(cap.batch, cap.tokens, cap.pages)

    def freeze(self, options: "PlanOptions | None" = None) -> None:
        """Fix the buffers where they are: a CUDA graph has captured their addresses (and,
        with `options`, the kernel variant of a plan with these options). From now on a
        batch that does not fit raises CapacityError instead of regrowing, and a plan
        that needs another kernel variant raises ValueError (_check_captured)."""
        self.frozen = True
        if options is not None and self._captured_options is None:
            self._captured_options = options

    def _check_captured(self, options: "PlanOptions") -> None:
        """ValueError naming what differs when a CUDA graph captured launches of another
        kernel variant than `options` need (the graph would replay that variant)."""
        was = self._captured_options
        if was is None or was.variant == options.variant:
            return
        diff = [f"{what} {'on' if new else 'off'} (captured {'on' if old else 'off'})"
                for what, old, new in (
                    ("causal / a window's right edge", was.bounded_right, options.bounded_right),
                    ("a sliding window", was.has_window, options.has_window),
                    ("softcap", was.softcap > 0, options.softcap > 0))
                if old != new]
        raise ValueError(f"podcute plan: {'; '.join(diff)}: a CUDA graph captured this "
                         "attention's launches with the other kernel variant, which a replay "
                         "would run. These are fixed at capture (README, CUDA graphs); use "
                         "another PODAttention (and graph) for the other kind of layer.")

    def _ensure_capacity(self, batch: int, tokens: int, pages: int) -> None:
        cap = self.capacity
        if batch <= cap.batch and tokens <= cap.tokens and pages <= cap.pages:
            return
        capturing = self._on_cuda and torch.cuda.is_current_stream_capturing()
        if self.frozen or capturing:
            over = [f"{what} {n} > {c} ({arg})" for what, n, c, arg in (
                ("requests", batch, cap.batch, "max_batch_size"),
                ("query tokens", tokens, cap.tokens, "max_num_tokens"),
                ("page-list entries", pages, cap.pages, "max_num_pages")) if n > c]
            why = "a CUDA graph has captured" if self.frozen else "CUDA graph capture holds"
            raise CapacityError(
                f"podcute plan: the batch exceeds the planner's capacity ({'; '.join(over)}) "
                f"and the buffers cannot grow: {why} their addresses. Construct PODAttention "
                "with larger capacities (the named arguments), or plan the largest batch "
                "before capturing.")
        self._sync_staging()
        self._check_limits(batch, tokens, pages)  # the batch itself within the hard limits

        def grow(n, c, limit):  # double, but never past the limit
            return c if n <= c else max(n, min(2 * c, limit))

        grown = (grow(batch, cap.batch, MAX_BATCH_SIZE), grow(tokens, cap.tokens, MAX_NUM_TOKENS),
                 grow(pages, cap.pages, MAX_NUM_PAGES))
        try:
            self._check_limits(*grown)
        except CapacityError:  # doubling would pass a limit the batch itself respects
            grown = (max(batch, cap.batch), max(tokens, cap.tokens), max(pages, cap.pages))
        batch, tokens, pages = grown
        self._allocate(batch, tokens, pages)

    def _sync_staging(self) -> None:
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous plan's H2D copies have read staging

    # ---- plan ---------------------------------------------------------------------------

    def plan(self, cu_seqlens_q, kv_lens=None, *, block_table=None, kv_indptr=None,
             kv_indices=None, last_page_len=None, causal: bool = True,
             sm_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
             batch_invariant: bool = False, _kv_name: str = "kv_lens") -> Plan:
        """Plan one batch (see the module docstring). KV lengths come from `kv_lens` or,
        with CSR pages, from `last_page_len`: kv_len = (pages - 1) * page_size + last.
        `window_size`, `softcap`, `batch_invariant`: docs/contract.md (PlanOptions).
        Raises ValueError naming the argument for a bad value; `_kv_name` is what the
        messages call kv_lens."""
        options = PlanOptions.make(causal, window_size, softcap, batch_invariant)
        if self.frozen:
            self._check_captured(options)
        if (block_table is None) == (kv_indices is None):
            raise ValueError("pass exactly one page format: block_table, or kv_indptr + "
                             "kv_indices")
        if kv_indices is not None and kv_indptr is None:
            raise ValueError("kv_indptr is required with kv_indices")
        if (kv_lens is None) == (last_page_len is None):
            raise ValueError(f"pass exactly one of {_kv_name} or last_page_len")
        if last_page_len is not None and kv_indptr is None:
            raise ValueError("last_page_len needs the CSR page format (kv_indptr + kv_indices)")
        h = host_arrays({"cu_seqlens_q": cu_seqlens_q, _kv_name: kv_lens,
                          "block_table": block_table, "kv_indptr": kv_indptr,
                          "kv_indices": kv_indices, "last_page_len": last_page_len})
        # One combined test in the common case; anything off takes the detailed checks,
        # which raise naming the first fault (and compute the same values otherwise).
        inputs = self._common_inputs(h, _kv_name)
        if inputs is None:
            inputs = self._checked_inputs(h, _kv_name)
        sm_scale = self.kernel_scale(sm_scale)
        if options.softcap > 0 and not (F32_TINY <= sm_scale / options.softcap
                                        and options.softcap <= F32_MAX):
            # the kernel computes softcap * tanh(s * (sm_scale / softcap)) in float32
            raise ValueError(f"softcap={options.softcap} with sm_scale={sm_scale}: sm_scale / "
                             "softcap must be a normal float32 (>= 1.2e-38) and softcap at most "
                             "3.4e38 (the kernel's float32); use softcap=0 for no cap")
        cu, q_len, kvl, used, total_q, page_src, num_entries = inputs
        self._ensure_capacity(q_len.size, total_q, num_entries)
        return self._build(cu, q_len, kvl, used, options, sm_scale, total_q, page_src,
                           num_entries)

    def _common_inputs(self, h, kv_name):
        """The batch's index arrays (as _checked_inputs returns them) when every check
        passes, tested with a few reductions instead of one pass per check; None when
        anything is off (or the input is unusual: B == 0, last_page_len, arrays not 1-D):
        then _checked_inputs finds and names the first fault."""
        ps = self.config.page_size
        cu, kv, bt = h["cu_seqlens_q"], h[kv_name], h["block_table"]
        B = cu.size - 1
        if kv is None or B < 1 or cu.ndim != 1 or kv.shape != (B,) or cu[0] != 0:
            return None
        cu = cu.astype(np.int64)
        kvl = kv.astype(np.int64)
        q_len = cu[1:] - cu[:-1]
        q_min, kv_max = q_len.min(), kvl.max()
        # non-decreasing cu_seqlens_q; 0 <= kv_len <= MAX_KV_LEN (causal q_len > kv_len is
        # legal: the first q_len - kv_len rows see no key)
        if q_min < 0 or kv_max > MAX_KV_LEN or kvl.min() < 0:
            return None
        needed = (kvl + (ps - 1)) // ps
        used = needed if q_min > 0 else needed * (q_len > 0)
        if bt is not None:
            max_needed = (int(kv_max) + ps - 1) // ps  # needed.max(): needed grows with kv_len
            if bt.ndim != 2 or bt.shape[0] != B or max_needed > bt.shape[1]:
                return None
            width = max_needed if q_min > 0 else int(used.max())
            page_src, num_entries = ("table", bt, width), B * width
        else:
            indptr, indices = h["kv_indptr"], h["kv_indices"]
            if indptr.shape != (B + 1,) or indices.ndim != 1:
                return None
            indptr = indptr.astype(np.int64)
            page_count = indptr[1:] - indptr[:-1]
            if (indptr[0] < 0 or page_count.min() < 0 or indptr[-1] > indices.size
                    or (needed - page_count).max() > 0):
                return None
            page_src, num_entries = ("csr", indices, indptr), int(indptr[-1] - indptr[0])
        return cu, q_len, kvl, used, int(cu[-1]), page_src, num_entries

    def _checked_inputs(self, h, kv_name):
        """Every check of the index inputs, in order, each raising a ValueError that names
        the argument; returns (cu, q_len, kv_len, pages used, total_q, page source,
        page-list entries). The page indices themselves are checked on the plan's copy
        (_stage_pages)."""
        ps = self.config.page_size
        cu = h["cu_seqlens_q"].reshape(-1).astype(np.int64)
        if cu.size < 1:
            raise ValueError("cu_seqlens_q must have B+1 >= 1 entries")
        B = cu.size - 1
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_q must start at 0, got {int(cu[0])}")
        q_len = cu[1:] - cu[:-1]
        if B and q_len.min() < 0:
            b = int((q_len < 0).argmax())
            raise ValueError(f"cu_seqlens_q must be non-decreasing; it decreases at index {b + 1} "
                             f"({int(cu[b])} -> {int(cu[b + 1])})")
        total_q = int(cu[-1])

        if h["block_table"] is not None:
            bt = h["block_table"]
            if bt.ndim != 2 or bt.shape[0] != B:
                raise ValueError(f"block_table must be [B={B}, max_pages], got shape "
                                 f"{tuple(bt.shape)}")
            page_count = None
            limit = bt.shape[1]
        else:
            indptr = h["kv_indptr"].reshape(-1).astype(np.int64)
            indices = h["kv_indices"].reshape(-1)
            if indptr.size != B + 1:
                raise ValueError(f"kv_indptr must have B+1={B + 1} entries, got {indptr.size}")
            page_count = limit = indptr[1:] - indptr[:-1]
            if indptr[0] < 0 or (B and page_count.min() < 0):
                raise ValueError("kv_indptr must be non-negative and non-decreasing")
            if indptr[-1] > indices.size:
                raise ValueError(f"kv_indptr[-1]={int(indptr[-1])} exceeds len(kv_indices)="
                                 f"{indices.size}")

        if h[kv_name] is not None:
            kv_src = kv_name
            kvl = h[kv_name].reshape(-1).astype(np.int64)
            if kvl.size != B:
                raise ValueError(f"{kv_name} must have B={B} entries, got {kvl.size}")
            if B and kvl.min() < 0:
                raise ValueError(f"{kv_name} must be >= 0, got {int(kvl.min())} at index "
                                 f"{int(kvl.argmin())}")
        else:
            kv_src = "last_page_len"
            lpl = h["last_page_len"].reshape(-1).astype(np.int64)
            if lpl.size != B:
                raise ValueError(f"last_page_len must have B={B} entries, got {lpl.size}")
            nonempty = page_count > 0
            bad = nonempty & ((lpl < 1) | (lpl > ps))
            if bad.any():
                b = int(bad.argmax())
                raise ValueError(f"last_page_len[{b}]={int(lpl[b])} must be in [1, page_size="
                                 f"{ps}] for a request with pages")
            kvl = ((page_count - 1) * ps + lpl) * nonempty
        if B and kvl.max() > MAX_KV_LEN:
            b = int(kvl.argmax())
            raise ValueError(f"{kv_src}[{b}] gives kv_len={int(kvl[b])}, past podcute's limit of "
                             f"{MAX_KV_LEN} KV tokens per request (int32 positions)")

        needed = (kvl + (ps - 1)) // ps
        bad = needed > limit
        if bad.any():
            b = int(bad.argmax())
            have = limit if page_count is None else int(limit[b])
            src = "block_table has" if page_count is None else "kv_indptr gives it"
            raise ValueError(f"{kv_src}[{b}] gives kv_len={int(kvl[b])}, which needs "
                             f"{int(needed[b])} pages of {ps} tokens, but {src} only {have}")

        # Pages actually read: those of requests with queries (checked by _stage_pages on
        # the plan's own copy, which is what the kernel reads).
        used = needed * (q_len > 0)
        # The page list the kernel reads is a plan-owned copy: a block table's first
        # max(used) columns of every row, or the CSR indices in use.
        if page_count is None:
            width = int(used.max()) if B else 0
            page_src, num_entries = ("table", bt, width), B * width
        else:
            page_src, num_entries = ("csr", indices, indptr), int(indptr[-1] - indptr[0])
        return cu, q_len, kvl, used, total_q, page_src, num_entries

    def kernel_scale(self, sm_scale) -> float:
        """sm_scale as a float (default 1/sqrt(head_dim)); ValueError unless it is a
        positive float32, the kernel's type."""
        if sm_scale is None:
            return 1.0 / math.sqrt(self.config.head_dim)
        given = sm_scale
        try:
            sm_scale = float(sm_scale)
        except OverflowError:  # an int past float64
            sm_scale = math.inf
        if 1e-37 < sm_scale < 1e38:  # a normal float32: no need for numpy's rounding
            return sm_scale
        with np.errstate(over="ignore"):
            f32 = np.float32(sm_scale)
        if not (np.isfinite(f32) and f32 > 0):
            raise ValueError(f"sm_scale must be a positive float32 (the kernel's type), got "
                             f"{given}")
        return sm_scale

    def _stage_pages(self, page_src, num_entries: int, used: np.ndarray):
        """Copy the pages into the plan-owned staging list (what the kernel will read),
        then bound and check *that copy*: whatever the caller writes to its tensors later,
        the checks and the kernel see the same pages. Returns (each request's offset in
        the list, the copy as a _PageSet, (lower, upper) bound of its page indices);
        ValueError naming the argument for a negative page index a request reads."""
        fmt, pages, arg = page_src
        B = used.size
        staged = self._page_staging[:num_entries]
        if fmt == "table":  # arg: columns copied (the most pages a request reads)
            table = staged.reshape(B, arg)
            if num_entries:
                table[:] = pages[:, :arg]
            start, copy = self._iota[:B] * arg, _PageSet(table, None, used)
            lo, hi = copy.bounds(arg)
        else:
            staged[:] = pages[arg[0]: arg[-1]]  # arg: kv_indptr
            start = arg[:-1] - arg[0]
            copy = _PageSet(None, (staged, arg - arg[0]), used)
            lo, hi = copy.bounds()
        if lo < 0:
            b, lo = copy.first_negative()
            if b >= 0:
                name = "block_table" if fmt == "table" else "kv_indices"
                raise ValueError(f"{name} holds a negative page index ({lo}) among the pages "
                                 f"request {b} reads")
        return start, copy, hi

    # ---- work ---------------------------------------------------------------------------

    def _span(self, kind, kv_start, kv_end):
        """KV tokens a piece costs: a prefill tile is tensor work whether its keys are all
        visible or not (whole tiles); decode streams the bytes of its tokens. kv_start
        None: 0."""
        if kind == Kind.PREFILL:
            tn = self.config.kernel.tile_n
            kv_end = (kv_end + (tn - 1)) // tn * tn
        return kv_end if kv_start is None else kv_end - kv_start

    def _presplit(self, b, e, fixed, rate, min_tiles, invariant_tokens=None):
        """Split KV ranges [b, e) (b tile-aligned; None: 0) into tile-aligned pieces of
        about equal work, each >= max(L / s, min_chunk) (L = these groups' work per CTA,
        s = chunks_per_cta) and >= min_tiles tiles; with `invariant_tokens`, into pieces
        of that many tokens from b (split points that depend on the request alone).
        Returns (group, index in group, kv start, kv end, pieces per group), or None
        when nothing splits."""
        tn = self.config.kernel.tile_n
        span = e if b is None else e - b
        t = (span + (tn - 1)) // tn
        if invariant_tokens is not None:
            tpc = np.full(e.size, invariant_tokens // tn, dtype=np.int64)
            nch = np.maximum((t + tpc - 1) // tpc, 1)
            if nch.max() <= 1:
                return None
        else:
            # (fixed summed in order, as plan_native.c does: numpy's sum is pairwise)
            load = (float(span.sum()) * rate + float(fixed.cumsum()[-1])) / self.grid
            c_k = max(load / self.cost.chunks_per_cta, self.cost.min_chunk_us)
            if float(span.max()) * rate <= c_k:
                return None
            nch = np.minimum(np.ceil(span * (rate / c_k)).astype(np.int64), t // min_tiles)
            if nch.max() <= 1:
                return None
            nch = np.maximum(nch, 1)
            tpc = (np.maximum(t, 1) + nch - 1) // nch  # KV tiles per piece
            nch = np.maximum((t + tpc - 1) // tpc, 1)
        src = np.arange(e.size).repeat(nch)
        j = _ragged_arange(nch, src.size)
        step = tpc[src] * tn
        s = j * step
        if b is not None:
            s += b[src]
        return src, j, s, np.minimum(s + step, e[src]), nch

    def _build(self, cu, q_len, kvl, used, options, sm_scale, total_q, page_src,
               num_entries) -> Plan:
        """Copy and check the pages, expand the batch into work rows, CTA lists, split
        slots and merges (written into the staging buffers: plan_native's C, else the
        numpy code below, which compute the same plan bit for bit), then write the rest
        of the metadata and make the Plan."""
        self._sync_staging()
        page_start, pages, max_page_index = self._stage_pages(page_src, num_entries, used)
        self._tiling = self._choose_tiling(q_len, options)
        lay = None
        if self._native is not None:
            lay = self._native.build(self, q_len, kvl, options)
        if lay is None:  # (no C compiler, or a capacity the numpy path grows or reports)
            lay = self._layout_numpy(q_len, kvl, options)
        cfg, grid, B = self.config, self.grid, q_len.size
        left, right = options.window_left, options.right
        hs = self._h
        hs["params"][Param.SM_SCALE] = sm_scale
        if options.softcap > 0:
            hs["params"][Param.SOFTCAP_SCALE] = sm_scale / options.softcap
            hs["params"][Param.SOFTCAP] = options.softcap
        hs["iparams"][IParam.WINDOW_LEFT] = left
        hs["iparams"][IParam.WINDOW_RIGHT] = right
        hs["cta_ptr"][:] = lay.ptr
        hs["q_start"][: B + 1] = cu
        hs["kv_len"][:B] = kvl
        hs["page_start"][:B] = page_start
        n = lay.n
        if self._on_cuda:
            end_off = self._segs["work"][0] + n * WORK_COLS
            self._meta[:end_off].copy_(self._staging_t[:end_off], non_blocking=True)
            if num_entries:
                self._page_list[:num_entries].copy_(self._page_staging_t[:num_entries],
                                                    non_blocking=True)
            if self._copy_done is None:
                self._copy_done = torch.cuda.Event()
            self._copy_done.record()

        # What the plan predicts (per-item and per-CTA times, the summary) is computed when
        # first read, from arrays nothing writes again: the kernel needs none of it. Until
        # then it holds the part costs and kinds (9 bytes a work row) and the cut parts'.
        rates = self._tiling.us[:2]
        costs = _once(lambda: self._predicted_costs(lay.pc, lay.kind, lay.ptr, lay.swaps,
                                                    lay.n0p, lay.fixes, rates, lay.order))
        counts = dict(num_requests=B, num_prefill_requests=lay.n_prefill_req,
                      num_decode_requests=lay.n_decode_req, num_split_items=lay.num_slots,
                      num_merges=lay.num_merge, grid=grid)
        summary = PlanSummary._lazy(lambda: self._summary_values(
            counts, costs()[1:], lay.kind, n, lay.n0d))
        return Plan(
            config=cfg, causal=bool(options.causal), sm_scale=sm_scale, options=options,
            total_q=total_q, batch_size=B, num_items=n, num_merge=lay.num_merge,
            num_slots=lay.num_slots, grid=grid, prefill_tile_m=self._tiling.tile_m,
            max_page_index=max_page_index,
            buffer_epoch=self.buffer_epoch, summary=summary, kernel_args=self.kernel_args,
            q_lens=q_len, kv_lens=kvl, needed_pages=used, _pages=pages, _buffers=self._d,
            _num_page_entries=num_entries, _costs=costs)

    def _group_lists(self, wk: np.ndarray, ptr: np.ndarray, decode: np.ndarray) -> np.ndarray:
        """The work rows `wk` (in stream order, `decode` True for a decode row) regrouped
        by kind within each CTA list, in place: the first list of an SM (`_odd` False)
        all its prefill rows first, the second all its decode rows first, each kind in its
        order (plan_native.c does the same). Returns where each row went."""
        n = wk.shape[0]
        counts = np.diff(ptr)
        first = decode == np.repeat(self._odd, counts)  # the list's first kind
        before = np.zeros(n + 1, dtype=np.int64)  # first-kind rows before each row
        np.cumsum(first, out=before[1:])
        at_start = before[ptr[:-1]]
        rank_first = before[:-1] - np.repeat(at_start, counts)
        n_first = before[ptr[1:]] - at_start
        pos_in_list = np.arange(n) - np.repeat(ptr[:-1], counts)
        dest = np.repeat(ptr[:-1], counts) + np.where(
            first, rank_first, np.repeat(n_first, counts) + pos_in_list - rank_first)
        grouped = np.empty_like(wk)
        grouped[dest] = wk
        wk[:] = grouped
        return dest

    def _layout_numpy(self, q_len, kvl, options) -> "Layout":
        """The work rows, merges and slot list of the batch in the staging buffers, and
        what the predictions need (numpy; plan_native.c is the same in C)."""
        cfg, kcfg, grid = self.config, self.config.kernel, self.grid
        causal, bounded, right = options.causal, options.bounded_right, options.right
        left = options.window_left
        tm_p, tm_d, tn = self._tiling.tile_m, kcfg.tile_m_decode, kcfg.tile_n
        G, Hkv = cfg.group_size, cfg.num_kv_heads
        B = q_len.size
        r_p, r_d, r_row, o_p, o_d = self._tiling.us

        rows = q_len * G
        is_pre = rows > tm_d
        preq = is_pre.nonzero()[0]
        if preq.size or not rows.all():
            dreq = ((rows > 0) ^ is_pre).nonzero()[0]  # 0 < rows <= tm_d
            d_rows, d_kv = rows[dreq], kvl[dreq]
        else:  # the common decode step: every request is decode work
            dreq, d_rows, d_kv = self._iota[:B], rows, kvl

        # ---- groups: work items before KV splitting ---------------------------------------
        # prefill (request, kv head, tm_p-row tile), then decode (request, kv head). tmpl
        # holds each group's work row, fixed its fixed cost.
        if preq.size:
            n_rt = (rows[preq] + (tm_p - 1)) // tm_p  # row tiles per prefill request
            n_tiles = int(n_rt.sum())
            n0p = n_tiles * Hkv
        else:
            n0p = 0
        n0d = dreq.size * Hkv
        n0 = n0p + n0d
        tmpl = np.empty((n0, WORK_COLS), dtype=np.int32)
        kv_end = np.empty(n0, dtype=np.int64)  # each group's KV range is [kv_begin, kv_end)
        # a tile-aligned start when a window's left edge skips keys, else 0 (None)
        kv_begin = np.zeros(n0, dtype=np.int64) if left >= 0 else None
        fixed = np.empty(n0)
        kinds = []  # per kind: (kind, its groups, cost per KV token)
        if n0p:
            # The row tiles, in (request, tile) order: the KV heads of one are alike.
            req = preq.repeat(n_rt)
            row_start = _ragged_arange(n_rt, n_tiles) * tm_p
            row_end = np.minimum(row_start + tm_p, rows[req])
            # keys no row of the item sees are never loaded
            e = visible_end_host(kvl[req], q_len[req], row_end, G, bounded, right)
            if left >= 0:  # nor those left of every row's window (whole tiles)
                b = load_start_host(kvl[req], q_len[req], row_start, G, left, e, tn)
                e_len = e - b  # the zigzag sorts by the work, not the end
            else:
                b, e_len = None, e
            # Zigzag the groups by length (longest, shortest, next longest, ...): every
            # stretch of the stream, so every CTA list, then holds long and short tiles in
            # the batch's proportion, and per-item costs the model misses spread evenly.
            # "By length" is a stable sort of the groups in (request, head, tile) order:
            # the tiles sorted stably, each followed by its heads, except that a request's
            # tiles of equal length (a run) go head by head (below).
            srt = e_len.argsort(kind="stable")
            e, e_len, req = e[srt], e_len[srt], req[srt]
            by_len = np.empty((n_tiles, Hkv, WORK_COLS), dtype=np.int32)
            by_len[:] = self._group_rows[Kind.PREFILL]  # KV_HEAD = head, KIND = PREFILL
            by_len[:, :, WorkCol.REQ] = req[:, None]
            by_len[:, :, WorkCol.ROW_START] = row_start[srt][:, None]
            by_len[:, :, WorkCol.ROW_END] = row_end[srt][:, None]
            by_len = _rows(by_len.reshape(n0p, WORK_COLS))
            # continues the tile before (the same KV range)
            run = (e[1:] == e[:-1]) & (req[1:] == req[:-1])
            if b is not None:
                b = b[srt]
                run &= b[1:] == b[:-1]
            if run.any():
                first = np.concatenate(([True], ~run)).nonzero()[0]  # each run's first tile
                run_len = np.diff(first, append=n_tiles)
                r = np.arange(first.size).repeat(run_len)  # run of each tile
                # group (tile p, head h) of a run of L tiles from tile f: f * Hkv + h * L + p - f
                pos = (first * (Hkv - 1))[r] + np.arange(n_tiles)
                pos = pos[:, None] + run_len[r][:, None] * np.arange(Hkv)
                ordered = np.empty_like(by_len)
                ordered[pos.reshape(-1)] = by_len
                by_len = ordered
            e = e.repeat(Hkv)  # (a run's tiles are of one KV range)
            half = (n0p + 1) // 2
            zig = _rows(tmpl[:n0p])
            zig[0::2], zig[1::2] = by_len[::-1][:half], by_len[: n0p - half]
            ends = kv_end[:n0p]
            ends[0::2], ends[1::2] = e[::-1][:half], e[: n0p - half]
            if b is not None:
                b = b.repeat(Hkv)
                begins = kv_begin[:n0p]
                begins[0::2], begins[1::2] = b[::-1][:half], b[: n0p - half]
            fixed[:n0p] = o_p
            kinds.append((Kind.PREFILL, slice(0, n0p), r_p))
        if n0d:
            t = tmpl[n0p:].reshape(dreq.size, Hkv, WORK_COLS)
            t[:] = self._group_rows[Kind.DECODE]  # KV_HEAD = head, ROW_START = 0
            t[:, :, WorkCol.REQ] = dreq[:, None]
            t[:, :, WorkCol.ROW_END] = d_rows[:, None]
            # the causal clip is a no-op for an item holding all rows of its request (not
            # a window's right edge, nor its left)
            if options.has_window:
                d_q = q_len[dreq]
                d_e = visible_end_host(d_kv, d_q, d_rows, G, bounded, right)
                kv_end[n0p:].reshape(dreq.size, Hkv)[:] = d_e[:, None]
                if left >= 0:
                    d_b = load_start_host(d_kv, d_q, 0, G, left, d_e, tn)
                    kv_begin[n0p:].reshape(dreq.size, Hkv)[:] = d_b[:, None]
            else:
                kv_end[n0p:].reshape(dreq.size, Hkv)[:] = d_kv[:, None]
            fixed[n0p:].reshape(dreq.size, Hkv)[:] = (d_rows * r_row + o_d)[:, None]
            kinds.append((Kind.DECODE, slice(n0p, n0), r_d))

        # ---- pieces of each kind: groups pre-split to <= the kind's work per CTA -----------
        # so each kind reaches every CTA and co-runs with the other on every SM.
        invariant = options.batch_invariant
        splits = [self._presplit(None if kv_begin is None else kv_begin[sl], kv_end[sl],
                                 fixed[sl], rate, self._tiling.min_tiles[kind_k],
                                 INVARIANT_SPLIT_TOKENS[kind_k] if invariant else None)
                  for kind_k, sl, rate in kinds]
        if not any(splits):  # (each is None or a tuple)
            # The pieces are the groups (g1 None: piece i is group i), with their KV ranges.
            nch_g = g1 = j1 = None
            s1 = np.zeros(n0, dtype=np.int64) if kv_begin is None else kv_begin
            e1, c1 = kv_end, np.empty(n0)
            for kind_k, sl, rate in kinds:
                b_k = None if kv_begin is None else kv_begin[sl]
                np.add(fixed[sl], self._span(kind_k, b_k, kv_end[sl]) * rate, out=c1[sl])
            n1p = n0p
        else:
            nch_g = np.ones(n0, dtype=np.int64)  # pieces per group
            cols = []  # per kind: group, index in group, kv start, kv end, cost
            for (kind_k, sl, rate), sp in zip(kinds, splits):
                e, f, g0 = kv_end[sl], fixed[sl], sl.start
                if sp is None:
                    z = np.zeros(e.size, dtype=np.int64)
                    b_k = z if kv_begin is None else kv_begin[sl]
                    cols.append((np.arange(g0, g0 + e.size), z, b_k, e,
                                 f + self._span(kind_k, b_k, e) * rate))
                else:
                    src, j, s, e2, nch = sp
                    nch_g[sl] = nch
                    cols.append((src + g0, j, s, e2,
                                 f[src] + self._span(kind_k, s, e2) * rate))
            n1p = cols[0][0].size if n0p else 0
            g1, j1, s1, e1, c1 = (np.concatenate(x) for x in zip(*cols)) if len(cols) == 2 \
                else cols[0]
        n1 = c1.size

        # ---- one stream, cut into the CTA lists ------------------------------------------
        # Merge the kinds by progress through their own kind (start / kind total): any
        # stretch of the stream then holds prefill and decode work in the batch's
        # proportion, interleaved. Cut the stream into `grid` runs of equal cost; the piece
        # under a boundary is split there at a KV tile when both sides keep >= min_chunk
        # of work, else it goes whole to the CTA holding its midpoint. So a CTA's load is
        # the mean +- about one KV tile plus an overhead.
        both = bool(n0p and n0d)
        if both:
            x = c1.cumsum()
            p_tot, total = float(x[n1p - 1]), float(x[-1])
            x -= c1  # each piece's start, then its progress through its kind
            x[:n1p] *= 1.0 / p_tot
            x[n1p:] -= p_tot
            x[n1p:] *= 1.0 / (total - p_tot)
            order = x.argsort(kind="stable")  # two sorted runs: a merge; prefill first at ties
            c = c1[order]
        else:
            order, c = None, c1
        cum = np.empty(n1 + 1)  # cost before each piece, and the total
        cum[0] = 0.0
        end = c.cumsum(out=cum[1:])
        bounds = self._bounds_unit * float(cum[-1])

        m = 0
        if n1:
            i = end.searchsorted(bounds, "right")  # the piece under each boundary
            if i.size and i[-1] >= n1:  # boundaries at the very end (rounding): none
                i = i[: i.searchsorted(n1)]
            ch = order[i] if both else i
            s_i, e_i, c_i = s1[ch], e1[ch], c[i]
            span_t = (e_i - s_i + (tn - 1)) // tn
            mt = self._tiling.mt[(ch >= n1p).view(np.int8)] if both else \
                self._tiling.mt[Kind.PREFILL if n0p else Kind.DECODE]
        # A cut must leave >= min_tiles on both sides: none when no piece under a boundary
        # has 2 * min_tiles (then skip the search).
        # A batch-invariant plan never cuts: a piece's KV range is the request's own.
        if n1 and not invariant and (span_t >= 2 * mt).any():
            start_i = end[i] - c_i
            k = np.rint((bounds[: i.size] - start_i) / c_i * span_t).astype(np.int64)
            # Boundaries closer than min_tiles under one piece (per-CTA load below
            # min_chunk): snap that piece's cuts to multiples of min_tiles and drop repeats,
            # so every part keeps >= min_tiles tiles (k ascends within a piece).
            ok = (k >= mt) & (k <= span_t - mt)
            if i.size > 1:
                same = i[1:] == i[:-1]
                mt1 = mt[1:] if both else mt
                close = same & (k[1:] - k[:-1] < mt1)
                if close.any():
                    snap = np.zeros(n1, dtype=bool)
                    snap[i[1:][close]] = True
                    sn = snap[i]
                    k[sn] = (k[sn] + mt // 2) // mt * mt if not both else \
                        (k[sn] + mt[sn] // 2) // mt[sn] * mt[sn]
                    ok = (k >= mt) & (k <= span_t - mt)
                    ok[1:] &= ~(same & (k[1:] == k[:-1]))
            m = np.count_nonzero(ok)

        if m:
            ci, ck, cspan = i[ok], k[ok], span_t[ok]
            npc = np.bincount(ci, minlength=n1)
            npc += 1
            src = np.arange(n1).repeat(npc)  # stream position of each part
            cut_pos = ci + np.arange(1, m + 1)  # the part that starts at each cut
            cut_kv = np.minimum(s_i[ok] + ck * tn, e_i[ok])
            cut_u = start_i[ok] + c_i[ok] * ck / cspan  # the cut in stream cost coordinates
            chunk = order[src] if both else src
        else:
            chunk = order  # None: identity
        if chunk is None:  # (g None: part i is group i)
            g, kv_s, kv_e, pc, n = g1, s1, e1, c1, n1
        else:
            kv_e, n = e1[chunk], chunk.size
            g, kv_s = (chunk if g1 is None else g1[chunk]), s1[chunk]
            pc = c[src] if m else c  # each part's cost, the piece's until fixed (below)
        kind = (chunk >= n1p) if both else None  # True: decode
        fix = None  # the parts next to a cut, whose costs are their own
        if m:
            u_hi = end[src]  # each part's span in stream cost coordinates
            u_lo = u_hi - pc
            u_lo[cut_pos] = cut_u
            u_hi[cut_pos - 1] = cut_u
            mid = 0.5 * (u_lo + u_hi)
            kv_s[cut_pos] = cut_kv
            kv_e[cut_pos - 1] = cut_kv
            fix = np.concatenate((cut_pos - 1, cut_pos))
        else:
            mid = end - 0.5 * c

        # ---- CTA lists: part midpoints (stream coordinates) against the boundaries -------
        ptr = np.empty(grid + 1, dtype=np.int64)
        ptr[0] = 0
        ptr[1:grid] = mid.searchsorted(bounds, "left")
        ptr[grid] = n

        # ---- split slots and merges: a group with >= 2 parts writes partials --------------
        # Its slots are contiguous: pre-split piece j takes local slot j, the part after
        # the r-th cut of the group takes (pieces of the group) + r.
        num_slots = num_merge = 0
        if m and nch_g is None:
            # Only the cut split groups, and a cut group's parts are adjacent: number the
            # parts next to a cut in stream order.
            split = np.zeros(n, dtype=bool)
            split[fix] = True
            at = split.nonzero()[0]
            num_slots = at.size
            slot = np.full(n, -1, dtype=np.int64)
            slot[at] = np.arange(num_slots)
            first_cut = np.concatenate(([True], ci[1:] != ci[:-1]))
            firsts = cut_pos[first_cut] - 1
            num_merge = firsts.size
            m_rows = g[firsts]
            m_first = slot[firsts]
            m_count = npc[ci[first_cut]]
        elif nch_g is not None:
            gcount = nch_g
            if m:
                gc = g[cut_pos]
                gcount = nch_g + np.bincount(gc, minlength=n0)
            m_rows = (gcount > 1).nonzero()[0]
            num_merge = m_rows.size
            m_count = gcount[m_rows]
            m_end = m_count.cumsum()
            num_slots = int(m_end[-1]) if num_merge else 0
            m_first = m_end - m_count
            # A part's slot = its group's first slot + its local slot; -1 (and local slot
            # 0) outside split groups.
            first_slot = np.full(n0, -1, dtype=np.int64)
            first_slot[m_rows] = m_first
            loc = j1[chunk] if chunk is not None else j1.copy()
            if m:
                o = gc.argsort(kind="stable")
                gs = gc[o]
                rank = np.empty(m, dtype=np.int64)
                rank[o] = np.arange(m) - gs.searchsorted(gs)
                loc[cut_pos] = nch_g[gc] + rank
            slot = first_slot[g] + loc
        cap = self.capacity
        if n > cap.items or num_merge > cap.merges or num_slots > cap.slots:
            if not invariant:
                raise AssertionError("podcute planner exceeded its capacity bound "
                                     f"({n}/{cap.items} items, {num_merge}/{cap.merges} "
                                     f"merges, {num_slots}/{cap.slots} slots)")
            # Fixed-size splits grow with the KV lengths, which no capacity bounds.
            self._grow_splits(n, num_merge, num_slots)

        # ---- write the metadata -------------------------------------------------------------
        hs = self._h
        wk = hs["work"][:n]
        if g is None:
            wk[:] = tmpl
        else:
            np.take(_rows(tmpl), g, out=_rows(wk))
        wk[:, WorkCol.KV_START] = kv_s
        wk[:, WorkCol.KV_END] = kv_e
        wk[:, WorkCol.SPLIT_SLOT] = slot if num_slots else -1
        swaps = None  # (rows, rows): list heads swapped with a later row of the other kind
        order = None  # where each row went when the lists were grouped by kind
        if both and self._group_kinds:
            order = self._group_lists(wk, ptr, kind)
        elif both:
            # Even lists start with prefill, odd ones with decode (when they hold both): swap
            # the first row with the first one of the wanted kind (all rows between are of
            # the other kind, so only that row moves within its kind's order).
            a, b = ptr[:-1], ptr[1:]
            ip, idd = (~kind).nonzero()[0], kind.nonzero()[0]
            f = np.where(self._odd, idd[np.minimum(idd.searchsorted(a), idd.size - 1)],
                         ip[np.minimum(ip.searchsorted(a), ip.size - 1)])
            moved = (f > a) & (f < b)
            if moved.any():
                swaps = a[moved], f[moved]
                rv = _rows(wk)
                rv[swaps[0]], rv[swaps[1]] = rv[swaps[1]], rv[swaps[0]].copy()
        if n0d:
            # A decode item's ordinal among its CTA list's decode items, above the kind
            # bit: the phase of the kernel's decode hand-over (metadata.KIND_BITS).
            kind_col = wk[:, WorkCol.KIND]
            dec = kind_col == Kind.DECODE
            before = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(dec, out=before[1:])
            ordinal = before[:-1] - np.repeat(before[ptr[:-1]], np.diff(ptr))
            kind_col[dec] |= (ordinal[dec] << KIND_BITS).astype(np.int32)
        if num_merge:
            mr = hs["merge"][:num_merge]
            mr[:, MergeCol.REQ: MergeCol.ROW_END + 1] = tmpl[m_rows, WorkCol.REQ: WorkCol.ROW_END + 1]
            mr[:, MergeCol.FIRST_SLOT] = m_first
            mr[:, MergeCol.NUM_SPLITS] = m_count
            hs["slot_merge"][:num_slots] = np.arange(num_merge).repeat(m_count)
        fixes = None if fix is None else (fix, fixed[g[fix]], kv_s[fix], kv_e[fix])
        return Layout(n, num_merge, num_slots, ptr, pc, kind, swaps, fixes, n0p, n0d,
                      preq.size, dreq.size, order)

    def _predicted_costs(self, pc, kind, ptr, swaps, n0p, fixes, rates, order=None):
        """(predicted time of each work row, of each CTA list, of each list's prefill
        rows). pc: each part's cost, its piece's for the parts next to a cut, which have
        their own: `fixes` = (those parts, their fixed costs, KV starts, KV ends), or None;
        kind: True for decode (None: all of one kind); swaps: the rows the list heads
        were swapped with; rates: the batch's prefill and decode cost per KV token."""
        r_p, r_d = rates
        if fixes is not None:
            fix, f, s, e = fixes
            pc = pc.copy()
            if kind is not None:
                dec_fix = kind[fix]
                span = np.where(dec_fix, self._span(Kind.DECODE, s, e),
                                self._span(Kind.PREFILL, s, e))
                rate = np.where(dec_fix, r_d, r_p)
            else:
                k_fix = Kind.PREFILL if n0p else Kind.DECODE
                span = self._span(k_fix, s, e)
                rate = r_p if n0p else r_d
            pc[fix] = f + span * rate
        cum = np.zeros(pc.size + 1)
        pc.cumsum(out=cum[1:])
        cta_cost = cum[ptr[1:]] - cum[ptr[:-1]]
        if kind is not None:
            (pc * ~kind).cumsum(out=cum[1:])
            p_cost = cum[ptr[1:]] - cum[ptr[:-1]]
        else:
            p_cost = cta_cost if n0p else cta_cost * 0
        item_cost = pc
        if swaps is not None:
            fa, ff = swaps
            item_cost = pc.copy()
            item_cost[fa], item_cost[ff] = pc[ff], pc[fa]
        if order is not None:  # (the lists grouped by kind: the same rows, moved)
            moved = np.empty_like(item_cost)
            moved[order] = item_cost
            item_cost = moved
        return item_cost, cta_cost, p_cost

    def _summary_values(self, counts, costs, kind, n, n0d):
        """PlanSummary's fields: `counts` plus the predictions from the per-CTA costs
        (all rows, prefill rows) and the rows' kinds (True: decode; None: all of one
        kind, decode if n0d)."""
        cta_cost, p_us = costs
        spm = self.config.kernel.ctas_per_sm
        per_sm = cta_cost.reshape(spm, -1).T
        p_sm = p_us.reshape(spm, -1).T
        mean = cta_cost.mean()
        n_d = int(kind.sum()) if kind is not None else (n if n0d else 0)
        # The HBM bound of the whole batch: every decode byte at the full-chip rate.
        d_total = (float((cta_cost - p_us).sum()) * self.cost.decode_sm_bandwidth
                   / self.cost.ref_num_sms)
        return dict(
            counts, num_prefill_items=n - n_d, num_decode_items=n_d,
            predicted_prefill_us=float(p_us.max()),
            predicted_decode_us=float((cta_cost - p_us).max()),
            predicted_us=float(max(per_sm.max(), p_sm.sum(1).max(),
                                   (per_sm - p_sm).sum(1).max(), d_total)),
            balance=float(cta_cost.max() / mean) if mean > 0 else 1.0)
