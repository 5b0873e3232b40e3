"""The FlashAttention-shaped entry point and plan reuse on the H200 (marker `gpu`).

- `flash_attn_varlen_func` (paged in vLLM's and upstream's argument orders, and
  contiguous K/V) matches `podcute.reference`, LSE in FlashAttention's [Hq, total_q];
- a step of several layers reuses its plan, and a step whose lengths or pages change in
  place (the same tensors) is never served the stale plan: its outputs are right;
- CUDA graphs of whole multi-layer steps (`PODAttention.run()` per layer, and the compat
  call per layer naming the step's plan): captured once, then per step plan() (or
  `flash_attn_varlen_plan`) with new lengths and pages, and replay: bitwise equal to eager
  execution, for steps whose prefill/decode mix and lengths change;
- a serving loop in vLLM's pattern: persistent NumPy metadata buffers written in place and
  passed as fresh `torch.from_numpy` slices, sliding-window and full layers alternating,
  eager steps and a whole-step graph, each step checked against the reference.
"""

import dataclasses

import numpy as np
import pytest
import torch

import podcute
from podcute import PODAttention
from podcute.compat.flash_attn import flash_attn_varlen_func, flash_attn_varlen_plan
from podcute.testing import make_batch

pytestmark = pytest.mark.gpu

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
if not HAS_SM90:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

HQ, HKV, D, PS = 8, 2, 128, 16  # one shipped variant family: bf16, D 128, GQA 4
MIX = ([300, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 2000, 8])


def rel_l2(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def batch(q_lens, kv_lens, page=PS, fmt="table", seed=0, num_pages=None):
    return make_batch(q_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                      page_size=page, device="cuda", page_format=fmt, seed=seed,
                      num_pages=num_pages)


def check(out, lse, b, n=None):
    n = n or b.q.shape[0]
    ref, ref_lse = b.reference(causal=True, return_lse=True)
    assert not out[:n].isnan().any()
    assert rel_l2(out[:n], ref) <= 5e-3
    if lse is not None:  # [Hq, total_q]
        fin = ~torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse.t()[:n]), ~fin)
        assert (lse.t()[:n][fin] - ref_lse[fin]).abs().max().item() <= 1e-3


def test_paged_vllm_order_with_lse():
    b = batch(*MIX)
    out = torch.full_like(b.q, float("nan"))
    out, lse = flash_attn_varlen_func(
        b.q, b.k_cache, b.v_cache, max(b.q_lens), b.cu_seqlens_q, max(b.kv_lens),
        seqused_k=b.seqused_k, block_table=b.block_table, causal=True,
        return_softmax_lse=True, out=out)
    assert lse.shape == (HQ, b.q.shape[0])
    check(out, lse, b)


