"""A continuous-batching serving loop over a paged KV cache, with attention by podcute.

This is documentation for engine authors: the smallest engine that uses podcute the way a
real one does. The model is Llama-shaped (embedding; per layer RMSNorm, q/k/v projections
with GQA, RoPE on q and k, attention, o projection, RMSNorm, SwiGLU MLP; final norm and
LM head) with random weights from a seed, so it runs in seconds and needs no download.

One engine step:

1. **schedule** (`Scheduler.schedule`): requests arrive at given steps and wait in a FIFO
   queue. Every running request that has finished its prompt decodes one token; the rest
   of the per-step token budget goes to prompt chunks, first of requests already being
   prefilled, then of newly admitted ones (chunked prefill: a long prompt takes several
   steps while the others keep decoding). A request is admitted only if the page pool can
   hold its whole sequence (pages are reserved up front, so no preemption is needed).
2. **metadata** (`Step`): the step's tokens, their positions and their cache slots (slot
   mapping: `page * page_size + position % page_size`), plus per request the query count
   (`cu_seqlens_q`), the KV length after this step (`kv_lens`) and its pages
   (`block_table`), all small CPU tensors.
3. **forward** (`Llama.forward`): every layer writes the new tokens' K/V into their slots
   and then attends over the cache. The podcute backend plans the batch once per step
   (`PODAttention.plan` with the CPU tensors: no GPU sync) and runs it once per layer.
   With CUDA graphs the whole forward (embedding -> layers -> logits) is captured once
   per token-count bucket; a step is padded to the smallest bucket that holds it (padding
   tokens write their K/V into a reserved scratch page and are never attended), planned,
   its inputs copied into the graph's static buffers, and the graph replayed. A step that
   fits no bucket runs eagerly.
4. **sample** greedily from the last token of every request whose known tokens are all
   in the cache now (its prompt's last chunk, or its decode token); a request with all
   its new tokens finishes and its pages go back to the free list.

    python examples/serve_llama.py [--requests 48] [--no-graphs]   # on an sm_90 GPU

serves a trace and prints tokens per second. tests/serving_harness.py checks this loop:
tokens and final hidden states against a teacher-forced float32 reference, CUDA-graph
replays bitwise equal to eager runs, the scheduler's invariants, and the throughput
against a dense SDPA backend; `python tests/serving_harness.py --tiny` runs it on the CPU.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from podcute import PODAttention

SCRATCH_PAGE = 0  # page 0 is never handed out: padding tokens write their K/V there


# ---- Configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    hidden: int = 1024
    num_layers: int = 4
    num_qo_heads: int = 8
    num_kv_heads: int = 2  # GQA: 4 query heads per KV head
    head_dim: int = 128
    ffn: int = 2816  # SwiGLU width, Llama's ~8/3 x hidden
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class ServeConfig:
    page_size: int = 16
    token_budget: int = 320  # query tokens per step; longer prompts are chunked
    max_running: int = 16  # requests in flight (<= token_budget: every decode fits)
    buckets: tuple = (32, 64, 128, 256)  # padded token counts with a CUDA graph each
    max_seq_len: int = 1024  # prompt + new tokens of the longest request (RoPE, pages)
    num_pages: int | None = None  # page pool; default: max_running full-length requests

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_pages or 1 + self.max_running * self.pages_per_seq


# ---- Model ---------------------------------------------------------------------------


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor  # [hidden, Hq * D]; x @ w
    wk: torch.Tensor  # [hidden, Hkv * D]
    wv: torch.Tensor
    wo: torch.Tensor  # [Hq * D, hidden]
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor  # [hidden, ffn]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [ffn, hidden]


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE of x [T, H, D] at the tokens' positions (cos, sin [T, D/2])."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class Llama:
    """Llama-shaped decoder. `forward` takes the attention as a callback, so the model
    knows nothing of pages: the engine's callback writes the cache and calls a backend."""

    def __init__(self, cfg: ModelConfig, device, seed: int = 0, max_positions: int = 4096):
        self.cfg, self.device = cfg, torch.device(device)
        gen = torch.Generator().manual_seed(seed)

        def put(t):  # drawn in float32 on the CPU: the same weights on any device
            return t.to(device=device, dtype=cfg.dtype)

        def w(rows, cols):  # unit-scale activations: std 1/sqrt(fan_in)
            return put(torch.randn(rows, cols, generator=gen) / math.sqrt(rows))

        def norm():  # not all ones, so the norm weights matter
            return put(1.0 + 0.1 * torch.randn(cfg.hidden, generator=gen))

        h, qd, kvd = cfg.hidden, cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.embed = put(torch.randn(cfg.vocab_size, h, generator=gen))
        self.layers = [Layer(norm(), w(h, qd), w(h, kvd), w(h, kvd), w(qd, h), norm(),
                             w(h, cfg.ffn), w(h, cfg.ffn), w(cfg.ffn, h))
                       for _ in range(cfg.num_layers)]
        self.final_norm = norm()
        self.lm_head = w(h, cfg.vocab_size)
        # RoPE tables (float32) for every position the engine will use, built once: a
        # captured graph holds their address
        half = cfg.head_dim // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos, self.sin = ang.cos().float().to(device), ang.sin().float().to(device)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, tokens, positions, attend):
        """tokens, positions: int64 [T]. attend(layer, q, k, v) -> [T, Hq, D] gives each
        layer's attention (q, k after RoPE). Returns the final-norm hidden states [T,
        hidden] (what the LM head reads) and the logits [T, vocab]."""
        cfg = self.cfg
        T = tokens.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]
        h = F.embedding(tokens, self.embed)
        for i, lay in enumerate(self.layers):
            x = rms_norm(h, lay.attn_norm, cfg.norm_eps)
            q = apply_rope((x @ lay.wq).view(T, cfg.num_qo_heads, cfg.head_dim), cos, sin)
            k = apply_rope((x @ lay.wk).view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = (x @ lay.wv).view(T, cfg.num_kv_heads, cfg.head_dim)
            o = attend(i, q, k, v)
            h = h + o.reshape(T, -1) @ lay.wo
            x = rms_norm(h, lay.mlp_norm, cfg.norm_eps)
            h = h + (F.silu(x @ lay.w_gate) * (x @ lay.w_up)) @ lay.w_down
        hidden = rms_norm(h, self.final_norm, cfg.norm_eps)
        return hidden, hidden @ self.lm_head


# ---- Paged KV cache ------------------------------------------------------------------


class PageAllocator:
    """Free list of page ids; page SCRATCH_PAGE is reserved and never handed out."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = deque(p for p in range(num_pages) if p != SCRATCH_PAGE)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV pages: need {n}, {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)


class PagedKVCache:
    """Per layer a K and a V pool [num_pages, page_size, Hkv, D] (NHD, podcute's layout)."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, device):
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=cfg.dtype, device=device)
                  for _ in range(cfg.num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def write(self, layer: int, slots, k, v) -> None:
        """Store the step's k, v [T, Hkv, D] at their slots (int64 [T], page * page_size +
        offset): a scatter into the pool viewed as one row per slot."""
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, new)


# ---- Requests and the scheduler ------------------------------------------------------


@dataclass
class Request:
    rid: int
    arrival: int  # the step it arrives at
    prompt: list[int]
    max_new_tokens: int
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    chunks: int = 0  # prefill chunks its prompt took

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    def kv_tokens_needed(self) -> int:
        # the last new token is sampled but never fed back, so its K/V are never stored
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass
class Step:
    """One engine step: what the model runs (CPU tensors) and what the scheduler needs
    back. Rows of a request's tokens are contiguous, in batch order."""

    index: int
    requests: list[Request]
    q_lens: list[int]
    tokens: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]: page * page_size + position % page_size
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    kv_lens: torch.Tensor  # int32 [B]: cached tokens after this step's writes
    block_table: torch.Tensor  # int32 [B, max pages in the batch], padded with SCRATCH_PAGE
    sample_rows: list[int]  # row of the last token of each request that samples
    sample_requests: list[Request]
    num_prefill: int  # requests in this step with a prompt chunk
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


