"""``flash_attn_varlen_func`` with FlashAttention's varlen signature, served by podcute.

The positional order after ``q, k, v`` is vLLM's fork's (``max_seqlen_q, cu_seqlens_q,
max_seqlen_k, cu_seqlens_k, seqused_k, ...``), which is how vLLM's FlashAttention backend
calls it; a call in upstream FlashAttention 2/3/4's order (``cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k``: a tensor where vLLM has an int) is recognised by the type
of the fourth argument. Every argument name of those versions is accepted
(``block_table`` or ``page_table``, ``return_softmax_lse`` or ``return_lse``).

Two KV forms, as in FlashAttention:

- paged: ``block_table`` [B, max_blocks] int32 with ``k``/``v`` caches
  [num_blocks, block_size, Hkv, D] and the KV lengths in ``seqused_k`` (or, upstream
  style, ``cu_seqlens_k``);
- contiguous varlen: ``k``/``v`` [total_k, Hkv, D] with ``cu_seqlens_k``; served as pages
  of one token (the kernel's gathered-page class).

Returns ``out`` [total_q, Hq, D], or ``(out, softmax_lse)`` with ``softmax_lse``
[Hq, total_q] float32 (natural log; FlashAttention's varlen layout; rows of padding
tokens past ``cu_seqlens_q[-1]`` are left unwritten, as FlashAttention leaves them).

Plans are reused across the layers of a step (``podcute.reuse``): the first call with a
step's metadata plans (one device-to-host copy if the index tensors are on the GPU), the
next calls with the same, unchanged tensors only launch.

``window_size`` (sliding window, ``None`` or -1 = unbounded on a side), ``softcap`` and
``s_aux`` (vLLM's name for gpt-oss's attention sinks, float32 [Hq]) are served as
podcute's ``window_size``, ``softcap`` and ``sinks``.
fp8 KV caches (``k``/``v`` in ``torch.float8_e4m3fn`` or ``float8_e5m2``, e.g. vLLM's
cache viewed as fp8) take 16-bit queries; ``k_descale`` / ``v_descale`` are their
dequantisation scales, as in FlashAttention 3: float32 [B, Hkv] (per request and KV head),
served when they do not vary across requests, i.e. the batch stride is 0 as in vLLM's
``layer._k_scale.expand(descale_shape)`` (also accepted: [Hkv], [1], [] tensors; None =
1.0). The values stay on the device (graph replays see new ones). As in FlashAttention 3,
descale factors of a 16-bit input do nothing: ``q_descale`` with 16-bit queries (podcute's
only queries) and ``k_descale``/``v_descale`` with a 16-bit cache are accepted and unused.
Arguments that change results and that podcute does not implement raise
``NotImplementedError`` naming them: ``dropout_p > 0``, ``alibi_slopes``,
``return_attn_probs``, ``q_v``, descales that differ per request, ``seqused_q``, context
parallelism.
Arguments that only tune speed (``num_splits``, ``scheduler_metadata``, ``pack_gqa``,
``deterministic``, ``fa_version``, ``sm_margin``) are accepted and do not change the
result: podcute's planner chooses its own splits, and its forward pass is deterministic
for a given batch.
"""

from __future__ import annotations

import numpy as np
import torch

from podcute.api import one_shot_fast, one_shot_for

__all__ = ["flash_attn_varlen_func", "flash_attn_varlen_plan"]

_WHERE = "flash_attn_varlen_func: "


def _unsupported(name: str, value, why: str) -> None:
    raise NotImplementedError(f"flash_attn_varlen_func: {name}={value!r} is not supported by "
                              f"podcute ({why})")


