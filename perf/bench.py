"""podcute benchmark: fused POD attention vs podcute serial, FA4 and the roofline.

    python -m perf.bench [--quick] [--out DIR] [--window L] [--softcap X] [--sinks]
                         [--batch-invariant] [--head-dim D] [--heads HQ/HKV]

One process measures the ceilings (copy bandwidth, bf16 matmul rate), then for every
workload of perf.workloads (each at page 16 and 128; --quick: M1, D1, F1 at page 16 and a
small sweep) times, with CUDA events and launch gaps hidden (perf.timing):

- fused:  PODAttention.run() over the whole batch, after one plan();
- serial: podcute on the prefill part, then on the decode part (two planned objects
          sharing the caches; q / out are row slices);
- fa4:    FlashAttention-4's one varlen paged call over the whole batch;
- fa4x2:  FA4 on the prefill part, then on the decode part.

Every output is checked once against podcute's float32 reference (rel L2 <= 5e-3),
outside the timed region. Writes <out>/bench.json, <out>/bench.md and PNG plots, and
prints the markdown last. The JSON is rewritten after every workload, so a run that is
cut short keeps what it measured.

Model features, applied to every workload of the run and to podcute (plan/run), FA4 and
the reference alike: `--window L` (window_size=(L, 0), causal; FlashInfer's window_left;
the roofline counts only the pairs and keys in the window), `--softcap X`, `--sinks`
(per-head sink logits [Hq], fixed seed), `--batch-invariant` (podcute's plan option; FA4
has no such switch and runs with num_splits=1, no split KV), `--head-dim D` and
`--heads HQ/HKV` (override every workload's shape). The options and the command line are
recorded in bench.json ("options", env "command") and in bench.md's header; with options
that change the attention computed, the earlier-run anchors (FlashInfer, FA4, roofline)
are not comparable and are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from perf import workloads as W
from perf.timing import host_time_per_call, sleep_cycles_per_second, time_gpu

REL_L2_TOL = 5e-3
METHODS = ("fused", "serial", "fa4", "fa4x2")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:800]}


def _unavailable(reason: str) -> dict:
    """A method's result when it cannot take the run's options (nothing was called)."""
    return {"error": f"unavailable: {reason}"[:800], "unavailable": reason}


# --------------------------------------------------------------------------------------
# Model-feature options (--window, --softcap, --sinks, --batch-invariant, --head-dim, --heads)
# --------------------------------------------------------------------------------------

SINK_SEED = 1234
SINK_RANGE = (0.0, 8.0)  # uniform: some heads' sinks take much of the softmax, some little
FA4_HEAD_DIM_RANGE = (8, 256)  # FA4's SM90 forward: 8 <= head_dim <= 256, a multiple of 8


@dataclass(frozen=True)
class Options:
    """The model features of a run; the defaults are the plain causal benchmark."""

    window_left: int = -1  # window_size=(window_left, 0); -1 = no window
    softcap: float = 0.0  # 0 = off
    sinks: bool = False
    batch_invariant: bool = False
    head_dim: int | None = None  # None: each workload's own
    heads: tuple | None = None  # (num_qo_heads, num_kv_heads); None: each workload's own
    head_dim_vo: int | None = None  # a value head dim of its own; None: head_dim's

    @property
    def window_size(self) -> tuple:
        return (self.window_left, 0) if self.window_left >= 0 else (-1, -1)

    def active(self) -> dict:
        """The options that differ from the defaults (JSON-friendly)."""
        out = {}
        if self.window_left >= 0:
            out["window_size"] = list(self.window_size)
        if self.softcap:
            out["softcap"] = self.softcap
        if self.sinks:
            out["sinks"] = dict(seed=SINK_SEED, uniform=list(SINK_RANGE), dtype="float32")
        if self.batch_invariant:
            out["batch_invariant"] = True
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        if self.heads is not None:
            out["heads"] = f"{self.heads[0]}/{self.heads[1]}"
        if self.head_dim_vo is not None:
            out["head_dim_vo"] = self.head_dim_vo
        return out

    @property
    def changes_attention(self) -> bool:
        """True when the attention computed (or its shape) is not the anchors' one."""
        return (self.window_left >= 0 or bool(self.softcap) or self.sinks
                or self.head_dim is not None or self.heads is not None
                or self.head_dim_vo is not None)

    def describe(self) -> str:
        parts = []
        if self.window_left >= 0:
            parts.append(f"window_size=({self.window_left}, 0)")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.sinks:
            parts.append(f"sinks (float32 [Hq], uniform {SINK_RANGE}, seed {SINK_SEED})")
        if self.batch_invariant:
            parts.append("batch_invariant")
        if self.head_dim is not None:
            parts.append(f"head_dim={self.head_dim}")
        if self.heads is not None:
            parts.append(f"heads={self.heads[0]}/{self.heads[1]}")
        if self.head_dim_vo is not None:
            parts.append(f"head_dim_vo={self.head_dim_vo}")
        return ", ".join(parts) or "none (causal, no window, no soft cap, no sinks)"

    def apply(self, w: W.Workload) -> W.Workload:
        """`w` with this run's shape and window (the roofline follows)."""
        if (self.head_dim is None and self.heads is None and self.window_left < 0
                and self.head_dim_vo is None):
            return w
        if self.window_left >= 0 and not w.causal:
            raise ValueError(f"--window is window_size=(L, 0) with causal; {w.name} is not causal")
        hq, hkv = self.heads if self.heads is not None else (None, None)
        return W.with_overrides(w, head_dim=self.head_dim, num_qo_heads=hq, num_kv_heads=hkv,
                                window_left=self.window_left if self.window_left >= 0 else None,
                                head_dim_vo=self.head_dim_vo)

    def _mask_kwargs(self) -> dict:
        """The window and soft cap, as podcute, the reference and FA4 all name them."""
        kw = {}
        if self.window_left >= 0:
            kw["window_size"] = self.window_size
        if self.softcap:
            kw["softcap"] = self.softcap
        return kw

    def plan_kwargs(self) -> dict:
        """PODAttention.plan keyword options (only those that are set)."""
        kw = self._mask_kwargs()
        if self.batch_invariant:
            kw["batch_invariant"] = True
        return kw

    def reference_kwargs(self, sinks) -> dict:
        """Batch.reference feature arguments (only those that are set)."""
        kw = self._mask_kwargs()
        if sinks is not None:
            kw["sinks"] = sinks
        return kw

    def fa4_kwargs(self, sinks) -> dict:
        """flash_attn.cute.interface.flash_attn_varlen_func keyword options: window_size
        (left, right), softcap (float, 0 = off), learnable_sink ([Hq]; FA4 before
        2026-08 asserts bfloat16, later ones also take float16/float32: a bfloat16 copy
        works on both and holds the same values, see make_sinks). FA4 has no batch-invariant
        switch; its forward does not split KV with num_splits=1 (the default), passed
        explicitly under --batch-invariant."""
        kw = self._mask_kwargs()
        if sinks is not None:
            kw["learnable_sink"] = sinks.to(torch.bfloat16)
        if self.batch_invariant:
            kw["num_splits"] = 1
        return kw

    def fa4_unavailable(self, w: W.Workload) -> str | None:
        """Why FA4 cannot run workload `w` with these options (None: it can)."""
        lo, hi = FA4_HEAD_DIM_RANGE
        if not (lo <= w.head_dim <= hi and w.head_dim % 8 == 0):
            return (f"FA4 (SM90) takes head_dim {lo}..{hi}, a multiple of 8; "
                    f"got {w.head_dim}")
        return None


