"""Experiment (issue 13): a mixed workload's fused time beside the times of its prefill
part and its decode part alone (each planned and run as its own batch), to see how much
of the two the fused launch overlaps.

    PODCUTE_ARCH=sm_90 python -m perf.exp_parts [PAGE] [W1,W2,...] [--one-cta-per-sm]

--one-cta-per-sm also times each at one CTA an SM (the planner told the chip has half its
SMs: as many CTAs as SMs, which the block scheduler spreads one an SM): a part much
slower so than at two says one CTA cannot keep its SM busy alone (a decoding CTA: cannot
cover HBM latency with its K/V stages), which is what each CTA of a fused launch faces
beside a CTA of the other kind.
"""
import argparse

import torch

from perf import workloads as W
from perf.timing import time_gpu
import podcute.plan as P
from podcute import PODAttention
from podcute.testing import make_batch


def fused_ms(w, q_lens, kv_lens, page, num_sms=None):
    b = make_batch(q_lens, kv_lens, num_qo_heads=w.num_qo_heads, num_kv_heads=w.num_kv_heads,
                   head_dim=w.head_dim, page_size=page, device="cuda", pool_factor=1.1,
                   garbage=0.0)
    init = P.Planner.__init__
    if num_sms is not None:
        P.Planner.__init__ = lambda self, *a, **kw: init(self, *a, **dict(kw, num_sms=num_sms))
    try:
        attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page, device="cuda",
                            max_batch_size=len(q_lens), max_num_tokens=sum(q_lens))
    finally:
        P.Planner.__init__ = init
    attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal)
    out = torch.empty_like(b.q)
    return time_gpu(lambda i: attn.run(b.q, b.k_cache, b.v_cache, out=out), reps=30).ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("page", nargs="?", type=int, default=16)
    p.add_argument("names", nargs="?", default="M1,M3,M5,P1")
    p.add_argument("--one-cta-per-sm", action="store_true")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = [("", None)] + ([(" 1/SM", sms // 2)] if args.one_cta_per_sm else [])
    for w in W.MAIN:
        if w.name not in args.names.split(","):
            continue
        pre = [(q, k) for q, k in zip(w.q_lens, w.kv_lens) if q > 1]
        dec = [(q, k) for q, k in zip(w.q_lens, w.kv_lens) if q == 1]
        parts = {"fused": list(zip(w.q_lens, w.kv_lens)), "prefill": pre, "decode": dec}
        for label, num_sms in grids:
            line = [f"{k} {fused_ms(w, *zip(*v), args.page, num_sms):.3f}"
                    for k, v in parts.items() if v]
            print(w.name, f"p{args.page}{label}", " | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
