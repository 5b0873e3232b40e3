"""Page lookup and the K/V page loaders both POD kernels use.

A work item's KV token t of request b lives at page ``mPageList[mPageStart[b] + t >>
page_shift]``, slot ``t & (page_size - 1)`` of the cache (`layouts.paged_kv`: the
canonical (page, slot, kv_head, dim) view). Tokens past the item's end are clamped to its
last one (`layouts.clamp_token`), so no page-table entry past the request's pages is ever
read and every loaded row holds finite values that the mask and P = 0 discard.

Two ways to bring a tile in:
  * a cp.async row gather (`gather.RowGather`, both kernels): each thread resolves the
    pages of the rows it copies (`PagedKV.page`, looked up a tile ahead) and addresses
    them with the token's slot (`PagedKV.slot`; `source_row` beside a second source);
  * TMA boxes (the sm_90a kernel, pages of 16 tokens or more): a box of `kv_box` slots x
    one swizzle-atom column block lies inside one page of one head (`make_kv_tma_atoms`,
    `PagedKV.box`, `tma_kv_tiles`, `copy_kv_boxes`).
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from podcute import layouts
from podcute.kernels.args import PodTensors
from podcute.kernels.work import WorkItem


@dataclass(frozen=True)
class PagedKV:
    """The page table of one launch, as a KV tile of `tile_n` tokens reads it."""

    mPageList: cute.Tensor
    page_divisor: layouts.PageShift
    tile_n: cutlass.Constexpr[int]

    @staticmethod
    def create(mPageList: cute.Tensor, page_shift: Int32, tile_n: int) -> "PagedKV":
        return PagedKV(mPageList, layouts.PageShift(page_shift), tile_n)

    def token(self, item: WorkItem, n_block: Int32, r):
        """The request's KV token of row `r` of tile n_block, clamped to the item's last."""
        return layouts.clamp_token(n_block * self.tile_n, r, item.kv_end)

    def locate(self, item: WorkItem, token):
        """(physical page, slot) of a (clamped) token of the item's request."""
        return layouts.kv_locate(self.mPageList, item.page_start, token, self.page_divisor)

    def page(self, item: WorkItem, token):
        """The physical page of a (clamped) token of the item's request."""
        return self.locate(item, token)[0]

    def slot(self, token):
        """The slot of a token within its page (no page-table load)."""
        return layouts.split_token(token, self.page_divisor)[1]

    def source_row(self, mKV: cute.Tensor, mKV2: Optional[cute.Tensor], second,
                   ragged: bool, page: Int32, token, kv_head: Int32) -> cute.Tensor:
        """The (D,) row of a token whose page was looked up (`page`), or where `second`
        holds (a runtime choice; None: no second source) its row of the second source
        `mKV2`: the ragged source (`ragged`, compile time: one page of the request's
        tokens, slot = token) or a second paged cache (the same page and slot)."""
        slot = self.slot(token)
        if const_expr(ragged):
            slot = layouts.ragged_locate(Int32(0), slot, token, second)[1]
        return layouts.kv_row_in(mKV, mKV2, second, page, slot, kv_head)

    def box(self, item: WorkItem, lane_box: Int32, kv_box: int, ragged: bool,
            n_block: Int32):
        """(page, box within the page) of box `lane_box` (of `kv_box` slots) of tile
        n_block; on the ragged source (`ragged`, compile time) page 0."""
        token = layouts.clamp_token(n_block * self.tile_n, lane_box * kv_box, item.kv_end)
        page, slot = Int32(0), token
        if const_expr(not ragged):
            page, slot = self.locate(item, token)
        return page, slot // kv_box


class KvTmaAtoms(NamedTuple):
    """The TMA atoms of the cache's K and V (and of the second source's, or None)."""

    k: cute.CopyAtom
    v: cute.CopyAtom
    k2: Optional[cute.CopyAtom]
    v2: Optional[cute.CopyAtom]

    def prefetch(self):
        for atom in self:
            if atom is not None:
                cpasync.prefetch_descriptor(atom)


def make_kv_tma_atoms(io: PodTensors, box_layout, box: tuple, second: bool):
    """(KvTmaAtoms, `io` with K and V, and the second pair with `second`, as their TMA
    tensors) for
    boxes of `box` = (slots, columns) over (slot, dim, kv_head, page): each box lies inside
    one page of one head and lands as a contiguous piece of a column block of a stage.
    (The ragged source is one page of kv_len slots: a box past its end is out of bounds on
    the slot mode, which TMA fills with zeros.)"""
    op = cpasync.CopyBulkTensorTileG2SOp()

    def atom(mKV):
        return cpasync.make_tiled_tma_atom(op, layouts.kv_tma_view(mKV), box_layout, box)

    atom_k, mK = atom(io.mK)
    atom_v, mV = atom(io.mV)
    atom_kr = atom_vr = None
    mK2, mV2 = io.mK2, io.mV2
    if const_expr(second):
        atom_kr, mK2 = atom(io.mK2)
        atom_vr, mV2 = atom(io.mV2)
    return (KvTmaAtoms(atom_k, atom_v, atom_kr, atom_vr),
            io._replace(mK=mK, mV=mV, mK2=mK2, mV2=mV2))


def tma_kv_tiles(tma_atom: cute.CopyAtom, mX_tma: cute.Tensor, sX: cute.Tensor,
                 kv_head: Int32, tiler: tuple):
    """(smem boxes (TMA, box, column block, stage), gmem boxes (TMA, box within page,
    column block, page)) of one KV head, for boxes of `tiler` = (slots, columns)."""
    gX = cute.flat_divide(mX_tma[None, None, kv_head, None], tiler)
    sXd = cute.flat_divide(sX, tiler)
    return cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1),
        cute.group_modes(sXd, 0, 2), cute.group_modes(gX, 0, 2),
    )


@cute.jit
def copy_kv_boxes(tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, page: Int32,
                  box_in_page: Int32, first_lane: Int32, stage_index: Int32, barrier,
                  boxes: cutlass.Constexpr[int], pieces: cutlass.Constexpr[int],
                  whole_rows: cutlass.Constexpr[bool], l2_policy: Optional[Int64] = None):
    """The boxes of one K or V tile, by one warp: box j from lane first_lane + j's (page,
    box within page). A rolled loop: unrolled, the compiler hoists every broadcast ahead
    of the copies and the 24-register producer spills. `whole_rows` (fp8: one copy a box,
    a whole 128-byte row, so the broadcasts are half the work): unrolled, their latencies
    overlap; the 64-register producer has room."""
    hint = {} if const_expr(l2_policy is None) else {"cache_policy": l2_policy}
    if const_expr(boxes == 1 and not whole_rows):
        for h in cutlass.range_constexpr(pieces):
            cute.copy(tma_atom, tXgX[None, box_in_page, h, page],
                      tXsX[None, 0, h, stage_index], tma_bar_ptr=barrier, **hint)
    else:
        for j in cutlass.range(boxes, unroll=boxes if whole_rows else 1):
            page_j = cute.arch.shuffle_sync(page, first_lane + j)
            box_j = cute.arch.shuffle_sync(box_in_page, first_lane + j)
            for h in cutlass.range_constexpr(pieces):
                cute.copy(tma_atom, tXgX[None, box_j, h, page_j],
                          tXsX[None, j, h, stage_index], tma_bar_ptr=barrier, **hint)
