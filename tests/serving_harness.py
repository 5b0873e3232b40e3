"""The checking harness of the serving example (examples/serve_llama.py).

The example is the engine; this module shows that it computes the right thing and
measures it against a dense baseline. tests/test_serving_cpu.py and
tests/test_serving_gpu.py import it; as a script it prints the report (and writes it as
JSON with --json):

    python tests/serving_harness.py            # on an H200: podcute and dense, every check
    python tests/serving_harness.py --json out.json --requests 48
    python tests/serving_harness.py --tiny     # the CPU test's tiny float32 setup

The dense backend (`DenseBackend`) runs the example's loop eagerly, attending per request
with `torch.nn.functional.scaled_dot_product_attention` over the K/V gathered from its
pages (bottom-right causal mask for chunks: query j of a chunk of m sits at position
kv_len - m + j, docs/contract.md).

Checks (`run_report`): the generated tokens and the final hidden states of both loops
against a teacher-forced float32 reference (the same weights, one full causal SDPA per
request over its whole sequence, no paging); graph replays bitwise equal to eager runs of
the same steps (`CheckedEngine`); the scheduler's invariants; and tokens per second of
both loops.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from podcute.reference import full_fp32_matmul

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve_llama.py"


def _load_example():
    """The example is a script, not a package: import it by path, once, as `serve_llama`
    (registered in sys.modules, so that its dataclasses find their module)."""
    mod = sys.modules.get("serve_llama")
    if mod is None:
        spec = importlib.util.spec_from_file_location("serve_llama", EXAMPLE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["serve_llama"] = mod
        spec.loader.exec_module(mod)
    return mod


ex = _load_example()

# A model, loop and trace small enough for the CPU (tests, machines without a GPU).
TINY = (ex.ModelConfig(vocab_size=256, hidden=128, num_layers=2, num_qo_heads=4,
                       num_kv_heads=2, head_dim=64, ffn=256, dtype=torch.float32),
        ex.ServeConfig(token_budget=48, max_running=6, buckets=(16, 32)),
        ex.TraceConfig(num_requests=10, short=(4, 20), long=(60, 100), new_tokens=(2, 8)))


# ---- The dense backend ---------------------------------------------------------------


def sdpa(q, k, v, **kw):
    """scaled_dot_product_attention of one request: q [m, Hq, D], k, v [kv_len, Hkv, D]
    (GQA: query head h reads KV head h // (Hq // Hkv)) -> [m, Hq, D]."""
    def heads_first(t):
        return t.transpose(0, 1)[None]  # [1, H, tokens, D]
    o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                       enable_gqa=True, **kw)
    return o[0].transpose(0, 1)


def causal_sdpa(layer, q, k, v):
    """The reference's attention: a whole sequence at once (q_len == kv_len, so the
    plain causal mask is the bottom-right one)."""
    return sdpa(q, k, v, is_causal=True)


class DenseBackend:
    """Per request: gather its K/V from the pages, one SDPA with an explicit bottom-right
    causal mask (query j of a chunk of m tokens sees keys <= kv_len - m + j). Eager: it
    does not pad, so the engine captures no graphs for it."""

    name = "dense"
    pads = False

    def __init__(self, mcfg: ex.ModelConfig, scfg: ex.ServeConfig, device):
        self.device, self.page_size = torch.device(device), scfg.page_size

    def prepare(self, step: ex.Step):
        ps = self.page_size
        kv_slots, self.spans, self.masks = [], [], []
        k0 = 0
        for b, (m, kv) in enumerate(zip(step.q_lens, step.kv_lens.tolist())):
            t = np.arange(kv)
            kv_slots.append(step.block_table[b].numpy().astype(np.int64)[t // ps] * ps + t % ps)
            q0 = int(step.cu_seqlens_q[b])
            self.spans.append((q0, q0 + m, k0, k0 + kv))
            k0 += kv
            # m == 1 sees every key; for a chunk, key t is visible to query j iff
            # t <= kv - m + j (bottom-right alignment)
            mask = None
            if m > 1:
                mask = (torch.arange(kv)[None, :]
                        <= torch.arange(kv - m, kv)[:, None]).to(self.device)
            self.masks.append(mask)
        self.kv_slots = torch.from_numpy(np.concatenate(kv_slots)).to(self.device)

    def attend(self, layer, q, k_cache, v_cache):
        # every request's K/V in order, one gather per pool
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, self.kv_slots)
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, self.kv_slots)
        out = torch.empty_like(q)
        for (q0, q1, k0, k1), mask in zip(self.spans, self.masks):
            out[q0:q1] = sdpa(q[q0:q1], k[k0:k1], v[k0:k1], attn_mask=mask)
        return out


