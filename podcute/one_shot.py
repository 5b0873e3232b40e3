"""The one-shot entry points (:func:`pod_attention`, and the registry podcute.compat's
calls share) and when such a call may skip planning (docs/contract.md, "Plans").

An engine calls attention once per layer with the same metadata (lengths, page table):
planning every call would cost the host ~0.1-1 ms per layer. A call reuses an earlier
plan in exactly two cases:

- **by content**: every index argument lives on the host (a CPU tensor or a NumPy
  array) and holds, at this call, the very values the plan was made from (dtype, shape
  and every element, compared against the plan's own snapshot). No way of writing them
  can serve a stale plan: torch writes, NumPy views, DLPack aliases, ``ctypes``, a
  re-pointed ``.data``, freed memory handed to a new tensor, a fresh
  ``torch.from_numpy(buf)`` each step all come down to the values compared here;
- **by name**: the caller passes the plan itself, a :class:`StepPlan` from
  ``flash_attn_varlen_plan`` as ``scheduler_metadata`` (FlashAttention 3's argument for
  the same thing), as FlashInfer's plan()/run() and :class:`~podcute.PODAttention` do.
  The caller then vouches for its index tensors; the kernel reads the copy the plan
  made and validated at plan time, and a handle whose plan was replaced is refused.

Index tensors on the device are never compared (that is a device sync per layer), so a
call with device metadata and no handle plans every time (one device-to-host copy).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from podcute.api import PODAttention
from podcute.checks import (DTYPES, FP8_DTYPES, check_head_dim, check_layout, check_page_size,
                            check_sm_scale)
from podcute.planning import PlanOptions

__all__ = ["pod_attention", "one_shot_attention", "one_shot_for", "one_shot_fast",
           "CallPlanner", "StepPlan", "host_view", "invalidate_plans", "capturing"]

_planners: "weakref.WeakSet[CallPlanner]" = weakref.WeakSet()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_view(x):
    """x's current values as a NumPy array without a copy when they live on the host (a
    CPU tensor, inference tensors included, or a NumPy array); None otherwise (a device
    tensor, whose values cannot be read without a sync, or anything NumPy cannot view)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        try:
            return torch.Tensor.numpy(x)
        except (RuntimeError, TypeError):  # e.g. a tensor subclass without storage
            return None
    return None


def _snapshot(tensors: tuple):
    """The index arguments' values as (shape, dtype, bytes in C order) each (None where an
    argument is None), or None when one of them cannot be compared later (it lives on the
    device). Bytes, because comparing a fresh `tobytes()` with them is a copy and a
    memcmp: a third of `np.array_equal`'s time on a 64 x 256 block table, a tenth on the
    small length arrays, and this runs every layer."""
    snap = []
    for t in tensors:
        if t is None:
            snap.append(None)
            continue
        a = host_view(t)
        if a is None:
            return None
        snap.append((a.shape, a.dtype, a.tobytes()))
    return tuple(snap)


class CallPlanner:
    """The plan of the last call of one :class:`~podcute.PODAttention` and the index
    values it was made from: reused while a call's values are those (module docstring)."""

    def __init__(self, attn):
        self.attn = attn
        self._made = None  # (plan, scalars, snapshot of the index arguments)
        _planners.add(self)

    def invalidate(self) -> None:
        """Forget the last plan: the next call plans again."""
        self._made = None

    def reuses(self, tensors: tuple, scalars: tuple) -> bool:
        """True if the attention still holds the plan made from these scalars and index
        values: each argument None where it was, else on the host with the same dtype,
        shape and elements as the snapshot."""
        made = self._made
        if made is None or made[0] is not self.attn._plan or made[1] != scalars:
            return False
        snap = made[2]
        if len(tensors) != len(snap):
            return False
        for t, s in zip(tensors, snap):
            if s is None:
                if t is not None:
                    return False
                continue
            a = host_view(t)
            if a is None or a.shape != s[0] or a.dtype != s[1] or a.tobytes() != s[2]:
                return False
        return True

    def plan(self, tensors: tuple, scalars: tuple, plan_fn, where: str = "") -> bool:
        """Make sure the attention holds the plan of this metadata: `plan_fn()` plans it
        unless reuses() says the held one is it. Returns True if it was reused. Under
        CUDA-graph capture nothing is planned (the graph would keep the copies): a call
        that cannot reuse raises RuntimeError."""
        if self.reuses(tensors, scalars):
            return True
        self._made = None  # a failed plan() leaves nothing to reuse
        if capturing():
            raise RuntimeError(
                f"{where}under CUDA-graph capture this call would plan: its index tensors "
                "live on the device (their values cannot be compared without a sync) or "
                "hold other values than the last plan's. Plan the step before capturing "
                "and name that plan (podcute.compat.flash_attn: scheduler_metadata="
                "flash_attn_varlen_plan(...); or PODAttention.plan()/run())")
        plan_fn()
        snap = _snapshot(tensors)
        if snap is not None:
            self._made = (self.attn._plan, scalars, snap)
        return False