class Scheduler:
    """FIFO admission, decode-first token budget, chunked prefill, up-front page
    reservation (so a running request can never run out of pages)."""

    def __init__(self, requests: list[Request], cfg: ServeConfig):
        if cfg.max_running > cfg.token_budget:
            raise ValueError("max_running must be <= token_budget (every decode needs a slot)")
        self.cfg = cfg
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.allocator = PageAllocator(cfg.pool_pages)
        self.step_no = 0
        for r in requests:
            too_long = r.kv_tokens_needed() > cfg.max_seq_len
            if too_long or self._pages_for(r) > self.allocator.num_free:
                raise ValueError(f"request {r.rid} ({len(r.prompt)} + {r.max_new_tokens} "
                                 "tokens) cannot fit the page pool or max_seq_len")

    def _pages_for(self, r: Request) -> int:
        return -(-r.kv_tokens_needed() // self.cfg.page_size)

    def has_work(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    def schedule(self) -> Step | None:
        """The next step's batch, or None for an idle step (nothing has arrived yet)."""
        while self.pending and self.pending[0].arrival <= self.step_no:
            self.waiting.append(self.pending.popleft())
        budget = self.cfg.token_budget
        work = []
        # Decodes first: one token each, they are what users are waiting on.
        for r in self.running:
            if not r.prefilling:
                work.append((r, 1))
                budget -= 1
        # Then the prompts already under way, then new requests while budget, slots and
        # pages last (FIFO: a request that does not fit blocks the ones behind it).
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(len(r.prompt) - r.num_cached, budget)
                work.append((r, n))
                budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.cfg.max_running
               and self._pages_for(self.waiting[0]) <= self.allocator.num_free):
            r = self.waiting.popleft()
            r.pages = self.allocator.alloc(self._pages_for(r))
            self.running.append(r)
            n = min(len(r.prompt), budget)
            work.append((r, n))
            budget -= n
        index = self.step_no
        self.step_no += 1
        if not work:
            if not self.waiting and self.pending:  # skip ahead to the next arrival
                self.step_no = max(self.step_no, self.pending[0].arrival)
            return None
        return self._build(index, work)

    def _build(self, index: int, work) -> Step:
        ps = self.cfg.page_size
        tokens, positions, slots, cu, kv_lens = [], [], [], [0], []
        sample_rows, sample_requests = [], []
        width = max(len(r.pages) for r, _ in work)
        table = np.full((len(work), width), SCRATCH_PAGE, dtype=np.int32)
        for b, (r, n) in enumerate(work):
            pos = np.arange(r.num_cached, r.num_cached + n)
            pages = np.asarray(r.pages, dtype=np.int64)
            tokens.append(np.asarray(r.seq[r.num_cached: r.num_cached + n], dtype=np.int64))
            positions.append(pos)
            slots.append(pages[pos // ps] * ps + pos % ps)
            cu.append(cu[-1] + n)
            kv_lens.append(r.num_cached + n)
            table[b, :len(r.pages)] = r.pages
            if r.num_cached + n == len(r.seq):  # all it knows is cached: sample the next
                sample_rows.append(cu[-1] - 1)
                sample_requests.append(r)
        num_prefill = sum(r.prefilling for r, _ in work)

        def i64(parts):
            return torch.from_numpy(np.concatenate(parts))

        return Step(index, [r for r, _ in work], [n for _, n in work], i64(tokens),
                    i64(positions), i64(slots), torch.tensor(cu, dtype=torch.int32),
                    torch.tensor(kv_lens, dtype=torch.int32), torch.from_numpy(table),
                    sample_rows, sample_requests, num_prefill, len(work) - num_prefill)

    def commit(self, step: Step, sampled: list[int]) -> None:
        """Advance the step's requests; append the sampled tokens; retire finished ones."""
        for r, n in zip(step.requests, step.q_lens):
            r.chunks += r.prefilling
            r.num_cached += n
        for r, tok in zip(step.sample_requests, sampled):
            r.output.append(tok)
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            self.allocator.release(r.pages)
            r.pages = []
            self.finished.append(r)


# ---- The attention backend: prepare(step) once per step, attend() per layer ----------


class PodcuteBackend:
    """One PODAttention for all layers: plan() once per step with CPU index tensors (no
    GPU sync), run() per layer. Capacities cover the largest batch the scheduler can
    form, so nothing regrows after a CUDA graph captured the buffers (README, CUDA
    graphs); padding rows of q past cu_seqlens_q[-1] are never read or written."""

    name = "podcute"
    pads = True  # may run a step padded to a bucket (q with extra rows)

    def __init__(self, mcfg: ModelConfig, scfg: ServeConfig, device, dtype=None):
        self.attn = PODAttention(
            mcfg.num_qo_heads, mcfg.num_kv_heads, mcfg.head_dim, scfg.page_size,
            dtype=dtype or mcfg.dtype, kv_layout="NHD", device=device,
            max_batch_size=scfg.max_running,
            max_num_tokens=max(scfg.token_budget, max(scfg.buckets, default=1)),
            # a block table costs B x the most pages one request reads
            max_num_pages=scfg.max_running * scfg.pages_per_seq)
        self.plans = 0

    def plan(self, cu_seqlens_q, kv_lens, block_table):
        self.plans += 1
        return self.attn.plan(cu_seqlens_q, kv_lens, block_table=block_table, causal=True)

    def prepare(self, step: Step):
        return self.plan(step.cu_seqlens_q, step.kv_lens, step.block_table)

    def prepare_dummy(self):
        """A one-token batch on the scratch page: what the graphs are captured with."""
        return self.plan(torch.tensor([0, 1], dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32),
                         torch.full((1, 1), SCRATCH_PAGE, dtype=torch.int32))

    def attend(self, layer, q, k_cache, v_cache):
        return self.attn.run(q, k_cache, v_cache)


# ---- The engine: one step's forward, eager or padded to a bucket and replayed --------


class StaticStep:
    """Fixed-address inputs and outputs of one bucket's graph."""

    def __init__(self, T: int, page_size: int, device):
        self.T = T
        # tokens, positions, slots: one buffer, so a step's inputs are one copy
        self.inputs = torch.zeros(3, T, dtype=torch.int64, device=device)
        self.tokens, self.positions, self.slots = self.inputs
        # Padding tokens (token 0 at position 0) write their K/V to the scratch page,
        # which no request reads (slots repeat past page_size: harmless).
        self.host = torch.zeros(3, T, dtype=torch.int64)
        self.host[2] = SCRATCH_PAGE * page_size + torch.arange(T) % page_size
        self.inputs.copy_(self.host)
        self.hidden = self.logits = None  # outputs, set by the capture

    def load(self, step: Step) -> None:
        n = step.num_tokens
        host = self.host.clone()  # the padding tail stays as it is
        host[0, :n], host[1, :n], host[2, :n] = step.tokens, step.positions, step.slots
        # a blocking copy: stream-ordered after the previous replay, and `host` may be
        # freed as soon as it returns
        self.inputs.copy_(host)


class Engine:
    """The model, its paged KV cache and a backend; with a padding backend and
    use_graphs, one CUDA graph of the whole forward per bucket, captured up front."""

    def __init__(self, model: Llama, scfg: ServeConfig, backend, use_graphs: bool = True):
        self.model, self.scfg, self.backend = model, scfg, backend
        self.device = model.device
        if scfg.max_seq_len > model.max_positions:
            raise ValueError(f"max_seq_len {scfg.max_seq_len} > the model's RoPE table "
                             f"({model.max_positions} positions)")
        self.cache = PagedKVCache(model.cfg, scfg.pool_pages, scfg.page_size, self.device)
        self.buckets = sorted(scfg.buckets) if backend.pads else []
        self.static = {T: StaticStep(T, scfg.page_size, self.device) for T in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs and self.buckets:
            for T in reversed(self.buckets):
                self._capture(self.static[T])
        self.steps_by_bucket: dict = {}

    def _forward(self, tokens, positions, slots):
        def attend(layer, q, k, v):
            self.cache.write(layer, slots, k, v)  # this step's K/V first: it attends to them
            return self.backend.attend(layer, q, self.cache.k[layer], self.cache.v[layer])
        return self.model.forward(tokens, positions, attend)

    def _capture(self, st: StaticStep) -> None:
        """README's protocol: plan a warm-up batch, run it on a side stream (compiles the
        kernel, initialises cuBLAS), capture. The inputs are all padding: their K/V go to
        the scratch page."""
        self.backend.prepare_dummy()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(st.tokens, st.positions, st.slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            st.hidden, st.logits = self._forward(st.tokens, st.positions, st.slots)
        self.graphs[st.T] = graph

    def bucket(self, n: int) -> int | None:
        return next((T for T in self.buckets if T >= n), None)

    def run(self, step: Step):
        """Hidden states and logits of the step's rows (more rows past them: padding).
        After a replay they live in the graph's buffers, which the next replay overwrites."""
        T = self.bucket(step.num_tokens)
        self.steps_by_bucket[T or "eager"] = self.steps_by_bucket.get(T or "eager", 0) + 1
        self.backend.prepare(step)  # plan once per step, before the replay
        if T is None:
            dev = self.device
            return self._forward(step.tokens.to(dev), step.positions.to(dev),
                                 step.slots.to(dev))
        st = self.static[T]
        st.load(step)
        if T not in self.graphs:  # padded but eager (no graphs, e.g. on the CPU)
            return self._forward(st.tokens, st.positions, st.slots)
        self.graphs[T].replay()
        return st.hidden, st.logits


# ---- The serving loop ----------------------------------------------------------------


def serve(engine: Engine, requests: list[Request], on_step=None) -> Scheduler:
    """Serve the requests to the end: schedule, forward, sample, commit. Returns the
    scheduler, every request in its `finished`. `on_step(step, hidden, logits)`, if
    given, sees each step's outputs before the next step overwrites them."""
    sched = Scheduler(requests, engine.scfg)
    while sched.has_work():
        step = sched.schedule()
        if step is None:
            continue
        hidden, logits = engine.run(step)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=engine.device)
        sampled = logits[rows].argmax(-1).tolist()  # the loop's one device->host sync
        if on_step is not None:
            on_step(step, hidden, logits)
        sched.commit(step, sampled)
    return sched


@dataclass
class Trace:
    """Requests as (arrival step, prompt, max new tokens); each run serves fresh copies."""

    items: list[tuple[int, list[int], int]]

    def requests(self) -> list[Request]:
        return [Request(i, a, list(p), n) for i, (a, p, n) in enumerate(self.items)]

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for _, p, n in self.items)


@dataclass(frozen=True)
class TraceConfig:
    """Mostly short prompts and a few long ones (longer than the token budget: chunked),
    arriving a few steps apart so that prefills land while others decode."""

    num_requests: int = 32
    short: tuple = (8, 64)  # prompt length range of most requests
    long: tuple = (300, 640)  # ... and of a long_fraction of them
    long_fraction: float = 0.25
    new_tokens: tuple = (4, 24)
    arrival_gap: tuple = (0, 3)  # steps between consecutive arrivals


def make_trace(tcfg: TraceConfig, vocab_size: int, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    items, step = [], 0
    for _ in range(tcfg.num_requests):
        lo, hi = tcfg.long if rng.random() < tcfg.long_fraction else tcfg.short
        prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(lo, hi))]
        items.append((step, prompt, rng.randint(*tcfg.new_tokens)))
        step += rng.randint(*tcfg.arrival_gap)
    return Trace(items)


def has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=TraceConfig.num_requests)
    p.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not has_sm90():
        sys.exit("podcute's kernels need an sm_90 GPU (python tests/serving_harness.py "
                 "--tiny runs this loop on the CPU with a dense SDPA backend)")
    mcfg = ModelConfig()
    trace = make_trace(TraceConfig(num_requests=a.requests), mcfg.vocab_size, a.seed)
    scfg = ServeConfig(max_seq_len=max(ServeConfig.max_seq_len, trace.max_seq_len))
    model = Llama(mcfg, "cuda", a.seed, max_positions=scfg.max_seq_len)
    with torch.no_grad():
        engine = Engine(model, scfg, PodcuteBackend(mcfg, scfg, "cuda"), not a.no_graphs)
        # the first pass compiles the kernel variants that eager steps need and warms
        # cuBLAS; the second is timed
        serve(engine, trace.requests())
        engine.steps_by_bucket.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        done = serve(engine, trace.requests()).finished
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    new = sum(len(r.output) for r in done)
    print(f"serve_llama on {torch.cuda.get_device_name()}: {len(done)} requests, "
          f"{sum(len(r.prompt) for r in done)} prompt + {new} new tokens in {wall:.3f} s, "
          f"{new / wall:.1f} tok/s (steps by bucket: {engine.steps_by_bucket})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
