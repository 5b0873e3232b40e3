"""Head dims between the compiled tiles (docs/design.md, "Head dims between the tiles"): the
tile a head dim runs on, the refusals, and what the host sizes by which width. The kernels'
numbers: tests/test_kernel_gpu.py::test_head_dims_between_tiles (GPU)."""

import pytest
import torch

from podcute import PODAttention
from podcute.kernels.config import KernelConfig, tile_head_dim


@pytest.mark.parametrize("d, tile", [(8, 64), (40, 64), (64, 64), (72, 96), (80, 96),
                                     (96, 96), (104, 128), (112, 128), (128, 128),
                                     (136, 256), (160, 256), (192, 256), (224, 256),
                                     (256, 256)])
def test_a_head_dim_runs_on_the_next_tile(d, tile):
    assert tile_head_dim(d) == tile
    for page in (1, 16, 128):
        c = KernelConfig.select("bfloat16", d, 4, page_size=page)
        assert c.head_dim == tile and c.io_dim == d and c.head_dim_io == (0 if d == tile else d)
        assert c.can_implement() == (True, "")
    if d <= 128:
        w = KernelConfig.select("bfloat16", d, 4, arch="sm_80")
        assert w.head_dim == tile and w.io_dim == d
    else:
        with pytest.raises(NotImplementedError, match=f"head_dim {d}.*sm_80"):
            KernelConfig.select("bfloat16", d, 4, arch="sm_80")


@pytest.mark.parametrize("d", [4, 12, 59, 84, 111, 264, 512])
def test_other_head_dims_are_refused_by_name(d):
    with pytest.raises(NotImplementedError, match=f"head_dim={d}"):
        PODAttention(8, 2, d, 16, device="cpu")
    with pytest.raises(ValueError, match="multiple of 8"):
        KernelConfig.select("bfloat16", d, 4)


def test_fp8_caches_keep_the_tile_widths():
    for d in (64, 96, 128, 256):
        c = KernelConfig.select("bfloat16", d, 4, page_size=16, kv_dtype="float8_e4m3fn")
        assert c.fp8 and c.io_dim == d and c.head_dim_io == 0
    for d in (40, 80, 112, 160):
        with pytest.raises(NotImplementedError, match=f"fp8 KV caches at head_dim {d}"):
            PODAttention(8, 2, d, 16, device="cpu", kv_dtype=torch.float8_e4m3fn)


def test_host_sizes_the_caller_width_and_the_tile_width_apart():
    """q/K/V/out are checked at the caller's width; the split partials (the kernel's own
    workspace) have the tile's; the default softmax scale is the caller's."""
    a = PODAttention(8, 2, 80, 16, device="cpu")
    cu = torch.tensor([0, 300, 301], dtype=torch.int32)
    kvl = torch.tensor([700, 9000], dtype=torch.int32)
    bt = torch.arange(2 * 600, dtype=torch.int32).reshape(2, 600)
    a.plan(cu, kvl, block_table=bt)
    assert a.planner.buffers.mPartialO.shape[-1] == 96
    assert a.planner.config.head_dim == 80 and a.planner.config.kernel.head_dim == 96
    assert abs(a.planner.kernel_scale(None) - 80 ** -0.5) < 1e-7
    q = torch.randn(301, 8, 96, dtype=torch.bfloat16)  # the tile's width is not the caller's
    k = torch.randn(1200, 16, 2, 80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim=80"):
        a.run(q, k, k)
