#!/usr/bin/env bash
# One call on a GPU machine (from the repo root; its environment script is .device/gpu-env.sh,
# git-ignored):
#
#   bash perf/gpu_check.sh STEP...      STEP: demo warm kernel features graph compat serving memcheck
#                                             racecheck synccheck quick-bench bench host
#                                             warm-fp8 fp8 fp8-bench fp8-memcheck fp8-ab ab
#                                             flag-ab (AB_CMD with a kernel flag on / off)
#                                             warm-portable portable (PODCUTE_ARCH=sm_90)
#                                             fp8-racecheck fp8-synccheck
#                                             second-memcheck second-racecheck (the
#                                             legacy wrapper's ragged K/V, BatchPOD's
#                                             second cache)
#                                             shared shared-memcheck shared-racecheck
#                                             shared-bench shared-parts share-pays
#                                             (shared-prefix plans: the GPU tests, the
#                                             sanitizers, perf.bench_shared, its parts'
#                                             batches, when sharing pays)
#                                             kv-box (page 16's TMA boxes against the
#                                             cp.async gather, perf.experiments.exp_kv_box)
#                                             ncu-W-PAGE
#                                             (ncu of workload W at page PAGE, e.g. ncu-F1-16)
#                                             ncu-fa4-W-PAGE (the same batch through FA4)
#                                             ncu-base-W-PAGE (the same for the source tree
#                                             unpacked in .device/base, for before/after)
#
# Installs podcute, loads the kernel cache carried in .device/pcache (perf/warm_cache.py
# fills it on a CPU machine), runs the steps in order (each under a timeout), and writes
# logs and JSON under $OUT. Env: PODCUTE_GPU_RANDOM (kernel sweep size, default 200),
# PODCUTE_GRAPH_PAIRS (default 60), BENCH_ARGS (extra perf.bench arguments), WARM_ARGS
# (extra perf.warm_cache arguments, e.g. "--only 16bit"), KERNEL_K (the kernel step's
# pytest -k expression, e.g. "invariant or random_mixed"), SANITIZE_ARGS (of the racecheck step,
# e.g. '--case "p16 mixed"'), FP8_SANITIZE_ARGS (of the fp8 sanitizer steps, e.g. '--case D256'),
# FP8_BENCH_ARGS (extra perf.bench_fp8 arguments of fp8-bench), AB_ROUNDS (new/base rounds of ab, default 2), DEADLINE_S
# (seconds for all steps; later steps are cut short or skipped; default 560, inside a
# device call's 600), PYTEST_ADDOPTS (e.g. a per-test --timeout, so a hung launch fails
# its test instead of the whole step), PODCUTE_TEST_DECODE_EVICT_FIRST=0 / 1 (every step's
# kernels without / with KernelConfig.decode_kv_evict_first, on by default; warm_cache
# compiles those).
#
# What comes back is one archive, $OUT/results.tgz (the device returns at most 8 files),
# rewritten after every step: a call killed at its limit still returns the steps it
# finished. The steps write into a scratch folder (OUT below, exported to them).
set -u
DEST=${OUT:-/tmp/podcute-out}
mkdir -p "$DEST"
OUT=$(mktemp -d /tmp/podcute-work.XXXXXX)
export OUT
pack() {  # every step's logs and JSON so far -> $DEST/results.tgz (replaced whole)
  tar czf "$DEST/.results.tgz" -C "$OUT" . && mv "$DEST/.results.tgz" "$DEST/results.tgz"
}
source .device/gpu-env.sh
# (GPU_CHECK_INSTALLED=1: the caller installed podcute, and may be running it beside)
[ "${GPU_CHECK_INSTALLED:-0}" = 1 ] ||
  pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
export PODCUTE_CACHE_DIR=${PODCUTE_CACHE_DIR:-$PWD/.device/pcache} PODCUTE_COMPILE_LOG=$OUT/compiles.log
# Scripts outside the repo root (tests/gpu_sanitize.py) import podcute from the tree.
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD:${PYTHONPATH:-}
if ! python -c "import podcute.layouts" 2>>"$OUT/install.log"; then
  # An old setuptools installs editable packages as a path entry, which cannot map
  # layouts/ to podcute.layouts: link it into this copy of the tree instead.
  echo "editable install does not map podcute.layouts; linking it" | tee -a "$OUT/install.log"
  ln -sfn ../layouts podcute/layouts
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
pack

NCU_SECTIONS=(--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
  --section InstructionStats --metrics "${NCU_METRICS:-sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg.pct_of_peak_sustained_elapsed}")
status=0
DEADLINE=${DEADLINE_S:-560}  # seconds for all steps: a device call has a hard limit, and
                             # the archive must still be written