def test_paged_upstream_order_cpu_metadata():
    b = batch(*MIX, seed=1)
    cu_k = torch.tensor([0] + torch.tensor(b.kv_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = flash_attn_varlen_func(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q.cpu(), cu_k,
                                 max(b.q_lens), max(b.kv_lens), causal=True,
                                 page_table=b.block_table.cpu())
    check(out, None, b)


def test_contiguous_kv():
    b = batch(*MIX, page=1, fmt="csr", seed=2)
    # The batch's pages in order are its requests' tokens: the contiguous varlen K/V.
    k = b.k_cache[b.kv_indices.long(), 0]
    v = b.v_cache[b.kv_indices.long(), 0]
    out, lse = flash_attn_varlen_func(b.q, k, v, max(b.q_lens), b.cu_seqlens_q,
                                      max(b.kv_lens), cu_seqlens_k=b.kv_indptr, causal=True,
                                      return_softmax_lse=True)
    check(out, lse, b)


@pytest.mark.usefixtures("fp8_kernel")
@pytest.mark.parametrize("per_head", [True, False])
def test_fp8_cache_with_vllm_descales(per_head):
    """vLLM's FlashAttention-3 call over an fp8 cache: 16-bit queries, the cache viewed as
    e4m3, descales as [B, Hkv] expands of the layer's scale (q_descale unused: 16-bit
    queries); matches the reference on the dequantised cache."""
    from podcute.testing import quantize_kv_cache

    b = batch(*MIX, seed=3)
    k8, ks = quantize_kv_cache(b.k_cache, per_head=per_head)
    v8, vs = quantize_kv_cache(b.v_cache, per_head=per_head)
    deq = dataclasses.replace(
        b, k_cache=(k8.float() * (ks.view(1, 1, -1, 1) if per_head else ks)).to(b.q.dtype),
        v_cache=(v8.float() * (vs.view(1, 1, -1, 1) if per_head else vs)).to(b.q.dtype))
    shape = (len(b.q_lens), HKV)
    out = torch.full_like(b.q, float("nan"))
    flash_attn_varlen_func(
        b.q, k8, v8, max(b.q_lens), b.cu_seqlens_q, max(b.kv_lens), seqused_k=b.seqused_k,
        block_table=b.block_table, causal=True, out=out, fa_version=3,
        q_descale=torch.ones(1, device="cuda").expand(shape),
        k_descale=(ks if per_head else ks.reshape(1)).expand(shape),
        v_descale=(vs if per_head else vs.reshape(1)).expand(shape))
    ref = deq.reference(causal=True)
    assert not out.isnan().any()
    assert rel_l2(out, ref) <= 1e-2


def layers_of(b, num_layers=3):
    """The layers of one step: the same requests and pages (one page table serves every
    layer), other queries and values per layer."""
    return [dataclasses.replace(b, q=b.q * (1 + 0.25 * i), v_cache=b.v_cache * (1 - 0.2 * i))
            for i in range(num_layers)]


def test_step_reuses_plan_and_never_serves_a_stale_one():
    layers = layers_of(batch(*MIX, seed=10, num_pages=600))
    bt = torch.zeros(7, 256, dtype=torch.int32, device="cuda")
    bt[:, :layers[0].block_table.shape[1]] = layers[0].block_table
    meta = dict(cu=layers[0].cu_seqlens_q.clone(), kvl=layers[0].seqused_k.clone(), bt=bt)

    def step(bs):
        outs = []
        for b in bs:
            outs.append(flash_attn_varlen_func(
                b.q, b.k_cache, b.v_cache, 300, meta["cu"], 2000, seqused_k=meta["kvl"],
                block_table=meta["bt"], causal=True))
        return outs

    podcute.invalidate_plans()
    for out, b in zip(step(layers), layers):  # one plan, three layers
        check(out, None, b)
    # The next step writes the same metadata tensors in place: other lengths and pages
    # (a decode-heavier mix): a stale plan would read the old pages.
    nxt = layers_of(batch([1, 1, 2, 0, 1, 1, 1], [701, 65, 2, 905, 17, 2001, 9], seed=20,
                          num_pages=600))
    meta["cu"].copy_(nxt[0].cu_seqlens_q)
    meta["kvl"].copy_(nxt[0].seqused_k)
    meta["bt"][:, :nxt[0].block_table.shape[1]].copy_(nxt[0].block_table)
    for out, b in zip(step(nxt), nxt):
        check(out, None, b, n=sum(b.q_lens))


@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_inference_mode_metadata_and_alternating_layer_types(where):
    """An engine's step under torch.inference_mode(): metadata made there has no version
    counter (device tensors plan every call, CPU ones compare by content), layers of two
    configurations alternate (the per-layer path starts from the other one's attention),
    and the next step's in-place writes are never served a stale plan."""
    with torch.inference_mode():
        a = layers_of(batch(*MIX, seed=30, num_pages=600))
        wide = make_batch(*MIX, num_qo_heads=2 * HQ, num_kv_heads=HKV, head_dim=64,
                          page_size=PS, device="cuda", seed=31, num_pages=600)
        bt = torch.zeros(7, 256, dtype=torch.int32, device=where)
        bt[:, :a[0].block_table.shape[1]] = a[0].block_table.to(where)
        # wide's pages differ from a's: one table per configuration would be an engine's
        # choice; here each keeps its own, and the lengths are shared
        bt_w = torch.zeros_like(bt)
        bt_w[:, :wide.block_table.shape[1]] = wide.block_table.to(where)
        cu, kvl = a[0].cu_seqlens_q.to(where).clone(), a[0].seqused_k.to(where).clone()
        assert cu.is_inference()

        def layer(b, table):
            return flash_attn_varlen_func(b.q, b.k_cache, b.v_cache, 300, cu, 2000,
                                          seqused_k=kvl, block_table=table, causal=True)

        for b in a:
            check(layer(b, bt), None, b)
            w = layer(wide, bt_w)
            ref = wide.reference(causal=True)
            assert rel_l2(w, ref) <= 5e-3
        nxt = batch([1, 1, 2, 0, 1, 1, 1], [701, 65, 2, 905, 17, 2001, 9], seed=32,
                    num_pages=600)
        cu.copy_(nxt.cu_seqlens_q)
        kvl.copy_(nxt.seqused_k)
        bt[:, :nxt.block_table.shape[1]].copy_(nxt.block_table)
        check(layer(nxt, bt), None, nxt, n=sum(nxt.q_lens))


class Step:
    """A multi-layer step with static buffers, as an engine holds them for one bucket."""

    LAYERS, T, PAGES = 3, 1024, 1500

    def __init__(self, compat: bool):
        self.compat = compat
        dev = dict(device="cuda")
        self.q = torch.zeros(self.LAYERS, self.T, HQ, D, dtype=torch.bfloat16, **dev)
        self.k = torch.zeros(self.LAYERS, self.PAGES, PS, HKV, D, dtype=torch.bfloat16, **dev)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        i32 = dict(dtype=torch.int32, **dev)
        self.cu = torch.zeros(33, **i32)
        self.kvl = torch.zeros(32, **i32)
        self.bt = torch.zeros(32, 256, **i32)
        self.attn = None if compat else PODAttention(
            HQ, HKV, D, PS, device="cuda", max_batch_size=32, max_num_tokens=self.T,
            max_num_pages=32 * 256)

    def load(self, q_lens, kv_lens, seed):
        B = len(q_lens)
        bs = layers_of(batch(q_lens, kv_lens, seed=seed, num_pages=self.PAGES), self.LAYERS)
        n = sum(q_lens)
        for i, b in enumerate(bs):
            self.q[i].zero_()
            self.q[i, :n] = b.q
            self.k[i].copy_(b.k_cache)
            self.v[i].copy_(b.v_cache)
        self.cu.zero_()
        self.cu[:B + 1] = bs[0].cu_seqlens_q
        self.cu[B + 1:] = n  # padding requests: q_len 0
        self.kvl.zero_()
        self.kvl[:B] = bs[0].seqused_k
        self.bt.zero_()
        self.bt[:B, :bs[0].block_table.shape[1]] = bs[0].block_table
        return bs

    def plan(self):
        if self.compat:  # the step's plan, named by every layer's call
            self.handle = flash_attn_varlen_plan(self.q[0], self.k[0], self.v[0], 0, self.cu,
                                                 0, seqused_k=self.kvl, block_table=self.bt,
                                                 causal=True)
        else:
            self.attn.plan(self.cu, self.kvl, block_table=self.bt, causal=True)

    def forward(self):
        for i in range(self.LAYERS):
            if self.compat:
                flash_attn_varlen_func(self.q[i], self.k[i], self.v[i], 0, self.cu, 0,
                                       seqused_k=self.kvl, block_table=self.bt, causal=True,
                                       out=self.out[i], scheduler_metadata=self.handle)
            else:
                self.attn.run(self.q[i], self.k[i], self.v[i], out=self.out[i])


STEPS = [  # (q_lens, kv_lens): mixes change between replays; 32 request slots
    ([200, 1, 1, 1, 3, 0, 1], [200, 900, 33, 2000, 57, 5, 16]),  # capture
    ([1] * 20, [i * 97 + 5 for i in range(20)]),  # decode only, longer contexts
    ([500, 300, 1, 1], [900, 300, 4000, 1]),  # prefill heavy, a split decode
    ([7, 1, 129, 1, 1, 1], [7, 1, 3000, 12, 600, 33]),
]


@pytest.mark.parametrize("compat", [False, True], ids=["run", "flash_attn_varlen_func"])
def test_graph_of_whole_steps_replays_like_eager(compat):
    podcute.invalidate_plans()
    st = Step(compat)
    st.load(*STEPS[0], seed=100)
    st.plan()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            st.forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st.forward()
    for j, (q_lens, kv_lens) in enumerate(STEPS):
        bs = st.load(q_lens, kv_lens, seed=200 + 10 * j)
        st.plan()
        st.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = st.out.clone()
        st.out.fill_(float("nan"))
        st.forward()  # eager, same plan
        torch.cuda.synchronize()
        n = sum(q_lens)
        assert torch.equal(replayed[:, :n], st.out[:, :n]), f"step {j}: replay != eager"
        assert replayed[:, n:].isnan().all(), f"step {j}: padding rows written"
        for i, b in enumerate(bs):
            check(replayed[i], None, b, n=n)


def test_vllm_serving_loop_numpy_buffers_alternating_layers_and_a_graph():
    """vLLM's CPU metadata: persistent NumPy buffers written through `.np` views, passed
    as fresh tensor slices each step; layers alternate a sliding window (64, 0) and full
    causal attention. Eager steps reuse each kind's plan by value across layers and replan
    after every in-place write; then a whole-step graph captured with each kind's named
    plan replays later steps after one flash_attn_varlen_plan per kind."""
    R, L, T, P = 16, 4, 512, 1200
    cu_np, kvl_np = np.zeros(R + 1, np.int32), np.zeros(R, np.int32)
    bt_np = np.zeros((R, 160), np.int32)
    kinds = [(64, 0), (-1, -1)] * (L // 2)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(L, T, HQ, D, **dev)
    k = torch.randn(L, P, PS, HKV, D, **dev)
    v = torch.randn(L, P, PS, HKV, D, **dev)
    out = torch.full((L, T, HQ, D), float("nan"), **dev)
    rng = np.random.default_rng(5)

    def load(q_lens, kv_lens):
        n = len(q_lens)
        cu_np[:] = 0
        kvl_np[:] = 0
        cu_np[1: n + 1] = np.cumsum(q_lens)
        cu_np[n + 1:] = cu_np[n]
        kvl_np[:n] = kv_lens
        bt_np[:] = rng.integers(0, P, size=bt_np.shape)  # (requests may share pages)
        q.normal_()
        return sum(q_lens)

    def meta():
        return (torch.from_numpy(cu_np), torch.from_numpy(kvl_np), torch.from_numpy(bt_np))

    def layer(i, cu, kvl, bt, handle=None):
        kw = {} if handle is None else dict(scheduler_metadata=handle)
        flash_attn_varlen_func(q[i], k[i], v[i], 0, cu, 0, seqused_k=kvl, block_table=bt,
                               causal=True, window_size=kinds[i], out=out[i], **kw)

    def reference(i, n):
        cu, kvl, bt = (t.clone().cuda() for t in meta())
        ref = podcute.pod_attention_reference(q[i, :n], k[i], v[i], cu_seqlens_q=cu,
                                              seqused_k=kvl, block_table=bt, causal=True,
                                              window_size=kinds[i])
        return ref

    steps = [([300, 1, 1, 7, 1], [300, 600, 33, 2000, 1]),
             ([1] * 12, [int(x) for x in rng.integers(1, 2500, 12)]),
             ([64, 1, 1, 2], [64, 2400, 17, 9])]
    for q_lens, kv_lens in steps:  # eager
        n = load(q_lens, kv_lens)
        out.fill_(float("nan"))
        for i in range(L):
            layer(i, *meta())
        for i in range(L):
            assert rel_l2(out[i, :n], reference(i, n)) <= 5e-3, f"eager step {q_lens}"
    # graph: each kind's plan named; per step one flash_attn_varlen_plan per kind
    handles = {}

    def plan_step():
        for w in set(kinds):
            handles[w] = flash_attn_varlen_plan(q[0], k[0], v[0], 0, *meta()[:1], 0,
                                                seqused_k=meta()[1], block_table=meta()[2],
                                                causal=True, window_size=w)

    load(*steps[0])
    plan_step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(L):
            layer(i, *meta(), handle=handles[kinds[i]])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(L):
            layer(i, *meta(), handle=handles[kinds[i]])
    for q_lens, kv_lens in steps[1:] + steps[:1]:
        n = load(q_lens, kv_lens)
        plan_step()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(L):
            assert rel_l2(out[i, :n], reference(i, n)) <= 5e-3, f"replayed step {q_lens}"
