"""The serving example (examples/serve_llama.py) on the CPU, tiny and in float32, through
its checking harness (tests/serving_harness.py).

The dense loop is checked end to end (scheduler invariants, tokens and hidden states
against the teacher-forced reference). For podcute, which cannot run on the CPU, every
step is planned by a host-only PODAttention (device="cpu"), and the same loop runs with
podcute's plans and attention from podcute.reference over the very metadata plan() got,
padded to the buckets as on the GPU; a stand-in for CUDA graphs (replay = rerun the
forward on the static buffers) exercises the replay bookkeeping and its checks.
"""

import dataclasses

import pytest
import torch

from podcute import PODAttention, pod_attention_reference

import serving_harness as harness

ex = harness.ex  # the example, imported by path
MCFG, SCFG, TCFG = harness.TINY


class PlannedReference(ex.PodcuteBackend):
    """podcute's plans (a host-only PODAttention) with podcute.reference attention over
    the metadata each plan() was given: what podcute's run() would compute."""

    name = "podcute-planned-reference"

    def __init__(self, mcfg, scfg, device):
        super().__init__(mcfg, scfg, "cpu", dtype=torch.bfloat16)  # kernel dtype: plan only
        self.summaries = []

    def plan(self, cu_seqlens_q, kv_lens, block_table):
        self.meta = (cu_seqlens_q, kv_lens, block_table)
        summary = super().plan(cu_seqlens_q, kv_lens, block_table)
        self.summaries.append(summary)
        return summary

    def attend(self, layer, q, k_cache, v_cache):
        cu, kvl, bt = self.meta
        return pod_attention_reference(q, k_cache, v_cache, cu_seqlens_q=cu, seqused_k=kvl,
                                       block_table=bt)


class StandInGraph:
    """Replays by rerunning the captured forward on the static buffers, in place."""

    def __init__(self, engine, st):
        self.engine, self.st = engine, st

    def replay(self):
        st = self.st
        hidden, logits = self.engine._forward(st.tokens, st.positions, st.slots)
        st.hidden.copy_(hidden)
        st.logits.copy_(logits)


def _stand_in_capture(self, st):
    self.backend.prepare_dummy()
    st.hidden, st.logits = self._forward(st.tokens, st.positions, st.slots)
    self.graphs[st.T] = StandInGraph(self, st)


@pytest.fixture(scope="module")
def setup():
    trace = ex.make_trace(TCFG, MCFG.vocab_size, seed=0)
    scfg = dataclasses.replace(SCFG, max_seq_len=trace.max_seq_len)
    model = ex.Llama(MCFG, "cpu", seed=0, max_positions=scfg.max_seq_len)
    return model, scfg, trace


def _serve(setup, backend_cls, steps=None, **engine_kw):
    model, scfg, trace = setup
    engine = harness.CheckedEngine(model, scfg, backend_cls(model.cfg, scfg, "cpu"), **engine_kw)
    with torch.no_grad():
        return harness.serve(engine, trace, record_steps=steps)


@pytest.fixture(scope="module")
def dense(setup):
    steps = []
    return _serve(setup, harness.DenseBackend, steps, use_graphs=False), steps


@pytest.fixture(scope="module")
def reference(setup, dense):
    return harness.teacher_forced(setup[0], dense[0].requests)


def test_scheduler_invariants(setup, dense):
    res, steps = dense
    _, scfg, trace = setup
    facts = harness.check_scheduler(res)
    assert facts["passed"], facts  # pages freed, all tokens, chunked prefill, a mixed step
    assert [len(r.output) for r in res.requests] == [n for _, _, n in trace.items]
    ps = scfg.page_size
    for step in steps:
        assert step.num_tokens <= scfg.token_budget
        assert len(step.requests) <= scfg.max_running
        assert step.cu_seqlens_q[-1] == step.num_tokens
        owned = set()
        for b, r in enumerate(step.requests):
            rows = slice(int(step.cu_seqlens_q[b]), int(step.cu_seqlens_q[b + 1]))
            pos, slots = step.positions[rows], step.slots[rows]
            # the new tokens end at kv_len and go to the request's own pages
            assert pos[-1] + 1 == step.kv_lens[b]
            assert torch.equal(slots, step.block_table[b][pos // ps].long() * ps + pos % ps)
            pages = set(step.block_table[b, :-(-int(step.kv_lens[b]) // ps)].tolist())
            assert ex.SCRATCH_PAGE not in pages and not pages & owned  # no sharing
            owned |= pages
        assert step.num_prefill + step.num_decode == len(step.requests)
    mixes = {(s.num_prefill > 0, s.num_decode > 0) for s in steps}
    assert (True, True) in mixes and (False, True) in mixes


def test_dense_loop_matches_teacher_forced(dense, reference):
    res = dense[0]
    tokens = harness.check_tokens(res, reference, harness.LOGIT_TOL[torch.float32])
    hidden = harness.check_hidden(res, reference, harness.HIDDEN_TOL[torch.float32])
    assert tokens["passed"] and tokens["exact"] == tokens["compared"], tokens
    assert hidden["passed"], hidden


def test_podcute_plans_every_step_on_the_host(dense):
    """The podcute backend's plan() for every step of the loop, on a host-only
    PODAttention with the example's capacities; run() needs the GPU."""
    res, steps = dense
    backend = ex.PodcuteBackend(MCFG, res.engine.scfg, "cpu", dtype=torch.bfloat16)
    assert isinstance(backend.attn, PODAttention)
    for step in steps:
        summary = backend.prepare(step)
        assert summary.num_requests == len(step.requests)
        assert backend.attn.current_plan.total_q == step.num_tokens
    assert backend.plans == len(steps)
    backend.prepare_dummy()
    q = torch.zeros(4, MCFG.num_qo_heads, MCFG.head_dim, dtype=torch.bfloat16)
    cache = res.engine.cache.k[0].to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        backend.attend(0, q, cache, cache)


def test_podcute_planned_loop_matches_dense(setup, dense, reference):
    """podcute's plans + reference attention, padded to the buckets: the dense loop's
    tokens, and hidden states matching the teacher-forced reference."""
    res = _serve(setup, PlannedReference, use_graphs=False)
    assert [r.output for r in res.requests] == [r.output for r in dense[0].requests]
    assert harness.check_hidden(res, reference, harness.HIDDEN_TOL[torch.float32])["passed"]
    by_bucket = res.engine.steps_by_bucket
    assert by_bucket.get("eager") and len(by_bucket) > 1, by_bucket  # padded and eager steps
    assert res.engine.backend.plans == len(res.steps)  # plan once per step


def test_graph_bookkeeping_with_a_stand_in(setup, dense, monkeypatch):
    """The graph path (capture per bucket, plan + load + replay per step, the replay
    checks) with replay = rerun on the static buffers."""
    monkeypatch.setattr(ex.Engine, "_capture", _stand_in_capture)
    res = _serve(setup, PlannedReference, use_graphs=True, replay_checks=3)
    assert sorted(res.engine.graphs) == sorted(SCFG.buckets)
    assert [r.output for r in res.requests] == [r.output for r in dense[0].requests]
    replays = harness.check_replays(res.engine)
    assert replays["passed"], replays
    assert len(replays["checked"]) >= 2
    # plans: one per bucket captured, one per step, one more per replay check
    assert res.engine.backend.plans == len(SCFG.buckets) + len(res.steps) + len(
        replays["checked"])


def test_cli_on_the_cpu(capsys):
    assert harness.main(["--tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "dense" in out
