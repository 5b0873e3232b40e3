"""`python -m podcute demo|bench|compile`.

demo: plans a realistic mixed batch (1 prefill of 2048 tokens + 128 decodes, all at KV
2048; Hq/Hkv/D 32/8/128, page 16). Without an sm_90 GPU it prints the plan summary and
says what the kernel needs; on an H100/H200 it also runs the fused kernel, compares it
with the float32 reference and times it.
"""

from __future__ import annotations

import argparse
import sys

import torch

DEMO = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
DEMO_Q_LENS = [2048] + [1] * 128
DEMO_KV_LENS = [2048] * 129


def _hopper_device():
    """The first sm_90 CUDA device, or None and a description of what was found."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    found = []
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        if cap == (9, 0):
            return torch.device("cuda", i), None
        found.append(f"{torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
    return None, ", ".join(found)


def _demo_lengths():
    q = torch.tensor([0] + DEMO_Q_LENS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, torch.tensor(DEMO_KV_LENS, dtype=torch.int32)


def _print_header():
    h = DEMO
    print(f"podcute demo: 1 prefill of {DEMO_Q_LENS[0]} tokens + {len(DEMO_Q_LENS) - 1} decodes, "
          f"all at KV {DEMO_KV_LENS[0]}; Hq/Hkv/D {h['num_qo_heads']}/{h['num_kv_heads']}/"
          f"{h['head_dim']}, page {h['page_size']}, bf16, causal")


def demo_cpu(found: str) -> int:
    from podcute import PODAttention

    _print_header()
    print(f"The fused kernel needs an NVIDIA Hopper GPU (sm_90: H100/H200); found {found}. "
          "Showing the plan only (planned on the CPU).")
    cu, kvl = _demo_lengths()
    ps = DEMO["page_size"]
    pages = [-(-n // ps) for n in DEMO_KV_LENS]
    block_table = torch.arange(len(pages) * max(pages), dtype=torch.int32).view(len(pages), -1)
    attn = PODAttention(**DEMO, dtype=torch.bfloat16, device="cpu")
    summary = attn.plan(cu, kvl, block_table=block_table, causal=True)
    print(summary)
    return 0


def demo_gpu(device) -> int:
    from podcute import PODAttention
    from podcute.testing import make_batch

    _print_header()
    print(f"device: {torch.cuda.get_device_name(device)}")
    batch = make_batch(DEMO_Q_LENS, DEMO_KV_LENS, **DEMO, dtype=torch.bfloat16, device=device)
    attn = PODAttention(**DEMO, dtype=torch.bfloat16, device=device,
                        max_batch_size=len(DEMO_Q_LENS), max_num_tokens=sum(DEMO_Q_LENS))
    cu, kvl = _demo_lengths()  # host copies: plan() needs no GPU sync
    summary = attn.plan(cu, kvl, block_table=batch.block_table, causal=True)
    print(summary)
    out = attn.run(batch.q, batch.k_cache, batch.v_cache)
    ref = batch.reference(causal=True)
    torch.cuda.synchronize(device)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"rel L2 error vs float32 reference: {rel:.2e}")

    fused = _median_us(lambda: attn.run(batch.q, batch.k_cache, batch.v_cache, out=out))
    print(f"fused POD launch: median {fused:.1f} us over 50 runs "
          f"(plan predicted {summary.predicted_us:.1f} us)")

    # podcute's own prefill-only and decode-only launches, back to back, on the same data.
    n_pre = DEMO_Q_LENS[0]
    parts = []
    for rows, reqs in ((slice(0, n_pre), slice(0, 1)), (slice(n_pre, None), slice(1, None))):
        q_lens, kv_lens = DEMO_Q_LENS[reqs], DEMO_KV_LENS[reqs]
        part = PODAttention(**DEMO, dtype=torch.bfloat16, device=device,
                            max_batch_size=len(q_lens), max_num_tokens=sum(q_lens))
        cu_part = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        part.plan(cu_part, torch.tensor(kv_lens, dtype=torch.int32),
                  block_table=batch.block_table[reqs], causal=True)
        parts.append((part, batch.q[rows], out[rows]))

    def serial():
        for part, q_part, out_part in parts:
            part.run(q_part, batch.k_cache, batch.v_cache, out=out_part)

    serial_us = _median_us(serial)
    print(f"prefill-only + decode-only launches back to back: median {serial_us:.1f} us "
          f"-> fused is {serial_us / fused:.2f}x")
    return 0 if rel < 2e-2 else 1


def _median_us(fn, reps: int = 50) -> float:
    """Median GPU time of fn() in microseconds (CUDA events, after warm-up)."""
    for _ in range(10):  # warm-up (first call compiles or loads the kernel)
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podcute", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["demo", "bench", "compile"])
    parser.add_argument("--arch", default="sm_90a",
                        help="compile: target architecture (sm_90a, sm_80, sm_86, sm_89, "
                             "sm_90: the portable kernel on Hopper, sm_120a)")
    parser.add_argument("--check", action="store_true",
                        help="compile: verify wgmma and setmaxnreg (sm_90a) or mma.sync "
                             "and ldmatrix (the other architectures) in the generated PTX")
    parser.add_argument("--jobs", type=int, default=None,
                        help="compile: parallel compiler processes (default: CPU count)")
    parser.add_argument("--features", default=None,
                        help="compile: comma-separated feature sets to build instead of the "
                             "shipped variants, each 'none' or names joined by '+' "
                             "(window, softcap, sinks), e.g. 'window+sinks,softcap'")
    parser.add_argument("--head-dims", default=None,
                        help="compile: comma-separated head dims (default: all the arch's); "
                             "QK:VO for a value head dim of its own, e.g. 192:128")
    parser.add_argument("--groups", default=None,
                        help="compile: comma-separated GQA groups (default: 1,4,7,8)")
    parser.add_argument("--kv-dtypes", default=None,
                        help="compile: comma-separated KV cache types, 'none' (the cache in "
                             "q's dtype) or float8_e4m3fn / float8_e5m2 (fp8 caches: head "
                             "dims 64, 96, 128, 256)")
    parser.add_argument("--dtypes", default=None,
                        help="compile: comma-separated query/output types (default: "
                             "bfloat16; float16 compiles on first use unless listed)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        device, found = _hopper_device()
        return demo_cpu(found) if device is None else demo_gpu(device)
    if args.command == "compile":
        from podcute.compile import compile_all, shipped_variants

        variants = None
        if args.features or args.head_dims or args.groups or args.kv_dtypes or args.dtypes:
            kw = {}
            try:
                if args.features:
                    kw["features"] = tuple("" if f == "none" else f
                                           for f in args.features.split(","))
                if args.head_dims:
                    kw["head_dims"] = tuple(
                        tuple(int(y) for y in x.split(":")) if ":" in x else int(x)
                        for x in args.head_dims.split(","))
                if args.groups:
                    kw["groups"] = tuple(int(x) for x in args.groups.split(","))
                if args.dtypes:
                    kw["dtypes"] = tuple(args.dtypes.split(","))
                if args.kv_dtypes:
                    kw["kv_dtypes"] = tuple("" if k == "none" else k
                                            for k in args.kv_dtypes.split(","))
                variants = shipped_variants(args.arch, **kw)
            except ValueError as err:
                print(f"python -m podcute compile: {err}", file=sys.stderr)
                return 2
        return compile_all(args.arch, check=args.check, jobs=args.jobs, variants=variants)
    try:  # the harness lives in the source tree's perf/, which the wheel does not ship
        from perf.bench import main as bench_main
    except ImportError as err:
        if err.name not in ("perf", "perf.bench"):
            raise
        print("python -m podcute bench needs a source checkout of podcute: the benchmark "
              "harness is the repository's perf/ package, which is not installed with the "
              "wheel. Run it from the repository root (python -m podcute bench, or "
              "python -m perf.bench).", file=sys.stderr)
        return 2
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
