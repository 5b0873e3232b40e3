"""Host time of plan() on this machine's CPU (no GPU needed).

    python -m perf.bench_plan [--reps N] [--calls-per-rep K] [--budget-s S] [--out PATH]

Plans each batch below with the index tensors on the CPU (the no-sync path an engine
uses), with Planner.plan and with PODAttention.plan (which adds the API's argument
checks: the path users call, which issue 12's targets apply to), on a planner for
device="cpu" (the CUDA path adds one non-blocking H2D copy and an event record). Each rep
times K back-to-back calls with perf_counter after warm-up; reported: median and p90 per
call, over the reps (fewer reps for slow batches, so a batch takes about S seconds). Hq/Hkv/D
32/8/128, page 16, block table unless named "-csr". The batches (issue 12, item 4):

- "mixed-256": 256 requests = 8 chunked prefills (512 tokens, KV up to 8K) + 248 decodes
  (q_len 1-4, KV 512-8K); target <= 150 us;
- "decode-1": one decode at KV 4096; target <= 40 us;
- "pre16-128..2048-256", "pre16-4096..8192-256", "pre16-4096..8192-1024": 256 or 1024
  requests, one in 16 a prefill of 128-2048 or 4096-8192 tokens (KV = its tokens + up to
  4K of context), the others decodes as in mixed-256;
- a CSR variant of mixed-256, 256 decodes, the README's M1 batch, one 8K prefill.

The load average of the machine (os.getloadavg) is recorded before and after: the timings
are only comparable on a quiet machine.

If perf/results/bench.json (an H200 run of perf.bench) exists, the plan's predicted time
is also printed next to the measured fused time of each of its workloads.

Human-readable lines go to stderr, the JSON to PATH (default perf/results/bench_plan.json;
"-": stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from podcute import PODAttention
from podcute.planning import Planner


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _inputs(q_lens, kv_lens, page_size, fmt="table", seed=0):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    cu = np.zeros(len(q_lens) + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    npages = -(-kv_lens // page_size)
    if fmt == "table":
        width = int(npages.max())
        bt = rng.permutation(len(q_lens) * width).astype(np.int32).reshape(len(q_lens), width)
        pages = dict(block_table=torch.from_numpy(bt))
    else:
        indptr = np.zeros(len(q_lens) + 1, np.int32)
        indptr[1:] = np.cumsum(npages)
        pages = dict(kv_indptr=torch.from_numpy(indptr),
                     kv_indices=torch.from_numpy(rng.permutation(int(indptr[-1])).astype(np.int32)))
    return torch.from_numpy(cu), torch.from_numpy(kv_lens.astype(np.int32)), pages


def _decodes(rng, n):
    return rng.integers(1, 5, n), rng.integers(512, 8193, n)


def _one_in_16(rng, n, lo, hi):
    """n requests, every 16th a prefill of lo..hi tokens (KV: its tokens + up to 4K of
    context), the others decodes; shuffled."""
    q, kv = _decodes(rng, n)
    pre = np.arange(0, n, 16)
    q[pre] = rng.integers(lo, hi + 1, pre.size)
    kv[pre] = q[pre] + rng.integers(0, 4097, pre.size)
    perm = rng.permutation(n)
    return q[perm], kv[perm]


# issue 12's targets for PODAttention.plan, us per call on the 2-core CPU machine
TARGETS = {"mixed-256": 150.0, "decode-1": 40.0}


def batches():
    rng = np.random.default_rng(0)
    dec_q, dec_kv = _decodes(rng, 248)
    pre_q = np.full(8, 512)
    pre_kv = rng.integers(512, 8193, 8)
    q = np.concatenate([pre_q, dec_q])
    kv = np.concatenate([pre_kv, dec_kv])
    perm = rng.permutation(256)
    yield "mixed-256", q[perm], kv[perm], "table"
    yield "mixed-256-csr", q[perm], kv[perm], "csr"
    yield "decode-256", np.ones(256, int), rng.integers(512, 8193, 256), "table"
    yield "M1 (1x2048 + 128 decodes @2048)", [2048] + [1] * 128, [2048] * 129, "table"
    yield "prefill-1x8192", [8192], [8192], "table"
    yield "decode-1", [1], [4096], "table"
    yield ("pre16-128..2048-256",) + _one_in_16(rng, 256, 128, 2048) + ("table",)
    yield ("pre16-4096..8192-256",) + _one_in_16(rng, 256, 4096, 8192) + ("table",)
    yield ("pre16-4096..8192-1024",) + _one_in_16(rng, 1024, 4096, 8192) + ("table",)


def time_calls(fn, reps, k, budget_s):
    """Median and p90 of the per-call time over reps of k back-to-back calls, after a
    warm-up; slow calls get fewer reps (at least 10) so this takes about budget_s."""
    t = time.perf_counter()
    warm = 0
    while warm < 20 and (warm < 3 or time.perf_counter() - t < 0.2):
        fn()
        warm += 1
    est = (time.perf_counter() - t) / warm
    reps = max(10, min(reps, int(budget_s / (est * k))))
    per_call = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(k):
            fn()
        per_call.append((time.perf_counter() - t) / k * 1e6)
    per_call.sort()
    return dict(median_us=statistics.median(per_call),
                p90_us=per_call[int(0.9 * (len(per_call) - 1))], reps=reps, calls_per_rep=k)


def calibration(path):
    """Plan predictions vs the fused times of a recorded GPU run."""
    from perf.workloads import M1_SHUFFLED, MAIN

    with open(path) as f:
        run = json.load(f)
    known = {w.name: w for w in MAIN + (M1_SHUFFLED,)}
    rows = []
    for r in run.get("main", []):
        w = known.get(r["name"])
        fused = r.get("timings", {}).get("fused", {}).get("ms")
        if w is None or fused is None:
            continue
        p = Planner(w.num_qo_heads, w.num_kv_heads, w.head_dim, r["page_size"], device="cpu",
                    max_batch_size=w.batch_size, max_num_tokens=w.total_q)
        cu, kv, pages = _inputs(w.q_lens, w.kv_lens, r["page_size"])
        s = p.plan(cu, kv, causal=w.causal, **pages).summary
        rows.append(dict(workload=w.name, page_size=r["page_size"],
                         roofline_us=r["roofline_ms"] * 1e3, predicted_us=s.predicted_us,
                         fused_us=fused * 1e3, fused_over_predicted=fused * 1e3 / s.predicted_us))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(__file__)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--calls-per-rep", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=2.0,
                    help="about this many seconds per batch and path (fewer reps if slow)")
    ap.add_argument("--only", default=None, help="comma-separated batch names")
    ap.add_argument("--gpu-run", default=os.path.join(here, "results", "bench.json"))
    ap.add_argument("--out", default=os.path.join(here, "results", "bench_plan.json"),
                    help='where the JSON goes ("-": stdout)')
    args = ap.parse_args(argv)

    out = dict(host=dict(machine=platform.machine(), processor=platform.processor(),
                         cpus=os.cpu_count(), python=platform.python_version(),
                         numpy=np.__version__, torch=torch.__version__),
               config=dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                           device="cpu"),
               load_before=os.getloadavg(), batches=[])
    # Sized for the largest batch, so no batch regrows the buffers while it is timed.
    cap = dict(device="cpu", max_batch_size=1024, max_num_tokens=1 << 18)
    planner = Planner(32, 8, 128, 16, **cap)
    attn = PODAttention(32, 8, 128, 16, **cap)
    only = set(args.only.split(",")) if args.only else None
    log(f"plan() host time, up to {args.reps} reps x {args.calls_per_rep} calls, "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average "
        f"{' '.join(f'{x:.2f}' for x in out['load_before'])}")
    log(f"{'batch':34s} {'items':>6s} {'Planner.plan':>22s} {'PODAttention.plan':>22s} target")
    for name, q, kv, fmt in batches():
        if only is not None and name not in only:
            continue
        cu, kvl, pages = _inputs(q, kv, 16, fmt)
        plan = planner.plan(cu, kvl, **pages)
        t_plan = time_calls(lambda: planner.plan(cu, kvl, **pages), args.reps,
                            args.calls_per_rep, args.budget_s)
        t_api = time_calls(lambda: attn.plan(cu, kvl, **pages), args.reps, args.calls_per_rep,
                           args.budget_s)
        target = TARGETS.get(name)
        out["batches"].append(dict(name=name, requests=len(q), total_q=int(np.sum(q)),
                                   page_format=fmt, num_items=plan.num_items,
                                   num_merges=plan.num_merge, planner=t_plan, api=t_api,
                                   target_us=target, summary=str(plan.summary)))
        verdict = "" if target is None else (
            f"<= {target:.0f} us: {'met' if t_api['median_us'] <= target else 'MISSED'}")
        log(f"{name:34s} {plan.num_items:6d} {t_plan['median_us']:9.1f} us (p90 "
            f"{t_plan['p90_us']:7.1f}) {t_api['median_us']:9.1f} us (p90 {t_api['p90_us']:7.1f}) "
            f"{verdict}")
    out["load_after"] = os.getloadavg()
    log(f"load average after: {' '.join(f'{x:.2f}' for x in out['load_after'])}")
    if os.path.exists(args.gpu_run):
        rows = calibration(args.gpu_run)
        out["calibration"] = dict(source=os.path.relpath(args.gpu_run), rows=rows)
        log(f"\nplan prediction vs fused time in {os.path.relpath(args.gpu_run)}:")
        for r in rows:
            log(f"  {r['workload']:8s} page {r['page_size']:3d}: roofline {r['roofline_us']:7.0f} "
                f"us, predicted {r['predicted_us']:7.0f} us, fused {r['fused_us']:7.0f} us "
                f"({r['fused_over_predicted']:.2f}x predicted)")
    text = json.dumps(out, indent=1)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        log(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