def make_sinks(num_qo_heads: int, device="cpu", seed: int = SINK_SEED) -> torch.Tensor:
    """Per-head sink logits, float32 [Hq], uniform in SINK_RANGE for a fixed seed. The values
    are rounded to bfloat16 first, so FA4's bfloat16 copy holds exactly the same numbers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lo, hi = SINK_RANGE
    s = lo + (hi - lo) * torch.rand(num_qo_heads, generator=g, dtype=torch.float32)
    return s.to(torch.bfloat16).to(torch.float32).to(device)


def parse_heads(text: str) -> tuple:
    """"HQ/HKV" -> (HQ, HKV), HQ a positive multiple of HKV (argparse type)."""
    try:
        hq, hkv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads takes HQ/HKV (e.g. 64/8), got {text!r}")
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(
            f"--heads {text}: HQ must be a positive multiple of HKV")
    return hq, hkv


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    v = float(text)
    if not v >= 0.0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _head_dim(text: str) -> int:
    v = int(text)
    if v < 8 or v % 8:
        raise argparse.ArgumentTypeError(f"head_dim must be a positive multiple of 8, got {v}")
    return v


def options_from_args(args) -> Options:
    return Options(
        window_left=-1 if getattr(args, "window", None) is None else int(args.window),
        softcap=float(getattr(args, "softcap", 0.0) or 0.0),
        sinks=bool(getattr(args, "sinks", False)),
        batch_invariant=bool(getattr(args, "batch_invariant", False)),
        head_dim=getattr(args, "head_dim", None),
        heads=getattr(args, "heads", None),
        head_dim_vo=getattr(args, "head_dim_vo", None),
    )


# --------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------


def measure_ceilings() -> dict:
    n = 2 << 30  # bf16 elements: a 4 GiB tensor
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = time_gpu(lambda i: dst.copy_(src), reps=10, warmup=3)
    copy_bps = 2 * src.numel() * src.element_size() / (t_copy.ms * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(m, m, dtype=torch.bfloat16, device="cuda")
    t_mm = time_gpu(lambda i: torch.matmul(a, b, out=c), reps=20, warmup=5)
    mm_fps = 2 * m**3 / (t_mm.ms * 1e-3)
    del a, b, c
    torch.cuda.empty_cache()
    return dict(copy_bytes_per_s=copy_bps, copy_ms=t_copy.ms, copy_tensor_bytes=n * 2,
                matmul_flops_per_s=mm_fps, matmul_ms=t_mm.ms, matmul_size=m)


# --------------------------------------------------------------------------------------
# One workload
# --------------------------------------------------------------------------------------


class Ctx:
    """What every workload run needs: the libraries, ceilings and options."""

    def __init__(self, args, ceilings, pod_cls, fa4_fn, device="cuda", opts=None):
        self.args, self.ceil, self.pod_cls, self.fa4 = args, ceilings, pod_cls, fa4_fn
        self.opts = opts if opts is not None else options_from_args(args)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # An explicit index: tensors made on it say cuda:N, and so does every object
            # constructed with it (a plain "cuda" would compare unequal to cuda:0).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.l2_bytes = 50 << 20
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", self.l2_bytes))


def _rel_l2(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _sets(batch, ws_bytes, l2_bytes, max_sets=6):
    """Input sets to rotate through so that one call's inputs are not in L2 from the last."""
    n = min(max_sets, max(1, math.ceil(3 * l2_bytes / max(ws_bytes, 1))))
    sets = [(batch.q, batch.k_cache, batch.v_cache)]
    for _ in range(n - 1):
        sets.append((batch.q.clone(), batch.k_cache.clone(), batch.v_cache.clone()))
    return sets


