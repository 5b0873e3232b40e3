"""KernelConfig.softmax_under_pv (sm_90a; select() turns it on for 16-bit caches with 128-
and 256-column tiles, where it measured faster): in the prefill loop K's stage is released
after the softmax, behind a test of the row sums, so that ptxas cannot hoist the wait for
the warpgroup's own P V GEMM above the softmax's exp2s (docs/notes/sm90a-kernel.md).
Compiled on the host (no GPU): the PTX of the loop holds that order (exp2s, then the guarded arrive, then the wait), the variant spills
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


def test_on_where_measured_faster_and_switched_by_environment(monkeypatch):
    """On in the sm_90a 16-bit variants with 128- and 256-column tiles (F1 faster on an
    H100), off at 64 and 96 columns (D 64 measured slower, D 96 unmeasured), with fp8
    caches (unmeasured) and on the warp-level kernel (no such loop); the test variables
    override select() both ways."""
    from podcute.compile import shipped_variants
    from podcute.kernels.config import SUPPORTED_ARCHS, KernelConfig
    from podcute.testing import KERNEL_FLAG_ENV, kernel_flag_env, kernel_flags_from_env

    for arch in SUPPORTED_ARCHS:
        for key in shipped_variants(arch):
            c = key.config
            want = arch == "sm_90a" and not c.kv_dtype and c.head_dim >= 128
            assert c.softmax_under_pv == want, c
    assert all(k.config.softmax_under_pv for k in shipped_variants(
        head_dims=(128, 256), groups=(4,), features=("window+softcap+sinks",)))
    assert not any(k.config.softmax_under_pv for k in shipped_variants(
        head_dims=(128,), groups=(4,), kv_dtypes=("float8_e4m3fn",)))
    # a caller's head dim runs on its tile: 112 on 128 columns, 80 on 96
    assert KernelConfig.select("bfloat16", 112, 4).softmax_under_pv
    assert not KernelConfig.select("bfloat16", 80, 4).softmax_under_pv
    var = KERNEL_FLAG_ENV["softmax_under_pv"]
    monkeypatch.setenv(var, "0")
    monkeypatch.setenv(KERNEL_FLAG_ENV["decode_kv_evict_first"], "0")
    with kernel_flags_from_env():
        cfg = KernelConfig.select("bfloat16", 128, 4, shared_prefix=True)
        assert not cfg.softmax_under_pv and not cfg.decode_kv_evict_first
    monkeypatch.setenv(var, "1")
    assert kernel_flag_env() == {var: "1", KERNEL_FLAG_ENV["decode_kv_evict_first"]: "0"}
    with kernel_flags_from_env():
        assert KernelConfig.select("bfloat16", 64, 4).softmax_under_pv
    cfg = KernelConfig.select("bfloat16", 128, 4)
    assert cfg.softmax_under_pv and cfg.decode_kv_evict_first
