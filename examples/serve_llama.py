"""A continuous-batching serving loop over a paged KV cache, with attention by podcute.

This is documentation for engine authors: the smallest engine that uses podcute the way a
real one does, plus the checks that show it computes the right thing.

The model is Llama-shaped (embedding; per layer RMSNorm, q/k/v projections with GQA, RoPE
on q and k, attention, o projection, RMSNorm, SwiGLU MLP; final norm and LM head) with
random weights from a seed, so it runs anywhere in seconds and needs no download.

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

The dense backend runs the same loop eagerly, attending per request with
`torch.nn.functional.scaled_dot_product_attention` over the K/V gathered from its pages
(bottom-right causal mask for chunks: query j of a chunk of m sits at position
kv_len - m + j, docs/contract.md).

Checks (`run_report`): the generated tokens and the final hidden states of both loops
against a teacher-forced float32 reference (the same weights, one full causal SDPA per
request over its whole sequence, no paging); graph replays bitwise equal to eager runs of
the same steps; the scheduler's invariants; and tokens per second of both loops.

    python examples/serve_llama.py            # on an H200; prints the report
    python examples/serve_llama.py --json out.json --requests 48
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from podcute.reference import full_fp32_matmul

SCRATCH_PAGE = 0  # page 0 is never handed out: padding tokens write their K/V there

# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


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
    """Llama-shaped decoder. `forward` takes the attention as a callback, so the serving
    loop (paged cache + a backend) and the reference (full causal SDPA) share every
    other line of the model."""

    def __init__(self, cfg: ModelConfig, device, seed: int = 0, max_positions: int = 4096):
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)

        def w(rows, cols):  # unit-scale activations: std 1/sqrt(fan_in)
            return torch.randn(rows, cols, generator=gen) / math.sqrt(rows)

        def norm():  # not all ones, so the norm weights matter
            return 1.0 + 0.1 * torch.randn(cfg.hidden, generator=gen)

        h, qd, kvd = cfg.hidden, cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.embed = torch.randn(cfg.vocab_size, h, generator=gen)
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
        self.cos, self.sin = ang.cos().float(), ang.sin().float()
        self._cast(device, cfg.dtype)

    def _cast(self, device, dtype) -> "Llama":
        def cast(t):
            return t.to(device=device, dtype=dtype)
        self.embed, self.final_norm, self.lm_head = map(cast, (self.embed, self.final_norm,
                                                               self.lm_head))
        self.layers = [Layer(*map(cast, dataclasses.astuple(lay))) for lay in self.layers]
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self.cfg = dataclasses.replace(self.cfg, dtype=dtype)
        self.device = torch.device(device)
        return self

    def copy_as(self, dtype) -> "Llama":
        """The same model in another dtype (the float32 reference: the bf16 weights
        upcast, so the same values)."""
        other = object.__new__(Llama)
        other.__dict__.update(self.__dict__)
        return other._cast(self.device, dtype)

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


# --------------------------------------------------------------------------------------
# Paged KV cache
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Requests and the scheduler
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Attention backends: prepare(step) once per step, attend(layer, q, k_cache, v_cache)
# per layer
# --------------------------------------------------------------------------------------


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


class DenseBackend:
    """Per request: gather its K/V from the pages, one SDPA with an explicit bottom-right
    causal mask (query j of a chunk of m tokens sees keys <= kv_len - m + j). Eager."""

    name = "dense"
    pads = False

    def __init__(self, mcfg: ModelConfig, scfg: ServeConfig, device):
        self.device, self.page_size = torch.device(device), scfg.page_size

    def prepare(self, step: Step):
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


# --------------------------------------------------------------------------------------
# The engine: one step's forward, eager or padded to a bucket and replayed from a graph
# --------------------------------------------------------------------------------------


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
    def __init__(self, model: Llama, scfg: ServeConfig, backend, use_graphs: bool,
                 replay_checks: int = 0):
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
        self.replay_checks_left = replay_checks
        self.replay_checks: list[dict] = []
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
        """Hidden states and logits of the step's rows (more rows past them: padding)."""
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
        if self.replay_checks_left and self._new_mix(step):
            self._check_replay(step, st)
        return st.hidden, st.logits

    def _new_mix(self, step: Step) -> bool:
        mix = (step.num_prefill > 0, step.num_decode > 0)
        return all(c["mix"] != mix for c in self.replay_checks)

    def _check_replay(self, step: Step, st: StaticStep) -> None:
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


# --------------------------------------------------------------------------------------
# The serving loop
# --------------------------------------------------------------------------------------


@dataclass
class Trace:
    """Requests as (arrival step, prompt, max new tokens): both loops serve copies."""

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


# A model, loop and trace small enough for the CPU (tests, machines without a GPU).
TINY = (ModelConfig(vocab_size=256, hidden=128, num_layers=2, num_qo_heads=4, num_kv_heads=2,
                    head_dim=64, ffn=256, dtype=torch.float32),
        ServeConfig(token_budget=48, max_running=6, buckets=(16, 32)),
        TraceConfig(num_requests=10, short=(4, 20), long=(60, 100), new_tokens=(2, 8)))


