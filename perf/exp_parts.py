"""Experiment (issue 13): a mixed workload's fused time beside the times of its prefill
part and its decode part alone (each planned and run as its own batch), to see how much
of the two the fused launch overlaps.

    PODCUTE_ARCH=sm_90 python -m perf.exp_parts [PAGE] [W1,W2,...]
"""
import sys

import torch

from perf import workloads as W
from perf.timing import time_gpu
from podcute import PODAttention
from podcute.testing import make_batch


def fused_ms(w, q_lens, kv_lens, page):
    b = make_batch(q_lens, kv_lens, num_qo_heads=w.num_qo_heads, num_kv_heads=w.num_kv_heads,
                   head_dim=w.head_dim, page_size=page, device="cuda", pool_factor=1.1,
                   garbage=0.0)
    attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page, device="cuda",
                        max_batch_size=len(q_lens), max_num_tokens=sum(q_lens))
    attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal)
    out = torch.empty_like(b.q)
    return time_gpu(lambda i: attn.run(b.q, b.k_cache, b.v_cache, out=out), reps=30).ms


def main(page: int, names) -> int:
    for w in W.MAIN:
        if w.name not in names:
            continue
        pre = [(q, k) for q, k in zip(w.q_lens, w.kv_lens) if q > 1]
        dec = [(q, k) for q, k in zip(w.q_lens, w.kv_lens) if q == 1]
        parts = {"fused": list(zip(w.q_lens, w.kv_lens)), "prefill": pre, "decode": dec}
        line = [f"{k} {fused_ms(w, [q for q, _ in v], [k_ for _, k_ in v], page):.3f}"
                for k, v in parts.items() if v]
        print(w.name, f"p{page}", " | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    page = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["M1", "M3", "M5", "P1"]
    raise SystemExit(main(page, names))
