"""What the planner hands out and what bounds it: the hard limits, :class:`CapacityError`,
the plan itself (:class:`Plan`, :class:`PlanSummary`, :class:`PlanConfig`), the buffer
sizes (:class:`Capacities`, :func:`capacities`) and a work expansion's result
(:class:`Layout`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from podcute.kernels.args import PlanTensors
from podcute.kernels.config import KernelConfig
from podcute.kernels.metadata import WORK_COLS
from podcute.planning.cost import DEFAULT_COST_MODEL

if TYPE_CHECKING:
    from podcute.planning.inputs import _PageSet
    from podcute.planning.options import PlanOptions

# Limits that keep every index the kernel computes inside int32 and the buffers sane.
MAX_KV_LEN = 2**31 - 1 - 1024  # token positions (+ one KV tile) stay int32
MAX_BATCH_SIZE = 2**20
MAX_NUM_TOKENS = 2**23
MAX_NUM_PAGES = 2**30  # page-list entries (page_start + page index stay int32)
MAX_WORK_ITEMS = 2**31 // WORK_COLS // 2


# float32's smallest normal and largest finite values: scales the kernel reads as float32
# must lie between them (a subnormal flushes to 0 in its fast math).
F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


# The torch twin of the kernel's plan bundle (kernels/args.py): the planner's whole
# buffers under the same names, in the same order, and log2 of the page size.
PlanBuffers = NamedTuple(
    "PlanBuffers",
    [(name, torch.Tensor) for name in PlanTensors._fields if name != "page_shift"]
    + [("page_shift", int)])


class CapacityError(ValueError):
    """A batch does not fit the planner's buffers, which cannot grow: a CUDA graph holds
    their addresses (after :meth:`Planner.freeze`), or the size is past a hard limit."""


# Batch-invariant plans split a request's KV range at fixed multiples of these many tokens
# (prefill, decode: Kind order), whatever else shares the batch.
INVARIANT_SPLIT_TOKENS = (8192, 4096)


@dataclass(frozen=True)
class PlanConfig:
    num_qo_heads: int
    num_kv_heads: int
    group_size: int  # G = Hq // Hkv: query heads per KV head, packed into rows
    head_dim: int
    page_size: int
    kernel: KernelConfig  # tiling (and default flags) of the kernel this plan is cut for


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


class Layout(NamedTuple):
    """What a work expansion (Planner._layout_numpy, or native's C) hands the rest of
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
    # Shared prefixes (planning/sharing.py): runs of leading pages several requests share,
    # attended once as multi-request tiles. shared_kv_tokens: the KV tokens those tiles
    # read (each run once); saved_kv_tokens: the tokens the sharers no longer read.
    # (No defaults: a lazy summary finds its fields through __getattr__, which a class
    # attribute would shadow.)
    num_shared_prefixes: int
    num_sharing_requests: int
    num_shared_tiles: int
    shared_kv_tokens: int
    saved_kv_tokens: int
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
            + (f"\n  shared prefixes: {self.num_shared_prefixes} runs of "
               f"{self.shared_kv_tokens} KV tokens shared by {self.num_sharing_requests} "
               f"requests ({self.num_shared_tiles} tiles), {self.saved_kv_tokens} KV token "
               "reads saved" if self.num_shared_prefixes else "")
        )

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
    # the planner's whole buffers and its grid: (*PlanBuffers, num_ctas), the kernel's
    # order after the caller's tensors (kernels/args.py)
    kernel_args: tuple = field(repr=False)
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
    # Requests [0, this) read a second cache when run() is given one (a `second_cache`
    # launch: FlashInfer's BatchPOD with separate caches); the plan word
    # IParam.SECOND_CACHE_REQUESTS holds it.
    second_cache_requests: int = 0
    # The plan runs the `shared_prefix` kernel variant (it shares a prefix, or a CUDA graph
    # captured that variant).
    shares: bool = False
    # the (first, second) cache page counts check_second_cache_pages last passed
    _two_cache_pages: tuple = field(repr=False, default=None)
    # launch's compiled kernels of this plan, by its flags (lse | sinks << 1 | ragged << 2
    # | second cache << 3): a list index per run() instead of a dict lookup that hashes the
    # whole configuration
    _kernels: list = field(repr=False, default_factory=lambda: [None] * 16)

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

    def check_second_cache_pages(self, num_pages: int, num_pages2: int,
                                 name: str = "block_table") -> None:
        """check_pages of a run over two caches: requests [0, second_cache_requests) read
        the second (num_pages2 pages), the others the first (num_pages). O(1) when plan()'s
        bound shows every page fits both; else O(pages read), once per pair of counts."""
        if self._two_cache_pages == (num_pages, num_pages2):
            return
        if not self.pages_within(min(num_pages, num_pages2)):
            req, pages = self._pages._flat()
            second = req < self.second_cache_requests
            bad = (pages >= np.where(second, num_pages2, num_pages)).nonzero()[0]
            if bad.size:
                b, page = int(req[bad[0]]), int(pages[bad[0]])
                which, n = (("the second cache", num_pages2) if second[bad[0]]
                            else ("the first cache", num_pages))
                raise ValueError(
                    f"{name}: request {b} reads page {page}, but {which} (requests "
                    f"{'<' if second[bad[0]] else '>='} {self.second_cache_requests} read it) "
                    f"has only {n} pages; page indices must be in [0, {n})")
        self._two_cache_pages = (num_pages, num_pages2)