@dataclass
class ServeResult:
    backend: str
    requests: list[Request]
    last_hidden: dict  # rid -> final-norm hidden state of its last processed token
    logits: dict  # rid -> [new tokens, vocab] logits its tokens were sampled from
    steps: list[dict]  # per step: tokens, prefill and decode requests, bucket
    wall_s: float
    pages_free_after: int
    pages_total: int
    engine: Engine

    @property
    def generated(self) -> int:
        return sum(len(r.output) for r in self.requests)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def serve(engine: Engine, trace: Trace, record_steps: list | None = None) -> ServeResult:
    """Run the trace to the end: schedule, forward, sample, commit, until every request
    finished. `record_steps`, if a list, receives every Step (for replanning in tests)."""
    sched = Scheduler(trace.requests(), engine.scfg)
    last_hidden, logits_rows, steps = {}, {}, []
    _sync(engine.device)
    t0 = time.perf_counter()
    while sched.has_work():
        step = sched.schedule()
        if step is None:
            continue
        if record_steps is not None:
            record_steps.append(step)
        hidden, logits = engine.run(step)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=engine.device)
        h, lg = hidden[rows], logits[rows]  # copies: a replay overwrites the outputs
        sampled = lg.argmax(-1).tolist()  # the loop's one device->host sync per step
        for j, r in enumerate(step.sample_requests):
            last_hidden[r.rid] = h[j]
            logits_rows.setdefault(r.rid, []).append(lg[j])
        steps.append(dict(index=step.index, tokens=step.num_tokens, prefill=step.num_prefill,
                          decode=step.num_decode, bucket=engine.bucket(step.num_tokens)))
        sched.commit(step, sampled)
    _sync(engine.device)
    wall = time.perf_counter() - t0
    return ServeResult(engine.backend.name, sorted(sched.finished, key=lambda r: r.rid),
                       last_hidden, {k: torch.stack(v) for k, v in logits_rows.items()},
                       steps, wall, sched.allocator.num_free, sched.allocator.num_pages - 1,
                       engine)


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------

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


def teacher_forced(model: Llama, requests: list[Request], cache: dict | None = None) -> dict:
    """The float32 model over each request's prompt + generated tokens (all but the last,
    which was never fed back), no paging: rid -> (last hidden state [hidden], logits
    [new tokens, vocab] at the positions that predicted them). `cache` (sequence ->
    result) spares recomputing a sequence another loop generated too."""
    ref = model.copy_as(torch.float32)
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


def check_replays(engine: Engine) -> dict:
    """At least two replayed steps with different prefill/decode mixes, all bitwise
    equal to eager runs."""
    checks = engine.replay_checks
    mixes = {c["mix"] for c in checks}
    return dict(passed=len(mixes) >= 2 and all(c["bitwise_equal"] for c in checks),
                checked=[{k: v for k, v in c.items() if k != "mix"} for c in checks])


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def build_engine(model, scfg, backend_name, use_graphs=True, replay_checks=0) -> Engine:
    if backend_name == "podcute":
        backend = PodcuteBackend(model.cfg, scfg, model.device)
    else:
        backend = DenseBackend(model.cfg, scfg, model.device)
    return Engine(model, scfg, backend, use_graphs=use_graphs and backend.pads,
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


def run_report(mcfg: ModelConfig = ModelConfig(), scfg: ServeConfig = ServeConfig(),
               tcfg: TraceConfig = TraceConfig(), seed: int = 0, device=None, backends=None,
               use_graphs: bool = True) -> dict:
    """Serve one trace with each backend (default: podcute and dense on an sm_90 GPU,
    dense elsewhere) and check both loops; the report's "passed" is every check's."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if backends is None:  # podcute runs on Hopper, in bf16 or fp16
        podcute = has_sm90() and device.type == "cuda" and mcfg.dtype != torch.float32
        backends = ("podcute", "dense") if podcute else ("dense",)
    trace = make_trace(tcfg, mcfg.vocab_size, seed)
    scfg = dataclasses.replace(scfg, max_seq_len=max(scfg.max_seq_len, trace.max_seq_len))
    model = Llama(mcfg, device, seed, max_positions=scfg.max_seq_len)
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="the CPU test's tiny float32 setup (the default without CUDA)")
    p.add_argument("--requests", type=int, help=f"default {TraceConfig.num_requests}")
    p.add_argument("--layers", type=int, help=f"default {ModelConfig.num_layers}")
    p.add_argument("--token-budget", type=int, help=f"default {ServeConfig.token_budget}")
    p.add_argument("--max-running", type=int, help=f"default {ServeConfig.max_running}")
    p.add_argument("--buckets", help="padded token counts with a graph each, e.g. 32,64 "
                   f"('' for none; default {','.join(map(str, ServeConfig.buckets))})")
    p.add_argument("--no-graphs", action="store_true", help="run podcute eagerly every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="also write the report here")
    a = p.parse_args(argv)
    cpu = not torch.cuda.is_available() or (a.device or "cuda").startswith("cpu")
    mcfg, scfg, tcfg = TINY if a.tiny or cpu else (ModelConfig(), ServeConfig(), TraceConfig())
    if not cpu:
        mcfg = dataclasses.replace(mcfg, dtype=torch.bfloat16)  # --tiny on a GPU
    if cpu or not has_sm90():
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
