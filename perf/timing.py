"""GPU timing with CUDA events, with and without host launch gaps.

`time_gpu(fn, reps)` calls `fn(i)` for i = 0..reps-1 back to back (after warm-up) and
records a CUDA event between consecutive calls, so call i takes events[i] -> events[i+1].
It does that twice:

- *with gaps*: plainly; if the host takes longer to issue a call than the GPU to run it,
  the GPU idles between calls and the interval includes that idle time;
- *GPU time* (the headline number): first a `torch.cuda._sleep` kernel long enough to
  cover issuing all reps is queued, so by the time the GPU reaches the first event every
  call is already queued and the intervals are pure GPU time. `queue_full` records that
  the first event had not completed when the host finished issuing (checked, and the
  sleep doubled and the pass repeated, up to 3 times).

Medians are reported. The caller rotates input sets through `i` where the working set
would otherwise sit in L2.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

_cycles_per_s = None


def sleep_cycles_per_second() -> float:
    """GPU clock cycles of torch.cuda._sleep per second, measured once."""
    global _cycles_per_s
    if _cycles_per_s is None:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        _cycles_per_s = cycles / (a.elapsed_time(b) * 1e-3)
    return _cycles_per_s


@dataclass
class Timing:
    ms: float  # median GPU time of one call, launch gaps hidden
    gaps_ms: float  # median time of one call issued back to back without the sleep
    min_ms: float
    max_ms: float
    host_issue_ms: float  # host time to issue one call (from the sleep pass)
    queue_full: bool
    reps: int
    first_call_s: float  # wall time of the first warm-up call (includes JIT compilation)

    def to_dict(self) -> dict:
        return asdict(self)


def _pass(fn, reps, sleep_cycles):
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(int(sleep_cycles))
    t0 = time.perf_counter()
    events[0].record()
    for i in range(reps):
        fn(i)
        events[i + 1].record()
    issue_s = time.perf_counter() - t0
    full = not events[0].query()
    torch.cuda.synchronize()
    times = [events[i].elapsed_time(events[i + 1]) for i in range(reps)]
    return times, issue_s, full


def time_gpu(fn, reps: int = 50, warmup: int = 5) -> Timing:
    t0 = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    for i in range(1, warmup):
        fn(i)
    torch.cuda.synchronize()

    gaps, issue_s, _ = _pass(fn, reps, 0)
    sleep_s = 1.5 * issue_s + 50e-6
    for _ in range(4):
        times, issue_s, full = _pass(fn, reps, sleep_s * sleep_cycles_per_second())
        if full:
            break
        sleep_s *= 2
    return Timing(
        ms=statistics.median(times),
        gaps_ms=statistics.median(gaps),
        min_ms=min(times),
        max_ms=max(times),
        host_issue_ms=issue_s * 1e3 / reps,
        queue_full=full,
        reps=reps,
        first_call_s=first_call_s,
    )


def host_time_per_call(fn, calls: int = 200) -> dict:
    """Host cost of one call: perf_counter around `calls` back-to-back calls, synchronizing
    only at the end. `issue_us` stops the clock before the final synchronize (pure host
    time while the launch queue has room); `wall_us` includes it (max of host and GPU)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return dict(issue_us=(t1 - t0) * 1e6 / calls, wall_us=(t2 - t0) * 1e6 / calls, calls=calls)