def run_workload(w: W.Workload, page: int, ctx: Ctx, *, reps: int, warmup: int,
                 check: bool = True, methods=METHODS, seed: int = 0) -> dict:
    from podcute.testing import make_batch

    ceil = ctx.ceil
    opts = ctx.opts
    w = opts.apply(w)  # the run's head_dim / heads / window (a no-op without options)
    res = dict(
        name=w.name, kind=w.kind, page_size=page, params=w.params,
        num_qo_heads=w.num_qo_heads, num_kv_heads=w.num_kv_heads, head_dim=w.head_dim,
        head_dim_vo=w.vo_dim, window_left=w.window_left, options=opts.active(),
        batch_size=w.batch_size, total_q=w.total_q, num_prefill=w.num_prefill,
        flops=W.flops(w), bytes=W.bytes_moved(w),
        roofline_ms=W.roofline_s(w, ceil["matmul_flops_per_s"], ceil["copy_bytes_per_s"]) * 1e3,
        bound=W.bound(w, ceil["matmul_flops_per_s"], ceil["copy_bytes_per_s"]),
        anchors=_anchors(w.name, page, opts), timings={}, rel_l2={}, notes=[],
    )
    # garbage=0: FA4 loads whole pages by TMA at page 128 and needs finite values in the
    # unused tail of a last page (its docstring); the data itself is random normal.
    batch = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                       num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                       dtype=torch.bfloat16, device=ctx.device, kv_layout="NHD",
                       page_format="table", pool_factor=1.1, garbage=0.0, seed=seed,
                       head_dim_vo=w.head_dim_vo)
    if w.params.get("shuffled_from"):
        res["notes"].append(f"requests of {w.params['shuffled_from']} in shuffled order")
    sets = _sets(batch, res["bytes"], ctx.l2_bytes)
    res["input_sets"] = len(sets)
    sinks = make_sinks(w.num_qo_heads, ctx.device) if opts.sinks else None
    ref = batch.reference(causal=w.causal, **opts.reference_kwargs(sinks)) if check else None
    plan_kw = opts.plan_kwargs()
    cu, kv, bt = batch.cu_seqlens_q, batch.seqused_k, batch.block_table
    B, np_ = w.batch_size, w.num_prefill
    tp = sum(w.q_lens[:np_]) if w.has_split else None
    out = torch.empty(w.total_q, w.num_qo_heads, w.vo_dim, dtype=batch.q.dtype,
                      device=batch.q.device)

    fns = {}  # method -> fn(i) that runs on input set i % len(sets)
    run_kw = {} if sinks is None else dict(sinks=sinks)
    if ctx.pod_cls is not None and "fused" in methods:
        # (head_dim_vo only where set: a base tree's PODAttention may predate it)
        vo_kw = {} if w.head_dim_vo is None else dict(head_dim_vo=w.head_dim_vo)

        def make_pod(b, t):
            return ctx.pod_cls(w.num_qo_heads, w.num_kv_heads, w.head_dim, page,
                               dtype=torch.bfloat16, kv_layout="NHD", device=ctx.device,
                               max_batch_size=max(b, 1), max_num_tokens=max(t, 1), **vo_kw)
        try:
            att = make_pod(B, w.total_q)
            summary = att.plan(cu, kv, block_table=bt, causal=w.causal, **plan_kw)
            summary = getattr(summary, "summary", summary)  # a PlanSummary (or a Plan)
            if summary is not None:
                res["plan_summary"] = str(summary)

            def fused(i, att=att):
                q, k, v = sets[i % len(sets)]
                att.run(q, k, v, out=out, **run_kw)
            fns["fused"] = fused
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            res["timings"]["fused"] = _err(e)
        if w.has_split and "serial" in methods:
            try:
                pre, dec = make_pod(np_, tp), make_pod(B - np_, w.total_q - tp)
                pre.plan(cu[: np_ + 1], kv[:np_], block_table=bt[:np_], causal=w.causal,
                         **plan_kw)
                dec.plan(cu[np_:] - tp, kv[np_:], block_table=bt[np_:], causal=w.causal,
                         **plan_kw)

                def serial(i, pre=pre, dec=dec):
                    q, k, v = sets[i % len(sets)]
                    pre.run(q[:tp], k, v, out=out[:tp], **run_kw)
                    dec.run(q[tp:], k, v, out=out[tp:], **run_kw)
                fns["serial"] = serial
            except Exception as e:  # noqa: BLE001
                res["timings"]["serial"] = _err(e)
    fa4_why_not = opts.fa4_unavailable(w) if ctx.fa4 is not None else None
    if fa4_why_not is not None:
        for name in ("fa4", "fa4x2"):
            if name in methods and (name == "fa4" or w.has_split):
                res["timings"][name] = _unavailable(fa4_why_not)
    elif ctx.fa4 is not None and "fa4" in methods:
        fa4 = ctx.fa4
        fa4_kw = opts.fa4_kwargs(sinks)

        def fa4_call(q, k, v, cu_q, seqused, table, max_q):
            return fa4(q, k, v, cu_seqlens_q=cu_q, seqused_k=seqused, page_table=table,
                       max_seqlen_q=max_q, causal=w.causal, **fa4_kw)[0]

        maxq = max(w.q_lens)
        fa4_out = [None]

        def fa4_one(i):
            q, k, v = sets[i % len(sets)]
            fa4_out[0] = fa4_call(q, k, v, cu, kv, bt, maxq)
        fns["fa4"] = fa4_one
        if w.has_split and "fa4x2" in methods:
            cu_dec = (cu[np_:] - tp).contiguous()
            maxq_pre, maxq_dec = max(w.q_lens[:np_]), max(w.q_lens[np_:])

            def fa4_two(i):
                q, k, v = sets[i % len(sets)]
                o1 = fa4_call(q[:tp], k, v, cu[: np_ + 1], kv[:np_], bt[:np_], maxq_pre)
                o2 = fa4_call(q[tp:], k, v, cu_dec, kv[np_:], bt[np_:], maxq_dec)
                fa4_out[0] = (o1, o2)
            fns["fa4x2"] = fa4_two

    def output_of(name):
        if name in ("fused", "serial"):
            return out
        o = fa4_out[0]
        return torch.cat(o) if isinstance(o, tuple) else o

    for name, fn in fns.items():
        try:
            if check:  # one call outside the timed region, checked against the reference
                out.fill_(float("nan"))
                fn(0)
                res["rel_l2"][name] = _rel_l2(output_of(name), ref)
            res["timings"][name] = time_gpu(fn, reps=reps, warmup=warmup).to_dict()
        except Exception as e:  # noqa: BLE001
            res["timings"][name] = _err(e)
            log(f"  {w.name}/p{page} {name}: {res['timings'][name]['error'][:200]}")
    for name, err in res["rel_l2"].items():
        if not err <= REL_L2_TOL:  # also catches NaN
            res["notes"].append(f"{name} rel L2 {err:.2e} > {REL_L2_TOL}")

    if w.name == "D1" and page == 16:
        res["host"] = {}
        for name in ("fused", "fa4"):
            if name in fns:
                try:
                    res["host"][name] = host_time_per_call(lambda fn=fns[name]: fn(0))
                except Exception as e:  # noqa: BLE001
                    res["host"][name] = _err(e)
    del batch, sets, ref, out, fns
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------------------
# Derived numbers, targets
# --------------------------------------------------------------------------------------