# ---- The example's engine and loop, recording what the checks need -------------------


class CheckedEngine(ex.Engine):
    """The example's engine, which checks its first `replay_checks` graph replays of a
    prefill/decode mix not checked yet against eager runs of the same steps."""

    def __init__(self, model, scfg, backend, use_graphs: bool = True, replay_checks: int = 0):
        super().__init__(model, scfg, backend, use_graphs)
        self.replay_checks_left = replay_checks
        self.replay_checks: list[dict] = []

    def run(self, step: ex.Step):
        out = super().run(step)
        T = self.bucket(step.num_tokens)
        if T in self.graphs and self.replay_checks_left and self._new_mix(step):
            self._check_replay(step, self.static[T])
        return out

    def _new_mix(self, step: ex.Step) -> bool:
        mix = (step.num_prefill > 0, step.num_decode > 0)
        return all(c["mix"] != mix for c in self.replay_checks)

    def _check_replay(self, step: ex.Step, st: ex.StaticStep) -> None:
        """Re-plan the step and run it eagerly on the same static inputs, into fresh
        buffers: the replay must match bitwise. (The eager run rewrites this step's K/V
        with the same values; the scratch page only ever holds padding.)"""
        self.replay_checks_left -= 1
        n = step.num_tokens
        g_hidden, g_logits = st.hidden[:n].clone(), st.logits[:n].clone()
        self.backend.prepare(step)
        e_hidden, e_logits = self._forward(st.tokens, st.positions, st.slots)
        e_hidden, e_logits = e_hidden[:n], e_logits[:n]
        equal = torch.equal(g_hidden, e_hidden) and torch.equal(g_logits, e_logits)
        self.replay_checks.append(dict(
            step=step.index, bucket=st.T, tokens=n, num_prefill=step.num_prefill,
            num_decode=step.num_decode, mix=(step.num_prefill > 0, step.num_decode > 0),
            bitwise_equal=equal,
            max_abs_diff=float(max((g_hidden.float() - e_hidden.float()).abs().max(),
                                   (g_logits.float() - e_logits.float()).abs().max()))))


@dataclass
class ServeResult:
    backend: str
    requests: list[ex.Request]
    last_hidden: dict  # rid -> final-norm hidden state of its last processed token
    logits: dict  # rid -> [new tokens, vocab] logits its tokens were sampled from
    steps: list[dict]  # per step: tokens, prefill and decode requests, bucket
    wall_s: float
    pages_free_after: int
    pages_total: int
    engine: ex.Engine

    @property
    def generated(self) -> int:
        return sum(len(r.output) for r in self.requests)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def serve(engine: ex.Engine, trace: ex.Trace, record_steps: list | None = None) -> ServeResult:
    """The example's serve() over the trace's requests, timed, recording each request's
    last hidden state and sampled-from logits and each step's shape. `record_steps`, if a
    list, receives every Step (for replanning in tests)."""
    last_hidden, logits_rows, steps = {}, {}, []

    def on_step(step, hidden, logits):
        if record_steps is not None:
            record_steps.append(step)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=engine.device)
        h, lg = hidden[rows], logits[rows]  # copies: a replay overwrites the outputs
        for j, r in enumerate(step.sample_requests):
            last_hidden[r.rid] = h[j]
            logits_rows.setdefault(r.rid, []).append(lg[j])
        steps.append(dict(index=step.index, tokens=step.num_tokens, prefill=step.num_prefill,
                          decode=step.num_decode, bucket=engine.bucket(step.num_tokens)))

    _sync(engine.device)
    t0 = time.perf_counter()
    sched = ex.serve(engine, trace.requests(), on_step)
    _sync(engine.device)
    wall = time.perf_counter() - t0
    return ServeResult(engine.backend.name, sorted(sched.finished, key=lambda r: r.rid),
                       last_hidden, {k: torch.stack(v) for k, v in logits_rows.items()},
                       steps, wall, sched.allocator.num_free, sched.allocator.num_pages - 1,
                       engine)