class StepPlan:
    """A plan the caller names (``flash_attn_varlen_plan``'s return value, taken back as
    ``scheduler_metadata``): the attention that holds it, the plan, and the scalars
    (causal, scale, window, softcap) it was made with."""

    __slots__ = ("attn", "plan", "scalars", "__weakref__")

    def __init__(self, attn, plan, scalars: tuple):
        self.attn, self.plan, self.scalars = attn, plan, scalars

    def check(self, scalars: tuple, where: str = "") -> None:
        """ValueError unless the attention still holds this plan and the call's scalars
        are the plan's."""
        if self.attn._plan is not self.plan:
            raise ValueError(
                f"{where}scheduler_metadata names a plan that a later plan of the same "
                "configuration replaced (each step's flash_attn_varlen_plan replaces the "
                "last one's); pass the handle of the current step")
        if scalars != self.scalars:
            names = ("causal", "softmax_scale", "window_size", "softcap")
            diff = [f"{n}={b!r} (planned {a!r})" for n, a, b in
                    zip(names, self.scalars, scalars) if a != b]
            raise ValueError(f"{where}this call's {', '.join(diff)} differ from the plan "
                             "named by scheduler_metadata; plan with the call's values")

    def __repr__(self) -> str:
        p = self.plan
        return (f"StepPlan(requests={p.batch_size}, query_tokens={p.total_q}, "
                f"causal={p.causal}, current={self.attn._plan is p})")


def invalidate_plans() -> None:
    """Make every one-shot or compat entry point plan its next call again (never needed
    for correctness: reuse compares values; this only drops the snapshots)."""
    for p in list(_planners):
        p.invalidate()


# --------------------------------------------------------------------------------------
# One-shot calls
# --------------------------------------------------------------------------------------

# (configuration, plan scalars) -> (PODAttention, CallPlanner): the one-shot entry points
# (pod_attention, podcute.compat) share one attention per head/page configuration,
# device and plan scalars (causal, scale, window, softcap, ...). Layers of different kinds
# (sliding-window and full layers) thus keep a plan each, and a CUDA graph of a whole
# step captures each kind's launches over its own buffers.
_ONE_SHOT: dict = {}


# What one_shot_for() saw (q's and the cache's dims, dtypes, device, layout, scalars) ->
# the one_shot_attention() it returned: a layer's call of a configuration seen before
# skips the checks (run() checks every tensor anyway).
_ONE_SHOT_FOR: dict = {}


