"""KernelConfig.decode_kv_evict_first (on in every shipped variant): decode items copy
their K/V under an L2 evict-first policy, in both kernels, and every other copy is as
without the flag. Compiled on the host (no GPU): each flagged variant compiles for
its target without a register spill (plain sm_90: no more than the unflagged variant),
carries the evict-first policy on its K/V copies, and the unflagged variant has no such
policy at all. Where the hinted copies' shared-memory addresses come from:
tests/test_smem_layouts.py."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compile

# (arch, head_dim, page_size, kv_dtype): the warp-level kernel's two pipelines (two
# stages on sm_90, one on sm_86) and each head dim's swizzle; sm_90a's three page classes
# (whole-tile and 16-slot TMA boxes, the cp.async gather) and an fp8 cache.
CASES = [("sm_90", 64, 16, ""), ("sm_90", 96, 16, ""), ("sm_90", 128, 16, ""),
         ("sm_86", 128, 16, ""), ("sm_90a", 128, 128, ""), ("sm_90a", 128, 16, ""),
         ("sm_90a", 128, 1, ""), ("sm_90a", 128, 16, "float8_e4m3fn")]

_SCRIPT = r"""
import dataclasses, json, sys
from podcute.compile import VariantKey, compile_variant
from podcute.kernels.config import KernelConfig
arch, d, page, kv, flag = json.loads(sys.argv[1])
cfg = KernelConfig.select("bfloat16", d, 4, True, True, page, arch, kv_dtype=kv)
ptx = compile_variant(VariantKey.make(dataclasses.replace(cfg, decode_kv_evict_first=flag)),
                      keep_ptx=True).__ptx__
print("RESULT " + json.dumps({
    "evict_first": ptx.count("createpolicy.fractional.L2::evict_first"),
    "hinted_cp_async": ptx.count("cp.async.cg.shared.global.L2::cache_hint"),
    "cp_async": ptx.count("cp.async.cg.shared.global"),
    "tma": ptx.count("cp.async.bulk.tensor")}))
"""


def _compile(case, flag: bool):
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    log = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps([*case, flag])],
                         capture_output=True, text=True, env=env, timeout=900)
    assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
    text = log.stdout + log.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
    assert spills, text[-2000:]
    result = json.loads(log.stdout.split("RESULT ", 1)[1].splitlines()[0])
    return result, max(spills)


@pytest.mark.sweep  # two compiles a case (~3 min in all on 2 cores): the -m sweep run
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).rstrip("-"))
def test_decode_copies_carry_an_evict_first_policy(case):
    arch, head_dim, page, kv = case
    plain, plain_spill = _compile(case, False)
    flagged, spill = _compile(case, True)
    assert plain["evict_first"] == 0 and plain["hinted_cp_async"] == 0, plain
    assert flagged["evict_first"] >= 1, flagged
    if arch != "sm_90a":
        # the decode path's K (and V) tiles, prologue and tile loop: a thread's share of
        # a 64-token tile in 16-byte copies each; the other paths' copies unchanged
        assert flagged["hinted_cp_async"] >= 2 * (64 * head_dim * 2 // 16 // 128), flagged
        assert flagged["cp_async"] - flagged["hinted_cp_async"] < plain["cp_async"]
    elif page == 1:
        # the gather: every K/V copy takes the item's policy (evict-normal off decode)
        assert flagged["hinted_cp_async"] >= 2, flagged
    else:
        # TMA: a decode item's copies in their own copy of the loop
        assert flagged["tma"] > plain["tma"], (flagged, plain)
    assert spill <= plain_spill and (arch == "sm_90" or spill == 0), (spill, plain_spill)


def test_the_flag_is_on_in_every_shipped_variant():
    from podcute.compile import shipped_variants
    from podcute.kernels.config import SUPPORTED_ARCHS

    for arch in SUPPORTED_ARCHS:
        assert all(k.config.decode_kv_evict_first for k in shipped_variants(arch))


def test_the_tests_switch_the_flag_by_environment(monkeypatch):
    """podcute.testing.decode_evict_first: how the GPU tests, tests/gpu_sanitize.py and the
    experiments run the kernels with or without the flag ($PODCUTE_TEST_DECODE_EVICT_FIRST)."""
    import podcute.planning as P
    from podcute.kernels.config import KernelConfig
    from podcute.testing import DECODE_EVICT_FIRST_ENV, kernel_flags_from_env

    def flags():
        planners = [P.Planner(32, 8, 128, 16, device="cpu", arch=a) for a in ("sm_90a", "sm_90")]
        return [p.config.kernel.decode_kv_evict_first for p in planners] + [
            KernelConfig.select("bfloat16", 128, 4, ragged_kv=True).decode_kv_evict_first]

    monkeypatch.delenv(DECODE_EVICT_FIRST_ENV, raising=False)
    with kernel_flags_from_env():
        assert flags() == [True] * 3  # the default
    monkeypatch.setenv(DECODE_EVICT_FIRST_ENV, "0")
    with kernel_flags_from_env():
        assert flags() == [False] * 3
    monkeypatch.setenv(DECODE_EVICT_FIRST_ENV, "1")
    with kernel_flags_from_env():
        assert flags() == [True] * 3
    assert flags() == [True] * 3
