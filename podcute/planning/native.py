"""The planner's work expansion in C (`native.c`): the same plan as
`Planner._layout_numpy` (expand.py), bit for bit, without numpy's per-call overhead (a plan
of one decode costs ~100 numpy calls there; in C the expansion is a few microseconds at any
size), and shared-prefix detection and rewrite (`sharing.detect` / `sharing.rewrite`:
`NativeBuilder.detect` / `.rewrite`). The two must stay bit-identical, so a change to
either needs the same change, with the same floating-point operations in the same order,
in the other.

Built on first use with the system's C compiler (``$CC`` or ``cc``) into the kernel cache
root (``$PODCUTE_CACHE_DIR`` or ``~/.cache/podcute``), keyed by the source's hash, and
loaded with ctypes. Without a compiler (or with ``PODCUTE_PLANNER=numpy``) the planner
uses the numpy code: same plans, slower. ``tests/test_plan_native.py`` checks that the two
agree on random batches of every kind.

This module reads what it needs from the planner it is handed (``build(planner, ...)``)
and imports only the plan's types, not the planner (which imports it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
import warnings
from pathlib import Path

import numpy as np

from podcute.kernels.metadata import (MERGE_COLS, SHARE_FIELD_MASK, SHARE_OWN_BIT,
                                      SHARE_RANK_SHIFT, SHARE_ROW_SHIFT, WORK_COLS, Kind,
                                      MergeCol, WorkCol)
from podcute.planning.types import INVARIANT_SPLIT_TOKENS, Layout

_SOURCE = Path(__file__).with_name("native.c")
_I64, _F64 = ctypes.c_int64, ctypes.c_double
_P = ctypes.c_void_p


class _PlanIO(ctypes.Structure):
    """PlanIO of native.c, field for field."""

    _fields_ = [
        ("B", _I64), ("q_len", _P), ("kv_len", _P),
        ("bounded", _I64), ("right", _I64), ("left", _I64), ("has_window", _I64),
        ("invariant", _I64),
        ("G", _I64), ("Hkv", _I64), ("tm_p", _I64), ("tm_d", _I64), ("tn", _I64),
        ("grid", _I64),
        ("r_p", _F64), ("r_d", _F64), ("r_row", _F64), ("o_p", _F64), ("o_d", _F64),
        ("chunks_per_cta", _F64), ("min_chunk_us", _F64),
        ("min_tiles", _I64 * 2), ("invariant_tokens", _I64 * 2),
        ("bounds_unit", _P), ("odd", _P), ("group", _I64),
        ("cap_items", _I64), ("cap_merges", _I64), ("cap_slots", _I64),
        ("work", _P), ("merge", _P), ("slot_merge", _P), ("ptr", _P),
        ("pc", _P), ("kind", _P), ("fix", _P), ("fix_s", _P), ("fix_e", _P),
        ("swap_a", _P), ("swap_f", _P), ("order", _P), ("fix_fixed", _P),
        ("n", _I64), ("num_merge", _I64), ("num_slots", _I64), ("n_prefill_req", _I64),
        ("n_decode_req", _I64), ("n0p", _I64), ("n0d", _I64), ("num_fix", _I64),
        ("num_swaps", _I64), ("both", _I64), ("grouped", _I64),
        ("scratch", _P), ("scratch_size", _I64), ("scratch_wanted", _I64),
        ("share_pages", _P), ("share_indptr", _P), ("share_max_q", _I64),
        ("share_min_kv", _I64), ("share_elem_bytes", _I64), ("share_row_stride", _I64),
        ("share_min_reads", _I64), ("share_page_size", _I64), ("first_repeat", _I64),
    ]


class _DetectIO(ctypes.Structure):
    """DetectIO of native.c, field for field."""

    _fields_ = [
        ("B", _I64), ("q_len", _P), ("kv_len", _P), ("pages", _P), ("indptr", _P),
        ("elem_bytes", _I64), ("row_stride", _I64),
        ("group", _I64), ("page_size", _I64), ("max_q", _I64), ("min_kv", _I64),
        ("tile_rows", _I64), ("max_tiles", _I64), ("max_tokens", _I64),
        ("window_left", _I64), ("min_reads", _I64), ("min_tokens", _I64),
        ("depth", _P), ("participants", _P), ("home", _P), ("row_off", _P),
        ("levels_ptr", _P), ("tile_first", _P), ("tile_count", _P), ("tile_lo", _P),
        ("tile_hi", _P), ("tile_rank0", _P), ("levels_tile", _P), ("levels_row", _P),
        ("cap_tiles", _I64), ("cap_levels", _I64),
        ("n_participants", _I64), ("n_tiles", _I64), ("n_levels", _I64), ("num_nodes", _I64),
        ("shared_tokens", _I64), ("saved_tokens", _I64),
    ]


class _RewriteIO(ctypes.Structure):
    """RewriteIO of native.c, field for field."""

    _fields_ = [
        ("P", _I64), ("U", _I64), ("L", _I64),
        ("participants", _P), ("home", _P), ("row_off", _P), ("p_rows", _P),
        ("levels_ptr", _P), ("tile_first", _P), ("tile_count", _P), ("tile_rank0", _P),
        ("levels_tile", _P), ("levels_row", _P),
        ("work", _P), ("merge", _P), ("slot_merge", _P), ("terms", _P),
        ("n", _I64), ("num_merge", _I64), ("num_slots", _I64), ("B", _I64), ("Hkv", _I64),
        ("terms_base", _I64), ("cap_merges", _I64), ("cap_slots", _I64), ("cap_terms", _I64),
        ("own_bit", _I64), ("row_shift", _I64), ("rank_shift", _I64), ("field_mask", _I64),
        ("total_merge", _I64), ("total_slots", _I64), ("n_terms", _I64),
    ]


# DetectIO's output arrays (Sharing's fields), in the order of NativeBuilder.detect's one
# buffer: per request, per tile, per level
_DETECT_OUT = ("depth", "participants", "home", "row_off", "levels_ptr", "tile_first",
               "tile_count", "tile_lo", "tile_hi", "tile_rank0", "levels_tile", "levels_row")


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class _Buffers:
    """One planner's constant fields and output buffers (for one buffer epoch)."""

    def __init__(self, planner):
        cfg, k, cap, c = planner.config, planner.config.kernel, planner.capacity, planner.cost
        self.epoch = planner.buffer_epoch
        grid = planner.grid
        self.ptr = np.empty(grid + 1, dtype=np.int64)
        self.pc = np.empty(cap.items, dtype=np.float64)
        self.kind = np.empty(cap.items, dtype=np.uint8)
        cuts = max(grid - 1, 1)
        self.fix = np.empty(2 * cuts, dtype=np.int64)
        self.fix_s = np.empty(2 * cuts, dtype=np.int64)
        self.fix_e = np.empty(2 * cuts, dtype=np.int64)
        self.fix_fixed = np.empty(2 * cuts, dtype=np.float64)
        self.swap_a = np.empty(grid, dtype=np.int64)
        self.swap_f = np.empty(grid, dtype=np.int64)
        self.order = np.empty(cap.items, dtype=np.int64)
        self.bounds_unit = np.ascontiguousarray(planner._bounds_unit, dtype=np.float64)
        self.odd = np.ascontiguousarray(planner._odd, dtype=np.uint8)
        hs = planner._h
        for a in (hs["work"], hs["merge"], hs["slot_merge"]):
            assert a.dtype == np.int32 and a.flags.c_contiguous
        _, r_d, r_row, o_p, o_d = planner._tiling.us
        io = self.io = _PlanIO()
        io.G, io.Hkv = cfg.group_size, cfg.num_kv_heads
        # (the prefill row tile, rate and smallest piece are the batch's: build())
        io.tm_d, io.tn, io.grid = k.tile_m_decode, k.tile_n, grid
        io.r_d, io.r_row, io.o_p, io.o_d = r_d, r_row, o_p, o_d
        io.chunks_per_cta, io.min_chunk_us = c.chunks_per_cta, c.min_chunk_us
        io.min_tiles[1] = planner._tiling.min_tiles[1]
        io.invariant_tokens[0], io.invariant_tokens[1] = INVARIANT_SPLIT_TOKENS
        io.bounds_unit, io.odd = _addr(self.bounds_unit), _addr(self.odd)
        io.cap_items, io.cap_merges, io.cap_slots = cap.items, cap.merges, cap.slots
        io.work, io.merge, io.slot_merge = (_addr(hs["work"]), _addr(hs["merge"]),
                                            _addr(hs["slot_merge"]))
        io.ptr, io.pc, io.kind = _addr(self.ptr), _addr(self.pc), _addr(self.kind)
        io.fix, io.fix_s, io.fix_e = _addr(self.fix), _addr(self.fix_s), _addr(self.fix_e)
        io.fix_fixed = _addr(self.fix_fixed)
        io.swap_a, io.swap_f = _addr(self.swap_a), _addr(self.swap_f)
        io.order = _addr(self.order)
        self.ref = ctypes.byref(io)
        self.grow_scratch(1 << 16)

    def grow_scratch(self, nbytes: int) -> None:
        """Scratch memory for the C side's arrays (kept: its pages stay mapped)."""
        self.scratch = np.empty(nbytes, dtype=np.uint8)
        self.io.scratch, self.io.scratch_size = _addr(self.scratch), nbytes


