"""Shared test fixtures."""

import json
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _kernel_flags():
    """$PODCUTE_TEST_DECODE_EVICT_FIRST, $PODCUTE_TEST_SOFTMAX_UNDER_PV = 0 / 1: the kernels
    run without / with that KernelConfig flag (podcute.testing.kernel_flags)."""
    from podcute.testing import kernel_flags_from_env

    with kernel_flags_from_env():
        yield


@pytest.fixture(scope="module", autouse=True)
def _gpu_report(request):
    """After a module that keeps a `_report` dict (the GPU tests), write it as JSON to
    $PODCUTE_GPU_REPORT (docs/gpu-runs.md records these)."""
    yield
    report = getattr(request.module, "_report", None)
    path = os.environ.get("PODCUTE_GPU_REPORT")
    if report is not None and path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


@pytest.fixture
def fp8_kernel():
    """Skips a GPU test of fp8 KV caches when PODCUTE_ARCH forces the warp-level kernel
    (e.g. sm_90, the portable kernel's H200 runs): it has no fp8 variant and refuses them
    with a ValueError before any launch (tests/test_api.py checks that message)."""
    from podcute.kernels.config import WARP_MMA_ARCHS
    from podcute.launch import requested_arch

    arch = requested_arch(None)
    if arch in WARP_MMA_ARCHS:
        pytest.skip(f"fp8 KV caches need the sm_90a kernel ({arch} forced)")


@pytest.fixture
def launches(monkeypatch):
    """run() completes on this CPU machine: the device check passes and launch() records
    (plan, q, k_cache, v_cache, out, lse, keywords) instead of launching."""
    import torch

    from podcute import api, one_shot
    from podcute.compat import flash_attn as fa

    rec = []
    monkeypatch.setattr(api, "require_arch", lambda *a, **kw: None)
    monkeypatch.setattr(api, "launch", lambda plan, q, k, v, out, lse, **kw:
                        rec.append((plan, q, k, v, out, lse, kw)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def reset():
        one_shot._LAST_POD.clear()
        fa._LAST.clear()
        one_shot.invalidate_plans()
        for att, _ in one_shot._ONE_SHOT.values():
            att._device_ok = False  # the stub's pass must not outlive it
    reset()
    yield rec
    reset()