# ---- Checks --------------------------------------------------------------------------

# Tolerances against the float32 reference, measured with a bf16 loop of the default
# 4-layer model (podcute's host planner + podcute.reference attention, and the dense
# backend, on the CPU): final hidden states rel L2 ~8e-3 (every activation is rounded to
# bf16, relative 2**-9 per rounding, a few dozen roundings along the residual stream),
# logits within 0.04 of the reference (they have ~unit scale: a std 1/sqrt(hidden) LM
# head on unit-RMS hidden states). The tolerances leave a 4-5x margin; a wrong page,
# mask or position moves both by O(1). Float32 loops (the CPU test) sit near 1e-6.
HIDDEN_TOL = {torch.bfloat16: 4e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# Bound on |loop logit - reference logit| at every sampled position, and so also the
# near-tie gap: the loop can pick another token than the reference's argmax only where
# the reference puts the two within twice the logit error; a pick against a clearer
# gap than LOGIT_TOL is a failure.
LOGIT_TOL = {torch.bfloat16: 0.2, torch.float16: 0.05, torch.float32: 1e-3}


def float32_copy(model: ex.Llama) -> ex.Llama:
    """The same model in float32: the 16-bit weights upcast, so the same values."""
    ref = object.__new__(ex.Llama)
    ref.__dict__.update(model.__dict__)
    ref.embed, ref.final_norm, ref.lm_head = (t.float() for t in (model.embed,
                                                                   model.final_norm,
                                                                   model.lm_head))
    ref.layers = [ex.Layer(**{k: t.float() for k, t in vars(lay).items()})
                  for lay in model.layers]
    ref.cfg = dataclasses.replace(model.cfg, dtype=torch.float32)
    return ref


def teacher_forced(model: ex.Llama, requests: list[ex.Request], cache: dict | None = None) -> dict:
    """The float32 model over each request's prompt + generated tokens (all but the last,
    which was never fed back), no paging: rid -> (last hidden state [hidden], logits
    [new tokens, vocab] at the positions that predicted them). `cache` (sequence ->
    result) spares recomputing a sequence another loop generated too."""
    ref = float32_copy(model)
    cache = {} if cache is None else cache
    out = {}
    # full float32 matmuls even if the caller enabled TF32
    with torch.no_grad(), full_fp32_matmul():
        for r in requests:
            seq = tuple(r.prompt + r.output[:-1])
            if seq not in cache:
                tokens = torch.tensor(seq, device=ref.device)
                hidden, logits = ref.forward(tokens, torch.arange(len(seq), device=ref.device),
                                             causal_sdpa)
                cache[seq] = (hidden[-1], logits[len(r.prompt) - 1:])
            out[r.rid] = cache[seq]
    return out


def check_tokens(result: ServeResult, ref: dict, logit_tol: float) -> dict:
    """Every generated token must be the reference's argmax unless the reference logits of
    the two tokens are within logit_tol (a near-tie that rounding may flip: counted), and
    the loop's logits must be within logit_tol of the reference's."""
    compared = exact = near_ties = 0
    failures = []
    worst_logit_err = 0.0
    for r in result.requests:
        ref_logits = ref[r.rid][1]
        chosen = torch.tensor(r.output, device=ref_logits.device)
        top = ref_logits.argmax(-1)
        gap = (ref_logits.gather(1, top[:, None]) - ref_logits.gather(1, chosen[:, None]))[:, 0]
        compared += len(r.output)
        exact += int((chosen == top).sum())
        for j in torch.nonzero(chosen != top).flatten().tolist():
            if gap[j] <= logit_tol:
                near_ties += 1
            else:
                failures.append(dict(request=r.rid, token=j, gap=round(float(gap[j]), 4)))
        err = (result.logits[r.rid].float() - ref_logits).abs().max()
        worst_logit_err = max(worst_logit_err, float(err))
    complete = compared == sum(r.max_new_tokens for r in result.requests)
    return dict(passed=complete and not failures and worst_logit_err <= logit_tol,
                compared=compared, exact=exact, near_ties=near_ties,
                worst_logit_abs_err=worst_logit_err, logit_tol=logit_tol, failures=failures[:10])


def check_hidden(result: ServeResult, ref: dict, tol: float) -> dict:
    """Relative L2 error of each request's last hidden state vs the reference."""
    rel = []
    for r in result.requests:
        got, want = result.last_hidden[r.rid].float(), ref[r.rid][0]
        rel.append(float((got - want).norm() / want.norm()))
    return dict(passed=max(rel) <= tol, worst_rel_l2=max(rel),
                median_rel_l2=float(np.median(rel)), tolerance=tol)


def check_scheduler(result: ServeResult) -> dict:
    """The loop did what continuous batching promises on this trace."""
    facts = dict(
        pages_freed=result.pages_free_after == result.pages_total,
        all_tokens=all(len(r.output) == r.max_new_tokens for r in result.requests),
        chunked_prefill=any(r.chunks > 1 for r in result.requests),
        mixed_step=any(s["prefill"] and s["decode"] for s in result.steps))
    return dict(passed=all(facts.values()), **facts,
                steps=len(result.steps),
                chunked_requests=sum(r.chunks > 1 for r in result.requests),
                mixed_steps=sum(bool(s["prefill"] and s["decode"]) for s in result.steps))


def check_replays(engine: CheckedEngine) -> dict:
    """At least two replayed steps with different prefill/decode mixes, all bitwise
    equal to eager runs."""
    checks = engine.replay_checks
    mixes = {c["mix"] for c in checks}
    return dict(passed=len(mixes) >= 2 and all(c["bitwise_equal"] for c in checks),
                checked=[{k: v for k, v in c.items() if k != "mix"} for c in checks])


# ---- Report --------------------------------------------------------------------------


def build_engine(model, scfg, backend_name, use_graphs=True, replay_checks=0) -> CheckedEngine:
    if backend_name == "podcute":
        backend = ex.PodcuteBackend(model.cfg, scfg, model.device)
    else:
        backend = DenseBackend(model.cfg, scfg, model.device)
    return CheckedEngine(model, scfg, backend, use_graphs=use_graphs and backend.pads,
                         replay_checks=replay_checks)


def run_backend(model, scfg, trace, name, use_graphs=True) -> tuple[ServeResult, ServeResult]:
    """Two passes over the trace: the first warms up (kernel compile, cuBLAS) and checks
    graph replays; the second is timed. Returns (checked, timed)."""
    with torch.no_grad():
        engine = build_engine(model, scfg, name, use_graphs, replay_checks=3)
        checked = serve(engine, trace)
        engine.replay_checks_left = 0
        engine.steps_by_bucket = {}
        timed = serve(engine, trace)
    return checked, timed


def run_report(mcfg: ex.ModelConfig = ex.ModelConfig(), scfg: ex.ServeConfig = ex.ServeConfig(),
               tcfg: ex.TraceConfig = ex.TraceConfig(), seed: int = 0, device=None,
               backends=None, use_graphs: bool = True) -> dict:
    """Serve one trace with each backend (default: podcute and dense on an sm_90 GPU,
    dense elsewhere) and check both loops; the report's "passed" is every check's."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if backends is None:  # podcute runs on Hopper, in bf16 or fp16
        podcute = ex.has_sm90() and device.type == "cuda" and mcfg.dtype != torch.float32
        backends = ("podcute", "dense") if podcute else ("dense",)
    trace = ex.make_trace(tcfg, mcfg.vocab_size, seed)
    scfg = dataclasses.replace(scfg, max_seq_len=max(scfg.max_seq_len, trace.max_seq_len))
    model = ex.Llama(mcfg, device, seed, max_positions=scfg.max_seq_len)
    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  model={k: str(v) if isinstance(v, torch.dtype) else v
                         for k, v in dataclasses.asdict(mcfg).items()},
                  serve=dataclasses.asdict(scfg),
                  trace=dict(requests=len(trace.items),
                             prompt_tokens=sum(len(p) for _, p, _ in trace.items),
                             new_tokens=sum(n for _, _, n in trace.items)),
                  backends={}, checks={})
    results, ref_cache = {}, {}
    for name in backends:
        checked, timed = run_backend(model, scfg, trace, name, use_graphs)
        results[name] = checked
        same = [r.output for r in timed.requests] == [r.output for r in checked.requests]
        report["backends"][name] = dict(
            tokens_per_s=timed.generated / timed.wall_s, wall_s=timed.wall_s,
            generated=timed.generated, steps=len(timed.steps),
            steps_by_bucket={str(k): v for k, v in timed.engine.steps_by_bucket.items()})
        # each loop is checked on its own tokens: a near-tie flip does not derail the rest
        ref = teacher_forced(model, checked.requests, ref_cache)
        checks = report["checks"]
        checks[f"{name}.tokens"] = check_tokens(checked, ref, LOGIT_TOL[mcfg.dtype])
        checks[f"{name}.hidden"] = check_hidden(checked, ref, HIDDEN_TOL[mcfg.dtype])
        checks[f"{name}.scheduler"] = check_scheduler(checked)
        checks[f"{name}.repeatable"] = dict(passed=same)  # the timed pass gave the same tokens
        if checked.engine.graphs:
            checks[f"{name}.graph_replay"] = check_replays(checked.engine)
    if len(results) == 2:
        a, b = results.values()
        report["same_tokens_requests"] = sum(x.output == y.output
                                             for x, y in zip(a.requests, b.requests))
    if {"podcute", "dense"} <= set(results):
        report["speedup"] = (report["backends"]["podcute"]["tokens_per_s"]
                             / report["backends"]["dense"]["tokens_per_s"])
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    return report


def format_report(rep: dict) -> str:
    lines = [f"serve_llama on {rep['device']}: {rep['trace']['requests']} requests, "
             f"{rep['trace']['prompt_tokens']} prompt + {rep['trace']['new_tokens']} new tokens"]
    for name, b in rep["backends"].items():
        lines.append(f"  {name:8s} {b['tokens_per_s']:9.1f} tok/s  ({b['generated']} tokens in "
                     f"{b['wall_s']:.3f} s; steps by bucket {b['steps_by_bucket']})")
    if "speedup" in rep:
        lines.append(f"  podcute / dense: {rep['speedup']:.2f}x")
    if "same_tokens_requests" in rep:
        lines.append(f"  requests with identical tokens in both loops: "
                     f"{rep['same_tokens_requests']}/{rep['trace']['requests']}")
    for name, c in rep["checks"].items():
        detail = {k: v for k, v in c.items() if k != "passed"}
        lines.append(f"  [{'ok' if c['passed'] else 'FAIL'}] {name}: {json.dumps(detail)}")
    lines.append("PASSED" if rep["passed"] else "FAILED")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The serving example's checks and throughput "
                                "(examples/serve_llama.py with podcute and a dense backend)")
    p.add_argument("--tiny", action="store_true",
                   help="the CPU test's tiny float32 setup (the default without CUDA)")
    p.add_argument("--requests", type=int, help=f"default {ex.TraceConfig.num_requests}")
    p.add_argument("--layers", type=int, help=f"default {ex.ModelConfig.num_layers}")
    p.add_argument("--token-budget", type=int, help=f"default {ex.ServeConfig.token_budget}")
    p.add_argument("--max-running", type=int, help=f"default {ex.ServeConfig.max_running}")
    p.add_argument("--buckets", help="padded token counts with a graph each, e.g. 32,64 "
                   f"('' for none; default {','.join(map(str, ex.ServeConfig.buckets))})")
    p.add_argument("--no-graphs", action="store_true", help="run podcute eagerly every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="also write the report here")
    a = p.parse_args(argv)
    cpu = not torch.cuda.is_available() or (a.device or "cuda").startswith("cpu")
    if a.tiny or cpu:
        mcfg, scfg, tcfg = TINY
    else:
        mcfg, scfg, tcfg = ex.ModelConfig(), ex.ServeConfig(), ex.TraceConfig()
    if not cpu:
        mcfg = dataclasses.replace(mcfg, dtype=torch.bfloat16)  # --tiny on a GPU
    if cpu or not ex.has_sm90():
        print("no sm_90 GPU in use: serving with the dense backend only")

    def override(cfg, **kw):  # the options given on the command line, over the preset
        return dataclasses.replace(cfg, **{k: v for k, v in kw.items() if v is not None})

    mcfg = override(mcfg, num_layers=a.layers)
    buckets = None if a.buckets is None else tuple(int(x) for x in a.buckets.split(",") if x)
    scfg = override(scfg, token_budget=a.token_budget, max_running=a.max_running,
                    buckets=buckets)
    tcfg = override(tcfg, num_requests=a.requests)
    rep = run_report(mcfg, scfg, tcfg, a.seed, a.device, use_graphs=not a.no_graphs)
    print(format_report(rep))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
