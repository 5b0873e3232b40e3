"""Experiment (GPU): where a shared-prefix launch's time goes. Times batches that isolate
its parts beside S1-S3, through perf.bench_shared (sharing on and off, the roofline that
counts each page once, the same run's ceilings):

- OWN: S1's own suffixes alone (128 decodes of 256 keys: 1024 decode items, no splits);
- PRE2 / PRE: 32 / 128 decodes sharing 8192 tokens with one own page each (8 / 32 prefix
  tiles, and 256 / 1024 one-page own items with their split protocol);
- P32 / P32x4 / P128: the tiles' tensor work as plain prefills (1 or 4 requests of 32
  query tokens, or 1 of 128, over 8192 keys: many-way splits, 128-row merges).

    python -m perf.experiments.shared_parts [--stub-merges] [--merge-splits N]
                                            [--workloads ...] [--reps N] [--out DIR]

`--stub-merges` makes every merge a no-op (its results are wrong; the times show what
the merges cost); `--merge-splits N` sets PodKernelBase.merge_splits (the non-shared
merge's splits in flight). Both change the kernels this process compiles: give it a
PODCUTE_CACHE_DIR of its own. Findings: docs/notes/shared-prefix.md ("Where S1's time
goes") and docs/notes/split-merge.md.
"""

from __future__ import annotations

import sys

import perf.bench_shared as bench_shared

EXTRA = {
    "OWN": ([], [(1, 256)] * 128),
    "PRE2": ([(8192, [(1, 16)] * 32)], []),
    "PRE": ([(8192, [(1, 16)] * 128)], []),
    "P32": ([], [(32, 8192)]),
    "P32x4": ([], [(32, 8192)] * 4),
    "P128": ([], [(128, 8192)]),
}


def _stub_merges() -> None:
    import cutlass
    import cutlass.cute as cute

    from podcute.kernels import split_merge

    @cute.jit
    def merge_rows(io, plan, r, group: cutlass.Constexpr[int],
                   head_dim: cutlass.Constexpr[int], tidx, num_threads,
                   shared: cutlass.Constexpr[bool] = False,
                   splits_in_flight: cutlass.Constexpr[int] = 2):
        pass

    split_merge.merge_rows = merge_rows  # (looked up when the kernel is traced)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--stub-merges" in argv:
        argv.remove("--stub-merges")
        _stub_merges()
    if "--merge-splits" in argv:
        i = argv.index("--merge-splits")
        from podcute.kernels.pod_kernel import PodKernelBase
        PodKernelBase.merge_splits = int(argv[i + 1])
        del argv[i: i + 2]
    if "--workloads" not in argv:
        argv += ["--workloads", "OWN,PRE2,PRE,P32,P32x4,P128,S1"]
    return bench_shared.main(argv, {**bench_shared.workloads(), **EXTRA})


if __name__ == "__main__":
    raise SystemExit(main())
