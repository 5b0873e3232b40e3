"""Experiment (issue 13): a mixed workload's fused time beside the times of its prefill
part and its decode part alone (each planned and run as its own batch), to see how much
of the two the fused launch overlaps.

    PODCUTE_ARCH=sm_90 python -m perf.experiments.exp_parts [PAGE] [W1,W2,...] [--one-cta-per-sm]
        [--variant planner|interleaved|grouped] [--fused-only]
        [--hbm-scale F] [--evict-first 0|1]

--one-cta-per-sm also times each at one CTA an SM (the planner told the chip has half its
SMs: as many CTAs as SMs, which the block scheduler spreads one an SM): a part much
slower so than at two says one CTA cannot keep its SM busy alone (a decoding CTA: cannot
cover HBM latency with its K/V stages), which is what each CTA of a fused launch faces
beside a CTA of the other kind.

--variant picks the lists' order whatever the chip (fused_ms) and --hbm-scale plans with
another chip's HBM rate (0.68: an H100's against the H200-calibrated cost model);
--fused-only skips the parts. The runs of 2026-12-05 on f7fa1d6 (docs/notes/sm-pairing.md)
alternated `--variant V --fused-only` over the variants, three rounds, on an H100 and an
H200 (then also with the lists taken by %smid, a kernel mode since removed: it gained
nothing).

--evict-first 0 / 1 runs the kernels without / with KernelConfig.decode_kv_evict_first
(decode items' K/V copies under an L2 evict-first policy; either kernel, PODCUTE_ARCH
picks; by default the variants' own choice, on): the A/B of it on an H100 (8d3e745,
2026-12-05, docs/notes/l2-hint.md; a mixed batch's fused time falls from about (decode
bytes + every prefill row tile's K/V re-read from HBM) / bandwidth towards its roofline:
`perf.experiments.l2_model`).
"""
import argparse
import dataclasses

import torch

from perf import workloads as W
from perf.timing import time_gpu
import podcute.planning as P
from podcute import PODAttention
from podcute.testing import decode_evict_first, make_batch


VARIANTS = ("planner", "interleaved", "grouped")


def fused_ms(w, q_lens, kv_lens, page, num_sms=None, variant="planner", hbm_scale=1.0):
    """variant: how a mixed batch's lists order their kinds (the warp-level kernel at two
    CTAs an SM). planner: the planner's choice for this chip; interleaved: the kinds
    interleaved, each list led by the kind its slot wants (the choice on an H200);
    grouped: each list's kinds one after the other, lists s prefill first and s + num_sms
    decode first (the choice on an H100). hbm_scale: the planner's cost model with this
    times its HBM rate."""
    b = make_batch(q_lens, kv_lens, num_qo_heads=w.num_qo_heads, num_kv_heads=w.num_kv_heads,
                   head_dim=w.head_dim, page_size=page, device="cuda", pool_factor=1.1,
                   garbage=0.0)
    init = P.Planner.__init__
    kw_plan = {} if num_sms is None else {"num_sms": num_sms}
    if hbm_scale != 1.0:
        kw_plan["cost_model"] = dataclasses.replace(
            P.DEFAULT_COST_MODEL, hbm_bytes_per_s=P.DEFAULT_COST_MODEL.hbm_bytes_per_s * hbm_scale)
    if variant != "planner":  # the grouping comes with the H100's rate, not the H200's
        kw_plan["hbm_bytes_per_sm_clock"] = (P.H100_HBM_BYTES_PER_SM_CLOCK
                                             if variant == "grouped"
                                             else P.H200_HBM_BYTES_PER_SM_CLOCK)
    P.Planner.__init__ = lambda self, *a, **kw: init(self, *a, **dict(kw, **kw_plan))
    try:
        attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page, device="cuda",
                            max_batch_size=len(q_lens), max_num_tokens=sum(q_lens))
        attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal)
    finally:
        P.Planner.__init__ = init
    out = torch.empty_like(b.q)
    return time_gpu(lambda i: attn.run(b.q, b.k_cache, b.v_cache, out=out), reps=30).ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("page", nargs="?", type=int, default=16)
    p.add_argument("names", nargs="?", default="M1,M3,M5,P1")
    p.add_argument("--one-cta-per-sm", action="store_true")
    p.add_argument("--variant", choices=VARIANTS, default="planner")
    p.add_argument("--fused-only", action="store_true", help="not the parts alone")
    p.add_argument("--hbm-scale", type=float, default=1.0,
                   help="the cost model's HBM rate times this (another chip's bandwidth)")
    p.add_argument("--evict-first", type=int, choices=(0, 1), default=None,
                   help="kernels without (0) / with (1) KernelConfig.decode_kv_evict_first")
    args = p.parse_args(argv)
    if args.evict_first is None:
        return _run(args)
    with decode_evict_first(bool(args.evict_first)):
        return _run(args)


def _run(args) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = [("", None)] + ([(" 1/SM", sms // 2)] if args.one_cta_per_sm else [])
    for w in W.MAIN:
        if w.name not in args.names.split(","):
            continue
        pre = [(q, k) for q, k in zip(w.q_lens, w.kv_lens) if q > 1]
        dec = [(q, k) for q, k in zip(w.q_lens, w.kv_lens) if q == 1]
        parts = {"fused": list(zip(w.q_lens, w.kv_lens)), "prefill": pre, "decode": dec}
        if args.fused_only:
            parts = {"fused": parts["fused"]}
        for label, num_sms in grids:
            line = []
            for k, v in parts.items():
                if v:
                    ms = fused_ms(w, *zip(*v), args.page, num_sms, args.variant, args.hbm_scale)
                    line.append(f"{k} {ms:.3f}")
            print(w.name, f"p{args.page}{label}", " | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
