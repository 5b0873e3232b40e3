"""``flash_attn_varlen_func`` with FlashAttention's varlen signatures, served by podcute.

One function takes the calls of every FlashAttention flavour an engine or its tests use:

- vLLM's fork (``vllm_flash_attn``): ``(q, k, v, max_seqlen_q, cu_seqlens_q,
  max_seqlen_k, cu_seqlens_k, seqused_k, q_v, dropout_p, softmax_scale, causal,
  window_size, ...)``, how vLLM's FlashAttention backend calls it; returns ``out``, or
  ``(out, softmax_lse)`` with ``return_softmax_lse``;
- upstream FlashAttention 2, 3 and 4, whose fourth argument is ``cu_seqlens_q`` (a
  tensor where vLLM has an int) and whose orders part after ``max_seqlen_k`` (FA2:
  ``dropout_p, softmax_scale, causal, window_size, ...``; FA3: ``seqused_q, seqused_k,
  softmax_scale, causal, qv, ...``: :data:`ORDERS`). FlashAttention 4's fourth argument is
  ``qv``, so its calls name their arguments; a call with a keyword only FA4 has
  (``learnable_sink``, ``return_lse``, ``min_seqlen_k``, ...) returns ``(out, lse)`` as FA4
  does. For an exact
  signature import :func:`flash_attn2_varlen_func`, :func:`flash_attn3_varlen_func`
  or :func:`flash_attn4_varlen_func`.

Every keyword of those versions is accepted (``block_table``/``page_table``,
``q_v``/``qv``, ``s_aux``/``learnable_sink`` (attention sinks), ``return_softmax_lse``/
``return_lse``); an unknown keyword raises TypeError, as Python does. Two KV forms:

- paged: ``block_table`` [B, max_blocks] int32 with caches [num_blocks, block_size,
  Hkv, D] and the KV lengths in ``seqused_k`` (or, FA2 style, ``cu_seqlens_k``);
- contiguous varlen: ``k``/``v`` [total_k, Hkv, D] with ``cu_seqlens_k`` (and, as
  FlashAttention 3 allows, ``seqused_k`` rows used from each offset); served as pages of
  one token (the kernel's gathered-page class).

FlashAttention 3's ``seqused_q`` (request i uses its first ``seqused_q[i]`` rows) is
served by planning each request's unused rows as a request with no KV (they get 0 and
-inf; FlashAttention leaves them unwritten).

``softmax_lse`` is [Hq, total_q] float32 (natural log; FlashAttention's varlen layout;
rows of padding tokens past ``cu_seqlens_q[-1]`` are left unwritten).

Plan reuse (``podcute.one_shot``): a call reuses the last plan only when its index tensors
are on the CPU and hold the same values, or when it names the plan: pass
``scheduler_metadata=flash_attn_varlen_plan(...)`` (FlashAttention 3's argument), made once
per step with the step's metadata. Index tensors on the device without that handle plan
every call (one device-to-host copy): correct, not fast. Under CUDA-graph capture a call
that would plan raises RuntimeError naming the handle.

``window_size`` (a pair of ints or a two-element tensor; ``None`` or -1 = unbounded on a
side), ``softcap`` and the sinks are served as podcute's ``window_size``, ``softcap`` and
``sinks`` (cast to float32). fp8 KV caches (``k``/``v`` in ``torch.float8_e4m3fn`` or
``float8_e5m2``) take 16-bit queries; ``k_descale``/``v_descale`` are their
dequantisation scales, as in FlashAttention 3: float32 [B, Hkv], served when they do not
vary across requests (batch stride 0, as vLLM's ``layer._k_scale.expand(B, Hkv)``; also
[Hkv], [1], []). As in FlashAttention 3, descales of a 16-bit input do nothing.
Arguments that change results and that podcute does not implement raise
``NotImplementedError`` naming them (docs/integration.md lists them); arguments that only
tune speed (``num_splits``, ``pack_gqa``, ``deterministic``, ``fa_version``,
``sm_margin``, a tensor ``scheduler_metadata``) are accepted and change nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from podcute.checks import check_sm_scale
from podcute.one_shot import StepPlan, one_shot_fast, one_shot_for
from podcute.planning import PlanOptions, host_arrays

__all__ = ["flash_attn_varlen_func", "flash_attn_varlen_plan", "flash_attn2_varlen_func",
           "flash_attn3_varlen_func", "flash_attn4_varlen_func", "ORDERS", "StepPlan"]

_WHERE = "flash_attn_varlen_func: "

# The positional order after (q, k, v) of each flavour's flash_attn_varlen_func.
ORDERS = {
    "vllm": ("max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "cu_seqlens_k", "seqused_k",
             "q_v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
             "alibi_slopes", "deterministic", "return_attn_probs", "block_table",
             "return_softmax_lse", "out", "scheduler_metadata", "q_descale", "k_descale",
             "v_descale", "num_splits", "fa_version", "s_aux", "cp_world_size", "cp_rank",
             "cp_tot_seqused_k"),
    "fa2": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
            "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
            "deterministic", "return_attn_probs", "block_table"),
    "fa3": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q",
            "seqused_k", "softmax_scale", "causal", "qv", "q_descale", "k_descale",
            "v_descale", "window_size", "attention_chunk", "softcap", "num_splits",
            "pack_gqa", "deterministic", "sm_margin", "return_attn_probs"),
    "fa4": ("qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
            "min_seqlen_k", "seqused_q", "seqused_k", "gather_kv_indices", "page_table",
            "softmax_scale", "causal", "window_size", "learnable_sink", "softcap",
            "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd",
            "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars", "return_lse",
            "scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata"),
}

# Every keyword any flavour takes, with its "feature off" default. Aliases map to one
# name below (_ALIASES).
_DEFAULTS = dict(
    max_seqlen_q=None, cu_seqlens_q=None, max_seqlen_k=None, cu_seqlens_k=None,
    seqused_k=None, seqused_q=None, q_v=None, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
    scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None, num_splits=0,
    fa_version=2, s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
    attention_chunk=0, pack_gqa=None, sm_margin=0, score_mod=None, aux_tensors=None,
    mask_mod=None, block_sparse_tensors=None, output_scale=None, aux_tensor_leading_dims=None,
    dynamic_causal=False, min_seqlen_k=None, gather_kv_indices=None, score_mod_bwd=None,
    aux_scalars=None, seqlen_k_per_split=None, disable_scheduler_metadata=False)
_ALIASES = {"page_table": "block_table", "qv": "q_v", "learnable_sink": "s_aux",
            "return_lse": "return_softmax_lse"}
# Keywords only FlashAttention 4 has: a call that passes one gets FA4's (out, lse) return.
_FA4_ONLY = frozenset(("learnable_sink", "score_mod", "return_lse", "min_seqlen_k",
                       "gather_kv_indices", "score_mod_bwd", "aux_scalars",
                       "seqlen_k_per_split", "disable_scheduler_metadata"))
# Arguments that change the result and podcute lacks: (name, why), refused when not None.
_UNSUPPORTED = (("alibi_slopes", "no ALiBi"), ("q_v", "no separate value-query (MLA) input"),
                ("cp_tot_seqused_k", "no context parallelism"),
                ("score_mod", "no score modifiers"), ("score_mod_bwd", "inference only"),
                ("aux_tensors", "no score modifiers"), ("aux_scalars", "no score modifiers"),
                ("mask_mod", "causal, window or no mask only"),
                ("block_sparse_tensors", "no block-sparse attention"),
                ("gather_kv_indices", "pages come from a block table or page_table"),
                ("output_scale", "no fp8 output"))


def _unsupported(name: str, value, why: str) -> None:
    shown = "<tensor>" if isinstance(value, torch.Tensor) else repr(value)
    raise NotImplementedError(f"flash_attn_varlen_func: {name}={shown} is not supported by "
                              f"podcute ({why})")


def _bind(flavour: str | None, args: tuple, kwargs: dict) -> tuple:
    """(the call's arguments by podcute's names, defaults filled in, the flavour whose
    return convention applies). `flavour` None: told from the call (module docstring)."""
    if flavour is None:
        if _FA4_ONLY.intersection(kwargs):
            flavour = "fa4"
        elif args and isinstance(args[0], torch.Tensor):
            flavour = _upstream_flavour(args, kwargs)
        else:
            flavour = "vllm"
    order = ORDERS[flavour]
    if flavour == "fa3" and kwargs.get("return_attn_probs", False) is True:
        # FlashAttention 3's return_attn_probs returns (out, softmax_lse), no probabilities
        kwargs = dict(kwargs, return_attn_probs=False, return_softmax_lse=True)
    if len(args) > len(order):
        raise TypeError(f"flash_attn_varlen_func() takes {len(order) + 3} positional arguments "
                        f"in {flavour}'s order but {len(args) + 3} were given")
    a = dict(_DEFAULTS)
    for name, value in zip(order, args):
        a[_ALIASES.get(name, name)] = value
    positional = {_ALIASES.get(n, n) for n in order[:len(args)]}
    by_keyword = {}
    for name, value in kwargs.items():
        key = _ALIASES.get(name, name)
        if key not in a:
            raise TypeError(f"flash_attn_varlen_func() got an unexpected keyword argument "
                            f"{name!r}")
        if key in positional:
            raise TypeError(f"flash_attn_varlen_func() got multiple values for argument "
                            f"{name!r}")
        if key in by_keyword:  # a name and its alias (block_table and page_table, ...)
            if value is None or value is False:
                continue
            if not (a[key] is None or a[key] is False):
                raise ValueError(f"flash_attn_varlen_func: pass {by_keyword[key]} or {name}, "
                                 "not both")
        by_keyword[key] = name
        a[key] = value
    return a, flavour


def _upstream_flavour(args: tuple, kwargs: dict) -> str:
    """FA2 or FA3 for a call in upstream order (q, k, v, cu_seqlens_q, ...; FA4's fourth
    argument is qv, so its calls name their arguments): FA2's fifth argument is dropout_p
    (a number), FA3's seqused_q; else keywords only FA3 has."""
    if len(args) > 4 and isinstance(args[4], (int, float)) and not isinstance(args[4], bool):
        return "fa2"
    if len(args) > 4 or {"seqused_q", "qv", "attention_chunk", "sm_margin"} & kwargs.keys():
        return "fa3"
    return "fa2"