def _anchors(name, page, opts: Options) -> dict:
    """The earlier-run anchors, or all None when the options change what is computed."""
    a = W.anchors(name, page)
    return {k: None for k in a} if opts.changes_attention else a


def ms(res, method, key="ms"):
    t = res["timings"].get(method)
    return t.get(key) if isinstance(t, dict) else None


def derive(res, by_key=None) -> dict:
    """Ratios of one result (None where a number is missing)."""
    f, s, a, a2 = (ms(res, m) for m in METHODS)
    roof = res["roofline_ms"]
    fi_est = None
    anc = res["anchors"]
    if anc.get("flashinfer_pod_ms") and anc.get("fa4_ms") and a:
        # FlashInfer's earlier number, rescaled by how FA4 moved between that run and this.
        fi_est = anc["flashinfer_pod_ms"] * a / anc["fa4_ms"]
    peers = [x for x in (a, a2, fi_est) if x]
    best = min(peers) if peers else None
    return dict(
        fused_ms=f, serial_ms=s, fa4_ms=a, fa4x2_ms=a2, fi_est_ms=fi_est, best_peer_ms=best,
        fused_over_roofline=f / roof if f else None,
        roofline_fraction=roof / f if f else None,
        speedup_vs_best_peer=best / f if (f and best) else None,
        speedup_vs_fa4=a / f if (f and a) else None,
        speedup_vs_serial=s / f if (f and s) else None,
    )


