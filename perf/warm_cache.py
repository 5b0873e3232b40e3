"""Compile, on a machine without a GPU, the kernel variants a device run needs (the GPU
tests, tests/gpu_sanitize.py, the demo and the benchmark), so the H200 loads them from
the carried cache instead of compiling:

    CUTE_DSL_ARCH=sm_90a PODCUTE_CACHE_DIR=.device/pcache python -m perf.warm_cache [-j 2]

(`.device/` is git-ignored and carried to the device; set PODCUTE_CACHE_DIR there too.)
With PODCUTE_TEST_DECODE_EVICT_FIRST or PODCUTE_TEST_SOFTMAX_UNDER_PV = 0 / 1, the
variants without / with that KernelConfig flag (podcute.testing.kernel_flags).
"""

from __future__ import annotations

import argparse
import os
import sys

# (dtype, head_dim, group, causal, has_lse, page_size); the page size stands for its class.
VARIANTS = sorted({
    # tests/test_kernel_gpu.py
    ("bfloat16", 128, 4, True, True, 16), ("float16", 128, 4, True, True, 16),
    ("bfloat16", 64, 4, True, True, 16), ("float16", 64, 1, True, True, 64),
    ("bfloat16", 128, 1, True, True, 1), ("bfloat16", 128, 7, True, True, 64),
    ("bfloat16", 128, 8, True, True, 128), ("bfloat16", 128, 32, True, True, 16),
    ("bfloat16", 128, 4, False, True, 16), ("float16", 64, 4, False, True, 1),
    ("bfloat16", 64, 4, True, True, 128), ("float16", 128, 4, False, True, 64),
    ("bfloat16", 128, 4, True, True, 128), ("bfloat16", 128, 4, True, True, 1),
    ("bfloat16", 128, 8, True, True, 8), ("float16", 64, 8, True, True, 256),
    ("bfloat16", 128, 7, True, True, 32), ("bfloat16", 128, 8, True, True, 16),
    ("bfloat16", 128, 8, True, True, 1),
    # tests/test_graph_gpu.py
    ("float16", 64, 1, True, True, 16),
    # tests/gpu_sanitize.py
    ("bfloat16", 128, 8, False, True, 128), ("bfloat16", 64, 8, True, True, 128),
    ("bfloat16", 64, 1, True, True, 1), ("float16", 64, 1, True, False, 16),
    ("bfloat16", 128, 4, True, True, 8), ("bfloat16", 96, 4, True, True, 16),
    ("bfloat16", 96, 1, False, True, 1), ("bfloat16", 96, 8, True, True, 128),
    ("bfloat16", 256, 4, True, True, 16), ("bfloat16", 256, 8, True, True, 128),
    ("bfloat16", 256, 1, False, True, 1),
    ("bfloat16", 160, 4, True, True, 16), ("bfloat16", 80, 4, True, True, 1),
    # compat and serving-loop GPU tests (8/2/128 bf16 causal, pages 1 and 16)
    ("bfloat16", 128, 4, True, False, 1),
    # demo and perf.bench (32/8/128 and 16/4/128, pages 16 and 128)
    ("bfloat16", 128, 4, True, False, 16), ("bfloat16", 128, 4, True, False, 128),
})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-j", type=int, default=2, help="parallel compiler processes")
    p.add_argument("--only", choices=("all", "fp8", "16bit"), default="all",
                   help="fp8: only the fp8-cache test variants; 16bit: all but those")
    p.add_argument("--arch", default=os.environ.get("PODCUTE_ARCH") or "sm_90a",
                   help="target (default $PODCUTE_ARCH or sm_90a; sm_90: the portable "
                        "kernel's variants, those it has)")
    args = p.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", args.arch)
    from podcute.testing import kernel_flags_from_env

    with kernel_flags_from_env():
        return _warm(args)


def _warm(args) -> int:
    from podcute.compile import VariantKey, compile_many
    from podcute.kernels.config import KernelConfig, WARP_MMA_ARCHS

    def select(*a, **kw):  # None where the arch's kernel lacks the variant (D 256, fp8)
        try:
            return KernelConfig.select(*a, arch=args.arch, **kw)
        except ValueError:
            if args.arch in WARP_MMA_ARCHS:
                return None
            raise

    from podcute.testing import (feature_test_variants, fp8_test_variants,
                                 head_size_test_variants, wide_test_variants)

    cfgs = []
    if args.only != "fp8":
        cfgs += [select(*v) for v in VARIANTS]
        cfgs += [select(**kw) for kw in feature_test_variants()]
        cfgs += [select(**kw) for kw in wide_test_variants()]  # test_random_wide
        cfgs += [select(**kw) for kw in head_size_test_variants()]
        # plans share prefixes by default: the shared_prefix twins of the demo's, the
        # benchmarks' and the compat tests' variants (perf.bench_shared, share_pays)
        cfgs += [select("bfloat16", 128, 4, True, lse, page, shared_prefix=True)
                 for lse in (True, False) for page in (1, 16, 128)]
        # tests/gpu_sanitize.py's feature cases
        cfgs += [select("bfloat16", 128, g, True, True, page, **f)
                 for g, page, f in ((4, 16, dict(window=True, softcap=True, has_sinks=True)),
                                    (4, 8, dict(window=True, has_sinks=True)),
                                    (8, 128, dict(window=True, softcap=True)))]
    if args.only != "16bit":  # tests/test_fp8_gpu.py, gpu_sanitize.py --fp8, perf.bench_fp8
        cfgs += [select(**kw) for kw in fp8_test_variants()]
        cfgs += [select("bfloat16", 128, 4, True, False, page, kv_dtype=kv)
                 for page in (16, 128) for kv in ("", "float8_e4m3fn")]
        # gpu_sanitize.py --fp8's D 256 cases; perf.bench_fp8's D 256 rows
        cfgs += [select("bfloat16", 256, 8, False, True, 4, kv_dtype="float8_e5m2"),
                 select("bfloat16", 256, 4, True, True, 16, kv_dtype="float8_e4m3fn")]
        cfgs += [select("bfloat16", 256, 2, True, False, page, kv_dtype=kv)
                 for page in (16, 128) for kv in ("", "float8_e4m3fn")]
    keys = [VariantKey.make(c) for c in cfgs if c is not None]
    keys = list(dict.fromkeys(keys))
    print(f"{len(keys)} distinct variants", flush=True)
    for key, secs, _ in compile_many(keys, args.j):
        c = key.config
        print(f"{c.dtype} d{c.head_dim} g{c.group} causal={c.causal} lse={c.has_lse} "
              f"kv_box={c.kv_box} {c.features or 'no features'} {secs:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