def _window(window_size) -> tuple:
    """FlashAttention's window_size (None, a pair whose sides may be None, or a
    two-element tensor) as podcute's (left, right) ints, -1 = unbounded."""
    if window_size is None:
        return (-1, -1)
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.dtype.is_floating_point:
            raise TypeError(f"{_WHERE}window_size must be a pair (left, right) of ints, got a "
                            f"{window_size.dtype} tensor of shape {tuple(window_size.shape)}")
        window_size = window_size.reshape(2).tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{_WHERE}window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side in window_size:
        if isinstance(side, torch.Tensor) and side.numel() == 1:
            side = side.item()
        out.append(-1 if side is None else side)
    return tuple(out)


def _check_semantics(a: dict) -> None:
    """Refuse every argument that would change the result and that podcute lacks."""
    if not (a["dropout_p"] or a["return_attn_probs"] or a["cp_world_size"] != 1
            or a["cp_rank"] != 0 or a["attention_chunk"] or a["dynamic_causal"]
            or any(a[name] is not None for name, _ in _UNSUPPORTED)):
        return  # every layer's call: nothing to refuse
    if a["dropout_p"]:
        _unsupported("dropout_p", a["dropout_p"], "inference attention: dropout must be 0")
    for name, why in _UNSUPPORTED:
        if a[name] is not None:
            _unsupported(name, a[name], why)
    if a["dynamic_causal"]:
        _unsupported("dynamic_causal", a["dynamic_causal"], "causal is fixed per call")
    if a["attention_chunk"]:
        _unsupported("attention_chunk", a["attention_chunk"], "no chunked (local) attention; "
                     "0 = off")
    if a["return_attn_probs"]:
        _unsupported("return_attn_probs", a["return_attn_probs"], "attention probabilities "
                     "are never materialised; use return_softmax_lse")
    if a["cp_world_size"] != 1 or a["cp_rank"] != 0:
        _unsupported("cp_world_size", a["cp_world_size"], "no context parallelism")


