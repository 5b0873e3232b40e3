"""The public edge on a CPU machine: every bad argument is reported as such (TypeError or
ValueError naming it) before any device check; a valid call without a Hopper GPU raises
the clear RuntimeError instead of falling back to the reference; the demo runs."""

import os
import subprocess
import sys

import pytest
import torch

import podcute
from podcute import PODAttention, PlanSummary, pod_attention

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_no_hopper = pytest.mark.skipif(HAS_HOPPER, reason="checks the no-GPU error path")

HQ, HKV, D, PS = 8, 2, 128, 16
I32 = dict(dtype=torch.int32)


def good(layout="NHD", dtype=torch.bfloat16):
    """A valid small batch: 2 requests (prefill 20 / kv 40, decode 1 / kv 17)."""
    q = torch.randn(21, HQ, D, dtype=dtype)
    shape = (8, PS, HKV, D) if layout == "NHD" else (8, HKV, PS, D)
    k = torch.randn(shape, dtype=dtype)
    v = torch.randn(shape, dtype=dtype)
    return dict(
        q=q, k=k, v=v,
        cu=torch.tensor([0, 20, 21], **I32),
        kvl=torch.tensor([40, 17], **I32),
        bt=torch.tensor([[0, 1, 2], [3, 4, 7]], **I32),
    )


def attn(**kw):
    kw.setdefault("device", "cpu")
    return PODAttention(HQ, HKV, D, PS, **kw)


def planned(layout="NHD", **kw):
    g = good(layout)
    a = attn(kv_layout=layout)
    a.plan(g["cu"], g["kvl"], block_table=g["bt"], **kw)
    return a, g


def raises(exc, *names):
    """pytest.raises whose message must mention every name."""
    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *a):
            r = self.ctx.__exit__(*a)
            if not r:  # another exception type: let it propagate as is
                return r
            msg = str(self.info.value)
            for n in names:
                assert n in msg, f"{n!r} not in error message: {msg}"
            return r
    return _Ctx()


# ---- constructor ---------------------------------------------------------------------------


def test_constructor_errors():
    with raises(ValueError, "num_qo_heads", "num_kv_heads"):
        PODAttention(12, 8, D, PS, device="cpu")
    with raises(NotImplementedError, "head_dim=84", "multiples of 8"):
        PODAttention(HQ, HKV, 84, PS, device="cpu")
    with raises(NotImplementedError, "head_dim=264", "up to 256"):
        PODAttention(HQ, HKV, 264, PS, device="cpu")
    # a head dim between the compiled tiles runs on the next one, its other columns zero
    narrow = PODAttention(HQ, HKV, 80, PS, device="cpu").planner.config.kernel
    assert (narrow.head_dim, narrow.head_dim_io, narrow.io_dim) == (96, 80, 80)
    for bad, err in ((0, ValueError), (-8, ValueError), (128.0, TypeError), (True, TypeError)):
        with raises(err, "head_dim"):
            PODAttention(HQ, HKV, bad, PS, device="cpu")
    with raises(NotImplementedError, "page_size=3", "supported"):
        PODAttention(HQ, HKV, D, 3, device="cpu")
    for bad, err in ((0, ValueError), (16.0, TypeError)):
        with raises(err, "page_size"):
            PODAttention(HQ, HKV, D, bad, device="cpu")
    with raises(ValueError, "kv_layout"):
        PODAttention(HQ, HKV, D, PS, kv_layout="NDH", device="cpu")
    with raises(TypeError, "dtype"):
        PODAttention(HQ, HKV, D, PS, dtype=torch.float32, device="cpu")
    with raises(TypeError, "num_kv_heads"):
        PODAttention(HQ, 2.0, D, PS, device="cpu")
    with raises(ValueError, "max_batch_size"):
        PODAttention(HQ, HKV, D, PS, device="cpu", max_batch_size=0)


@needs_no_hopper
@pytest.mark.skipif(torch.cuda.is_available(), reason="machine has CUDA")
def test_constructor_on_cuda_without_gpu():
    with raises(RuntimeError, "Hopper", "sm_90a", "found"):
        PODAttention(HQ, HKV, D, PS)


# ---- plan() ----------------------------------------------------------------------------------


def test_plan_returns_summary():
    a, g = planned()
    s = a.plan(g["cu"], g["kvl"], block_table=g["bt"])
    assert isinstance(s, PlanSummary)
    assert s.num_requests == 2 and s.num_decode_requests == 1 and s.num_prefill_requests == 1
    assert a.current_plan.total_q == 21


