"""Experiment (GPU): when does sharing a prefix pay? Times one sharing group inside a
background of unshared decodes, planned with sharing and without (perf.bench_shared: the
same run's ceilings, each result checked against the reference), over the group's size
and its shared run:

- background: 32 decodes of 1024 own keys (32/8/128, page 16);
- group: N decodes sharing RUN tokens, 256 own keys each; N in {2, 4, 8, 32}, RUN in
  {256, 512, 2048, 8192}.

    python -m perf.experiments.share_pays [--sizes 2,4,8,32] [--runs 256,512,2048,8192]
                                          [--reps N] [--out DIR]

The question is the threshold of sharing.MIN_SHARED_TOKENS and of the sharers a node
needs (docs/notes/shared-prefix.md, "When sharing pays"): a plan that shares must not be
slower than the plain one, since plan() shares by default.
"""

from __future__ import annotations

import argparse
import sys

import perf.bench_shared as bench_shared

BACKGROUND = [(1, 1024)] * 32


def specs(sizes, runs):
    out = {"BG": ([], BACKGROUND)}
    for n in sizes:
        for run in runs:
            out[f"N{n}R{run}"] = ([(run, [(1, 256)] * n)], BACKGROUND)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,4,8,32")
    ap.add_argument("--runs", default="256,512,2048,8192")
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    table = specs([int(x) for x in args.sizes.split(",")],
                  [int(x) for x in args.runs.split(",")])
    if "--workloads" not in rest:
        rest += ["--workloads", ",".join(table)]
    return bench_shared.main(rest, table)


if __name__ == "__main__":
    raise SystemExit(main())