class NativeBuilder:
    """Planner._layout_numpy in C (module docstring)."""

    def __init__(self, lib):
        self._fn = lib.podcute_build
        self._fn.argtypes = [ctypes.c_void_p]
        self._fn.restype = ctypes.c_int
        self._detect = lib.podcute_detect
        self._rewrite = lib.podcute_rewrite
        for fn in (self._detect, self._rewrite):
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = ctypes.c_int

    def rewrite(self, sh, work: np.ndarray, merge: np.ndarray, slot_merge: np.ndarray,
                shared: np.ndarray, n: int, num_merge: int, num_slots: int, B: int,
                num_kv_heads: int, p_rows: np.ndarray, terms_base: int, cap_merges: int,
                cap_slots: int, cap_terms: int):
        """sharing.rewrite in C, its terms written into `shared` from `terms_base`: (merges,
        slots, terms) of the rewritten plan, a dict of what it needs when the buffers
        cannot hold it (as rewrite's), or NotImplemented (buffers C does not write, out
        of memory)."""
        plan = (work, merge, slot_merge, shared)
        if any(a.dtype != np.int32 or not a.flags.c_contiguous for a in plan):
            return NotImplemented
        io = _RewriteIO()
        keep = []  # (the int64 arrays C reads stay alive through the call)
        for name in ("participants", "home", "row_off", "levels_ptr", "tile_first",
                     "tile_count", "tile_rank0", "levels_tile", "levels_row"):
            a = np.ascontiguousarray(getattr(sh, name), dtype=np.int64)
            keep.append(a)
            setattr(io, name, _addr(a))
        rows = np.ascontiguousarray(p_rows, dtype=np.int64)
        io.p_rows = _addr(rows)
        io.P, io.U, io.L = sh.participants.size, sh.num_tiles, sh.levels_tile.size
        io.work, io.merge, io.slot_merge = _addr(work), _addr(merge), _addr(slot_merge)
        io.terms = _addr(shared) + 4 * terms_base
        io.n, io.num_merge, io.num_slots, io.B, io.Hkv = n, num_merge, num_slots, B, num_kv_heads
        io.terms_base, io.cap_merges, io.cap_slots, io.cap_terms = (terms_base, cap_merges,
                                                                    cap_slots, cap_terms)
        io.own_bit, io.row_shift = SHARE_OWN_BIT, SHARE_ROW_SHIFT
        io.rank_shift, io.field_mask = SHARE_RANK_SHIFT, SHARE_FIELD_MASK
        rc = self._rewrite(ctypes.byref(io))
        if rc == -3:
            raise AssertionError("a sharer's row or rank past SHARE_FIELD_MASK")
        if rc == 2:
            return dict(merges=io.total_merge, slots=io.total_slots, terms=io.n_terms)
        if rc != 1:
            return NotImplemented
        return io.total_merge, io.total_slots, io.n_terms

    def detect(self, page_src, q_len: np.ndarray, kvl: np.ndarray, group: int,
               page_size: int, decode_rows: int, tile_rows: int, max_tiles: int,
               max_tokens: int, window_left: int = -1, min_reads: int = 0):
        """sharing.detect in C: the same Sharing (or None), or NotImplemented where C
        does not read the pages (another dtype, gaps in a row) or ran out of memory."""
        from podcute.planning import sharing

        B = int(q_len.size)
        view = _page_view(page_src)
        if view is None or B == 0:
            return NotImplemented if B else None
        io = _DetectIO()
        io.pages, io.elem_bytes, io.row_stride, io.indptr = view
        q = np.ascontiguousarray(q_len, dtype=np.int64)
        kv = np.ascontiguousarray(kvl, dtype=np.int64)
        io.B, io.q_len, io.kv_len = B, _addr(q), _addr(kv)
        io.max_q, io.min_kv = sharing.candidate_bounds(group, page_size, decode_rows)
        io.group, io.page_size, io.tile_rows = group, page_size, tile_rows
        io.max_tiles, io.max_tokens, io.window_left = max_tiles, max_tokens, window_left
        io.min_reads, io.min_tokens = min_reads, sharing.MIN_SHARED_TOKENS
        cap_t, cap_l = 2 * B, 4 * B
        for _ in range(2):
            # One buffer for every output (one address: each costs ~1 us from numpy), cut
            # into _DETECT_OUT's arrays: per request (B + 1), per tile, per level.
            sizes = (B + 1,) * 5 + (cap_t,) * 5 + (cap_l,) * 2
            out = np.empty(sum(sizes), dtype=np.int64)
            at, off, arrays = _addr(out), 0, {}
            for name, size in zip(_DETECT_OUT, sizes):
                setattr(io, name, at + 8 * off)
                arrays[name] = out[off: off + size]
                off += size
            io.cap_tiles, io.cap_levels = cap_t, cap_l
            rc = self._detect(ctypes.byref(io))
            if rc != 2:
                break
            cap_t, cap_l = io.n_tiles, io.n_levels
        if rc == 0:
            return None
        if rc != 1:
            return NotImplemented
        # (each array cut to what this batch filled)
        used = dict(depth=B, participants=io.n_participants, home=io.n_participants,
                    row_off=io.n_participants, levels_ptr=io.n_participants + 1,
                    levels_tile=io.n_levels, levels_row=io.n_levels)
        return sharing.Sharing(
            **{name: a[:used.get(name, io.n_tiles)] for name, a in arrays.items()},
            num_nodes=io.num_nodes, shared_tokens=io.shared_tokens,
            saved_tokens=io.saved_tokens)

    def build(self, planner, q_len: np.ndarray, kvl: np.ndarray, options, share_test=None):
        """(the batch's Layout (the rows written to the planner's staging buffers), or
        None when a capacity would be exceeded (the numpy path then grows the buffers or
        raises, as it does); the answer to sharing's first test).

        `share_test`: (page source, max q_len, min kv_len - q_len, a node's least plain
        reads in tokens, page size) of sharing's candidates, or None. The answer is
        whether two candidates start on the same page and a node of them may pay
        (sharing.detect's first test and sharing._may_pay), or None when not asked or C
        cannot say (pages of another dtype or layout: numpy decides)."""
        bufs = planner.__dict__.get("_native_bufs")
        if bufs is None or bufs.epoch != planner.buffer_epoch:
            bufs = planner._native_bufs = _Buffers(planner)
        io = bufs.io
        q_len = np.ascontiguousarray(q_len, dtype=np.int64)
        kvl = np.ascontiguousarray(kvl, dtype=np.int64)
        io.B, io.q_len, io.kv_len = q_len.size, _addr(q_len), _addr(kvl)
        # (the batch's prefill tiling: Planner._choose_tiling)
        t = planner._tiling
        io.tm_p, io.r_p, io.min_tiles[0] = t.tile_m, t.us[0], t.min_tiles[0]
        io.bounded, io.right, io.left = options.bounded_right, options.right, options.window_left
        io.has_window, io.invariant = options.has_window, options.batch_invariant
        io.group = planner._group_kinds  # (each list by kind: Planner._group_lists)
        io.share_pages = _share_pages(io, share_test) if share_test is not None else None
        rc = self._fn(bufs.ref)
        first_repeat = None if io.first_repeat < 0 else bool(io.first_repeat)
        if io.scratch_wanted > io.scratch_size:  # (it used malloc'ed blocks this time)
            bufs.grow_scratch(2 * io.scratch_wanted)
        if rc != 0:
            return None, first_repeat
        n, m2, ns = io.n, io.num_fix, io.num_swaps
        kind = bufs.kind[:n].view(np.bool_).copy() if io.both else None
        fixes = None
        if m2:
            fixes = (bufs.fix[:m2].copy(), bufs.fix_fixed[:m2].copy(), bufs.fix_s[:m2].copy(),
                     bufs.fix_e[:m2].copy())
        swaps = (bufs.swap_a[:ns].copy(), bufs.swap_f[:ns].copy()) if ns else None
        order = bufs.order[:n].copy() if io.grouped else None
        return Layout(n, io.num_merge, io.num_slots, bufs.ptr.copy(), bufs.pc[:n].copy(), kind,
                      swaps, fixes, io.n0p, io.n0d, io.n_prefill_req, io.n_decode_req,
                      order), first_repeat


