"""The serving example (examples/serve_llama.py) on an H200 (marker `gpu`), through its
checking harness (tests/serving_harness.py).

A 4-layer Llama-shaped bf16 model (8 query heads, 2 KV heads, head_dim 128, random
weights) serves a trace with continuous batching over a paged KV cache, once with podcute
(plan once per step, CUDA graphs per token-count bucket, eager steps past the largest
bucket) and once with dense per-request SDPA. Every check of the harness's report must
pass: tokens and final hidden states of both loops against the teacher-forced float32
reference, graph replays bitwise equal to eager runs of the same steps (steps of
different prefill/decode mixes), the scheduler's invariants, and a repeated timed pass
giving the same tokens. Tokens per second of both loops are printed and recorded.

Set PODCUTE_SERVING_REQUESTS (default 24) and PODCUTE_GPU_REPORT (the report as JSON).
"""

import os

import pytest
import torch

import serving_harness as harness

ex = harness.ex  # the example, imported by path
pytestmark = pytest.mark.gpu

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
if not HAS_SM90:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

NUM_REQUESTS = int(os.environ.get("PODCUTE_SERVING_REQUESTS", "24"))
_report = {}


def test_serving_loop_podcute_and_dense():
    tcfg = ex.TraceConfig(num_requests=NUM_REQUESTS)
    rep = harness.run_report(ex.ModelConfig(), ex.ServeConfig(), tcfg, seed=0, device="cuda")
    _report.update(rep)
    print("\n" + harness.format_report(rep))
    checks = rep["checks"]
    for name in ("tokens", "hidden", "scheduler", "repeatable"):
        for backend in ("podcute", "dense"):
            assert f"{backend}.{name}" in checks
    assert "podcute.graph_replay" in checks
    failed = {k: v for k, v in checks.items() if not v["passed"]}
    assert not failed, failed
    by_bucket = rep["backends"]["podcute"]["steps_by_bucket"]
    assert any(k != "eager" for k in by_bucket), by_bucket  # steps replayed from graphs
    replays = checks["podcute.graph_replay"]["checked"]
    assert len({(c["num_prefill"] > 0, c["num_decode"] > 0) for c in replays}) >= 2
    for b in rep["backends"].values():
        assert b["tokens_per_s"] > 0
