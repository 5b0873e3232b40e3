"""Every shipped variant of the warp-level (mma.sync) kernel compiles, on a CPU-only
machine, for each architecture it serves (sm_80, sm_86, sm_89, plain sm_90, sm_120a), with
mma.sync fed by ldmatrix in its PTX, no wgmma, and no register spills reported by ptxas
(plain sm_90: within SPILL_ALLOWANCE); so do the variants with every model feature on and
those with a second K/V source, ragged or a second cache (they compile on first use)."""

import os
import re
import subprocess
import sys

import pytest

from podcute.compile import cache_dir, shipped_variants
from podcute.kernels.config import WARP_MMA_ARCHS

# The full variant sweep: `python -m pytest -m sweep` (.ci/run runs it after the README's
# command; tests/test_compile_quick.py is the per-family compile in the default suite).
pytestmark = [pytest.mark.compile, pytest.mark.sweep]

FEATURES = "window+softcap+sinks"
BOTH = "bfloat16,float16"  # the shipped set is bf16; the feature check covers fp16 too
# Spill bytes ptxas is known to report on plain sm_90, per variant set (0 elsewhere): its
# 128-row prefill items (config.WIDE_PREFILL_ARCHS) keep O of 32 rows a warp (128
# registers at D 128) beside a per-SM budget of 255, and ptxas, reading ahead as far as
# registers allow, leaves a few values in local memory. Where they are (SASS of the
# 2026-12-05 build, `python -m perf.experiments.sass_loops`, docs/notes/warp-kernel.md): in the two-block
# tile loop, 2 reloads a tile at D 128 G 4-8 non-causal, none in the causal ones, 4
# stores and 4 loads (the row sums) at G 1, 9 reloads with every model feature, of
# ~1500-1650 instructions; the rest is per-item code (the split items' fold, the
# epilogue; with every model feature one more store an item since the one-sweep split
# merge, its tile loops' local memory unchanged). The targets with 64-row items spill
# nothing.
SPILL_ALLOWANCE = {"sm_90": {"shipped": 64, "features": 108, "ragged": 64, "cache2": 64}}
# sm_89 and sm_120a have sm_86's 100 KB SMs, so the same configurations (one K/V stage):
# their feature and second-source variants are the same code ptxas already checked for
# sm_86, and compiling them again would spend ~10 % of CI's 90 minutes. Their shipped
# sets still compile for their own targets.
SHIPPED_ONLY = ("sm_89", "sm_120a")