def _page_view(page_src):
    """(pages' address, element bytes, row stride (table), indptr's address (CSR)) of a
    page source C can read, else None: pages of another dtype or with gaps in a row."""
    fmt, pages, arg = page_src
    size = pages.dtype.itemsize
    if pages.dtype.kind != "i" or size not in (4, 8):
        return None
    if fmt == "table":
        if pages.ndim != 2 or pages.strides[1] != size or pages.strides[0] % size:
            return None
        return _addr(pages), size, pages.strides[0] // size, None
    if (pages.ndim != 1 or pages.strides[0] != size or arg.dtype != np.int64
            or not arg.flags.c_contiguous):
        return None
    return _addr(pages), size, 0, _addr(arg)


def _share_pages(io, share_test):
    """Set sharing's first test's fields of `io` but its pages; return their address, or
    None (not asked) where C cannot read them (`_page_view`)."""
    page_src, max_q, min_kv, min_reads, page_size = share_test
    view = _page_view(page_src)
    if view is None:
        return None
    addr, io.share_elem_bytes, io.share_row_stride, io.share_indptr = view
    io.share_max_q, io.share_min_kv = max_q, min_kv
    io.share_min_reads, io.share_page_size = min_reads, page_size
    return addr


# The C side writes rows by these column numbers (native.c's enums).
assert (tuple(WorkCol) == tuple(range(WORK_COLS)) and WORK_COLS == 8
        and WorkCol.KIND == 7 and WorkCol.SPLIT_SLOT == 6 and WorkCol.KV_START == 4)
