"""Experiment (issue 13): which CTAs of a persistent grid share an SM. The planner assumes
lists s and s + num_SMs do (`Planner._odd`: which kind each list starts with), and the
fused launch's overlap of prefill with decode rests on what co-resident CTAs run. A probe
kernel with the portable kernel's block (128 threads) and shared memory (two CTAs an SM)
records each CTA's %smid and start/end times (%globaltimer_lo) while it spins.
On the H100 (2026-12-05) 24-72 of the 132 SMs held CTAs s and s + 132, the rest other
pairs, and the map changed between launches. The first 132 CTAs take one SM each, so
lists grouped by kind (s prefill first, s + 132 decode first: `Planner._group_lists`)
give every SM one of each whatever the map; taking the lists by %smid (76a7ad9 to
8d3e745, 2026-12-05) gained nothing over that and was removed (docs/notes/sm-pairing.md).

    python -m perf.experiments.exp_sm_pairs [--smem-kb 97] [--spin-us 50]
"""
import argparse
import collections

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

from podcute.kernels.ptx import asm32, sm_id


def _clock_ns() -> Int32:
    """The low word of the global nanosecond timer."""
    return asm32(Int32, [], "mov.u32 $0, %globaltimer_lo;", side_effects=True)


class Probe:
    def __init__(self, smem_bytes: int):
        self.smem_bytes = smem_bytes

    @cute.jit
    def __call__(self, mOut: cute.Tensor, spin_ns: Int32, grid: Int32, stream: cuda.CUstream):
        @cute.struct
        class Storage:
            buf: cute.struct.MemRange[cutlass.Int8, self.smem_bytes]

        self.storage = Storage
        self.kernel(mOut, spin_ns).launch(grid=[grid, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, spin_ns: Int32):
        cutlass.memory.SmemAllocator().allocate(self.storage)
        tidx = cute.arch.thread_idx()[0]
        cta = cute.arch.block_idx()[0]
        t0 = _clock_ns()
        t = t0
        while t - t0 < spin_ns:
            t = _clock_ns()
        if tidx == 0:
            mOut[cta, 0] = sm_id()
            mOut[cta, 1] = t0
            mOut[cta, 2] = t


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smem-kb", type=int, default=97)
    p.add_argument("--spin-us", type=int, default=50)
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = 2 * sms
    out = torch.zeros(grid, 3, dtype=torch.int32, device="cuda")
    fn = cute.compile(Probe(args.smem_kb * 1024), from_dlpack(out), Int32(0), Int32(grid),
                      cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    for run in range(3):
        out.zero_()
        fn(from_dlpack(out), Int32(args.spin_us * 1000), Int32(grid),
           cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        h = out.cpu().tolist()
        if run == 0:
            first = [r[0] for r in h]
        elif [r[0] for r in h] != first:
            print(f"run {run}: the CTA -> SM map differs from run 0's")
        by_sm = collections.defaultdict(list)
        for c, (sm, _, _) in enumerate(h):
            by_sm[sm].append(c)
        t_min = min(r[1] for r in h)
        late = sum(1 for r in h if r[1] - t_min > args.spin_us * 500)
        pairs = collections.Counter()
        for sm, cs in by_sm.items():
            if len(cs) == 2:
                pairs[("s, s+SMs" if cs[1] - cs[0] == sms else
                       "adjacent" if cs[1] - cs[0] == 1 else f"gap {cs[1] - cs[0]}")] += 1
            else:
                pairs[f"{len(cs)} CTAs"] += 1
        print(f"run {run}: grid {grid}, {len(by_sm)} SMs used, CTAs starting late "
              f"(after half the spin): {late}; SM sharing: {dict(pairs)}")
        print("  first 8 SMs:", {sm: by_sm[sm] for sm in sorted(by_sm)[:8]})
        print("  CTA -> SM, first 12:", [h[c][0] for c in range(12)],
              "from", sms, ":", [h[c][0] for c in range(sms, sms + 12)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