def _window(window_size) -> tuple:
    """FlashAttention's window_size (None, or a pair whose sides may be None) as
    podcute's (left, right), -1 = unbounded."""
    if window_size is None:
        return (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{_WHERE}window_size must be a pair (left, right), got {window_size!r}")
    return tuple(-1 if side is None else side for side in window_size)


def _check_semantics(dropout_p, alibi_slopes, return_attn_probs, q_v, seqused_q,
                     cp_world_size, cp_rank, cp_tot_seqused_k) -> None:
    """Refuse every argument that would change the result and that podcute lacks."""
    if not (dropout_p or return_attn_probs or alibi_slopes is not None or q_v is not None
            or seqused_q is not None or cp_tot_seqused_k is not None
            or cp_world_size != 1 or cp_rank != 0):
        return  # every layer's call: nothing to refuse (skips building the table below)
    if dropout_p:
        _unsupported("dropout_p", dropout_p, "inference attention: dropout must be 0")
    for name, value, why in (
            ("alibi_slopes", alibi_slopes, "no ALiBi"),
            ("q_v", q_v, "no separate value-query (MLA) input"),
            ("seqused_q", seqused_q, "query lengths come from cu_seqlens_q"),
            ("cp_tot_seqused_k", cp_tot_seqused_k, "no context parallelism")):
        if value is not None:
            _unsupported(name, "<tensor>" if isinstance(value, torch.Tensor) else value, why)
    if return_attn_probs:
        _unsupported("return_attn_probs", return_attn_probs, "attention probabilities are "
                     "never materialised; use return_softmax_lse")
    if cp_world_size != 1 or cp_rank != 0:
        _unsupported("cp_world_size", cp_world_size, "no context parallelism")


def _descale(name: str, d, fp8: bool):
    """A FlashAttention-3 descale argument as run()'s k_scale/v_scale: None for a 16-bit
    input (where FlashAttention ignores it too), else a float32 [Hkv] or [1] view of the
    caller's tensor (never a copy: its values may change between graph replays)."""
    if d is None:
        return None
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{_WHERE}{name} must be a float32 tensor or None, got "
                        f"{type(d).__name__}")
    if not fp8:
        return None
    if d.dim() > 2:
        raise ValueError(f"{_WHERE}{name} must be [batch_size, num_kv_heads], [num_kv_heads], "
                         f"[1] or [], got shape {tuple(d.shape)}")
    if d.dim() == 2:
        # [B, Hkv]: one row serves every request only if the rows are one memory row
        if d.shape[0] > 1 and d.stride(0) != 0:
            _unsupported(name, "<tensor>", "descale factors that differ per request; pass one "
                         "row for all, e.g. scale.expand(batch_size, num_kv_heads), or a "
                         "[num_kv_heads] tensor")
        if d.shape[0] == 0:
            return None  # no requests
        d = d[0]
    if d.dim() == 1 and d.shape[0] > 1 and d.stride(0) == 0:
        d = d[:1]  # one scale for every head
    return d  # run() checks dtype, shape, device and alignment, naming k_scale/v_scale


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn_varlen_func: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"flash_attn_varlen_func: {name} must be {ndim}-D, got shape "
                         f"{tuple(t.shape)}")


def _check_indptr(cu_seqlens_k) -> None:
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1:
        raise TypeError("flash_attn_varlen_func: cu_seqlens_k must be a 1-D int32 tensor")
    if cu_seqlens_k.dtype != torch.int32:
        raise TypeError(f"flash_attn_varlen_func: cu_seqlens_k must be int32, got "
                        f"{cu_seqlens_k.dtype}")


_TOKEN_PAGES = np.zeros(0, dtype=np.int32)


def _token_pages(num_tokens: int) -> np.ndarray:
    """0 .. num_tokens-1 as int32 (the page list of contiguous K/V seen as 1-token pages):
    a view of one host array that grows to the largest call, so plan() copies nothing
    back from the device and a serving loop's varying sizes keep no arrays alive."""
    global _TOKEN_PAGES
    if _TOKEN_PAGES.size < num_tokens:
        _TOKEN_PAGES = np.arange(max(num_tokens, 2 * _TOKEN_PAGES.size), dtype=np.int32)
    return _TOKEN_PAGES[:num_tokens]


