"""Run one benchmark workload's fused launch a few times, for a profiler to pick up:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight ... python -m perf.profile_one F1 128

(perf.workloads names; page size). Prints the plan and the median of the runs.
"""

import sys

import torch

from perf import workloads as W
from podcute import PODAttention
from podcute.testing import make_batch


def main(name: str, page: int, runs: int = 5) -> int:
    w = next(x for x in W.MAIN if x.name == name)
    b = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                   num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                   device="cuda", pool_factor=1.1, garbage=0.0)
    attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page, device="cuda",
                        max_batch_size=w.batch_size, max_num_tokens=w.total_q)
    print(attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal))
    out = torch.empty_like(b.q)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        attn.run(b.q, b.k_cache, b.v_cache, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    print(f"{name} page {page}: median {sorted(times)[runs // 2]:.3f} ms over {runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
