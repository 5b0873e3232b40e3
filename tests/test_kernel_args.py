"""The seam between the planner, launch() and both kernel families: one compiled
signature, `(*PodTensors, *PlanTensors, num_ctas, stream)` (kernels/args.py), which the
fake arguments of a compile, the kernels' entry point and the planner's buffers all
follow, field for field."""

import inspect

import torch

from podcute.compile import VariantKey, _fake_args
from podcute.kernels.args import PlanTensors, PodTensors
from podcute.kernels.config import KernelConfig
from podcute.kernels.pod_kernel import PodKernelBase
from podcute.planning import PlanBuffers, Planner

ABI = PodTensors._fields + PlanTensors._fields + ("num_ctas", "stream")


def test_entry_point_takes_both_bundles_flat():
    fn = inspect.unwrap(PodKernelBase.__call__)
    assert tuple(inspect.signature(fn).parameters)[1:] == ABI


def test_fake_arguments_follow_the_bundles():
    for arch, kv in (("sm_90a", ""), ("sm_90a", "float8_e4m3fn"), ("sm_80", "")):
        cfg = KernelConfig.select("bfloat16", 128, 4, True, True, 16, arch, kv_dtype=kv,
                                  has_sinks=True)
        args = _fake_args(VariantKey.make(cfg))
        assert len(args) == len(ABI)
        io = PodTensors(*args[:len(PodTensors._fields)])
        assert (io.mLSE is None) == (not cfg.has_lse) and io.mSinks is not None
        assert (io.mKScale is None) == (not kv) and io.mK2 is None


def test_planner_buffers_are_the_torch_twin():
    assert PlanBuffers._fields == PlanTensors._fields
    p = Planner(8, 2, 128, 16, device="cpu", num_sms=4)
    buffers, grid = p.kernel_args[:-1], p.kernel_args[-1]
    assert PlanBuffers(*buffers) == p.buffers and grid == p.grid
    assert p.buffers.page_shift == 4 and p.buffers.mParams.dtype == torch.float32
    assert p.buffers.mIParams.data_ptr() == p.buffers.mParams.data_ptr()


def test_each_family_builds_only_its_own_configurations():
    from podcute.kernels.pod_fwd_sm80 import PodAttentionSm80
    from podcute.kernels.pod_fwd_sm90 import PodAttentionSm90
    hopper = KernelConfig.select("bfloat16", 128, 4, page_size=16)
    portable = KernelConfig.select("bfloat16", 128, 4, page_size=16, arch="sm_90")
    assert hopper.kernel_class() is PodAttentionSm90
    assert portable.kernel_class() is PodAttentionSm80
    for cls, cfg in ((PodAttentionSm80, hopper), (PodAttentionSm90, portable)):
        ok, why = cls.can_implement(cfg)
        assert not ok and why