def targets(main_results) -> list:
    """[(target, value, passed)] from the issue, per page size."""
    out = []
    pages = sorted({r["page_size"] for r in main_results})
    for page in pages:
        rs = {r["name"]: r for r in main_results if r["page_size"] == page}
        for name in W.MIXED:
            if name not in rs:
                continue
            d = derive(rs[name])
            v = d["fused_over_roofline"]
            out.append((f"{name} p{page}: fused <= {W.MIXED_MAX_ROOFLINE_RATIO} x roofline",
                        v, v is not None and v <= W.MIXED_MAX_ROOFLINE_RATIO))
            v = d["speedup_vs_best_peer"]
            out.append((f"{name} p{page}: faster than best peer (best peer / fused)",
                        v, v is not None and v > 1.0))
        if "D1" in rs:
            v = derive(rs["D1"])["roofline_fraction"]
            out.append((f"D1 p{page}: >= {W.DECODE_MIN_ROOFLINE_FRACTION} of roofline", v,
                        v is not None and v >= W.DECODE_MIN_ROOFLINE_FRACTION))
        if "F1" in rs:
            v = derive(rs["F1"])["speedup_vs_fa4"]
            out.append((f"F1 p{page}: faster than FA4 (FA4 / fused)", v,
                        v is not None and v > 1.0))
        sp = [derive(rs[n])["speedup_vs_serial"] for n in W.SERIAL_TARGET_SET if n in rs]
        if sp and all(sp):
            g = W.geomean(sp)
            out.append((f"p{page}: geomean serial / fused over "
                        f"{','.join(n for n in W.SERIAL_TARGET_SET if n in rs)} "
                        f">= {W.SERIAL_MIN_SPEEDUP_GEOMEAN}", g,
                        g >= W.SERIAL_MIN_SPEEDUP_GEOMEAN))
    return out


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def markdown(report) -> str:
    c, env = report["ceilings"], report["env"]
    lines = [
        "# podcute benchmark",
        "",
        f"{env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"podcute {env.get('git')} ({env.get('podcute_api')}"
        + (f", kernel sources {env['kernel_sources']}" if env.get("kernel_sources") else "")
        + f"), FA4: {env.get('fa4')}",
        "",
    ]
    command = report.get("command") or env.get("command")
    lines += [f"Command: `{command}`", ""] if command else []  # not in older reports
    if env.get("kernel_flags"):
        lines += [kernel_flags_line(env["kernel_flags"]), ""]
    lines += [
        f"Options (every workload; podcute, FA4 and the reference alike): "
        f"{report.get('options_text') or env.get('options') or Options().describe()}",
        "",
    ]
    lines += [f"Note: {n}" for n in report.get("notes") or []]
    lines += [""] if report.get("notes") else []
    lines += [
        f"Ceilings (this run): copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s. "
        "Times are GPU ms (median, launch gaps hidden); 'gaps' = issued back to back "
        "without hiding. Ratios: fused/roof (target <= 1.25, D1 roof/fused >= 0.90), "
        "peer/fused and serial/fused are speedups of fused (> 1 = fused faster). "
        "FI est. = FlashInfer BatchPOD anchor x (FA4 this run / FA4 anchor). "
        "Anchors: earlier run on this H200.",
        "",
        "| workload | page | bound | roofline | fused | fused gaps | serial | FA4 | FA4x2 "
        "| FI est. | fused/roof | best peer/fused | FA4/fused | serial/fused | max rel L2 "
        "| anchor roof | anchor FI POD | anchor FA4 | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["main"]:
        d = derive(r)
        errs = [v for v in r["rel_l2"].values() if v is not None]
        notes = list(r["notes"]) + [f"{m}: {t['error'][:80]}" for m, t in r["timings"].items()
                                    if isinstance(t, dict) and "error" in t]
        if r["timings"].get("fused", {}).get("queue_full") is False:
            notes.append("fused: queue not kept full")
        base = [o for o in report["main"] if o["name"] == r["params"].get("shuffled_from")
                and o["page_size"] == r["page_size"]]
        if base and d["fused_ms"] and ms(base[0], "fused"):
            notes.append(f"fused / fused({base[0]['name']}) = "
                         f"{d['fused_ms'] / ms(base[0], 'fused'):.3f}")
        a = r["anchors"]
        lines.append(
            f"| {r['name']} | {r['page_size']} | {r['bound']} | {_f(r['roofline_ms'])} "
            f"| {_f(d['fused_ms'])} | {_f(ms(r, 'fused', 'gaps_ms'))} | {_f(d['serial_ms'])} "
            f"| {_f(d['fa4_ms'])} | {_f(d['fa4x2_ms'])} | {_f(d['fi_est_ms'])} "
            f"| {_f(d['fused_over_roofline'], '{:.2f}')} "
            f"| {_f(d['speedup_vs_best_peer'], '{:.2f}')} | {_f(d['speedup_vs_fa4'], '{:.2f}')} "
            f"| {_f(d['speedup_vs_serial'], '{:.2f}')} "
            f"| {_f(max(errs) if errs else None, '{:.1e}')} "
            f"| {_f(a['roofline_ms'])} | {_f(a['flashinfer_pod_ms'])} | {_f(a['fa4_ms'])} "
            f"| {'; '.join(notes)} |")
    lines += ["", "## Targets", "", "| target | value | pass |", "|---|---|---|"]
    for name, v, ok in report["targets"]:
        lines.append(f"| {name} | {_f(v, '{:.3f}')} | {'PASS' if ok else 'FAIL'} |")
    if report.get("host"):
        lines += ["", "## Host time per call (D1, page 16, 200 calls, sync at the end)", "",
                  "| method | issue us/call | wall us/call |", "|---|---|---|"]
        for m, h in report["host"].items():
            if "error" in h:
                lines.append(f"| {m} | error | {h['error'][:80]} |")
            else:
                lines.append(f"| {m} | {h['issue_us']:.1f} | {h['wall_us']:.1f} |")
    sw = report.get("sweep") or []
    if sw:
        lines += ["", "## Sweep (page 16): one prefill chunk + decode batch @ ctx", ""]
        for title, key in (("serial / fused", "speedup_vs_serial"),
                           ("roofline / fused", "roofline_fraction"),
                           ("FA4 / fused", "speedup_vs_fa4")):
            rows, cols, grid = sweep_grid(sw, key)
            lines += [f"**{title}**", "",
                      "| chunk | " + " | ".join(_col(x, b) for x, b in cols) + " |",
                      "|---" * (len(cols) + 1) + "|"]
            for i, chunk in enumerate(rows):
                lines.append(f"| {chunk} | " + " | ".join(_f(v, "{:.2f}") for v in grid[i]) + " |")
            vals = [v for row in grid for v in row if v]
            if vals:
                lines.append(f"\ngeomean {W.geomean(vals):.2f}, min {min(vals):.2f}, "
                             f"max {max(vals):.2f}")
            lines.append("")
        bad = [f"{r['name']}: {'; '.join(r['notes'])}" for r in sw if r["notes"]]
        if bad:
            lines += ["Sweep failures: " + " / ".join(bad), ""]
    if report.get("skipped"):
        lines += ["", f"Skipped (time budget): {', '.join(report['skipped'])}"]
    return "\n".join(lines) + "\n"


def _col(ctx, batch) -> str:
    return f"{batch}@{ctx // 1024}K" if ctx % 1024 == 0 else f"{batch}@{ctx}"


def sweep_grid(sweep_results, key):
    rows = sorted({r["params"]["chunk"] for r in sweep_results})
    cols = sorted({(r["params"]["ctx"], r["params"]["batch"]) for r in sweep_results})
    grid = [[None] * len(cols) for _ in rows]
    for r in sweep_results:
        p = r["params"]
        grid[rows.index(p["chunk"])][cols.index((p["ctx"], p["batch"]))] = derive(r)[key]
    return rows, cols, grid


def short_options(active: dict) -> str:
    """A compact form of Options.active() for plot titles (head_dim is in the title)."""
    parts = []
    if "window_size" in active:
        parts.append(f"window {active['window_size'][0]}")
    if active.get("softcap"):
        parts.append(f"softcap {active['softcap']:g}")
    if active.get("sinks"):
        parts.append("sinks")
    if active.get("batch_invariant"):
        parts.append("batch-invariant")
    if active.get("heads"):
        parts.append(f"heads {active['heads']}")
    if active.get("head_dim_vo"):
        parts.append(f"head_dim_vo {active['head_dim_vo']}")
    return ", ".join(parts)


def plots(report, out_dir) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except Exception as e:  # noqa: BLE001
        log(f"no plots: {e}")
        return []
    files = []
    main = [r for r in report["main"] if r["params"].get("shuffled_from") is None]
    if main:
        labels = [f"{r['name']}\np{r['page_size']}" for r in main]
        series = [("podcute fused", "fused_ms"), ("podcute serial", "serial_ms"),
                  ("FA4 1 call", "fa4_ms"), ("FA4 2 calls", "fa4x2_ms")]
        vals = [[derive(r)[k] or 0 for r in main] for _, k in series]
        vals.append([r["roofline_ms"] for r in main])
        names = [s for s, _ in series] + ["roofline"]
        x = np.arange(len(main))
        width = 0.16
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(main)), 5))
        for j, (name, v) in enumerate(zip(names, vals)):
            ax.bar(x + (j - 2) * width, v, width, label=name,
                   color="black" if name == "roofline" else None)
        ax.set_xticks(x, labels)
        ax.set_ylabel("GPU ms (median, gaps hidden)")
        dims = sorted({r.get("head_dim") for r in main if r.get("head_dim")})
        d_txt = "/".join(f"D{d}" for d in dims) or "D?"
        extra = short_options(report.get("options") or {})
        ax.set_title(f"podcute vs peers and roofline (bf16, {d_txt}, causal"
                     f"{', ' + extra if extra else ''})", fontsize=10)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, "bench_times.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    sw = report.get("sweep") or []
    for key, title, fname in (
        ("speedup_vs_serial", "podcute serial / fused (speedup of fused)", "sweep_vs_serial.png"),
        ("roofline_fraction", "roofline / fused (fraction of roofline)", "sweep_roofline.png"),
        ("speedup_vs_fa4", "FA4 / fused (speedup of fused)", "sweep_vs_fa4.png"),
    ):
        if not sw:
            break
        rows, cols, grid = sweep_grid(sw, key)
        arr = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cols) + 2), 0.6 * len(rows) + 2))
        im = ax.imshow(arr, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(cols)), [_col(x, b) for x, b in cols], rotation=45)
        ax.set_yticks(range(len(rows)), [str(c) for c in rows])
        ax.set_xlabel("decode batch @ decode ctx")
        ax.set_ylabel("prefill chunk")
        for i in range(len(rows)):
            for j in range(len(cols)):
                if not np.isnan(arr[i, j]):
                    ax.text(j, i, f"{arr[i, j]:.2f}", ha="center", va="center", color="w",
                            fontsize=8)
        fig.colorbar(im, ax=ax)
        ax.set_title(f"sweep, page 16: {title}")
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    return files