def flash_attn_varlen_func(q, k, v, max_seqlen_q=None, cu_seqlens_q=None, max_seqlen_k=None,
                           cu_seqlens_k=None, seqused_k=None, q_v=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None, return_softmax_lse=False, out=None,
                           scheduler_metadata=None, q_descale=None, k_descale=None,
                           v_descale=None, num_splits=0, fa_version=2, s_aux=None,
                           cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, *,
                           page_table=None, seqused_q=None, return_lse=None, pack_gqa=None,
                           sm_margin=0):
    """Varlen attention over a paged (or contiguous) KV cache (module docstring)."""
    if return_lse is not None:
        return_softmax_lse = bool(return_lse)
    if (block_table is not None and seqused_k is not None and page_table is None
            and cu_seqlens_k is None and type(max_seqlen_q) is int and max_seqlen_q >= 0
            and type(max_seqlen_k) is int and max_seqlen_k >= 0 and not dropout_p
            and q_v is None and alibi_slopes is None and not return_attn_probs
            and seqused_q is None and cp_world_size == 1 and cp_rank == 0
            and cp_tot_seqused_k is None and (causal is True or causal is False)
            and (q_descale is None or type(q_descale) is torch.Tensor)):
        # A layer's call in vLLM's form (each test above is one _Call.of would pass):
        # launch straight away if the last paged call's plan serves it.
        att = one_shot_fast(_LAST, "paged", (cu_seqlens_q, seqused_k, None, block_table),
                            _scalars(causal, softmax_scale, window_size, softcap), q, k, v,
                            out)
        if att is not None:
            return _run(att, att._plan, q, k, v, out, s_aux, return_softmax_lse,
                        _descale("k_descale", k_descale, att.fp8),
                        _descale("v_descale", v_descale, att.fp8))
    call = _Call.of(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k,
                    seqused_k, q_v, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, return_attn_probs, block_table, q_descale, k_descale,
                    v_descale, cp_world_size, cp_rank, cp_tot_seqused_k, page_table,
                    seqused_q)
    att = call.plan()
    plan = att.current_plan
    att._check_tensors(plan, q, call.k_cache, call.v_cache, out)
    res = _run(att, plan, q, call.k_cache, call.v_cache, out, s_aux, return_softmax_lse,
               call.scales.get("k_scale"), call.scales.get("v_scale"))
    if block_table is not None:
        _LAST["paged"] = (att, call.planner)
    return res


# "paged" -> the (PODAttention, CallPlanner) of the last paged call that launched.
_LAST: dict = {}


def _scalars(causal, softmax_scale, window_size, softcap) -> tuple:
    """What besides the index tensors a call's plan depends on (the page size and form
    are the attention's and the index tuple's)."""
    return (causal, softmax_scale, _window(window_size), 0.0 if softcap is None else softcap)


def _run(att, plan, q, k_cache, v_cache, out, s_aux, return_softmax_lse, k_scale, v_scale):
    """The launch once q, the caches and out passed run()'s checks; FlashAttention's
    returns (softmax_lse [Hq, total_q])."""
    if not return_softmax_lse:
        return att._run_checked(plan, q, k_cache, v_cache, out, False, None, s_aux, k_scale,
                                v_scale)
    lse = torch.empty(att.num_qo_heads, q.shape[0], dtype=torch.float32, device=q.device)
    out, _ = att._run_checked(plan, q, k_cache, v_cache, out, True, lse.t(), s_aux, k_scale,
                              v_scale)
    return out, lse


def flash_attn_varlen_plan(q, k, v, max_seqlen_q=None, cu_seqlens_q=None, max_seqlen_k=None,
                           cu_seqlens_k=None, seqused_k=None, softmax_scale=None, causal=False,
                           block_table=None, *, page_table=None, window_size=None, softcap=0.0,
                           **unused) -> None:
    """Plan the batch of a coming `flash_attn_varlen_func` call without launching it:
    what an engine calls once per step before replaying a CUDA graph that captured the
    step's calls (the replayed launches read the plan of the latest call or this one;
    the captured calls themselves plan nothing while their metadata is unchanged). Takes
    the same arguments; `q`, `k`, `v` give shapes, dtype and device only."""
    _Call.of(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
             None, 0.0, softmax_scale, causal, window_size, softcap, None, False, block_table,
             None, None, None, 1, 0, None, page_table, None).plan()