def one_shot_attention(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype, kv_layout: str, device,
                       kv_dtype: torch.dtype | None = None, scalars: tuple = (),
                       head_dim_vo: int | None = None) -> tuple:
    """The (PODAttention, CallPlanner) the one-shot entry points use for a configuration
    and the plan scalars of a call (hashable; the entry point's own tuple)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo
    key = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout, device, kv_dtype,
           scalars, head_dim_vo)
    hit = _ONE_SHOT.get(key)
    if hit is None:
        att = PODAttention(num_qo_heads, num_kv_heads, head_dim, page_size, dtype=dtype,
                           kv_layout=kv_layout, device=device, kv_dtype=kv_dtype,
                           head_dim_vo=head_dim_vo)
        hit = _ONE_SHOT[key] = (att, CallPlanner(att))
    return hit


def one_shot_for(q, k_cache, v_cache, kv_layout: str, *, where: str = "",
                 names: tuple = ("q", "k_cache", "v_cache"), scalars: tuple = ()) -> tuple:
    """one_shot_attention() of the configuration a call's tensors imply: q [T, Hq, D] and
    4-D caches in `kv_layout`, each check a named error before anything is planned.
    `where` prefixes the messages and `names` are what the caller calls q and the caches;
    `scalars` (hashable, validated by the caller) pick the attention of a kind of layer.
    v_cache's last dim may differ from q's and k_cache's: the value head dim."""
    try:
        qn, kn = q.shape, k_cache.shape
        memo = (len(qn), qn[1], qn[2], len(kn), kn[1], kn[2], kn[3], v_cache.shape[-1],
                q.dtype, k_cache.dtype, q.device, kv_layout, scalars)
        hit = _ONE_SHOT_FOR.get(memo)
    except (AttributeError, IndexError, TypeError):
        memo = hit = None
    if (hit is not None and type(q) is torch.Tensor and type(k_cache) is torch.Tensor
            and type(v_cache) is torch.Tensor):
        return hit
    q_name, k_name, v_name = names
    for name, t in zip(names, (q, k_cache, v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"{where}{q_name} must be [total_q, num_qo_heads, head_dim], got "
                         f"shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"{where}{k_name} must be 4-D ({kv_layout}), got shape "
                         f"{tuple(k_cache.shape)}")
    if q.dtype not in DTYPES:
        if q.dtype in FP8_DTYPES:
            raise NotImplementedError(f"{where}fp8 queries ({q_name} {q.dtype}) are not "
                                      "supported by podcute (supported: bf16/fp16 queries, "
                                      "also over an fp8 KV cache)")
        raise TypeError(f"{where}{q_name} must be torch.bfloat16 or torch.float16, got {q.dtype}")
    Hq, D = q.shape[1], q.shape[2]
    page_dim = 1 if kv_layout == "NHD" else 2
    ps, Hkv = k_cache.shape[page_dim], k_cache.shape[3 - page_dim]
    if Hq < 1:
        raise ValueError(f"{where}{q_name} must have >= 1 query heads ({q_name}.shape[1]), got "
                         f"shape {tuple(q.shape)}")
    if Hkv < 1:
        raise ValueError(f"{where}{k_name} must have >= 1 KV heads, got shape "
                         f"{tuple(k_cache.shape)} ({kv_layout})")
    if k_cache.shape[3] != D:
        raise ValueError(f"{where}{k_name} head_dim {k_cache.shape[3]} differs from "
                         f"{q_name}'s {D}")
    if Hq % Hkv:
        raise ValueError(f"{where}{q_name}'s {Hq} heads must be a multiple of {k_name}'s {Hkv} "
                         "KV heads")
    check_head_dim(D, f"{where}head_dim ({q_name}.shape[2])")
    Dv = v_cache.shape[-1] if v_cache.dim() == 4 else D  # (run() names a v of other rank)
    if Dv != D:
        check_head_dim(Dv, f"{where}head_dim_vo ({v_name}.shape[3])")
    check_page_size(ps, f"{where}page_size ({k_name}.shape[{page_dim}])")
    # An fp8 cache selects fp8 variants (PODAttention checks the head dim); any other
    # cache dtype is run()'s to refuse.
    kv_dtype = k_cache.dtype if k_cache.dtype in FP8_DTYPES else None
    hit = one_shot_attention(Hq, Hkv, D, ps, q.dtype, kv_layout, q.device, kv_dtype, scalars,
                             Dv)
    if memo is not None:
        _ONE_SHOT_FOR[memo] = hit
    return hit


def pod_attention(q, k_cache, v_cache, *, cu_seqlens_q, seqused_k, block_table, causal=True,
                  sm_scale=None, kv_layout="NHD", return_lse=False, out=None,
                  window_size=(-1, -1), softcap=0.0, sinks=None, batch_invariant=False,
                  k_scale=None, v_scale=None):
    """One call: plan + run (FlashAttention-style arguments; `window_size`, `softcap`,
    `sinks`, `batch_invariant`, and for fp8 caches `k_scale`/`v_scale`, as
    PODAttention.plan/run). A later call reuses the plan only while its index tensors
    live on the CPU (or are NumPy arrays) and hold the same values (``podcute.one_shot``:
    per layer of a step only the first call plans); index tensors on the device plan
    every call (one device->host copy): keep them on the CPU, or use PODAttention's
    plan()/run() to name the plan yourself."""
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    index = (cu_seqlens_q, seqused_k, block_table)
    scalars = (causal, sm_scale, window, softcap, batch_invariant)
    hit = one_shot_fast(_LAST_POD, (kv_layout, scalars), index, scalars, q, k_cache, v_cache,
                        out)
    if hit is not None:
        return hit._run_checked(hit._plan, q, k_cache, v_cache, out, return_lse, None, sinks,
                                k_scale, v_scale)
    check_layout(kv_layout)
    options = PlanOptions.make(causal, window, softcap, batch_invariant)  # named errors
    check_sm_scale(sm_scale)
    scalars = (causal, sm_scale, (options.window_left, options.window_right), softcap,
               batch_invariant)
    att, planner = one_shot_for(q, k_cache, v_cache, kv_layout, where="pod_attention: ",
                                scalars=scalars)
    planner.plan(index, scalars,
                 lambda: att.plan(cu_seqlens_q, seqused_k, block_table=block_table,
                                  causal=causal, sm_scale=sm_scale, window_size=window,
                                  softcap=softcap, batch_invariant=batch_invariant,
                                  _kv_name="seqused_k"),
                 where="pod_attention: ")
    res = att.run(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks,
                  k_scale=k_scale, v_scale=v_scale)
    _LAST_POD[(kv_layout, scalars)] = (att, planner)
    return res


# (kv_layout, scalars) -> the (PODAttention, CallPlanner) of pod_attention's last call
# of that kind that launched.
_LAST_POD: dict = {}


def one_shot_fast(last: dict, slot, index: tuple, scalars: tuple, q, k_cache, v_cache, out):
    """The per-layer path of a one-shot entry point: the PODAttention of the entry point's
    last launching call (`last[slot]`) if its plan serves this call's metadata
    (CallPlanner.reuses) and the tensors pass that attention's run() checks, which fix the
    configuration (q's and the caches' dims, dtypes and device) as one_shot_for() would
    find it; else None, and the caller takes the full path. `slot` must tell apart what
    the tensors' shapes cannot (the cache layout)."""
    try:
        hit = last.get(slot)
    except TypeError:  # an unhashable slot: the full path names the bad argument
        return None
    if hit is None:
        return None
    att, planner = hit
    if (planner.reuses(index, scalars)
            and att._common_case(att._plan, q, k_cache, v_cache, out)):
        return att
    return None

