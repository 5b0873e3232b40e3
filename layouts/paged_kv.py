"""CuTe views of the paged KV cache.

The cache arrives as ``[num_pages, page_size, Hkv, D]`` ("NHD") or
``[num_pages, Hkv, page_size, D]`` ("HND"), with any strides: it may be one half of an
interleaved ``[num_pages, 2, ...]`` tensor, or a slice of a bigger pool. The kernel only
ever sees the *canonical* view (page, slot_in_page, kv_head, dim), so the one code path
serves both layouts; the permutation is a compile-time fact (part of the compile key).

A request's pages are ``page_list[page_start + i]``: ``page_list`` is the flat block table
(``page_start = b * block_table.stride(0)``) or FlashInfer's ``kv_indices``
(``page_start = kv_indptr[b]``), so block-table and CSR batches share one gather.

All helpers are plain Python called while tracing ``@cute.jit`` / ``@cute.kernel`` code.
They never rebuild strides from Python ints or cast them, so the Int64 strides that
``from_dlpack`` gives a large tensor survive: a pool of more than 2**31 elements is
addressed correctly (offsets are computed as page (Int32) x stride (Int64)). A
hand-built cache layout must likewise carry Int64 strides.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

KV_LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class PageShift:
    """A runtime page size that is a power of two, as its log2: a token splits into
    (page, slot) with a shift and a mask (one register, where a general runtime divisor
    needs three and a multiply-high)."""

    shift: cutlass.Int32

    def split(self, token):
        return token >> self.shift, token & ((cutlass.Int32(1) << self.shift) - 1)

# Modes of the given tensor that land at canonical (page, slot, kv_head, dim).
_TO_CANONICAL = {"NHD": (0, 1, 2, 3), "HND": (0, 2, 1, 3)}


def canonical_kv(mKV: cute.Tensor, kv_layout: str) -> cute.Tensor:
    """View of the cache with modes (page, slot_in_page, kv_head, dim); no data moves.

    ``kv_layout`` ("NHD" or "HND") is a compile-time Python string. The strides are the
    caller's own (static or dynamic, Int64 kept), merely reordered.
    """
    if kv_layout not in _TO_CANONICAL:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if cute.rank(mKV) != 4:
        raise ValueError(f"KV cache must be rank 4, got layout {mKV.layout}")
    order = _TO_CANONICAL[kv_layout]
    if order == (0, 1, 2, 3):
        return mKV
    return cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=list(order)))


def kv_tma_view(mKV_canon: cute.Tensor) -> cute.Tensor:
    """Canonical cache reordered to (slot, dim, kv_head, page) for a TMA load.

    With ``page_size`` a multiple of the KV tile, one (tile_n, D) box over modes 0-1 is
    a piece of one page of one head; kv_head and page become plain box coordinates.
    """
    return cute.make_tensor(mKV_canon.iterator, cute.select(mKV_canon.layout, mode=[1, 3, 2, 0]))


def split_token(token, page_size):
    """(page index within the request, slot within the page) of a KV token.

    ``page_size`` may be
      * a Python int (compile time): a power of two becomes shift/mask, any other value
        a division by a constant (the compiler turns it into a multiply-high);
      * a :class:`PageShift` (runtime power-of-two page size, as its log2);
      * a ``cute.FastDivmodDivisor`` (runtime page size, precomputed magic number);
      * an Int32 (runtime page size; a real integer division, the slow fallback).
    ``token`` must be >= 0 (shift and signed division agree only there).
    """
    if isinstance(page_size, int):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if page_size & (page_size - 1) == 0:
            shift = page_size.bit_length() - 1
            return token >> shift, token & (page_size - 1)
        return token // page_size, token % page_size
    if isinstance(page_size, PageShift):
        return page_size.split(token)
    if isinstance(page_size, cute.FastDivmodDivisor):
        return divmod(token, page_size)
    return token // page_size, token % page_size


def kv_locate(page_list: cute.Tensor, page_start, token, page_size):
    """(physical page, slot) of KV token ``token`` of a request; one page-list load.

    K and V share the page table, so a producer resolves a row once and reads both
    caches with :func:`kv_row_at`.
    """
    page_idx, slot = split_token(token, page_size)
    return page_list[page_start + page_idx], slot


def kv_row_at(mKV_canon: cute.Tensor, page, slot, kv_head) -> cute.Tensor:
    """The (D,) row at a resolved (page, slot) of head ``kv_head``."""
    return mKV_canon[page, slot, kv_head, None]


# The request of a plan whose K/V a `ragged_kv` kernel variant reads from its second
# source, contiguous ragged tensors (FlashInfer's legacy POD prefill) seen canonically as
# [1, kv_len, Hkv, D]: one page that holds all its tokens.
RAGGED_REQUEST = 0


def ragged_locate(page, slot, token, ragged):
    """(page, slot) of a token: the paged (page, slot), or on the ragged source (``ragged``
    true, a runtime Boolean) page 0, slot ``token``. ``ragged`` None (a variant without
    the ragged source): the paged ones, with no code."""
    if ragged is None:
        return page, slot
    return cutlass.select_(ragged, cutlass.Int32(0), page), cutlass.select_(ragged, token, slot)


def kv_row_in(mKV_canon: cute.Tensor, mKV_ragged, ragged, page, slot, kv_head) -> cute.Tensor:
    """The (D,) row at (page, slot) of head ``kv_head`` of the cache or, where ``ragged``
    holds, of the ragged source ``mKV_ragged`` (None: the cache only)."""
    row = kv_row_at(mKV_canon, page, slot, kv_head)
    if mKV_ragged is None:
        return row
    addr = cutlass.select_(ragged, kv_row_at(mKV_ragged, page, slot, kv_head).iterator.toint(),
                           row.iterator.toint())
    # Both rows are 16-byte aligned (checked by the API); the select hides it from the DSL.
    ptr = cute.make_ptr(row.element_type, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, row.layout)


def kv_row(mKV_canon: cute.Tensor, page_list: cute.Tensor, page_start, token, kv_head,
           page_size) -> cute.Tensor:
    """The (D,) row of KV token ``token`` (0-based within its request) of ``kv_head``.

    ``mKV_canon[page_list[page_start + token // page_size], token % page_size, kv_head, :]``.
    """
    page, slot = kv_locate(page_list, page_start, token, page_size)
    return kv_row_at(mKV_canon, page, slot, kv_head)


def clamp_token(tile_start, row, kv_end):
    """KV token of row ``row`` of the tile at ``tile_start``, clamped to ``kv_end - 1``.

    cp.async, unlike TMA, does not zero-fill, and a page-table entry past the request's
    last page can be garbage (or point at a page of another request). Clamping makes
    every row of a partial tile re-read the last valid token instead: the page-table
    read stays in range and the loaded K/V values are finite, so ``P = 0`` on those rows
    gives exactly 0 in the PV product. Scores of rows with ``tile_start + row >= kv_end``
    must still be masked to -inf by the kernel. Requires ``kv_end >= 1``.
    """
    return cutlass.min(tile_start + row, kv_end - 1)


def kv_row_clamped(mKV_canon: cute.Tensor, page_list: cute.Tensor, page_start, tile_start,
                   row, kv_end, kv_head, page_size) -> cute.Tensor:
    """(D,) gmem row for row ``row`` of a (tile_n, D) K/V tile starting at token
    ``tile_start``, with the token clamped by :func:`clamp_token` (see there why)."""
    token = clamp_token(tile_start, row, kv_end)
    return kv_row(mKV_canon, page_list, page_start, token, kv_head, page_size)
