"""The planner's cost model: what one work piece is predicted to take on one CTA
(:class:`CostModel`), the unit costs of a batch's prefill row tile (:class:`PrefillTiling`),
and the chip facts the kind pairing reads (HBM bytes per SM clock)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np


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
        tn = kernel.tile_n
        # MMA columns a key (Q K^T, P V) and the caller's columns of a K + V token and a
        # Q + O row: the tile's head dim twice, but for head dims between the tiles and a
        # value head dim of its own (KernelConfig.mma_cols, io_dim, vo_dim).
        mma_qk, mma_pv = kernel.mma_cols
        cols = kernel.io_dim + kernel.vo_dim
        us_tile = 2.0 * (mma_qk + mma_pv) * kernel.tile_m_prefill * tn / c.mma_flops_per_us()
        kv_bytes = 1 if kernel.fp8 else c.elem_bytes  # an fp8 cache streams half the bytes
        us_tok = cols * kv_bytes / c.hbm_bytes_per_us()
        us_row = cols * c.elem_bytes / c.hbm_bytes_per_us()
        min_tiles = (max(1, math.ceil(c.min_chunk_us / us_tile)),
                     max(1, math.ceil(c.min_chunk_us / (us_tok * tn))))
        return PrefillTiling(
            kernel.tile_m_prefill,
            (us_tile / tn, us_tok, us_row, c.prefill_item_overhead_us,
             c.decode_item_overhead_us),
            min_tiles, np.array(min_tiles, dtype=np.int64))
