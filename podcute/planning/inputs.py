"""The batch's index inputs on the host: numpy copies of whatever tensors plan() was given
(:func:`host_arrays`), the checks that name a bad argument and the arrays the planner
reads (:func:`batch_inputs`), and the set of pages the batch reads (:class:`_PageSet`)."""

from __future__ import annotations

import numpy as np
import torch

from podcute.planning.arrays import _ragged_arange
from podcute.planning.types import MAX_KV_LEN


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


def batch_inputs(page_size, kv_name, cu_seqlens_q, kv_lens, block_table, kv_indptr,
                 kv_indices, last_page_len):
    """The batch's index arrays for Planner.plan(): (cu, q_len, kv_len, pages used,
    total_q, page source, page-list entries) as _checked_inputs returns them, from the
    page format given (a block table, or CSR kv_indptr + kv_indices) and the KV lengths
    (`kv_lens`, which the messages call `kv_name`, or CSR last_page_len). Raises
    ValueError naming the argument for a bad value."""
    if (block_table is None) == (kv_indices is None):
        raise ValueError("pass exactly one page format: block_table, or kv_indptr + "
                         "kv_indices")
    if kv_indices is not None and kv_indptr is None:
        raise ValueError("kv_indptr is required with kv_indices")
    if (kv_lens is None) == (last_page_len is None):
        raise ValueError(f"pass exactly one of {kv_name} or last_page_len")
    if last_page_len is not None and kv_indptr is None:
        raise ValueError("last_page_len needs the CSR page format (kv_indptr + kv_indices)")
    h = host_arrays({"cu_seqlens_q": cu_seqlens_q, kv_name: kv_lens,
                      "block_table": block_table, "kv_indptr": kv_indptr,
                      "kv_indices": kv_indices, "last_page_len": last_page_len})
    # One combined test in the common case; anything off takes the detailed checks,
    # which raise naming the first fault (and compute the same values otherwise).
    inputs = _common_inputs(h, kv_name, page_size)
    if inputs is None:
        inputs = _checked_inputs(h, kv_name, page_size)
    return inputs


def _common_inputs(h, kv_name, ps):
    """The batch's index arrays (as _checked_inputs returns them) when every check
    passes, tested with a few reductions instead of one pass per check; None when
    anything is off (or the input is unusual: B == 0, last_page_len, arrays not 1-D):
    then _checked_inputs finds and names the first fault."""
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


def _checked_inputs(h, kv_name, ps):
    """Every check of the index inputs, in order, each raising a ValueError that names
    the argument; returns (cu, q_len, kv_len, pages used, total_q, page source,
    page-list entries). The page indices themselves are checked on the plan's copy
    (Planner._stage_pages)."""
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

    # Pages actually read: those of requests with queries (checked by
    # Planner._stage_pages on the plan's own copy, which is what the kernel reads).
    used = needed * (q_len > 0)
    # The page list the kernel reads is a plan-owned copy: a block table's first
    # max(used) columns of every row, or the CSR indices in use.
    if page_count is None:
        width = int(used.max()) if B else 0
        page_src, num_entries = ("table", bt, width), B * width
    else:
        page_src, num_entries = ("csr", indices, indptr), int(indptr[-1] - indptr[0])
    return cu, q_len, kvl, used, total_q, page_src, num_entries