def _descale(name: str, d, fp8: bool, batch_size: int):
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
        if d.shape[0] != batch_size:
            raise ValueError(f"{_WHERE}{name} must be [batch_size={batch_size}, num_kv_heads] "
                             f"(one row per request), got shape {tuple(d.shape)}")
        if batch_size == 0:
            return None  # no request reads the cache
        # [B, Hkv]: one row serves every request only if the rows are one memory row
        if d.shape[0] > 1 and d.stride(0) != 0:
            _unsupported(name, d, "descale factors that differ per request; pass one row "
                         "for all, e.g. scale.expand(batch_size, num_kv_heads), or a "
                         "[num_kv_heads] tensor")
        d = d[0]
    if d.dim() == 1 and d.shape[0] > 1 and d.stride(0) == 0:
        d = d[:1]  # one scale for every head
    return d  # run() checks dtype, shape, device and alignment, naming k_scale/v_scale


def _sinks(s_aux):
    """FA4's learnable_sink / vLLM's s_aux as podcute's float32 sinks (cast if needed)."""
    if s_aux is None or (isinstance(s_aux, torch.Tensor) and s_aux.dtype == torch.float32):
        return s_aux
    if not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"{_WHERE}learnable_sink / s_aux must be a tensor [num_heads], got "
                        f"{type(s_aux).__name__}")
    if not s_aux.dtype.is_floating_point:
        raise TypeError(f"{_WHERE}learnable_sink / s_aux must be a float tensor, got "
                        f"{s_aux.dtype}")
    return s_aux.float()


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_WHERE}{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{_WHERE}{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_kv(k, v, ndim: int) -> None:
    """k and v tensors of `ndim` dims (v's head dim may differ from k's: FlashAttention
    3's and 4's separate value head dim, e.g. 192 / 128; out then has v's)."""
    _check_tensor("k", k, ndim)
    _check_tensor("v", v, ndim)


def _caches(k, v, paged: bool) -> tuple:
    """k and v as the kernel's caches: paged [num_blocks, block_size, Hkv, D] as they
    are, contiguous [total_k, Hkv, D] as pages of one token (a view)."""
    if paged:
        _check_kv(k, v, 4)
        return k, v
    _check_kv(k, v, 3)
    return k.unsqueeze(1), v.unsqueeze(1)


def _check_indptr(cu_seqlens_k) -> None:
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1:
        raise TypeError(f"{_WHERE}cu_seqlens_k must be a 1-D int32 tensor")
    if cu_seqlens_k.dtype != torch.int32:
        raise TypeError(f"{_WHERE}cu_seqlens_k must be int32, got {cu_seqlens_k.dtype}")


_TOKEN_PAGES = np.zeros(0, dtype=np.int32)


def _token_pages(num_tokens: int) -> np.ndarray:
    """0 .. num_tokens-1 as int32 (the page list of contiguous K/V seen as 1-token pages):
    a view of one host array that grows to the largest call, so plan() copies nothing
    back from the device and a serving loop's varying sizes keep no arrays alive."""
    global _TOKEN_PAGES
    if _TOKEN_PAGES.size < num_tokens:
        _TOKEN_PAGES = np.arange(max(num_tokens, 2 * _TOKEN_PAGES.size), dtype=np.int32)
    return _TOKEN_PAGES[:num_tokens]


def _scalars(causal, softmax_scale, window_size, softcap) -> tuple:
    """What besides the index tensors a call's plan depends on (the page size and form
    are the attention's and the index tuple's)."""
    return (causal, softmax_scale, _window(window_size), 0.0 if softcap is None else softcap)


def flash_attn_varlen_func(q, k, v, *args, **kwargs):
    """Varlen attention over a paged (or contiguous) KV cache in any FlashAttention
    flavour's calling convention (module docstring)."""
    return _varlen(q, k, v, *_bind(None, args, kwargs))


def flash_attn2_varlen_func(q, k, v, *args, **kwargs):
    """FlashAttention 2's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes, deterministic, return_attn_probs, block_table)``; returns ``out``."""
    return _varlen(q, k, v, *_bind("fa2", args, kwargs))


def flash_attn3_varlen_func(q, k, v, *args, **kwargs):
    """FlashAttention 3's (``hopper/flash_attn_interface.py``) order: ``cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
    causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk, softcap,
    num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs``."""
    return _varlen(q, k, v, *_bind("fa3", args, kwargs))


def flash_attn4_varlen_func(q, k, v, *args, **kwargs):
    """FlashAttention 4's (``flash_attn.cute``) order: ``qv, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, min_seqlen_k, seqused_q, seqused_k, gather_kv_indices,
    page_table, softmax_scale, causal, ...`` (``ORDERS["fa4"]``); returns ``(out, lse)``
    (lse [Hq, total_q] with ``return_lse``, else None)."""
    return _varlen(q, k, v, *_bind("fa4", args, kwargs))


def _varlen(q, k, v, a: dict, flavour: str):
    """The call, its arguments bound (_bind)."""
    _check_semantics(a)  # (every path: nothing podcute lacks is ever ignored)
    want_lse = bool(a["return_softmax_lse"])
    handle = a["scheduler_metadata"]
    if isinstance(handle, StepPlan):
        res = _run_named(q, k, v, a, handle, want_lse)
    else:
        res = _run_one_shot(q, k, v, a, want_lse)
    if flavour == "fa4":
        return res if want_lse else (res, None)
    return res


def _run_named(q, k, v, a: dict, handle: StepPlan, want_lse: bool):
    """A call that names its plan (scheduler_metadata=StepPlan): no planning, no compare."""
    scalars = _scalars(a["causal"], a["softmax_scale"], a["window_size"], a["softcap"])
    handle.check(scalars, _WHERE)
    att = handle.attn
    k_cache, v_cache = _caches(k, v, paged=a["block_table"] is not None)
    plan = handle.plan
    att._check_tensors(plan, q, k_cache, v_cache, a["out"])
    B = plan.batch_size
    return _run(att, plan, q, k_cache, v_cache, a["out"], _sinks(a["s_aux"]), want_lse,
                _descale("k_descale", a["k_descale"], att.fp8, B),
                _descale("v_descale", a["v_descale"], att.fp8, B))


def _run_one_shot(q, k, v, a: dict, want_lse: bool):
    """A call without a named plan: the per-layer path when the last paged call's plan
    serves it (podcute.one_shot), else the argument mapping and plan()."""
    bt, seqused_k, causal = a["block_table"], a["seqused_k"], a["causal"]
    if (bt is not None and seqused_k is not None and a["cu_seqlens_k"] is None
            and a["seqused_q"] is None
            and type(a["max_seqlen_q"]) is int and type(a["max_seqlen_k"]) is int
            and (causal is True or causal is False)
            and (a["q_descale"] is None or type(a["q_descale"]) is torch.Tensor)):
        # A layer's call in vLLM's form (each test above is one _Call.of would pass; the
        # refusals are _varlen's): launch straight away if the last paged call's plan of
        # its kind serves it.
        scalars = _scalars(causal, a["softmax_scale"], a["window_size"], a["softcap"])
        # (the index tuple of _Call.of's paged form, whose plan this reuses)
        index = (a["cu_seqlens_q"], seqused_k, None, bt, None)
        att = one_shot_fast(_LAST, ("paged", scalars), index, scalars, q, k, v, a["out"])
        if att is not None:
            B = att._plan.batch_size
            return _run(att, att._plan, q, k, v, a["out"], _sinks(a["s_aux"]), want_lse,
                        _descale("k_descale", a["k_descale"], att.fp8, B),
                        _descale("v_descale", a["v_descale"], att.fp8, B))
    call = _Call.of(q, k, v, a)
    att = call.plan()
    plan = att.current_plan
    att._check_tensors(plan, q, call.k_cache, call.v_cache, a["out"])
    res = _run(att, plan, q, call.k_cache, call.v_cache, a["out"], _sinks(a["s_aux"]),
               want_lse, call.scales.get("k_scale"), call.scales.get("v_scale"))
    if bt is not None:
        _LAST[("paged", call.scalars)] = (att, call.planner)
    return res


# ("paged", scalars) -> the (PODAttention, CallPlanner) of the last paged call of that
# kind that launched.
_LAST: dict = {}


def _run(att, plan, q, k_cache, v_cache, out, sinks, return_softmax_lse, k_scale, v_scale):
    """The launch once q, the caches and out passed run()'s checks; FlashAttention's
    returns (softmax_lse [Hq, total_q])."""
    if not return_softmax_lse:
        return att._run_checked(plan, q, k_cache, v_cache, out, False, None, sinks, k_scale,
                                v_scale)
    lse = torch.empty(att.num_qo_heads, q.shape[0], dtype=torch.float32, device=q.device)
    out, _ = att._run_checked(plan, q, k_cache, v_cache, out, True, lse.t(), sinks, k_scale,
                              v_scale)
    return out, lse


def flash_attn_varlen_plan(q, k, v, *args, **kwargs) -> StepPlan:
    """Plan the batch of the coming ``flash_attn_varlen_func`` calls of a step, without
    launching, and return the plan's handle: pass it to those calls as
    ``scheduler_metadata`` (they then neither plan nor compare their index tensors) and,
    with CUDA graphs, call this once per step before replaying (the replayed launches
    read this plan). Takes flash_attn_varlen_func's arguments (any flavour's order);
    ``q``, ``k``, ``v`` give shapes, dtype and device only. It always plans: the handle
    names the metadata its tensors hold now."""
    a, _ = _bind(None, args, kwargs)
    _check_semantics(a)
    call = _Call.of(q, k, v, a)
    call.planner.invalidate()
    att = call.plan()
    return StepPlan(att, att.current_plan, call.scalars)


class _Call:
    """One call's arguments mapped onto podcute: the caches as the kernel reads them, the
    one-shot PODAttention of the configuration and scalars, and how to plan the batch."""

    def __init__(self, att, planner, k_cache, v_cache, scales, index_args, scalars, plan_fn):
        self.att, self.planner = att, planner
        self.k_cache, self.v_cache = k_cache, v_cache
        self.scales = scales  # run()'s k_scale / v_scale keywords (fp8 caches)
        self.scalars = scalars
        self._index_args, self._plan_fn = index_args, plan_fn

    def plan(self):
        """Plan (or reuse the plan of the same metadata: podcute.one_shot); the attention."""
        self.planner.plan(self._index_args, self.scalars, self._plan_fn, _WHERE)
        return self.att

    @staticmethod
    def of(q, k, v, a: dict) -> "_Call":
        cu_seqlens_q, cu_seqlens_k, seqused_k = a["cu_seqlens_q"], a["cu_seqlens_k"], a["seqused_k"]
        block_table, causal = a["block_table"], a["causal"]
        # (the refusals, _check_semantics, are the callers': _varlen, flash_attn_varlen_plan)
        if a["q_descale"] is not None and not isinstance(a["q_descale"], torch.Tensor):
            raise TypeError(f"{_WHERE}q_descale must be a float32 tensor or None, got "
                            f"{type(a['q_descale']).__name__}")
        window = _window(a["window_size"])
        softcap = 0.0 if a["softcap"] is None else a["softcap"]
        for name in ("max_seqlen_q", "max_seqlen_k"):
            m = a[name]
            if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer))
                                  or m < 0):
                raise TypeError(f"{_WHERE}{name} must be a non-negative int, got {m!r}")
        if cu_seqlens_q is None:
            raise ValueError(f"{_WHERE}cu_seqlens_q is required")
        _check_tensor("q", q, 3)
        if not isinstance(causal, bool):
            raise TypeError(f"{_WHERE}causal must be a bool, got {type(causal).__name__}")
        check_sm_scale(a["softmax_scale"], "softmax_scale")
        options = PlanOptions.make(causal, window, softcap)  # named errors before any plan
        scalars = (causal, a["softmax_scale"], (options.window_left, options.window_right),
                   softcap)

        if block_table is not None:
            # Paged: caches [num_blocks, block_size, Hkv, D], lengths in seqused_k (vLLM) or
            # cu_seqlens_k (upstream FlashAttention 2).
            k_cache, v_cache = _caches(k, v, paged=True)
            if (seqused_k is None) == (cu_seqlens_k is None):
                raise ValueError(f"{_WHERE}with block_table pass exactly one of seqused_k or "
                                 "cu_seqlens_k (the KV lengths)")
            if seqused_k is None:
                _check_indptr(cu_seqlens_k)
            pages = dict(block_table=block_table)
            index_args = (cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, a["seqused_q"])
            kv_name = "seqused_k" if seqused_k is not None else "cu_seqlens_k"
        else:
            # Contiguous varlen K/V [total_k, Hkv, D]: pages of one token, CSR indices 0..n-1.
            k_cache, v_cache = _caches(k, v, paged=False)
            # (FlashAttention 3: seqused_k, if given, is how many of a request's rows from
            # cu_seqlens_k[i] it uses.)
            if cu_seqlens_k is None:
                raise ValueError(f"{_WHERE}without block_table pass cu_seqlens_k (contiguous "
                                 "K/V)")
            _check_indptr(cu_seqlens_k)
            pages = dict(kv_indptr=cu_seqlens_k, kv_indices=_token_pages(k.shape[0]))
            index_args = (cu_seqlens_q, cu_seqlens_k, seqused_k, a["seqused_q"])
            kv_name = "cu_seqlens_k" if seqused_k is None else "seqused_k"

        att, planner = one_shot_for(q, k_cache, v_cache, "NHD", where=_WHERE,
                                    names=("q", "k", "v"), scalars=scalars)
        B = cu_seqlens_q.shape[0] - 1 if hasattr(cu_seqlens_q, "shape") else 0
        scales = {}
        if a["k_descale"] is not None or a["v_descale"] is not None:
            scales = dict(k_scale=_descale("k_descale", a["k_descale"], att.fp8, B),
                          v_scale=_descale("v_descale", a["v_descale"], att.fp8, B))

        def plan():
            # KV lengths from seqused_k, else from cu_seqlens_k (a device op when it lives
            # there: done only when a call plans, and read back in plan()'s one copy).
            kv_lens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            cu, lens, pg = cu_seqlens_q, kv_lens, pages
            if a["seqused_q"] is not None:
                cu, lens, pg = _used_rows(a["seqused_q"], cu_seqlens_q, kv_lens, pages)
            try:
                att.plan(cu, lens, causal=causal, sm_scale=a["softmax_scale"],
                         window_size=window, softcap=softcap, _kv_name=kv_name, **pg)
            except (TypeError, ValueError) as err:
                raise type(err)(_WHERE + _renamed(str(err), block_table is None)) from err

        return _Call(att, planner, k_cache, v_cache, scales, index_args, scalars, plan)