step() {  # step NAME SECONDS CMD...: run, log, record the exit code
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 15))
  if [ $left -lt 20 ]; then echo "=== $name skipped: deadline" | tee -a "$OUT/summary.txt"; status=1; return 1; fi
  [ $secs -gt $left ] && secs=$left
  echo "=== $name" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$OUT/$name.log"
  echo "=== $name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  pack
  return $rc
}

for s in "$@"; do
  case $s in
    demo) step demo 120 python -m podcute demo || break ;;
    warm) step warm 300 python -m perf.warm_cache -j "$(nproc)" ${WARM_ARGS:-} ;;  # compile here
    warm-fp8) step warm-fp8 300 python -m perf.warm_cache --only fp8 -j "$(nproc)" ;;
    # the portable (mma.sync) kernel compiled for plain sm_90, forced by PODCUTE_ARCH
    warm-portable) step warm-portable 300 env PODCUTE_ARCH=sm_90 \
        python -m perf.warm_cache --only 16bit -j "$(nproc)" ;;
    portable) step portable 500 env PODCUTE_ARCH=sm_90 \
        PODCUTE_GPU_REPORT="$OUT/portable_report.json" \
        python -m pytest -q -x -m gpu tests/test_kernel_gpu.py ;;
    fp8) step fp8 420 env PODCUTE_GPU_REPORT="$OUT/fp8_report.json" \
        python -m pytest -q -x -m gpu tests/test_fp8_gpu.py ;;
    fp8-bench) step fp8-bench 500 python -m perf.bench_fp8 --out "$OUT/fp8" \
        --dtypes bfloat16,float16 ${FP8_BENCH_ARGS:-} ;;
    # A/B: one benchmark command of the tree unpacked in .device/base and of this one,
    # alternating new/base twice (one machine, so the ratio is the measurement).
    # fp8-ab: perf.bench_fp8 FP8_AB_ARGS; ab: AB_CMD (e.g. "perf.bench --quick --only
    # M1,F1"; with PODCUTE_ARCH=sm_90 in the environment, of the portable kernel).
    fp8-ab|ab) ln -sfn ../layouts .device/base/podcute/layouts
        if [ "$s" = fp8-ab ]; then
          ab_cmd="perf.bench_fp8 ${FP8_AB_ARGS:---workloads F1,M3 --pages 16,128 --dtypes bfloat16}"
        else
          ab_cmd=${AB_CMD:-perf.bench --quick --only M1,D1,F1 --pages 16}
        fi
        for r in $(seq "${AB_ROUNDS:-2}"); do
          step $s-new$r 200 python -m $ab_cmd --out "$OUT/$s-new$r"
          step $s-base$r 200 env -C .device/base PYTHONPATH=$PWD/.device/base:${PYTHONPATH:-} \
              python -m $ab_cmd --out "$OUT/$s-base$r"
        done ;;
    # flag-ab: the same benchmark (AB_CMD) with a KernelConfig flag's variable (FLAG_AB,
    # default PODCUTE_TEST_SOFTMAX_UNDER_PV; podcute.testing.KERNEL_FLAG_ENV) at 1 and at 0,
    # alternating AB_ROUNDS times on this tree
    flag-ab) var=${FLAG_AB:-PODCUTE_TEST_SOFTMAX_UNDER_PV}
        for r in $(seq "${AB_ROUNDS:-2}"); do
          for v in 1 0; do
            step flag-ab-$v-$r 200 env "$var=$v" python -m ${AB_CMD:-perf.bench --only F1,M1,D1 --pages 16,128} \
                --out "$OUT/flag-ab-$v-$r"
          done
        done ;;
    fp8-memcheck) step fp8-memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python tests/gpu_sanitize.py --fp8 ${FP8_SANITIZE_ARGS:-} ;;
    fp8-racecheck) step fp8-racecheck 400 compute-sanitizer --tool racecheck --error-exitcode 3 \
        --kernel-regex kns=kernel_cutlass \
        python tests/gpu_sanitize.py --fp8 --small ${FP8_SANITIZE_ARGS:-} ;;
    fp8-synccheck) step fp8-synccheck 300 compute-sanitizer --tool synccheck --error-exitcode 3 \
        python tests/gpu_sanitize.py --fp8 --small ${FP8_SANITIZE_ARGS:-} ;;
    # the second K/V sources: the legacy wrapper's ragged one, BatchPOD's second cache
    second-memcheck) for f in --legacy --cache2; do step second-memcheck$f 240 \
        compute-sanitizer --tool memcheck --error-exitcode 3 python tests/gpu_sanitize.py $f
        done ;;
    second-racecheck) for f in --legacy --cache2; do step second-racecheck$f 300 \
        compute-sanitizer --tool racecheck --error-exitcode 3 --kernel-regex kns=kernel_cutlass \
        python tests/gpu_sanitize.py $f --small; done ;;
    shared) step shared 400 python -m pytest -q -x -m gpu tests/test_shared_prefix_gpu.py ;;
    shared-memcheck) step shared-memcheck 300 compute-sanitizer --tool memcheck \
        --error-exitcode 3 python tests/gpu_sanitize.py --shared ;;
    shared-racecheck) step shared-racecheck 400 compute-sanitizer --tool racecheck \
        --error-exitcode 3 --kernel-regex kns=kernel_cutlass python tests/gpu_sanitize.py \
        --shared --small ;;
    shared-bench) step shared-bench 200 python -m perf.bench_shared --out "$OUT/shared-bench" ;;
    shared-parts) step shared-parts 300 python -m perf.experiments.shared_parts \
        --out "$OUT/shared-parts" ;;
    kv-box) step kv-box 300 python -m perf.experiments.exp_kv_box ${KV_BOX_ARGS:-} ;;
    share-pays) step share-pays 300 python -m perf.experiments.share_pays \
        --out "$OUT/share-pays" ;;
    features) step features 500 env PODCUTE_GPU_REPORT="$OUT/features_report.json" \
        python -m pytest -q -x -m gpu tests/test_kernel_gpu.py -k "feature or invariant or nothing" ;;
    kernel) step kernel 420 env PODCUTE_GPU_REPORT="$OUT/kernel_report.json" \
        python -m pytest -q -x -m gpu tests/test_kernel_gpu.py ${KERNEL_K:+-k "$KERNEL_K"} ;;
    graph) step graph 300 env PODCUTE_GPU_REPORT="$OUT/graph_report.json" \
        python -m pytest -q -x -m gpu tests/test_graph_gpu.py ;;
    compat) step compat 300 python -m pytest -q -m gpu tests/test_compat_flash_attn_gpu.py \
        tests/test_compat_flashinfer_gpu.py ;;
    serving) step serving 300 env PODCUTE_GPU_REPORT="$OUT/serving_report.json" \
        python -m pytest -q -s -m gpu tests/test_serving_gpu.py ;;
    host) step host 300 python -m perf.bench_host --out "$OUT/host" ;;
    memcheck) step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python tests/gpu_sanitize.py ;;
    racecheck) step racecheck 400 compute-sanitizer --tool racecheck --error-exitcode 3 \
        python tests/gpu_sanitize.py --small ${SANITIZE_ARGS:-} ;;
    synccheck) step synccheck 300 compute-sanitizer --tool synccheck --error-exitcode 3 \
        python tests/gpu_sanitize.py --small ;;
    quick-bench) step quick-bench 400 python -m perf.bench --quick --no-sweep \
        --out "$OUT/bench" ${BENCH_ARGS:-} && sed -n '/^| workload/,/^$/p' "$OUT/bench/bench.md" ;;
    bench) step bench 580 python -m perf.bench --out "$OUT/bench" ${BENCH_ARGS:-} ;;
    fbench-*) step "$s" 580 env DEADLINE_S=$((DEADLINE - SECONDS - 20)) \
        bash perf/feature_bench.sh ${s#fbench-} ;;  # e.g. fbench-d256 (perf/feature_bench.sh)
    ncu-base-*) w=${s#ncu-base-}  # the same profile of the tree in .device/base
        prof=perf.experiments.profile_one  # (perf.profile_one in a tree older than perf/experiments/)
        [ -f .device/base/perf/experiments/profile_one.py ] || prof=perf.profile_one
        step "$s" 240 env -C .device/base PYTHONPATH=$PWD/.device/base:${PYTHONPATH:-} \
        ncu --clock-control none -k regex:kernel_cutlass --launch-skip 3 --launch-count 1 \
        "${NCU_SECTIONS[@]}" python -m $prof ${w%-*} ${w##*-} ;;
    ncu-fa4-*) w=${s#ncu-fa4-}  # the same batch through FlashAttention-4 (its mainloop beside ours)
        step "$s" 240 env PODCUTE_PROFILE_PEER=fa4 ncu --clock-control none \
        -k regex:kernel_cutlass --launch-skip 3 --launch-count 1 "${NCU_SECTIONS[@]}" \
        python -m perf.experiments.profile_one ${w%-*} ${w##*-} ;;
    ncu-*) w=${s#ncu-}; step "$s" 240 ncu --clock-control none -k regex:kernel_cutlass \
        --launch-skip 3 --launch-count 1 "${NCU_SECTIONS[@]}" \
        python -m perf.experiments.profile_one ${w%-*} ${w##*-} ;;
    *) echo "unknown step $s"; status=2 ;;
  esac
done
pack
exit $status