assert (tuple(MergeCol) == tuple(range(MERGE_COLS)) and MergeCol.NUM_SPLITS == 5
        and MERGE_COLS == 12)
assert (Kind.PREFILL, Kind.DECODE) == (0, 1)

_lock = threading.Lock()
_loaded: list = []  # [NativeBuilder or None] once tried


def _cache_root() -> Path:
    return Path(os.environ.get("PODCUTE_CACHE_DIR", Path.home() / ".cache" / "podcute"))


def _build_library() -> Path:
    """Compile native.c (once per source version) and return the library's path."""
    src = _SOURCE.read_bytes()
    digest = hashlib.sha256(src).hexdigest()[:16]
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    lib = root / f"plan_native-{digest}.so"
    if not lib.exists():
        tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
        cc = os.environ.get("CC", "cc")
        # -ffp-contract=off: no fused multiply-adds (numpy rounds every product).
        cmd = [cc, "-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
               "-o", str(tmp), str(_SOURCE)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib)
        finally:
            tmp.unlink(missing_ok=True)
    return lib


def load() -> NativeBuilder | None:
    """The C work expansion, built and loaded on first use; None (numpy) when it cannot
    be built or PODCUTE_PLANNER=numpy."""
    if os.environ.get("PODCUTE_PLANNER", "") == "numpy":
        return None
    with _lock:
        if not _loaded:
            try:
                _loaded.append(NativeBuilder(ctypes.CDLL(str(_build_library()))))
            except (OSError, subprocess.SubprocessError) as err:
                detail = getattr(err, "stderr", b"") or b""
                warnings.warn("podcute: the planner's C expansion could not be built "
                              f"({err}{': ' + detail.decode(errors='replace')[-500:] if detail else ''}); "
                              "planning with numpy (same plans, slower)")
                _loaded.append(None)
        return _loaded[0]
