"""Host planner: turns one mixed batch into the int32 work metadata the fused kernel runs.

Once per engine step (the kernel then runs once per layer with the same plan):

1. normalise the page format (block table or CSR) and the KV lengths (``kv_lens`` or
   FlashInfer's ``last_page_len``) into host numpy arrays and validate the values
   (inputs.py);
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
   splitting the piece under a boundary at a KV tile (steps 2-4: the work expansion,
   expand.py, or the same in C, native.c);
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

import numpy as np
import torch

from podcute.kernels.config import SUPPORTED_PAGE_SIZES, KernelConfig
from podcute.kernels.metadata import (MERGE_COLS, NUM_PARAMS, WORK_COLS, IParam, Kind, Param,
                                      WorkCol)
from podcute.planning import native
from podcute.planning.cost import (DEFAULT_COST_MODEL, H200_HBM_BYTES_PER_SM_CLOCK, CostModel,
                                   PrefillTiling, chip_hbm_bytes_per_sm_clock)
from podcute.planning.expand import WorkExpansion
from podcute.planning.inputs import _PageSet, batch_inputs
from podcute.planning.options import PlanOptions
from podcute.planning import sharing
from podcute.planning.types import (F32_MAX, F32_TINY, MAX_BATCH_SIZE, MAX_NUM_PAGES,
                                    MAX_NUM_TOKENS, MAX_WORK_ITEMS, CapacityError, Plan,
                                    PlanBuffers, PlanConfig, PlanSummary, capacities)

_ALIGN = 16  # int32 elements: metadata segments start on 64-byte boundaries


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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


class Planner(WorkExpansion):
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
                 hbm_bytes_per_sm_clock: float | None = None, head_dim_vo: int | None = None):
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
        head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo
        kernel = KernelConfig.select(dtype, head_dim, G, page_size=page_size,  # names head_dim
                                     kv_dtype=kv_dtype, arch=arch, head_dim_vo=head_dim_vo)
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
        # Shared prefixes (sharing.py): the split slots their partials may take beyond the
        # expansion's (grown on demand until a CUDA graph holds the buffers), and whether
        # a graph captured the shared_prefix variant (None: no capture yet).
        self._share_slots = 16 * num_kv_heads
        self._share_terms = 16 * num_kv_heads * max_batch_size
        self._captured_shares = None
        self._last_shared = False  # the last plan shared: the next looks first (_build)
        self._kernel_shares = dataclasses.replace(kernel, shared_prefix=True).can_implement()[0]
        # (max q_len, min kv_len - q_len) of requests that may share: sharing's first test
        self._share_bounds = sharing.candidate_bounds(self.config.group_size, page_size,
                                                      kernel.tile_m_decode)
        # The K and V bytes of one token, every KV head: what a sharer's plain plan reads.
        self._token_bytes = num_kv_heads * (head_dim + head_dim_vo) * (1 if kernel.fp8 else 2)
        self._allocate(max_batch_size, max_num_tokens, max_num_pages)
        # The work expansion in C (None: no C compiler here, or PODCUTE_PLANNER=numpy).
        self._native = native.load()

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
        # Room for shared prefixes (sharing.py): up to `batch` prefix tiles, each a request
        # (two entries: its start and end) with a row tile per KV head; a merge per
        # (sharer, head) and a feed row per tile group; their slots; the tiles' tokens
        # and terms in the shared list.
        tiles, Hkv = cap.batch, cfg.num_kv_heads
        self._share_cap = dict(tiles=tiles, merges=Hkv * (cap.batch + tiles),
                               slots=self._share_slots, tokens=2 * cap.tokens,
                               terms=self._share_terms)
        self._base_cap = cap
        cap = dataclasses.replace(cap, items=cap.items + Hkv * tiles)
        n_req = cap.batch + 1 + 2 * tiles
        merges_all = cap.merges + self._share_cap["merges"]
        slots_all = cap.slots + self._share_cap["slots"]
        shared_list = self._share_cap["tokens"] + 2 * self._share_cap["terms"]
        # One int32 buffer with fixed segment offsets -> one H2D copy of a prefix per plan
        # (the shared list after the work rows: sent only when a plan shares); the page
        # list is a second buffer (its own capacity), sent with a second copy.
        segs, off = {}, 0
        for name, n in (("params", NUM_PARAMS), ("cta_ptr", grid + 1),
                        ("q_start", n_req + 1), ("kv_len", n_req),
                        ("page_start", n_req), ("merge", merges_all * MERGE_COLS),
                        ("slot_merge", slots_all), ("work", cap.items * WORK_COLS),
                        ("shared", shared_list)):
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
        self._merge_sem = torch.zeros(merges_all, dtype=torch.int32, device=dev)
        D, tm = cfg.kernel.head_dim, cfg.kernel.partial_rows  # (the tile's: whole fragments)
        self._partial_o = torch.empty(slots_all, tm, D, dtype=torch.float32, device=dev)
        self._partial_lse = torch.empty(slots_all, tm, dtype=torch.float32, device=dev)
        self.capacity = cap
        self.buffer_epoch += 1
        # Views built once: slicing tensors per plan costs microseconds.
        self._d = {k: self._meta[o: o + n] for k, (o, n) in segs.items()}
        self._h = {k: self._staging[o: o + n] for k, (o, n) in segs.items()}
        self._d["merge"] = self._d["merge"].view(merges_all, MERGE_COLS)
        self._d["work"] = self._d["work"].view(cap.items, WORK_COLS)
        self._d["iparams"] = self._d["params"]  # int32 words (metadata.IParam)
        self._d["params"] = self._d["params"].view(torch.float32)
        self._h["merge"] = self._h["merge"].reshape(merges_all, MERGE_COLS)
        self._h["work"] = self._h["work"].reshape(cap.items, WORK_COLS)
        self._h["iparams"] = self._h["params"]
        self._h["params"] = self._h["params"].view(np.float32)
        d = self._d
        d["page_list"], d["merge_sem"] = self._page_list, self._merge_sem  # for Plan's views
        self._iota = np.arange(cap.batch + 1)  # request indices, sliced instead of made
        # The kernel's metadata arguments: whole buffers, the same tuple for every plan of
        # this buffer epoch (so a CUDA graph that captured them stays valid).
        self.buffers = PlanBuffers(
            mWork=d["work"], mCtaPtr=d["cta_ptr"], mQStart=d["q_start"], mKvLen=d["kv_len"],
            mPageStart=d["page_start"], mPageList=self._page_list, mPartialO=self._partial_o,
            mPartialLSE=self._partial_lse, mMerge=d["merge"], mSlotMerge=d["slot_merge"],
            mMergeSem=self._merge_sem, mParams=d["params"], mIParams=d["iparams"],
            mShared=d["shared"], page_shift=cfg.page_size.bit_length() - 1)
        self.kernel_args = (*self.buffers, grid)

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

    def freeze(self, options: "PlanOptions | None" = None, shares: bool | None = None) -> None:
        """Fix the buffers where they are: a CUDA graph has captured their addresses (and,
        with `options`, the kernel variant of a plan with these options). From now on a
        batch that does not fit raises CapacityError instead of regrowing, and a plan
        that needs another kernel variant raises ValueError (_check_captured). `shares`:
        the captured plan ran the shared_prefix variant, which every later plan then runs
        (False: later plans share nothing)."""
        self.frozen = True
        if options is not None and self._captured_options is None:
            self._captured_options = options
        if shares is not None and self._captured_shares is None:
            self._captured_shares = bool(shares)

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
             batch_invariant: bool = False, share_prefixes: bool = True,
             _kv_name: str = "kv_lens", _second_cache_requests: int = 0) -> Plan:
        """Plan one batch (see the module docstring). KV lengths come from `kv_lens` or,
        with CSR pages, from `last_page_len`: kv_len = (pages - 1) * page_size + last.
        `window_size`, `softcap`, `batch_invariant`: docs/contract.md (PlanOptions).
        `share_prefixes`: attend leading pages that several requests share once for all
        of them (sharing.py, docs/notes/shared-prefix.md); False: the plain plan.
        Raises ValueError naming the argument for a bad value; `_kv_name` is what the
        messages call kv_lens. `_second_cache_requests` (podcute.compat's BatchPOD): the
        requests [0, n) that read a second cache when run() is given one."""
        options = PlanOptions.make(causal, window_size, softcap, batch_invariant)
        if self.frozen:
            self._check_captured(options)
        inputs = batch_inputs(self.config.page_size, _kv_name, cu_seqlens_q, kv_lens,
                              block_table, kv_indptr, kv_indices, last_page_len)
        sm_scale = self.kernel_scale(sm_scale)
        if options.softcap > 0 and not (F32_TINY <= sm_scale / options.softcap
                                        and options.softcap <= F32_MAX):
            # the kernel computes softcap * tanh(s * (sm_scale / softcap)) in float32
            raise ValueError(f"softcap={options.softcap} with sm_scale={sm_scale}: sm_scale / "
                             "softcap must be a normal float32 (>= 1.2e-38) and softcap at most "
                             "3.4e38 (the kernel's float32); use softcap=0 for no cap")
        cu, q_len, kvl, used, total_q, page_src, num_entries = inputs
        n2 = _second_cache_requests
        if isinstance(n2, bool) or not isinstance(n2, (int, np.integer)) or \
                not 0 <= n2 <= q_len.size:
            raise ValueError(f"_second_cache_requests must be an int in [0, batch size "
                             f"{q_len.size}], got {n2!r}")
        if not isinstance(share_prefixes, (bool, np.bool_)):
            raise TypeError(f"share_prefixes must be a bool, got {type(share_prefixes).__name__}")
        self._ensure_capacity(q_len.size, total_q, num_entries)
        # (a node's plain reads are at most the batch's: a batch of fewer pages shares none)
        min_reads = -(-self.share_min_read_bytes // self._token_bytes)
        look = (share_prefixes and num_entries * self.config.page_size >= min_reads
                and self._may_share(options, int(n2)))
        return self._build(cu, q_len, kvl, used, options, sm_scale, total_q, page_src,
                           num_entries, int(n2), None, min_reads if look else None)

    def _may_share(self, options: PlanOptions, second_cache_requests: int) -> bool:
        """Whether this batch may share prefixes: one cache, not batch-invariant (a
        request's result would depend on who shares its batch), and no CUDA graph holding
        the other kernel variant. (A window limits which nodes: sharing.detect.)"""
        return (self._kernel_shares and not options.batch_invariant
                and second_cache_requests == 0 and self._captured_shares is not False)

    # A shared node's least plain reads (sharing.MIN_SHARED_READ_BYTES); an instance may
    # lower it (the tests share small batches with 0).
    share_min_read_bytes = sharing.MIN_SHARED_READ_BYTES

    def _detect_sharing(self, page_src, q_len, kvl, options: PlanOptions, min_reads: int):
        cfg, sc = self.config, self._share_cap
        # (tiles no taller than the shortest prefill tile a batch may get: each is then one
        # row tile of the expansion, whatever tiling _choose_tiling picks)
        args = (page_src, q_len, kvl, cfg.group_size, cfg.page_size, cfg.kernel.tile_m_decode,
                self._tilings[-1].tile_m, sc["tiles"], sc["tokens"], options.window_left,
                min_reads)
        if self._native is not None:  # (the same Sharing in C: native.c, podcute_detect)
            found = self._native.detect(*args)
            if found is not NotImplemented:
                return found
        return sharing.detect(*args)

    def _grow_share_room(self, need: dict) -> bool:
        """Room for a sharing plan's split slots and terms (twice what it needs); False when
        a CUDA graph holds the buffers or the merges do not fit (the batch is then planned
        without sharing)."""
        if (self.frozen or (self._on_cuda and torch.cuda.is_current_stream_capturing())
                or need["merges"] > self.capacity.merges + self._share_cap["merges"]):
            return False
        self._sync_staging()
        extra_slots = need["slots"] - self.capacity.slots
        self._share_slots = max(2 * extra_slots, self._share_slots)
        self._share_terms = max(2 * need["terms"], self._share_terms)
        cap = self._base_cap
        self._allocate(cap.batch, cap.tokens, cap.pages)
        return True

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

    def _page_starts(self, page_src, B: int) -> np.ndarray:
        """Each request's offset in the staged page list (_stage_pages' layout of it)."""
        fmt, _, arg = page_src
        if fmt == "table":
            return self._iota[:B] * arg
        return arg[:-1] - arg[0]

    def _stage_pages(self, page_src, num_entries: int, used: np.ndarray):
        """Copy the pages into the plan-owned staging list (what the kernel will read),
        then bound and check *that copy*: whatever the caller writes to its tensors later,
        the checks and the kernel see the same pages. Returns (each request's offset in
        the list, the copy as a _PageSet, an upper bound of its page indices);
        ValueError naming the argument for a negative page index a request reads."""
        fmt, pages, arg = page_src
        B = used.size
        staged = self._page_staging[:num_entries]
        if fmt == "table":  # arg: columns copied (the most pages a request reads)
            table = staged.reshape(B, arg)
            if num_entries:
                table[:] = pages[:, :arg]
            copy = _PageSet(table, None, used)
            lo, hi = copy.bounds(arg)
        else:
            staged[:] = pages[arg[0]: arg[-1]]  # arg: kv_indptr
            copy = _PageSet(None, (staged, arg - arg[0]), used)
            lo, hi = copy.bounds()
        start = self._page_starts(page_src, B)
        if lo < 0:
            b, lo = copy.first_negative()
            if b >= 0:
                name = "block_table" if fmt == "table" else "kv_indices"
                raise ValueError(f"{name} holds a negative page index ({lo}) among the pages "
                                 f"request {b} reads")
        return start, copy, hi

    # ---- work (the expansion itself: expand.WorkExpansion) ------------------------------

    def _build(self, cu, q_len, kvl, used, options, sm_scale, total_q, page_src,
               num_entries, second_cache_requests: int = 0, share=None,
               detect: int | None = None) -> Plan:
        """Expand the batch into work rows, CTA lists, split slots and merges (written into
        the staging buffers: native's C, else the numpy code of expand.py, which compute
        the same plan bit for bit), copy and check the pages, then write the rest of the
        metadata and make the Plan.

        `detect`: None, or look for shared prefixes whose sharers would read this many
        tokens of their run without sharing (sharing.detect), and plan them if found. The
        C expansion answers detect's first test while it reads the batch, so a batch
        that shares nothing pays ~3 us for it rather than numpy's ~9; a batch whose
        first pages repeat is expanded again with its sharing."""
        self._sync_staging()
        B = q_len.size
        q_x, kv_x = q_len, kvl
        if share is None and detect is not None and self._last_shared:
            # The last plan shared (a serving loop's shared prompt): look first, and skip
            # the plain expansion that only answers the first test. (The same plan: the
            # augmented batch's expansion does not depend on it.)
            share = self._detect_sharing(page_src, q_len, kvl, options, detect)
            detect = None  # (looked: found, or nothing pays)
        self._last_shared = share is not None
        if share is not None:
            # The augmented batch: sharers' own suffixes, then the prefix tiles.
            q_x, kv_x, kv_kernel, ps_x, qs_x, share_tokens = sharing.augment(
                share, q_len, kvl, self._page_starts(page_src, B), cu, self.config.page_size)
        self._tiling = self._choose_tiling(q_x, options)
        lay, first_repeat = None, None
        if self._native is not None:
            test = ((page_src, *self._share_bounds, detect, self.config.page_size)
                    if detect is not None else None)
            lay, first_repeat = self._native.build(self, q_x, kv_x, options, test)
        if detect is not None and first_repeat is not False:
            share = self._detect_sharing(page_src, q_len, kvl, options, detect)
            if share is not None:
                return self._build(cu, q_len, kvl, used, options, sm_scale, total_q, page_src,
                                   num_entries, second_cache_requests, share)
        if lay is None:  # (no C compiler, or a capacity the numpy path grows or reports)
            lay = self._layout_numpy(q_x, kv_x, options)
        shares = share is not None or bool(self._captured_shares)
        num_merge, num_slots = lay.num_merge, lay.num_slots
        hs = self._h
        if shares:
            sharing.fill_merge_columns(hs["merge"], num_merge)
        if share is not None:
            sc = self._share_cap
            n_tok = share_tokens.size
            args = (hs["work"], hs["merge"], hs["slot_merge"])
            rest = (lay.n, num_merge, num_slots, B, self.config.num_kv_heads,
                    q_len[share.participants] * self.config.group_size, n_tok,
                    self.capacity.merges + sc["merges"], self.capacity.slots + sc["slots"],
                    sc["terms"])
            shared_list = hs["shared"]
            out = NotImplemented
            if self._native is not None:  # (C writes the terms into the list itself)
                out = self._native.rewrite(share, *args, shared_list, *rest)
            if out is NotImplemented:
                out = sharing.rewrite(share, *args, *rest)
                if not isinstance(out, dict):
                    num_merge, num_slots, terms = out
                    shared_list[n_tok: n_tok + terms.size] = terms.reshape(-1)
                    out = num_merge, num_slots, terms.shape[0]
            if isinstance(out, dict):
                # no room: grow it (before a capture) and plan again, else plan this
                # batch without sharing
                if not self._grow_share_room(out):
                    share = None
                return self._build(cu, q_len, kvl, used, options, sm_scale, total_q, page_src,
                                   num_entries, second_cache_requests, share)
            num_merge, num_slots, n_terms = out
            shared_list[:n_tok] = share_tokens
        # The pages only now: a batch-invariant layout may regrow the buffers
        # (_grow_splits), and pages staged before it would stay in the old ones while the
        # kernel read the new, zeroed list.
        page_start, pages, max_page_index = self._stage_pages(page_src, num_entries, used)
        cfg, grid = self.config, self.grid
        left, right = options.window_left, options.right
        hs["params"][Param.SM_SCALE] = sm_scale
        if options.softcap > 0:
            hs["params"][Param.SOFTCAP_SCALE] = sm_scale / options.softcap
            hs["params"][Param.SOFTCAP] = options.softcap
        hs["iparams"][IParam.WINDOW_LEFT] = left
        hs["iparams"][IParam.WINDOW_RIGHT] = right
        hs["iparams"][IParam.SECOND_CACHE_REQUESTS] = second_cache_requests
        hs["iparams"][IParam.VIRTUAL_REQUESTS] = B + 1
        hs["cta_ptr"][:] = lay.ptr
        if share is None:
            hs["q_start"][: B + 1] = cu
            hs["kv_len"][:B] = kvl
            hs["page_start"][:B] = page_start
        else:
            nx = q_x.size
            hs["q_start"][: nx + 1] = qs_x
            hs["kv_len"][:nx] = kv_kernel
            hs["page_start"][:nx] = ps_x
        n = lay.n
        if self._on_cuda:
            end_off = self._segs["work"][0] + n * WORK_COLS
            self._meta[:end_off].copy_(self._staging_t[:end_off], non_blocking=True)
            if share is not None:
                s0 = self._segs["shared"][0]
                s1 = s0 + n_tok + 2 * n_terms
                self._meta[s0:s1].copy_(self._staging_t[s0:s1], non_blocking=True)
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
                      num_merges=lay.num_merge, grid=grid, num_shared_prefixes=0,
                      num_sharing_requests=0, num_shared_tiles=0, shared_kv_tokens=0,
                      saved_kv_tokens=0)
        if share is not None:
            # (the tiles are requests of the augmented batch: decode-like or prefill-like
            # by their rows)
            tiles_pre = int((q_x[B + 1::2] * cfg.group_size > cfg.kernel.tile_m_decode).sum())
            counts.update(num_prefill_requests=lay.n_prefill_req - tiles_pre,
                          num_decode_requests=lay.n_decode_req - (share.num_tiles - tiles_pre),
                          num_split_items=int((hs["work"][:n, WorkCol.SPLIT_SLOT] >= 0).sum()),
                          num_merges=num_merge, num_shared_prefixes=share.num_nodes,
                          num_sharing_requests=int(share.participants.size),
                          num_shared_tiles=share.num_tiles,
                          shared_kv_tokens=share.shared_tokens,
                          saved_kv_tokens=share.saved_tokens)
        summary = PlanSummary._lazy(lambda: self._summary_values(
            counts, costs()[1:], lay.kind, n, lay.n0d))
        return Plan(
            config=cfg, causal=bool(options.causal), sm_scale=sm_scale, options=options,
            total_q=total_q, batch_size=B, num_items=n, num_merge=num_merge,
            num_slots=num_slots, grid=grid, prefill_tile_m=self._tiling.tile_m,
            max_page_index=max_page_index,
            buffer_epoch=self.buffer_epoch, summary=summary, kernel_args=self.kernel_args,
            q_lens=q_len, kv_lens=kvl, needed_pages=used, _pages=pages, _buffers=self._d,
            _num_page_entries=num_entries, _costs=costs,
            second_cache_requests=second_cache_requests, shares=shares)