def kernel_flags_line(flags: dict) -> str:
    """A report's line naming its side of a kernel-flag A/B (podcute.testing.kernel_flag_env)."""
    return "Kernel flags: `" + " ".join(f"{k}={v}" for k, v in flags.items()) + "`"


def environment(fa4_note) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__,
               cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0),
               num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
               fa4=fa4_note)
    from podcute.compile import kernel_sources
    from podcute.testing import kernel_flag_env

    env["kernel_sources"] = kernel_sources()

    # an A/B's kernel flags (podcute.testing.kernel_flags_from_env), where set
    env["kernel_flags"] = kernel_flag_env()
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10,
                                    cwd=os.path.dirname(__file__)).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        env["git"] = "?"
    return env


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _guarded(w, page, fn, opts: Options | None = None) -> dict:
    """fn()'s result, or a result that records why the workload could not run at all
    (e.g. out of memory, or a CUDA context lost to an earlier fault)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        log(f"  {w.name}/p{page} failed: {type(e).__name__}: {e}"[:300])
        opts = opts or Options()
        return dict(name=w.name, kind=w.kind, page_size=page, params=w.params,
                    options=opts.active(), roofline_ms=float("nan"), bound="-",
                    anchors=_anchors(w.name, page, opts),
                    timings={}, rel_l2={}, notes=[_err(e)["error"][:200]])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="M1, D1, F1 at page 16, small sweep")
    p.add_argument("--out", default=os.path.join("perf", "results"))
    p.add_argument("--reps", type=int, default=None, help="timed calls per method (50; quick 30)")
    p.add_argument("--sweep-reps", type=int, default=10)
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--only", default=None,
                   help="comma-separated workload names (e.g. F1,D1); implies --no-sweep")
    p.add_argument("--pages", default=None, help="comma-separated page sizes (e.g. 16,128)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip remaining sweep points after this many seconds (450; quick 100)")
    g = p.add_argument_group("model features (every workload; podcute, FA4 and the reference)")
    g.add_argument("--window", type=_nonneg_int, default=None, metavar="L",
                   help="sliding window: window_size=(L, 0) with causal (FlashInfer's "
                        "window_left=L); the roofline counts only the keys in the window")
    g.add_argument("--softcap", type=_nonneg_float, default=0.0, metavar="X",
                   help="logit soft cap X * tanh(s / X) (0 = off)")
    g.add_argument("--sinks", action="store_true",
                   help=f"per-head sink logits: float32 [Hq], uniform in {SINK_RANGE}, seed "
                        f"{SINK_SEED} (FA4: learnable_sink, a bfloat16 copy of the same values)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="podcute plan(batch_invariant=True); FA4 has no such switch and runs "
                        "with num_splits=1 (no split KV)")
    g.add_argument("--head-dim", type=_head_dim, default=None, metavar="D",
                   help="override every workload's head_dim (podcute: 64, 96, 128 or 256)")
    g.add_argument("--heads", type=parse_heads, default=None, metavar="HQ/HKV",
                   help="override every workload's num_qo_heads/num_kv_heads (e.g. 64/8)")
    g.add_argument("--head-dim-vo", type=_head_dim, default=None, metavar="DV",
                   help="a value head dim of its own (V and out rows), e.g. --head-dim 192 "
                        "--head-dim-vo 128 (DeepSeek's prefill)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def command_line(argv=None) -> str:
    """The command that reproduces this run (for docs)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return "python -m perf.bench" + ("" if not argv else " " + shlex.join(argv))


