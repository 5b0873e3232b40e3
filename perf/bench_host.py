"""Host-side costs of podcute's compiled variants: cold compile, disk-warm load, run() overhead.

    python -m perf.bench_host [--out DIR] [--calls N]

For the issue "compiled variants: cache, AOT warm-up, low launch overhead":

a. cold compile: with PODCUTE_CACHE_DIR (and the DSL's own CUTE_DSL_CACHE_DIR) pointing at
   fresh empty temp folders, time `import cutlass, cutlass.cute`, `import podcute.compile`,
   then `compile_variant(key)` for three variants (the first compile also pays the DSL's
   one-time initialisation);
b. disk-warm load: a fresh subprocess with the same (now filled) cache folder initialises
   CUDA, imports podcute.compile and times `compile_variant(key)` for the same keys; the
   subprocess's PODCUTE_COMPILE_LOG must stay empty (no compile happened). It then runs one
   small batch through the loaded kernel and checks it against the reference;
c. host cost of one `PODAttention.run()` and of one CUDA-graph replay of it, perf_counter
   around back-to-back calls: on a decode-only batch (64 decodes at kv 4096, Hq/Hkv/D
   32/8/128, page 16, bf16) whose GPU time exceeds the host time, measured in chunks of
   100 calls issued behind a queued `torch.cuda._sleep` (so the GPU queue never drains and
   never fills: pure host cost), and plainly (issue and wall time per call); and on a tiny
   batch (1 decode at kv 16, GPU time ~ a few us), plainly. The graph replay's output is
   checked to equal the eager output bit for bit.

Writes DIR/bench_host.json and DIR/bench_host.md and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()
VARIANTS = (  # (dtype name, head_dim, group, causal, has_lse)
    ("bfloat16", 128, 4, True, False),
    ("float16", 64, 1, False, True),
    ("bfloat16", 128, 8, True, True),
)
CHUNK = 100  # calls per sleep-covered chunk


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _label(v) -> str:
    dt, d, g, causal, lse = v
    return f"{'bf16' if dt == 'bfloat16' else 'fp16'} D{d} g{g} {'causal' if causal else 'non-causal'} lse={lse}"


def _key(v):
    from podcute.compile import VariantKey
    from podcute.kernels.config import KernelConfig

    dt, d, g, causal, lse = v
    return VariantKey.make(KernelConfig.select(dt, d, g, causal, lse, page_size=16))


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return len([line for line in f if line.strip()])
    except FileNotFoundError:
        return 0


# --------------------------------------------------------------------------------------
# a. cold compile (this process)
# --------------------------------------------------------------------------------------


def cold_compile(compile_log: str) -> dict:
    t = time.perf_counter()
    import torch  # noqa: F401

    import_torch_s = time.perf_counter() - t
    t = time.perf_counter()
    import cutlass  # noqa: F401
    import cutlass.cute  # noqa: F401

    import_dsl_s = time.perf_counter() - t
    t = time.perf_counter()
    import podcute.compile as pc

    import_podcute_compile_s = time.perf_counter() - t
    res = dict(import_torch_s=import_torch_s, import_cutlass_cute_s=import_dsl_s,
               import_podcute_compile_s=import_podcute_compile_s,
               cache_dir=str(pc.cache_dir()), variants=[])
    for v in VARIANTS:
        before = _lines(compile_log)
        t = time.perf_counter()
        key = _key(v)
        pc.compile_variant(key)
        s = time.perf_counter() - t
        t = time.perf_counter()
        pc.compile_variant(key)  # in-memory hit
        hit_us = (time.perf_counter() - t) * 1e6
        res["variants"].append(dict(variant=_label(v), compile_s=s, memory_hit_us=hit_us,
                                    compiles_logged=_lines(compile_log) - before,
                                    entry=pc._entry_name(key)))
        log(f"  cold compile {_label(v)}: {s:.2f} s (memory hit {hit_us:.1f} us)")
    folder = pc.cache_dir()
    res["cache_files"] = sorted(
        (p.name, p.stat().st_size) for p in folder.iterdir() if p.suffix == ".o")
    return res


# --------------------------------------------------------------------------------------
# b. disk-warm load (child process)
# --------------------------------------------------------------------------------------


def load_child() -> dict:
    """Runs in the subprocess: init CUDA, import, load each key from disk, run once."""
    t = time.perf_counter()
    import torch

    import_torch_s = time.perf_counter() - t
    t = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cuda_init_s = time.perf_counter() - t
    t = time.perf_counter()
    import podcute.compile as pc

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    import cutlass  # noqa: F401  (else the first load would include the DSL import)
    import cutlass.cute  # noqa: F401

    import_dsl_s = time.perf_counter() - t
    res = dict(import_torch_s=import_torch_s, cuda_init_s=cuda_init_s,
               import_podcute_compile_s=import_s, import_cutlass_cute_s=import_dsl_s,
               variants=[])
    for v in VARIANTS:
        t = time.perf_counter()
        pc.compile_variant(_key(v))
        res["variants"].append(dict(variant=_label(v), load_ms=(time.perf_counter() - t) * 1e3))
    # The loaded (not compiled) kernel really runs: first run() in a warm-disk process.
    import podcute
    from podcute.testing import make_batch

    b = make_batch([1, 1, 1], [16, 300, 1000], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   page_size=16, device="cuda", garbage=0.0)
    attn = podcute.PODAttention(32, 8, 128, 16, device="cuda", max_batch_size=8,
                                max_num_tokens=8)
    attn.plan(b.cu_seqlens_q.cpu(), b.seqused_k.cpu(), block_table=b.block_table)
    t = time.perf_counter()
    out = attn.run(b.q, b.k_cache, b.v_cache)
    torch.cuda.synchronize()
    res["first_run_ms"] = (time.perf_counter() - t) * 1e3
    ref = b.reference().float()
    res["first_run_rel_l2"] = ((out.float() - ref).norm() / ref.norm()).item()
    return res


def disk_load(env: dict, child_log: str) -> dict:
    env = dict(env, PODCUTE_COMPILE_LOG=child_log)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "perf.bench_host", "--load-child"], env=env,
                          capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return dict(error=f"child rc {proc.returncode}: {proc.stderr[-2000:]}",
                    child_wall_s=wall, compiles_logged=_lines(child_log))
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["child_wall_s"] = wall
    res["compiles_logged"] = _lines(child_log)
    res["no_compile"] = res["compiles_logged"] == 0
    for r in res["variants"]:
        log(f"  disk load {r['variant']}: {r['load_ms']:.1f} ms")
    log(f"  child: compiles logged {res['compiles_logged']}, first run "
        f"{res['first_run_ms']:.1f} ms, rel L2 {res['first_run_rel_l2']:.2e}")
    return res


# --------------------------------------------------------------------------------------
# c. host overhead of run() and of a graph replay
# --------------------------------------------------------------------------------------


def _sleep_covered(fn, calls):
    """Host us per call, `calls` calls in chunks of CHUNK, each chunk issued behind a long
    queued sleep (checked: the event after the sleep had not completed when the chunk
    finished issuing, i.e. the GPU never caught up and the host never waited on it)."""
    import torch

    from perf.timing import sleep_cycles_per_second

    cps = sleep_cycles_per_second()
    sleep_s, per_chunk, full_all = 0.02, [], True
    for _ in range(max(1, calls // CHUNK)):
        for _attempt in range(4):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(sleep_s * cps))
            ev = torch.cuda.Event()
            ev.record()
            t0 = time.perf_counter()
            for _ in range(CHUNK):
                fn()
            dt = time.perf_counter() - t0
            full = not ev.query()
            if full:
                break
            sleep_s *= 2
        full_all &= full
        per_chunk.append(dt * 1e6 / CHUNK)
    torch.cuda.synchronize()
    return dict(us_median_chunk=statistics.median(per_chunk), us_mean=statistics.fmean(per_chunk),
                us_min_chunk=min(per_chunk), chunks=len(per_chunk), chunk=CHUNK,
                queue_full=full_all, sleep_s=sleep_s)


def one_shot_overhead(b, calls: int) -> dict:
    """Host us per layer of the one-shot entry points after a step's first call (which
    plans): `pod_attention` with CPU index tensors, and the FlashAttention-shaped call
    with device index tensors as vLLM passes them. Each first call is timed too."""
    import torch

    import podcute
    from perf.timing import host_time_per_call
    from podcute.compat.flash_attn import flash_attn_varlen_func

    q, k, v = b.q, b.k_cache, b.v_cache
    out = torch.empty_like(q)
    cpu = dict(cu_seqlens_q=b.cu_seqlens_q.cpu(), seqused_k=b.seqused_k.cpu(),
               block_table=b.block_table.cpu())
    dev = {name: t.cuda() for name, t in cpu.items()}
    max_q = max(b.q_lens)
    max_k = int(max(b.kv_lens))

    def one_shot():
        podcute.pod_attention(q, k, v, out=out, **cpu)

    def fa_compat():
        flash_attn_varlen_func(q, k, v, max_q, dev["cu_seqlens_q"], max_k,
                               seqused_k=dev["seqused_k"], block_table=dev["block_table"],
                               causal=True, out=out)

    res = {}
    for name, fn, args in (("pod_attention_cpu_metadata", one_shot, cpu),
                           ("flash_attn_varlen_func_device_metadata", fa_compat, dev)):
        podcute.invalidate_plans()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # the step's first call: plans
        first_us = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        for _ in range(20):
            fn()
        res[name] = dict(first_call_us=first_us, plain=host_time_per_call(fn, calls),
                         sleep_covered=_sleep_covered(fn, calls))
        # A changed length must re-plan (never a stale plan): shorten in place, call,
        # restore (a longer request could need a page the block table lacks).
        args["seqused_k"].sub_(1)
        t0 = time.perf_counter()
        fn()
        res[name]["after_change_us"] = (time.perf_counter() - t0) * 1e6
        args["seqused_k"].add_(1)
        log(f"    {name}: {res[name]}")
    torch.cuda.synchronize()
    return res


def host_overhead(calls: int) -> dict:
    import torch

    import podcute
    from perf.timing import host_time_per_call, time_gpu
    from podcute.testing import make_batch

    res = {}
    for name, n, kv in (("decode64_kv4096", 64, 4096), ("tiny_1x_kv16", 1, 16)):
        b = make_batch([1] * n, [kv] * n, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                       page_size=16, dtype=torch.bfloat16, device="cuda", garbage=0.0)
        attn = podcute.PODAttention(32, 8, 128, 16, device="cuda", max_batch_size=64,
                                    max_num_tokens=64)
        summary = attn.plan(b.cu_seqlens_q.cpu(), b.seqused_k.cpu(), block_table=b.block_table)
        q, k, v = b.q, b.k_cache, b.v_cache
        out = torch.empty_like(q)

        def eager():
            attn.run(q, k, v, out=out)

        r = dict(batch=f"{n} decode(s) at kv {kv}, Hq/Hkv/D 32/8/128, page 16, bf16",
                 plan=str(summary), num_merge=attn.current_plan.num_merge)
        r["one_shot"] = one_shot_overhead(b, calls)
        # The floor under run(): the compiled kernel called directly with the plan's
        # buffers (tvm-ffi argument passing + the launch), no podcute Python around it.
        from podcute.launch import _kernel
        plan = attn.current_plan
        pod = _kernel(q.device, q.dtype, plan.config, plan.options, False, False)
        raw_args = (q, k, v, out, None, None, None, None, None, None, *plan.kernel_args)

        def raw():
            pod(*raw_args)

        for _ in range(20):
            raw()
        r["raw_call"] = dict(plain=host_time_per_call(raw, calls),
                             sleep_covered=_sleep_covered(raw, calls))
        log(f"  {name} raw kernel call: {r['raw_call']}")
        for _ in range(20):
            eager()
        torch.cuda.synchronize()
        eager_out = attn.run(q, k, v).clone()
        ref = b.reference().float()
        r["rel_l2_vs_reference"] = ((eager_out.float() - ref).norm() / ref.norm()).item()
        r["eager"] = dict(plain=host_time_per_call(eager, calls),
                          sleep_covered=_sleep_covered(eager, calls),
                          gpu_ms=time_gpu(lambda i: eager(), reps=50).ms)
        log(f"  {name} eager: {r['eager']}")

        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    eager()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                attn.run(q, k, v, out=out)
            torch.cuda.synchronize()
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, eager_out))
            replay = g.replay
            for _ in range(20):
                replay()
            torch.cuda.synchronize()
            r["graph"] = dict(output_equals_eager=same, plain=host_time_per_call(replay, calls),
                              sleep_covered=_sleep_covered(replay, calls),
                              gpu_ms=time_gpu(lambda i: replay(), reps=50).ms)
            torch.cuda.synchronize()
            r["graph"]["output_equals_eager_after_timing"] = bool(torch.equal(out, eager_out))
            log(f"  {name} graph: {r['graph']}")
            del g
        except Exception as e:  # noqa: BLE001
            r["graph"] = dict(error=f"{type(e).__name__}: {e}"[:1000])
            log(f"  {name} graph FAILED: {r['graph']['error']}")
        res[name] = r
    return res


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def markdown(rep: dict) -> str:
    L = [f"# podcute host costs ({rep['env'].get('gpu', '?')})", ""]
    c = rep.get("compile") or {}
    if "error" in c:
        L += [f"cold compile FAILED: {c['error']}", ""]
    elif c:
        L += [f"Imports (cold process): torch {c['import_torch_s']:.2f} s, cutlass + cutlass.cute "
              f"{c['import_cutlass_cute_s']:.2f} s, podcute.compile "
              f"{c['import_podcute_compile_s']:.2f} s.", ""]
    ld = rep.get("load") or {}
    loads = {r["variant"]: r["load_ms"] for r in ld.get("variants", [])}
    L += ["| variant | cold compile (s) | disk-warm load (ms) | in-memory hit (us) |",
          "|---|---|---|---|"]
    for r in c.get("variants", []):
        L.append(f"| {r['variant']} | {r['compile_s']:.2f} | {_f(loads.get(r['variant']))} | "
                 f"{r['memory_hit_us']:.1f} |")
    L.append("")
    if "error" in ld:
        L += [f"disk-warm load FAILED: {ld['error']}", ""]
    elif ld:
        L += [f"Disk-warm subprocess: CUDA init {ld['cuda_init_s']:.2f} s, import podcute.compile "
              f"{ld['import_podcute_compile_s']:.2f} s, then cutlass + cutlass.cute "
              f"{ld.get('import_cutlass_cute_s', float('nan')):.2f} s (before the loads; the "
              "first load also loads the DSL runtime libraries), compiles logged "
              f"{ld['compiles_logged']} (must be 0), first run() of a loaded kernel "
              f"{ld['first_run_ms']:.1f} ms (rel L2 vs reference {ld['first_run_rel_l2']:.1e}).",
              ""]
    h = rep.get("host") or {}
    if "error" in h:
        L += [f"host overhead FAILED: {h['error']}", ""]
    if h and "error" not in h:
        L += ["Host time per call (us), 1000 back-to-back calls, perf_counter; "
              "'behind sleep' = chunks of 100 issued behind a queued torch.cuda._sleep "
              "(median chunk; pure host cost), 'issue'/'wall' = plain back-to-back "
              "(wall includes the final synchronize).", "",
              "| batch | mode | behind sleep | issue | wall | GPU ms/call | graph == eager |",
              "|---|---|---|---|---|---|---|"]
        for name, r in h.items():
            m = r.get("raw_call")
            if m:
                L.append(f"| {name} | raw kernel call | {m['sleep_covered']['us_median_chunk']:.1f}"
                         f" | {m['plain']['issue_us']:.1f} | {m['plain']['wall_us']:.1f} | | |")
            for mode in ("eager", "graph"):
                m = r.get(mode) or {}
                if "error" in m:
                    L.append(f"| {name} | {mode} | FAILED: {m['error'][:120]} | | | | |")
                    continue
                sc, pl = m["sleep_covered"], m["plain"]
                eq = "" if mode == "eager" else str(m["output_equals_eager"]
                                                   and m["output_equals_eager_after_timing"])
                L.append(f"| {name} | {mode} {'run()' if mode == 'eager' else 'replay()'} | "
                         f"{sc['us_median_chunk']:.1f}{'' if sc['queue_full'] else ' (queue drained)'}"
                         f" | {pl['issue_us']:.1f} | {pl['wall_us']:.1f} | "
                         f"{m['gpu_ms']:.4f} | {eq} |")
        L.append("")
        L += ["One-shot entry points per layer (plan reused after the step's first call; "
              "us): first call (plans), then per call behind sleep / issue, and a call "
              "right after an in-place length change (re-plans).", "",
              "| batch | entry point | first call | behind sleep | issue | after a change |",
              "|---|---|---|---|---|---|"]
        for name, r in h.items():
            for entry, m in (r.get("one_shot") or {}).items():
                L.append(f"| {name} | {entry} | {m['first_call_us']:.0f} | "
                         f"{m['sleep_covered']['us_median_chunk']:.1f} | "
                         f"{m['plain']['issue_us']:.1f} | {m['after_change_us']:.0f} |")
        L.append("")
    return "\n".join(L)


def environment() -> dict:
    import torch

    env = dict(python=platform.python_version(), torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        import cutlass

        env["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        env["cutlass_dsl"] = f"import failed: {e}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("perf", "results"))
    p.add_argument("--calls", type=int, default=1000, help="timed calls per host measurement")
    p.add_argument("--keep-cache", action="store_true", help="keep the temp cache folders")
    p.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_child:
        print(json.dumps(load_child()))
        return 0

    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="podcute-bench-host-")
    env = dict(os.environ, PODCUTE_CACHE_DIR=os.path.join(tmp, "podcute-cache"),
               CUTE_DSL_CACHE_DIR=os.path.join(tmp, "dsl-cache"))
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    parent_log = os.path.join(tmp, "compile-parent.log")
    child_log = os.path.join(tmp, "compile-child.log")
    # Before podcute.compile (or the DSL) is imported: both read these.
    os.environ.update(PODCUTE_CACHE_DIR=env["PODCUTE_CACHE_DIR"],
                      CUTE_DSL_CACHE_DIR=env["CUTE_DSL_CACHE_DIR"],
                      CUTE_DSL_ARCH=env["CUTE_DSL_ARCH"], PODCUTE_COMPILE_LOG=parent_log)
    env.pop("PODCUTE_COMPILE_LOG", None)

    rep = dict(env={}, compile=None, load=None, host=None, tmp=tmp)
    path = os.path.join(args.out, "bench_host.json")

    def save():
        with open(path, "w") as f:
            json.dump(rep, f, indent=1, default=str)

    log("a. cold compile")
    try:
        rep["compile"] = cold_compile(parent_log)
    except Exception as e:  # noqa: BLE001
        rep["compile"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        log(f"  FAILED {rep['compile']['error']}")
    rep["env"] = environment()
    save()
    log("b. disk-warm load (subprocess)")
    try:
        rep["load"] = disk_load(env, child_log)
    except Exception as e:  # noqa: BLE001
        rep["load"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
    save()
    log("c. host overhead per call")
    try:
        rep["host"] = host_overhead(args.calls)
    except Exception as e:  # noqa: BLE001
        rep["host"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        log(f"  FAILED {rep['host']['error']}")
    save()
    md = markdown(rep)
    with open(os.path.join(args.out, "bench_host.md"), "w") as f:
        f.write(md)
    if not args.keep_cache:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {path}")
    print(md)
    ok = all(isinstance(rep[k], dict) and "error" not in rep[k]
             for k in ("compile", "load", "host"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