def test_plan_type_errors():
    a = attn()
    g = good()
    with raises(TypeError, "cu_seqlens_q", "int32"):
        a.plan(g["cu"].long(), g["kvl"], block_table=g["bt"])
    with raises(TypeError, "kv_lens", "int32"):
        a.plan(g["cu"], g["kvl"].float(), block_table=g["bt"])
    with raises(TypeError, "block_table", "int32"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"].long())
    with raises(TypeError, "kv_indptr", "int32"):
        a.plan(g["cu"], g["kvl"], kv_indptr=torch.tensor([0, 3, 5]),
               kv_indices=torch.arange(5, **I32))
    with raises(TypeError, "kv_indices", "int32"):
        a.plan(g["cu"], g["kvl"], kv_indptr=torch.tensor([0, 3, 5], **I32),
               kv_indices=torch.arange(5))
    with raises(TypeError, "last_page_len", "int32"):
        a.plan(g["cu"], None, kv_indptr=torch.tensor([0, 3, 5], **I32),
               kv_indices=torch.arange(5, **I32), last_page_len=torch.tensor([8, 1]))
    with raises(TypeError, "cu_seqlens_q"):
        a.plan([0, 20, 21], g["kvl"], block_table=g["bt"])
    with raises(TypeError, "sm_scale"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"], sm_scale="0.1")
    with raises(TypeError, "causal"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"], causal=None)


def test_plan_shape_and_format_errors():
    a = attn()
    g = good()
    with raises(ValueError, "cu_seqlens_q", "1-D"):
        a.plan(g["cu"][None], g["kvl"], block_table=g["bt"])
    with raises(ValueError, "kv_lens", "2 entries"):
        a.plan(g["cu"], torch.tensor([40], **I32), block_table=g["bt"])
    with raises(ValueError, "block_table", "2-D"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"].reshape(-1))
    with raises(ValueError, "block_table", "2 entries"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"][:1])
    with raises(ValueError, "block_table", "contiguous"):
        a.plan(g["cu"], g["kvl"], block_table=torch.zeros(3, 2, **I32).t())
    with raises(ValueError, "kv_indptr", "3 entries"):
        a.plan(g["cu"], g["kvl"], kv_indptr=torch.tensor([0, 5], **I32),
               kv_indices=torch.arange(5, **I32))
    with raises(ValueError, "page format", "block_table"):
        a.plan(g["cu"], g["kvl"])
    with raises(ValueError, "page format"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"], kv_indptr=torch.tensor([0, 3, 5], **I32),
               kv_indices=torch.arange(5, **I32))
    with raises(ValueError, "kv_lens", "last_page_len"):
        a.plan(g["cu"], None, block_table=g["bt"])
    with raises(ValueError, "last_page_len", "CSR"):
        a.plan(g["cu"], None, block_table=g["bt"], last_page_len=torch.tensor([8, 1], **I32))
    with raises(ValueError, "sm_scale"):
        a.plan(g["cu"], g["kvl"], block_table=g["bt"], sm_scale=-1.0)


def test_plan_value_errors():
    a = attn()
    g = good()
    with raises(ValueError, "cu_seqlens_q", "non-decreasing"):
        a.plan(torch.tensor([0, 21, 20], **I32), g["kvl"], block_table=g["bt"])
    with raises(ValueError, "cu_seqlens_q", "start at 0"):
        a.plan(torch.tensor([1, 20, 21], **I32), g["kvl"], block_table=g["bt"])
    with raises(ValueError, "kv_lens", ">= 0"):
        a.plan(g["cu"], torch.tensor([40, -1], **I32), block_table=g["bt"])
    with raises(ValueError, "kv_lens", "pages", "block_table"):  # 49 tokens need 4 pages of 16
        a.plan(g["cu"], torch.tensor([49, 17], **I32), block_table=g["bt"])
    with raises(ValueError, "kv_lens", "pages", "kv_indptr"):
        a.plan(g["cu"], g["kvl"], kv_indptr=torch.tensor([0, 2, 4], **I32),
               kv_indices=torch.arange(4, **I32))
    # causal with q_len 20 > kv_len 19: bottom-right aligned, the first row sees no key
    a.plan(g["cu"], torch.tensor([19, 17], **I32), block_table=g["bt"])
    a.plan(g["cu"], torch.tensor([19, 17], **I32), block_table=g["bt"], causal=False)
    with raises(ValueError, "block_table", "negative"):
        a.plan(g["cu"], g["kvl"], block_table=torch.tensor([[0, -1, 2], [3, 4, 5]], **I32))
    with raises(ValueError, "kv_indices", "negative"):
        a.plan(g["cu"], g["kvl"], kv_indptr=torch.tensor([0, 3, 5], **I32),
               kv_indices=torch.tensor([0, 1, 2, -3, 4], **I32))
    with raises(ValueError, "last_page_len", "page_size"):
        a.plan(g["cu"], None, kv_indptr=torch.tensor([0, 3, 5], **I32),
               kv_indices=torch.arange(5, **I32), last_page_len=torch.tensor([17, 1], **I32))


def test_failed_plan_leaves_no_stale_plan():
    a, g = planned()
    with pytest.raises(ValueError):
        a.plan(torch.tensor([0, 21, 20], **I32), g["kvl"], block_table=g["bt"])
    with raises(RuntimeError, "before plan"):
        a.run(g["q"], g["k"], g["v"])


def test_plan_with_csr_and_last_page_len():
    a = attn()
    s = a.plan(torch.tensor([0, 20, 21], **I32), None,
               kv_indptr=torch.tensor([0, 3, 5], **I32), kv_indices=torch.arange(5, **I32),
               last_page_len=torch.tensor([8, 1], **I32))
    assert s.num_requests == 2
    assert a.current_plan.kv_lens.tolist() == [40, 17]


# ---- run() -----------------------------------------------------------------------------------


def test_run_before_plan():
    g = good()
    with raises(RuntimeError, "before plan"):
        attn().run(g["q"], g["k"], g["v"])


def test_run_dtype_errors():
    a, g = planned()
    with raises(TypeError, "q", "bfloat16"):
        a.run(g["q"].half(), g["k"], g["v"])
    with raises(TypeError, "k_cache", "v_cache"):
        a.run(g["q"], g["k"].half(), g["v"])
    with raises(TypeError, "k_cache", "v_cache"):
        a.run(g["q"], g["k"], g["v"].float())
    with raises(TypeError, "q", "torch.Tensor"):
        a.run([1], g["k"], g["v"])
    with raises(TypeError, "out", "dtype"):
        a.run(g["q"], g["k"], g["v"], out=torch.empty(21, HQ, D, dtype=torch.float16))


def test_run_device_errors():
    a, g = planned()
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    with raises(ValueError, "k_cache", "device"):
        a.run(g["q"], meta(g["k"]), g["v"])
    with raises(ValueError, "q", "cpu"):
        a.run(meta(g["q"]), g["k"], g["v"])
    with raises(ValueError, "out"):
        a.run(g["q"], g["k"], g["v"], out=meta(g["q"]))
    with raises(ValueError, "cu_seqlens_q", "device"):
        a.plan(torch.tensor([0, 20, 21], dtype=torch.int32, device="meta"), g["kvl"],
               block_table=g["bt"])


def test_run_shape_errors():
    a, g = planned()
    q, k, v = g["q"], g["k"], g["v"]
    with raises(ValueError, "q", "num_qo_heads"):
        a.run(q[:, :4], k, v)
    with raises(ValueError, "q", "head_dim"):
        a.run(torch.randn(21, HQ, 64, dtype=q.dtype), k, v)
    with raises(ValueError, "q", "cu_seqlens_q", "21"):
        a.run(q[:20], k, v)
    with raises(ValueError, "k_cache", "NHD"):
        a.run(q, k.transpose(1, 2), v)  # an HND cache given to an NHD attention
    with raises(ValueError, "k_cache", "page_size"):
        a.run(q, k[:, :8], v[:, :8])
    with raises(ValueError, "k_cache"):
        a.run(q, k[0], v[0])
    with raises(ValueError, "v_cache", "k_cache"):
        a.run(q, k, v[:7])
    with raises(ValueError, "q", "contiguous last dimension"):
        a.run(torch.randn(21, D, HQ, dtype=q.dtype).transpose(1, 2), k, v)
    with raises(ValueError, "k_cache", "contiguous last dimension"):
        a.run(q, torch.randn(8, PS, D, HKV, dtype=q.dtype).transpose(2, 3), v)
    with raises(ValueError, "out", "[total_q, Hq, D]"):
        a.run(q, k, v, out=torch.empty(20, HQ, D, dtype=q.dtype))
    with raises(ValueError, "out", "contiguous"):
        a.run(q, k, v, out=torch.empty(21, D, HQ, dtype=q.dtype).transpose(1, 2))


def test_run_hnd_layout_shape():
    a, g = planned("HND")
    with raises(ValueError, "k_cache", "HND"):
        a.run(g["q"], g["k"].transpose(1, 2), g["v"])


def test_page_index_outside_cache():
    """Security boundary: a page index >= num_pages is refused at run (O(1) check)."""
    a, g = planned()
    q, k, v = g["q"], g["k"], g["v"]
    with raises(ValueError, "block_table", "request 1", "page 4", "k_cache"):
        a.run(q, k[:4], v[:4])  # request 1 reads pages 3, 4 of a 4-page cache
    if not HAS_HOPPER:  # the table's column 2 of request 1 (page 7) is never read
        with raises(RuntimeError, "Hopper"):
            a.run(q, k[:5], v[:5])
    # unused columns of the table may hold anything
    bt = torch.tensor([[0, 1, 2, 99], [3, 4, 5, -7]], **I32)
    a.plan(g["cu"], g["kvl"], block_table=bt)
    if not HAS_HOPPER:
        with raises(RuntimeError, "Hopper"):
            a.run(q, k[:6], v[:6])  # passes validation, stops at the GPU check
    a.plan(g["cu"], g["kvl"], kv_indptr=torch.tensor([0, 3, 5], **I32),
           kv_indices=torch.tensor([0, 1, 2, 3, 8], **I32))
    with raises(ValueError, "kv_indices", "page 8"):
        a.run(q, k, v)


@needs_no_hopper
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_run_without_hopper_raises_clearly(layout, monkeypatch):
    """A fully valid call on a machine without an sm_90 GPU must not fall back to the
    reference: it raises the RuntimeError naming what is needed."""
    import podcute.reference as ref

    def boom(*a, **k):
        raise AssertionError("silent fallback to the reference")

    monkeypatch.setattr(ref, "pod_attention_reference", boom)
    a, g = planned(layout)
    with raises(RuntimeError, "podcute needs an NVIDIA GPU it has a kernel for",
                "sm_90a (Hopper: H100/H200)", "sm_80 (A100/A30)", "found"):
        a.run(g["q"], g["k"], g["v"])
    with raises(RuntimeError, "Hopper"):
        a.run(g["q"], g["k"], g["v"], out=torch.empty_like(g["q"]), return_lse=True)


# ---- one-shot ----------------------------------------------------------------------------------


def test_one_shot_errors_and_no_hopper():
    g = good()
    kw = dict(cu_seqlens_q=g["cu"], seqused_k=g["kvl"], block_table=g["bt"])
    with raises(ValueError, "kv_layout"):
        pod_attention(g["q"], g["k"], g["v"], kv_layout="XYZ", **kw)
    with raises(TypeError, "q", "bfloat16"):
        pod_attention(g["q"].float(), g["k"], g["v"], **kw)
    with raises(NotImplementedError, "head_dim"):
        pod_attention(torch.randn(21, HQ, 84, dtype=torch.bfloat16),
                      torch.randn(8, PS, HKV, 84, dtype=torch.bfloat16),
                      torch.randn(8, PS, HKV, 84, dtype=torch.bfloat16), **kw)
    with raises(RuntimeError, "GPU"):  # head dim 80 is served: checked, then the device
        pod_attention(torch.randn(21, HQ, 80, dtype=torch.bfloat16),
                      torch.randn(8, PS, HKV, 80, dtype=torch.bfloat16),
                      torch.randn(8, PS, HKV, 80, dtype=torch.bfloat16), **kw)
    with raises(NotImplementedError, "page_size"):
        pod_attention(g["q"], g["k"][:, :3], g["v"][:, :3], **kw)
    with raises(ValueError, "heads"):
        pod_attention(g["q"][:, :3], g["k"], g["v"], **kw)
    with raises(ValueError, "seqused_k", "pages"):
        pod_attention(g["q"], g["k"], g["v"], cu_seqlens_q=g["cu"],
                      seqused_k=torch.tensor([49, 17], **I32), block_table=g["bt"])
    with raises(TypeError, "seqused_k", "int32"):
        pod_attention(g["q"], g["k"], g["v"], cu_seqlens_q=g["cu"], seqused_k=g["kvl"].long(),
                      block_table=g["bt"])
    with raises(ValueError, "q", "21"):
        pod_attention(g["q"][:19], g["k"], g["v"], **kw)
    if not HAS_HOPPER:
        with raises(RuntimeError, "Hopper"):
            pod_attention(g["q"], g["k"], g["v"], **kw)


def test_exports():
    for name in ("PODAttention", "pod_attention", "pod_attention_reference", "PlanSummary"):
        assert name in podcute.__all__ and hasattr(podcute, name)


# ---- demo ----------------------------------------------------------------------------------------


@needs_no_hopper
def test_demo_runs_on_cpu():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "podcute", "demo"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "sm_90" in r.stdout and "H100/H200" in r.stdout
    assert "129 requests (1 prefill, 128 decode)" in r.stdout
    assert "balance" in r.stdout and "predicted" in r.stdout



def test_run_fast_path_never_passes_a_bad_call():
    """run()'s one-pass check (_common_case) may only say yes to calls the detailed checks
    (_validate_run) accept: random good and bad q / cache / out variants."""
    import random

    rng = random.Random(0)
    a = attn()
    g = good()
    a.plan(g["cu"], g["kvl"], block_table=g["bt"])
    plan = a.current_plan
    pool = torch.randn(64 * 1024, dtype=torch.bfloat16)

    def variant(base, kind):
        if kind == "ok":
            return base
        if kind == "dtype":
            return base.half()
        if kind == "transposed":  # last dim not contiguous
            return base.transpose(-1, -2).contiguous().transpose(-1, -2)
        if kind == "misaligned":  # a row stride that is not a multiple of 8 elements
            flat = torch.empty(base.numel() + base.shape[0] * 4, dtype=base.dtype)
            st = list(base.stride())
            st[0] += 4 if base.dim() == 3 else 0
            return flat.as_strided(base.shape, st)
        if kind == "offset":  # data pointer not 16-byte aligned
            flat = torch.empty(base.numel() + 8, dtype=base.dtype)
            return flat[1: 1 + base.numel()].view(base.shape)
        if kind == "shape":
            return base[:-1]
        if kind == "empty":
            return base[:0]
        raise AssertionError(kind)

    kinds = ["ok"] * 6 + ["dtype", "transposed", "misaligned", "offset", "shape", "empty"]
    checked = passed = 0
    for _ in range(400):
        q = variant(g["q"], rng.choice(kinds))
        k = variant(g["k"], rng.choice(kinds))
        v = k if rng.random() < 0.2 else variant(g["v"], rng.choice(kinds))
        out = None
        r = rng.random()
        if r < 0.3:
            out = variant(torch.empty_like(g["q"]), rng.choice(kinds))
        elif r < 0.4:
            out = q  # in place: overlaps q
        elif r < 0.5:
            out = pool[: g["q"].numel()].view(g["q"].shape) if rng.random() < 0.5 else \
                torch.empty(1, HQ, D, dtype=torch.bfloat16).expand(g["q"].shape)
        fast = a._common_case(plan, q, k, v, out)
        try:
            a._validate_run(plan, q, k, v, out)
            valid = True
        except (TypeError, ValueError):
            valid = False
        checked += 1
        passed += fast
        assert valid or not fast, (q.shape, q.stride(), k.shape, None if out is None else
                                   (out.shape, out.stride()))
    assert checked == 400 and passed > 20


# ---- architectures ---------------------------------------------------------------------------


def test_arch_option_selects_the_kernel_family():
    """arch= (or PODCUTE_ARCH) picks the kernel the plan is made for: the warp-level
    kernel's 64-row decode items and its 2 CTAs an SM, or sm_90a's 128-row items on one."""
    from podcute.kernels.config import SUPPORTED_ARCHS, WARP_MMA_ARCHS, WIDE_PREFILL_ARCHS

    hopper = PODAttention(HQ, HKV, D, PS, device="cpu")
    assert hopper.arch == "sm_90a" and hopper.planner.config.kernel.tile_m_prefill == 128
    for arch in WARP_MMA_ARCHS:
        a = PODAttention(HQ, HKV, D, PS, device="cpu", arch=arch)
        k = a.planner.config.kernel
        assert a.arch == arch and k.warp_mma and k.arch == arch
        assert (k.tile_m_decode, k.num_threads, k.ctas_per_sm) == (64, 128, 2)
        # 128-row prefill items where measured (D 128's Q tile fits there: config.py)
        assert k.tile_m_prefill == (128 if arch in WIDE_PREFILL_ARCHS else 64), arch
        assert a.planner.grid == 2 * a.planner.num_sms
    with raises(ValueError, "arch must be one of", *SUPPORTED_ARCHS):
        PODAttention(HQ, HKV, D, PS, device="cpu", arch="sm_100a")
    with raises(NotImplementedError, "head_dim 256 has no kernel on sm_80"):
        PODAttention(HQ, HKV, 256, PS, device="cpu", arch="sm_80")
    with raises(NotImplementedError, "fp8 KV caches need the sm_90a kernel"):
        PODAttention(HQ, HKV, D, PS, device="cpu", arch="sm_86", kv_dtype=torch.float8_e4m3fn)


def test_arch_from_the_environment(monkeypatch):
    monkeypatch.setenv("PODCUTE_ARCH", "sm_90")
    assert PODAttention(HQ, HKV, D, PS, device="cpu").arch == "sm_90"
    assert PODAttention(HQ, HKV, D, PS, device="cpu", arch="sm_90a").arch == "sm_90a"
    monkeypatch.setenv("PODCUTE_ARCH", "hopper")
    with raises(ValueError, "arch must be one of", "'hopper'"):
        PODAttention(HQ, HKV, D, PS, device="cpu")


def test_arch_compatibility_rule():
    from podcute.launch import ARCH_OF_CAPABILITY, runs_on

    assert runs_on("sm_90a", (9, 0)) and runs_on("sm_90", (9, 0))
    assert runs_on("sm_80", (8, 6)) and runs_on("sm_86", (8, 9)) and runs_on("sm_80", (8, 0))
    assert not runs_on("sm_86", (8, 0)) and not runs_on("sm_80", (9, 0))
    assert not runs_on("sm_90a", (10, 0)) and not runs_on("sm_120a", (12, 1))
    for cap, arch in ARCH_OF_CAPABILITY.items():
        assert runs_on(arch, cap)


@needs_no_hopper
def test_run_of_a_portable_plan_without_its_gpu_raises_clearly():
    a = PODAttention(HQ, HKV, D, PS, device="cpu", arch="sm_80")
    a.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
           block_table=torch.arange(3, dtype=torch.int32)[None])
    q = torch.randn(3, HQ, D, dtype=torch.bfloat16)
    k = torch.randn(3, PS, HKV, D, dtype=torch.bfloat16)
    with raises(RuntimeError, "podcute needs an NVIDIA GPU it has a kernel for", "found"):
        a.run(q, k, k.clone())


def test_second_cache_run_checks(launches):
    # run(_second_cache=(k2, v2)) (podcute.compat's BatchPOD): the second cache gets run()'s
    # checks under its own name, each request's pages are checked against its own cache,
    # lse may overlap neither cache, and fp8 PODAttentions have no second-cache variant.
    g = good()
    a = attn()
    a.plan(g["cu"], g["kvl"], block_table=g["bt"], _second_cache_requests=1)
    k2, v2 = torch.randn(3, PS, HKV, D, dtype=torch.bfloat16), torch.randn(3, PS, HKV, D,
                                                                         dtype=torch.bfloat16)
    a.run(g["q"], g["k"], g["v"], _second_cache=(k2, v2))  # request 0: pages 0-2 of k2
    assert launches[-1][6]["second_cache"] == (k2, v2)
    with raises(ValueError, "request 0", "page 2", "second cache", "only 2 pages"):
        a.run(g["q"], g["k"], g["v"], _second_cache=(k2[:2], v2[:2]))
    with raises(ValueError, "request 1", "page 4", "first cache", "only 4 pages"):
        a.run(g["q"], g["k"][:4], g["v"][:4], _second_cache=(k2, v2))
    with raises(TypeError, "the second k cache"):
        a.run(g["q"], g["k"], g["v"], _second_cache=(k2.half(), v2.half()))
    with raises(TypeError, "_second_cache", "tuple"):
        a.run(g["q"], g["k"], g["v"], _second_cache=[k2, v2])
    lse = k2.view(torch.float32).view(-1)[: 21 * HQ].view(21, HQ)
    with raises(ValueError, "lse overlaps", "the second k cache"):
        a.run(g["q"], g["k"], g["v"], lse=lse, _second_cache=(k2, v2))
    fp8 = attn(kv_dtype=torch.float8_e4m3fn)
    fp8.plan(g["cu"], g["kvl"], block_table=g["bt"], _second_cache_requests=1)
    k8 = g["k"].to(torch.float8_e4m3fn)
    with raises(ValueError, "second cache", "16-bit"):
        fp8.run(g["q"], k8, k8, _second_cache=(k8, k8))