def select_workloads(args, opts: Options | None = None) -> tuple:
    """(main workloads, page sizes, sweep workloads) of a run, with the options applied
    (head_dim / heads / window); sets args.no_sweep with --only."""
    opts = opts if opts is not None else options_from_args(args)
    main_wl, pages, sweep_wl = W.workloads(args.quick)
    if args.only:
        names = args.only.split(",")
        main_wl = tuple(w for w in W.MAIN + W.EXTRA if w.name in names)
        args.no_sweep = True
    if args.pages:
        pages = tuple(int(x) for x in args.pages.split(","))
    return (tuple(opts.apply(w) for w in main_wl), pages,
            [opts.apply(w) for w in sweep_wl])


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = options_from_args(args)
    command = command_line(argv)
    reps = args.reps or (30 if args.quick else 50)
    budget = args.budget_s or (100.0 if args.quick else 450.0)
    if not torch.cuda.is_available():
        print("perf.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    torch.cuda.set_device(0)

    pod_cls, pod_note = None, "podcute.api.PODAttention"
    try:
        from podcute.api import PODAttention as pod_cls
    except Exception as e:  # noqa: BLE001
        pod_note = f"unavailable: import failed ({type(e).__name__}: {e})"[:300]
        log(f"podcute {pod_note}; timing peers only")
    fa4_fn, fa4_note = None, "disabled (--no-fa4)"
    if not args.no_fa4:
        try:
            from flash_attn.cute.interface import flash_attn_varlen_func as fa4_fn

            fa4_note = "flash_attn.cute.interface.flash_attn_varlen_func"
        except Exception as e:  # noqa: BLE001
            fa4_note = f"skipped: import failed ({type(e).__name__}: {e})"[:300]
            log(f"FA4 {fa4_note}")

    main_wl, pages, sweep_wl = select_workloads(args, opts)
    env = dict(environment(fa4_note), podcute_api=pod_note, command=command,
               options=opts.describe())
    report = dict(env=env, args=vars(args), command=command, options=opts.active(),
                  options_text=opts.describe(), ceilings=None, main=[], sweep=[], host={},
                  targets=[], skipped=[])
    if opts.changes_attention:
        report["notes"] = ["options change the attention computed: earlier-run anchors "
                           "(FlashInfer, FA4, roofline) left out, and the targets (set for "
                           "the default options) are for reference only"]
    json_path = os.path.join(args.out, "bench.json")

    def save():
        report["targets"] = targets(report["main"])
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)

    with torch.no_grad():
        log("ceilings")
        sleep_cycles_per_second()
        report["ceilings"] = ctx_ceil = measure_ceilings()
        log(f"  copy {ctx_ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"matmul {ctx_ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
        ctx = Ctx(args, ctx_ceil, pod_cls, fa4_fn, opts=opts)

        for page in pages:
            for k, w in enumerate(main_wl):
                if w.params.get("shuffled_from") and page != pages[0]:
                    continue
                log(f"{w.name} page {page}")
                r = _guarded(w, page, lambda: run_workload(w, page, ctx, reps=reps, warmup=5,
                                                           seed=k), opts)
                report["main"].append(r)
                if "host" in r:
                    report["host"] = r.pop("host")
                d = derive(r)
                log(f"  fused {_f(d['fused_ms'])} serial {_f(d['serial_ms'])} "
                    f"fa4 {_f(d['fa4_ms'])} fa4x2 {_f(d['fa4x2_ms'])} "
                    f"roof {r['roofline_ms']:.3f} ms; rel L2 {r['rel_l2']}")
                save()

        if not args.no_sweep:
            for k, w in enumerate(sweep_wl):
                if time.perf_counter() - T0 > budget:
                    report["skipped"].append(w.name)
                    continue
                r = _guarded(w, 16, lambda: run_workload(
                    w, 16, ctx, reps=args.sweep_reps, warmup=2,
                    methods=("fused", "serial", "fa4"), seed=100 + k), opts)
                report["sweep"].append(r)
                d = derive(r)
                log(f"{w.name}: fused {_f(d['fused_ms'])} serial/fused "
                    f"{_f(d['speedup_vs_serial'], '{:.2f}')} roof/fused "
                    f"{_f(d['roofline_fraction'], '{:.2f}')}")
                save()
            if report["skipped"]:
                log(f"skipped {len(report['skipped'])} sweep points (budget {budget:.0f} s)")

    save()
    report["plots"] = plots(report, args.out)
    save()
    md = markdown(report)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    log(f"wrote {json_path}, bench.md, {len(report['plots'])} plots; "
        f"total {time.perf_counter() - T0:.0f} s")
    print(md)
    return 0


if __name__ == "__main__":
    from podcute.testing import kernel_flags_from_env

    with kernel_flags_from_env():  # $PODCUTE_TEST_*=0/1: an A/B of a KernelConfig flag
        sys.exit(main())
