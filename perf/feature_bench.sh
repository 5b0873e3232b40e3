#!/usr/bin/env bash
# The model-feature benchmark runs of issue 10 (docs/performance.md), on the H200 after
# perf/gpu_check.sh's set-up (or standalone: it sources the same environment):
#
#   bash perf/feature_bench.sh SET...   SET: d256 window softcap sinks d96 d64 invariant f1
#
# Each set is one or two `python -m perf.bench` runs (FA4 with the same options in the
# same run), written to $OUT/bench-<name>/. Env: REPS (timed calls, default 20),
# PAGES (default 16,128), DEADLINE_S (seconds for all sets).
set -u
OUT=${OUT:-/tmp/podcute-out}
REPS=${REPS:-20}
PAGES=${PAGES:-16,128}
DEADLINE=${DEADLINE_S:-100000}
mkdir -p "$OUT"
b() {  # b NAME ARGS...: one perf.bench run
  local name=$1; shift
  if [ $((DEADLINE - SECONDS)) -lt 40 ]; then echo "=== bench-$name skipped: deadline"; return; fi
  echo "=== bench-$name: $*"
  timeout $((DEADLINE - SECONDS - 10)) python -m perf.bench --reps "$REPS" --pages "$PAGES" \
    --out "$OUT/bench-$name" "$@" >"$OUT/bench-$name.log" 2>&1
  echo "rc=$? ${SECONDS}s"
  sed -n '/^| workload/,/^$/p' "$OUT/bench-$name/bench.md" 2>/dev/null
}
for s in "$@"; do
  case $s in
    d256) b d256 --heads 16/8 --head-dim 256 --only F1,D1,M1 ;;
    window) b window --window 4096 --only F1,M3 ;;
    softcap) b base-m1 --only M1; b softcap --softcap 30 --only M1 ;;
    sinks) b base-m1-64 --heads 64/8 --head-dim 64 --only M1
           b sinks --heads 64/8 --head-dim 64 --sinks --only M1 ;;
    d96) b d96 --head-dim 96 --only M1,M2,M3,M4,M5,P1 ;;
    d64) b d64 --head-dim 64 --only M1,M2,M3,M4,M5,P1 ;;
    # issue 44's prefill targets beside FA4: F1 at head dims 64 and 256 and under a window
    # (F1 at 128 is in the default run)
    f1) b f1-d64 --head-dim 64 --only F1; b f1-d256 --heads 16/8 --head-dim 256 --only F1
        b f1-window --window 4096 --only F1 ;;
    invariant) b base-inv --only M1,M2,M3,M4,M5,D1; b invariant --batch-invariant --only M1,M2,M3,M4,M5,D1 ;;
    *) echo "unknown set $s"; exit 2 ;;
  esac
done
