"""Shared test fixtures."""

import json
import os

import pytest


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