class _Call:
    """One call's arguments mapped onto podcute: the caches as the kernel reads them, the
    one-shot PODAttention of the configuration, and how to plan the batch."""

    def __init__(self, att, planner, k_cache, v_cache, scales, index_args, scalars, plan_fn):
        self.att, self.planner = att, planner
        self.k_cache, self.v_cache = k_cache, v_cache
        self.scales = scales  # run()'s k_scale / v_scale keywords (fp8 caches)
        self._index_args, self._scalars, self._plan_fn = index_args, scalars, plan_fn

    def plan(self):
        """Plan (or reuse the plan of the same metadata: podcute.reuse); the attention."""
        self.planner.plan(self._index_args, self._scalars, self._plan_fn)
        return self.att

    @staticmethod
    def of(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, q_v,
           dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           return_attn_probs, block_table, q_descale, k_descale, v_descale, cp_world_size,
           cp_rank, cp_tot_seqused_k, page_table, seqused_q) -> "_Call":
        if isinstance(max_seqlen_q, torch.Tensor):
            # Upstream order: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k).
            (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) = (
                max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k)
        if page_table is not None:
            if block_table is not None:
                raise ValueError("flash_attn_varlen_func: pass block_table or page_table, "
                                 "not both")
            block_table = page_table
        _check_semantics(dropout_p, alibi_slopes, return_attn_probs, q_v, seqused_q,
                         cp_world_size, cp_rank, cp_tot_seqused_k)
        _descale("q_descale", q_descale, fp8=False)  # its type only: 16-bit queries
        window = _window(window_size)
        softcap = 0.0 if softcap is None else softcap
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer))
                                  or m < 0):
                raise TypeError(f"flash_attn_varlen_func: {name} must be a non-negative int, got "
                                f"{m!r}")
        if cu_seqlens_q is None:
            raise ValueError("flash_attn_varlen_func: cu_seqlens_q is required")
        _check_tensor("q", q, 3)
        if not isinstance(causal, bool):
            raise TypeError(f"flash_attn_varlen_func: causal must be a bool, got "
                            f"{type(causal).__name__}")

        if block_table is not None:
            # Paged: caches [num_blocks, block_size, Hkv, D], lengths in seqused_k (vLLM) or
            # cu_seqlens_k (upstream FlashAttention 2).
            _check_tensor("k", k, 4)
            _check_tensor("v", v, 4)
            if (seqused_k is None) == (cu_seqlens_k is None):
                raise ValueError("flash_attn_varlen_func: with block_table pass exactly one of "
                                 "seqused_k or cu_seqlens_k (the KV lengths)")
            k_cache, v_cache = k, v
            if seqused_k is None:
                _check_indptr(cu_seqlens_k)
            pages = dict(block_table=block_table)
            index_args = (cu_seqlens_q, seqused_k, cu_seqlens_k, block_table)
        else:
            # Contiguous varlen K/V [total_k, Hkv, D]: pages of one token, CSR indices 0..n-1.
            _check_tensor("k", k, 3)
            _check_tensor("v", v, 3)
            if cu_seqlens_k is None or seqused_k is not None:
                raise ValueError("flash_attn_varlen_func: without block_table pass cu_seqlens_k "
                                 "(contiguous K/V) and no seqused_k")
            _check_indptr(cu_seqlens_k)
            k_cache, v_cache = k.unsqueeze(1), v.unsqueeze(1)
            pages = dict(kv_indptr=cu_seqlens_k, kv_indices=_token_pages(k.shape[0]))
            index_args = (cu_seqlens_q, cu_seqlens_k)

        att, planner = one_shot_for(q, k_cache, v_cache, "NHD", where=_WHERE,
                                    names=("q", "k", "v"))
        scales = {}
        if k_descale is not None or v_descale is not None:
            scales = dict(k_scale=_descale("k_descale", k_descale, att.fp8),
                          v_scale=_descale("v_descale", v_descale, att.fp8))

        def plan():
            # KV lengths from seqused_k, else from cu_seqlens_k (a device op when it lives
            # there: done only when a call plans, and read back in plan()'s one copy).
            kv_lens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            att.plan(cu_seqlens_q, kv_lens, causal=causal, sm_scale=softmax_scale,
                     window_size=window, softcap=softcap, _kv_name="seqused_k", **pages)

        return _Call(att, planner, k_cache, v_cache, scales, index_args,
                     _scalars(causal, softmax_scale, window_size, softcap), plan)
