"""KernelConfig.softmax_under_pv (sm_90a, off in every shipped variant until a GPU measures
it): in the prefill loop K's stage is released after the softmax, behind a test of the row
sums, so that ptxas cannot hoist the wait for the warpgroup's own P V GEMM above the
softmax's exp2s (docs/notes/sm90a-kernel.md). Compiled on the host (no GPU): the PTX of the
loop holds that order (exp2s, then the guarded arrive, then the wait), the variant spills
nothing, and where `nvdisasm` is installed, the SASS keeps every exp2 of the tile between
the S wait and the P V wait. The flag's switch for the GPU runs is tested beside the L2
hint's (tests/test_l2_hint.py)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compile

_SCRIPT = r"""
import dataclasses, json, shutil, sys
from podcute.compile import VariantKey, compile_variant, ptx_dump_dir
from podcute.kernels.config import KernelConfig
out, flag = sys.argv[1], json.loads(sys.argv[2])
cfg = KernelConfig.select("bfloat16", 128, 4, True, False, 128, "sm_90a")
shutil.rmtree(ptx_dump_dir(), ignore_errors=True)
pod = compile_variant(VariantKey.make(dataclasses.replace(cfg, softmax_under_pv=flag)),
                      keep_ptx=True)
open(out + ".ptx", "w").write(pod.__ptx__)
shutil.copy(next(ptx_dump_dir().glob("*.cubin")), out + ".cubin")
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("under_pv")
    out = str(folder / "f1")
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}",  # a fresh compile keeps
               PODCUTE_CACHE_DIR=str(folder / "cache"))            # the PTX
    log = subprocess.run([sys.executable, "-c", _SCRIPT, out, "true"], capture_output=True,
                         text=True, env=env, timeout=900)
    assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
    return out, log.stdout + log.stderr


def _between(lines, start, end):
    """The lines after the first match of regex `start` and before the next of `end`."""
    i = next(k for k, l in enumerate(lines) if re.search(start, l))
    j = next(k for k in range(i + 1, len(lines)) if re.search(end, lines[k]))
    return lines[i + 1:j]


def test_the_ptx_releases_k_after_the_exp2s(compiled):
    out, _ = compiled
    lines = open(out + ".ptx").read().splitlines()
    # the steady prefill loop is the one that waits for all but one wgmma group
    body = _between(lines, r"wgmma\.wait_group\.sync\.aligned\s+1;",
                    r"wgmma\.wait_group\.sync\.aligned\s+0;")
    ops = [l.split()[0] for l in body if l.strip() and not l.strip().startswith(("$", "//"))]
    ex2 = [k for k, op in enumerate(ops) if op.startswith("ex2.")]
    arrive = [k for k, op in enumerate(ops) if op.startswith("mbarrier.arrive")]
    assert len(ex2) >= 64 and arrive, (len(ex2), arrive)
    assert max(ex2) < arrive[-1], "K's release precedes an exp2"
    # the release sits behind a compare of the row sums with -1 (true for NaN too)
    assert any(re.match(r"setp\.eq\.f32\s.*0fBF800000", l.strip()) for l in body)


def test_no_register_spills(compiled):
    _, log = compiled
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) == 0, log[-2000:]


def test_the_sass_keeps_every_exp2_under_the_p_v_gemm(compiled):
    from perf.experiments.sass_loops import _INSN, events, find_nvdisasm, loops

    tool = find_nvdisasm()
    if tool is None:  # the test extra installs nvidia-cuda-nvdisasm
        pytest.skip("needs nvdisasm (SASS)")
    out, _ = compiled
    sass = subprocess.run([tool, "-c", out + ".cubin"], capture_output=True,
                          text=True, check=True).stdout
    insns = [(int(m.group(1), 16), m.group(2), m.group(3))
             for m in map(_INSN.match, sass.splitlines()) if m]
    orders = [events(insns, s, e) for s, e, _ in loops(sass)]
    prefill = [o for o in orders if "DEPBAR<=0x1" in o]
    assert prefill, orders
    for order in prefill:
        between = order.split("DEPBAR<=0x1", 1)[1].split("DEPBAR<=0x0", 1)[0]
        assert "MUFUx66" in between, order[:300]


def test_off_in_every_shipped_variant_and_switched_by_environment(monkeypatch):
    from podcute.compile import shipped_variants
    from podcute.kernels.config import SUPPORTED_ARCHS, KernelConfig
    from podcute.testing import KERNEL_FLAG_ENV, kernel_flags_from_env

    for arch in SUPPORTED_ARCHS:
        assert not any(k.config.softmax_under_pv for k in shipped_variants(arch))
    var = KERNEL_FLAG_ENV["softmax_under_pv"]
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv(KERNEL_FLAG_ENV["decode_kv_evict_first"], "0")
    with kernel_flags_from_env():
        cfg = KernelConfig.select("bfloat16", 128, 4, shared_prefix=True)
        assert cfg.softmax_under_pv and not cfg.decode_kv_evict_first
    cfg = KernelConfig.select("bfloat16", 128, 4)
    assert not cfg.softmax_under_pv and cfg.decode_kv_evict_first
