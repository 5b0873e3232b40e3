"""cp.async row gather into swizzled shared memory tiles.

K/V rows come from scattered pages and Q rows from packed (token, head) pairs, so no
single TMA box covers a tile: every row has its own global address. Each producer
thread resolves the address of the rows it copies (through `podcute.layouts`) and
issues 16-byte cp.async copies for its chunks of them.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from podcute.kernels.ptx import cp_async_16_with_policy
from podcute.kernels.smem import swizzled_address

COPY_BITS = 128  # 16-byte cp.async: global rows must be 16-byte aligned (checked by the API)


@dataclass(frozen=True)
class RowGather:
    tiled_copy: cute.TiledCopy
    thr_copy: cute.ThrCopy
    tXcX: cute.Tensor  # (row, col) of each element this thread copies
    dtype: cutlass.Constexpr
    head_dim: cutlass.Constexpr[int]
    rolled: cutlass.Constexpr[bool]
    # Columns of a global row (the caller's head dim): the tile's columns past them are
    # not copied; they stay as zeroed at the kernel's start, or with `zero_rest` each copy
    # writes zeros there (where the tile's memory serves something else between tiles).
    cols: cutlass.Constexpr[int]
    zero_rest: cutlass.Constexpr[bool]

    @staticmethod
    def create(dtype, num_rows: int, head_dim: int, num_threads: int, tidx: Int32,
               threads_per_row: int = 8, rolled: bool = False,
               cols: Optional[int] = None, zero_rest: bool = False) -> "RowGather":
        """`threads_per_row` threads copy a row, 16 B each per pass: 8 make a warp read
        whole 128 B lines (4 rows per warp instruction); fewer leave each thread fewer
        rows to resolve (registers) at half-line granularity. `rolled` copies a thread's
        rows in a loop rather than unrolled: one row address live at a time, for a
        producer at its register floor."""
        elems = COPY_BITS // dtype.width
        threads_per_row = math.gcd(head_dim // elems, threads_per_row)
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            dtype,
            num_bits_per_copy=COPY_BITS,
        )
        thr_layout = cute.make_ordered_layout(
            (num_threads // threads_per_row, threads_per_row), order=(1, 0)
        )
        tiled_copy = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, elems)))
        thr_copy = tiled_copy.get_slice(tidx)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((num_rows, head_dim)))
        return RowGather(tiled_copy, thr_copy, tXcX, dtype, head_dim, rolled,
                         head_dim if cols is None else cols, zero_rest)

    def with_cols(self, cols: int) -> "RowGather":
        """The same gather of rows `cols` columns wide (V rows beside K's, where the
        value head dim is the caller's own: KernelConfig.head_dim_vo)."""
        return dataclasses.replace(self, cols=cols)

    @property
    def rows_per_thread(self) -> int:
        return cute.size(self.tXcX, mode=[1])

    def row(self, m: int):
        """Tile row of this thread's m-th row (0 <= m < rows_per_thread)."""
        return self.tXcX[0, m, 0][0]

    @cute.jit
    def copy_rows(self, sX: cute.Tensor, gmem_row: Callable,
                  l2_policy: Optional[Int64] = None):
        """Copy each of this thread's tile rows r (the m-th) from the (D,) global tensor
        `gmem_row(m, r)` into sX[r, :]; with `l2_policy` (`ptx.l2_evict_first_policy`)
        the copies carry it as their L2 cache hint."""
        tXsX = self.thr_copy.partition_D(sX)
        if const_expr(self.rolled):
            for m in cutlass.range(cute.size(tXsX, mode=[1]), unroll=1):
                self._copy_row(tXsX, m, gmem_row, l2_policy)
        else:
            for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                self._copy_row(tXsX, m, gmem_row, l2_policy)

    @cute.jit
    def _copy_row(self, tXsX: cute.Tensor, m, gmem_row: Callable,
                  l2_policy: Optional[Int64]):
        """The copies of this thread's m-th row."""
        elem_bytes = self.dtype.width // 8
        # Rebuild the row pointer with the 16-byte alignment the API guarantees:
        # the DSL cannot infer it through dynamic page and head strides.
        base = gmem_row(m, self.row(m)).iterator.toint()
        for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
            col = self.tXcX[0, m, k][1]
            if const_expr(self.cols < self.head_dim):
                if col < self.cols:
                    self._copy_chunk(tXsX, m, k, base, col, elem_bytes, l2_policy)
                else:
                    if const_expr(self.zero_rest):
                        zero = cute.make_rmem_tensor_like(tXsX[None, m, k])
                        zero.fill(0)
                        cute.autovec_copy(zero, tXsX[None, m, k])
            else:
                self._copy_chunk(tXsX, m, k, base, col, elem_bytes, l2_policy)

    @cute.jit
    def _copy_chunk(self, tXsX: cute.Tensor, m, k: cutlass.Constexpr[int], base, col,
                    elem_bytes: cutlass.Constexpr[int], l2_policy: Optional[Int64]):
        """One 16-byte copy: chunk k of this thread's m-th row, from row address `base`."""
        if const_expr(l2_policy is not None):
            # (the DSL's cp.async atom has no L2 hint: the same 16-byte copy in PTX)
            dst = swizzled_address(tXsX[None, m, k].iterator)
            cp_async_16_with_policy(dst, base + Int64(col * elem_bytes), l2_policy)
        else:
            src_ptr = cute.make_ptr(self.dtype, base + Int64(col * elem_bytes),
                                    cute.AddressSpace.gmem, assumed_align=16)
            src = cute.make_tensor(src_ptr, tXsX[None, m, k].layout)
            cute.copy(self.tiled_copy, src, tXsX[None, m, k])
