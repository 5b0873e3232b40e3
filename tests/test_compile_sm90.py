"""Every shipped kernel variant compiles for sm_90a on a CPU-only machine, with wgmma and
setmaxnreg in its PTX and no register spills reported by ptxas."""

import os
import re
import subprocess
import sys

import pytest

from podcute.compile import VariantKey, shipped_variants
from podcute.kernels.config import KernelConfig

# The full variant sweep: `python -m pytest -m sweep` (.ci/run runs it after the README's
# command; tests/test_compile_quick.py is the per-family compile in the default suite).
pytestmark = [pytest.mark.compile, pytest.mark.sweep]


@pytest.fixture(scope="module")
def compile_log():
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    proc = subprocess.run(
        [sys.executable, "-m", "podcute", "compile", "--arch", "sm_90a", "--check"],
        # ~20-30 min on CI's 2 cores (the whole shipped sm_90a set); the VM's speed drifts
        # by ~1.5x, and 30 min was once too little: room below CI's 90-min budget
        capture_output=True, text=True, env=env, timeout=3000,
    )
    return proc


def test_all_variants_compile_with_wgmma_and_setmaxnreg(compile_log):
    assert compile_log.returncode == 0, compile_log.stdout[-3000:] + compile_log.stderr[-3000:]
    lines = [l for l in compile_log.stdout.splitlines() if l.startswith("[")]
    assert len(lines) == len(shipped_variants())
    for line in lines:
        assert re.search(r"wgmma=[1-9]", line) and re.search(r"setmaxnreg=[1-9]", line), line


def test_no_register_spills(compile_log):
    text = compile_log.stdout + compile_log.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
    # Every variant's one fused kernel reports its resource usage.
    assert len(spills) >= len(shipped_variants()), text[-2000:]
    assert max(spills) == 0, [l for l in text.splitlines() if "spill stores" in l and " 0 bytes" not in l]


# The shipped set is bf16 (fp16 compiles on first use); these checks cover fp16 too.
BOTH = ("bfloat16", "float16")
FEATURE_ARGS = ["--features", "window+softcap+sinks", "--head-dims", "64,96,128,256",
                "--groups", "4", "--dtypes", ",".join(BOTH)]


def _compile_log(*args):
    """`python -m podcute compile --check` of a variant selection, with ptxas remarks."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    return subprocess.run(
        [sys.executable, "-m", "podcute", "compile", "--arch", "sm_90a", "--check", *args],
        capture_output=True, text=True, env=env, timeout=1800)


@pytest.fixture(scope="module")
def feature_log():
    """Variants with every model feature on (they compile on first use; this checks the
    heaviest of them for each head dim and page class)."""
    return _compile_log(*FEATURE_ARGS)


def test_feature_variants_compile_without_spills(feature_log):
    assert feature_log.returncode == 0, feature_log.stdout[-3000:] + feature_log.stderr[-3000:]
    lines = [l for l in feature_log.stdout.splitlines() if l.startswith("[")]
    want = shipped_variants(head_dims=(64, 96, 128, 256), groups=(4,),
                            features=("window+softcap+sinks",), dtypes=BOTH)
    assert len(lines) == len(want) and all("window+softcap+sinks" in l for l in lines)
    _assert_no_spills(feature_log, len(want))


def _assert_no_spills(log, variants: int):
    """Every variant's kernel reported its resources, none with a spill."""
    text = log.stdout + log.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
    assert len(spills) >= variants and max(spills) == 0, [
        l for l in text.splitlines() if "spill stores" in l and " 0 bytes" not in l]


# Both fp8 types with both query types, but e5m2 with fp16 queries only: the MMAs run in
# fp16 for bf16 queries too, so the K/V converters are the same code for both query types
# and the query side the same for both fp8 types; e5m2 with bf16 queries combines two
# checked halves, and compiling its 48 variants would spend ~5 % of CI's 90 minutes.
FP8_SETS = {"float8_e4m3fn": BOTH, "float8_e5m2": ("float16",)}


@pytest.fixture(scope="module", params=sorted(FP8_SETS))
def fp8_log(request):
    """fp8-cache variants (they compile on first use) with every model feature (the most
    registers), each head dim and page class (the converting producer warps' loads and
    the MMA warpgroups' 192 registers, the warp-level decode path's included, must not
    spill)."""
    kv, dtypes = request.param, FP8_SETS[request.param]
    want = shipped_variants(head_dims=(64, 96, 128, 256), groups=(4,),
                            features=("window+softcap+sinks",), kv_dtypes=(kv,), dtypes=dtypes)
    return want, _compile_log("--kv-dtypes", kv, "--features", "window+softcap+sinks",
                              "--head-dims", "64,96,128,256", "--groups", "4",
                              "--dtypes", ",".join(dtypes))


def test_fp8_variants_compile_without_spills(fp8_log):
    want, log = fp8_log
    assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
    lines = [l for l in log.stdout.splitlines() if l.startswith("[")]
    assert len(lines) == len(want) and all(" kv=float8_" in l for l in lines)
    for line in lines:
        assert re.search(r"wgmma=[1-9]", line) and re.search(r"setmaxnreg=[1-9]", line), line
    _assert_no_spills(log, len(want))


@pytest.mark.parametrize("feature", ["ragged", "cache2"])
def test_second_source_variants_compile_without_spills(feature):
    """The variants with a second K/V source (compiled on first use): the legacy POD
    wrapper's ragged one, BatchPOD's second cache; every head dim and page class. The
    second source's items take their own copy of the producer's TMA loop, so the
    24-register producer must not spill."""
    log = _compile_log("--features", feature, "--groups", "4")
    assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
    lines = [l for l in log.stdout.splitlines() if l.startswith("[")]
    want = shipped_variants(groups=(4,), features=(feature,))
    assert len(lines) == len(want) and all(f" {feature} " in l for l in lines)
    _assert_no_spills(log, len(want))
    flag = {"ragged": "ragged_kv", "cache2": "second_cache"}[feature]
    with pytest.raises(ValueError, match="16-bit cache"):
        KernelConfig.select("bfloat16", 128, 4, kv_dtype="float8_e4m3fn", **{flag: True})


def test_every_selected_configuration_is_buildable():
    """Every head dim x page class x group the API accepts has a configuration (even
    K/V stage counts, shared memory and registers within the SM's)."""
    from podcute.kernels.config import FP8_HEAD_DIMS, SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES

    for d in SUPPORTED_HEAD_DIMS:
        for page in SUPPORTED_PAGE_SIZES:
            for g in (1, 3, 8, 32):
                cfg = KernelConfig.select("bfloat16", d, g, page_size=page, window=True,
                                          softcap=True, has_sinks=True)
                assert cfg.can_implement() == (True, "")
                assert cfg.num_stages % cfg.num_mma_warpgroups == 0
                if d in FP8_HEAD_DIMS:
                    for kv in ("float8_e4m3fn", "float8_e5m2"):
                        c8 = KernelConfig.select("float16", d, g, page_size=page, kv_dtype=kv)
                        assert c8.can_implement() == (True, "") and c8.fp8_stages >= 4


def test_unsupported_arch_is_refused():
    proc = subprocess.run([sys.executable, "-m", "podcute", "compile", "--arch", "sm_100a"],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "sm_90a" in proc.stderr and "sm_80" in proc.stderr
    with pytest.raises(ValueError, match="sm_90a"):
        VariantKey.make(KernelConfig.select("bfloat16", 128, 4, True, True, arch="sm_100a"))