def _used_rows(seqused_q, cu_seqlens_q, kv_lens, pages: dict) -> tuple:
    """FlashAttention 3's seqused_q (request i uses the first seqused_q[i] of its rows from
    cu_seqlens_q[i]) as a podcute batch: each request followed by a request of its unused
    rows with no KV (they see no key: out 0, lse -inf), so every row keeps its place.
    Returns (cu_seqlens_q, kv_lens, page arguments) of that batch, host arrays."""
    h = host_arrays({"seqused_q": seqused_q, "cu_seqlens_q": cu_seqlens_q, "kv_lens": kv_lens,
                     **pages})
    cu = h["cu_seqlens_q"].astype(np.int64).reshape(-1)
    used = h["seqused_q"].astype(np.int64).reshape(-1)
    B = cu.size - 1
    if used.shape != (B,) or (used < 0).any() or (used > cu[1:] - cu[:-1]).any():
        raise ValueError(f"{_WHERE}seqused_q must hold B={B} counts, each between 0 and its "
                         "request's rows in cu_seqlens_q")
    cu2 = np.empty(2 * B + 1, np.int64)
    cu2[0], cu2[1::2], cu2[2::2] = cu[0], cu[:-1] + used, cu[1:]
    kv2 = np.zeros(2 * B, np.int64)
    kv2[0::2] = h["kv_lens"].reshape(-1)
    if "block_table" in pages:
        bt = h["block_table"]
        pg = dict(block_table=np.zeros((2 * B, bt.shape[1]), np.int32))
        pg["block_table"][0::2] = bt
    else:
        ip = h["kv_indptr"].astype(np.int64)
        ip2 = np.empty(2 * B + 1, np.int64)
        ip2[0], ip2[1::2], ip2[2::2] = ip[0], ip[1:], ip[1:]
        pg = dict(kv_indptr=ip2.astype(np.int32), kv_indices=h["kv_indices"])
    return cu2.astype(np.int32), kv2.astype(np.int32), pg


def _renamed(msg: str, contiguous: bool) -> str:
    """A planner message in FlashAttention's names: softmax_scale, and for contiguous K/V
    its CSR offsets are cu_seqlens_k and its page list the K/V rows."""
    msg = msg.replace("sm_scale", "softmax_scale")
    if not contiguous:
        return msg
    return msg.replace("kv_indptr", "cu_seqlens_k").replace("kv_indices", "the K/V rows")