def _compile(arch: str, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    return subprocess.run(
        [sys.executable, "-m", "podcute", "compile", "--arch", arch, "--check", *args],
        capture_output=True, text=True, env=env, timeout=1800)


@pytest.mark.parametrize("arch", WARP_MMA_ARCHS)
def test_portable_variants_compile_without_spills(arch):
    allowance = SPILL_ALLOWANCE.get(arch, {})
    sets = (
        ((), shipped_variants(arch), allowance.get("shipped", 0)),
        (("--features", FEATURES, "--groups", "4", "--dtypes", BOTH),
         shipped_variants(arch, groups=(4,), features=(FEATURES,), dtypes=BOTH.split(",")),
         allowance.get("features", 0)),
        # the second K/V sources: the legacy POD wrapper's ragged one, BatchPOD's
        # second cache
        (("--features", "ragged,cache2", "--groups", "4"),
         shipped_variants(arch, groups=(4,), features=("ragged", "cache2")),
         max(allowance.get("ragged", 0), allowance.get("cache2", 0))))
    for args, want, allowed in sets[:1] if arch in SHIPPED_ONLY else sets:
        log = _compile(arch, *args)
        assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
        lines = [l for l in log.stdout.splitlines() if l.startswith("[")]
        assert len(lines) == len(want), log.stdout[-2000:]
        for line in lines:
            assert re.search(r" mma=[1-9]", line) and re.search(r"ldmatrix=[1-9]", line), line
        text = log.stdout + log.stderr
        assert f"for {arch} in" in log.stdout
        # ptxas compiled each kernel for this target, none with a spill.
        # (ptxas's report of a kernel that spills comes line-wrapped inside a remark)
        targets = re.findall(r"Compiling entry function\s+'[^']*'\s+for\s+'(\w+)'", text)
        assert len(targets) >= len(want) and set(targets) == {arch}, set(targets)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
        assert len(spills) >= len(want) and max(spills) <= allowed, [
            l for l in text.splitlines() if "spill stores" in l and " 0 bytes" not in l]
    # The arch's own cache folder holds its kernels.
    assert len(list(cache_dir(arch).glob("*.o"))) >= len(shipped_variants(arch))


def test_fp8_and_head_dim_256_are_sm90a_only():
    from podcute.kernels.config import KernelConfig

    for arch in WARP_MMA_ARCHS:
        with pytest.raises(NotImplementedError, match="fp8 KV caches need the sm_90a kernel"):
            KernelConfig.select("bfloat16", 128, 4, arch=arch, kv_dtype="float8_e4m3fn")
        with pytest.raises(NotImplementedError, match="head_dim 256 has no kernel"):
            KernelConfig.select("bfloat16", 256, 4, arch=arch)
        with pytest.raises(ValueError, match="fp8"):
            shipped_variants(arch, kv_dtypes=("float8_e4m3fn",))


def test_two_kv_stages_where_two_ctas_of_them_fit():
    """Two K/V stages where two CTAs of them fit the SM (the runtime's 1 KB a CTA
    counted), else one stage; two CTAs an SM either way; 128-row prefill items on
    WIDE_PREFILL_ARCHS where two CTAs of them and two stages fit, else 64-row ones."""
    from podcute.kernels.config import (ARCH_SMEM, CTA_RESERVED_SMEM, WIDE_PREFILL_ARCHS,
                                        KernelConfig)

    for arch in WARP_MMA_ARCHS:
        for d in (64, 96, 128):
            cfg = KernelConfig.select("bfloat16", d, 4, arch=arch)
            assert cfg.ctas_per_sm == 2, (arch, d)
            fits = 2 * (((64 + 4 * 64) * d * 2 + 1024) + CTA_RESERVED_SMEM) <= ARCH_SMEM[arch][0]
            assert cfg.num_stages == (2 if fits else 1), (arch, d, cfg.num_stages)
            assert cfg.q_in_registers == (cfg.num_stages == 2)
            # 128-row prefill items where their Q tile fits beside the two stages
            wide = 2 * (((128 + 4 * 64) * d * 2 + 1024) + CTA_RESERVED_SMEM) <= ARCH_SMEM[arch][0]
            wide = wide and arch in WIDE_PREFILL_ARCHS
            assert cfg.tile_m_prefill == (128 if wide else 64), (arch, d)
            assert cfg.tile_m_decode == 64
    # D 128: 81 KB a CTA takes two stages on sm_80 (164 KB an SM) and sm_90, one on the
    # 100 KB SMs.
    assert [KernelConfig.select("bfloat16", 128, 4, arch=a).num_stages
            for a in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120a")] == [2, 1, 1, 2, 1]


def test_shipped_only_archs_share_sm86s_configurations():
    """SHIPPED_ONLY's feature and second-source variants are left to sm_86's compile:
    that holds only while they select sm_86's configurations."""
    import dataclasses

    from podcute.kernels.config import KernelConfig

    for arch in SHIPPED_ONLY:
        for d in (64, 96, 128):
            for page in (1, 16, 128):
                for f in (dict(window=True, softcap=True, has_sinks=True),
                          dict(ragged_kv=True), dict(second_cache=True)):
                    mine = KernelConfig.select("bfloat16", d, 4, page_size=page, arch=arch, **f)
                    ref = KernelConfig.select("bfloat16", d, 4, page_size=page, arch="sm_86", **f)
                    assert dataclasses.replace(mine, arch="sm_86") == ref, (arch, d, page, f)
