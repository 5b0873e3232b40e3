"""Static tile configuration shared by the planner and the kernel.

The planner must cut work exactly the way the kernel tiles it, so both read the tile
sizes from here.
"""

from dataclasses import dataclass

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SUPPORTED_ARCHS = ("sm_90a",)


@dataclass(frozen=True)
class TileConfig:
    head_dim: int
    tile_m: int  # packed (token, head) rows per work item: one consumer warpgroup
    tile_n: int  # KV tokens per pipeline stage
    num_stages: int  # K/V pipeline depth

    @staticmethod
    def for_head_dim(head_dim: int) -> "TileConfig":
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        # Two CTAs share an SM (one prefill-heavy, one decode-heavy at any moment), so each
        # keeps to half of the 227 KB of shared memory: Q tile + stages x (K + V tiles).
        # tile_n 64 also bounds registers: with S of one tile and P of the previous one
        # live at once (intra-warpgroup overlap), a 128-wide tile spills at D 64.
        if head_dim == 64:
            return TileConfig(head_dim, tile_m=64, tile_n=64, num_stages=4)  # 72 KB
        return TileConfig(head_dim, tile_m=64, tile_n=64, num_stages=2)  # 80 KB
