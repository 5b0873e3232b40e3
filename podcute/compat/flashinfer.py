"""FlashInfer's POD entry points, served by :class:`podcute.PODAttention`.

Three classes keep the constructor, ``plan()`` and ``run()`` signatures of FlashInfer's
(``flashinfer/pod.py`` and ``flashinfer/attention/_core.py``, FlashInfer commit
``fb28d7242b35``) and run podcute's fused kernel underneath:

- :class:`BatchPODWithPagedKVCacheWrapper`: a paged prefill batch and a paged decode batch.
  plan() builds **one** podcute plan over their concatenation (prefill requests first,
  then decode requests); run() makes **one** launch for both, over one KV cache or over
  separate prefill and decode caches (the kernel's second-cache variant);
- :class:`PODWithPagedKVCacheWrapper` (FlashInfer's older API): one prefill over
  contiguous ragged K/V plus a paged decode batch, in **one** launch too (the kernel's
  ragged variant reads the prefill's K/V rows); two launches only where one plan cannot
  serve both sides (the class docstring says when);
- :class:`BatchAttention`: one paged batch, one launch.

How FlashInfer's conventions map onto podcute:

- ``paged_kv_cache`` is one ``[P, 2, page_size, Hkv, D]`` (NHD) / ``[P, 2, Hkv,
  page_size, D]`` (HND) tensor (4-D when page_size is 1, as FlashInfer allows) or a
  ``(k, v)`` tuple; :func:`unpack_paged_kv_cache` turns either into k/v views, never a copy;
- CSR pages (``kv_indptr``, ``kv_indices``) with ``last_page_len``, or ``kv_len_arr``,
  go to podcute's planner as they are; index tensors on the CPU cost no device sync,
  index tensors on the device one device->host copy per plan();
- LSE: FlashInfer's kernels return the log-sum-exp in **base 2** (``log2(sum 2^(s *
  log2 e))`` = natural LSE * log2(e)), float32 ``[rows, num_qo_heads]``; podcute's
  natural-log LSE is converted with one multiply by :data:`LOG2E`;
- workspace buffers are required as in FlashInfer and checked (a tensor on the CPU or on
  a CUDA device) but not used: podcute's planner owns its buffers. The workspace's
  device is the wrapper's: a CPU workspace plans on the host only, and run() then raises
  podcute's RuntimeError naming the Hopper GPU it needs;
- features podcute does not implement raise ``NotImplementedError`` naming the argument
  and what is supported: ``pos_encoding_mode`` other than ``"NONE"``,
  ``rope_scale``/``rope_theta``, custom
  masks, fp8 queries (``q_scale`` other than None/1), KV dtypes other than q's or fp8,
  ``head_dim_qk != head_dim_vo`` with an fp8 cache, fp16 QK reduction, the profiler,
  NVFP4 scale factors, ``jit_args``;
- fp8 KV caches: plan with ``kv_data_type=torch.float8_e4m3fn`` (or ``float8_e5m2``) and
  bf16/fp16 ``q_data_type``; run()'s ``k_scale``/``v_scale`` (Python floats as FlashInfer
  takes them, or podcute's float32 device tensors of shape [] or [Hkv]) dequantise the
  cache, keys ``k * k_scale`` and values ``v * v_scale``, inside the kernel
  (``PODAttention.run``). With a 16-bit cache ``k_scale`` must be None or 1 and
  ``v_scale`` (a float or one-element tensor) multiplies the output, as FlashInfer's
  does (the LSE is unscaled). One difference from
  FlashInfer: its ``BatchPODWithPagedKVCacheWrapper.run`` scales only the decode side
  (its prefill side computes on the unscaled fp8 values); here both sides read the same
  cache in one launch, and the scales apply to both;
- arguments that only tune speed (``non_blocking``, ``enable_pdl``) are accepted and
  change nothing: podcute's host->device copies are always non-blocking, and it does not
  use programmatic dependent launch;
- bad arguments raise TypeError/ValueError under FlashInfer's argument names, before
  anything touches a GPU.

podcute plans ``causal`` and the kernel variant with it; FlashInfer's POD wrappers take
``causal_p`` in run(). The POD wrappers therefore plan with the ``causal_p`` of the last
run() (at first FlashInfer's default, False) and re-plan on the host, once, when a run()
asks for the other one; FlashInfer's decode side is always non-causal, which equals
causal for one query token per request.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import torch

from podcute.api import PODAttention
from podcute.checks import (DTYPES, FP8_DTYPES, KV_LAYOUTS, check_index, check_int,
                            renamed_errors, same_device, scale_tensor)
from podcute.one_shot import capturing
from podcute.planning import CapacityError, host_arrays

__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper", "BatchAttention",
           "unpack_paged_kv_cache", "LOG2E"]

LOG2E = math.log2(math.e)  # natural-log LSE * LOG2E = FlashInfer's base-2 LSE


# --------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------


def _is_none(v):
    return v is None


def _is_off(v):  # None or 0 (logits_soft_cap)
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _is_unit(v):  # None or 1 (fp8 dequantisation scales)
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1)


# FlashInfer arguments without a podcute counterpart: the values that mean "feature off"
# (accepted) and how to say what is supported. A "_p"/"_d" suffix names the prefill or
# decode side of the same argument.
_FEATURES = {
    "pos_encoding_mode": (lambda v: v == "NONE", '"NONE" (apply RoPE to q and k before '
                          'attention)'),
    "rope_scale": (_is_none, "None (no RoPE inside attention)"),
    "rope_theta": (_is_none, "None (no RoPE inside attention)"),
    "custom_mask": (_is_none, "None (causal or no mask)"),
    "packed_custom_mask": (_is_none, "None (causal or no mask)"),
    "q_scale": (_is_unit, "None or 1.0 (queries are bf16/fp16, never fp8)"),
    "k_scale": (_is_unit, "None or 1.0 with a bf16/fp16 cache; plan kv_data_type="
                "torch.float8_e4m3fn or float8_e5m2 for an fp8 cache and its scales"),
    "v_scale": (_is_unit, "None or 1.0 with a bf16/fp16 cache; plan kv_data_type="
                "torch.float8_e4m3fn or float8_e5m2 for an fp8 cache and its scales"),
    "use_fp16_qk_reduction": (lambda v: v is False, "False (QK is accumulated in fp32)"),
    "use_profiler": (lambda v: v is False, "False"),
    "profiler_buffer": (_is_none, "None (no profiler)"),
    "kv_cache_sf": (_is_none, "None (no NVFP4 caches)"),
    "jit_args": (_is_none, "None (podcute compiles its own kernel)"),
}


def _window(name: str, window_left) -> tuple:
    """FlashInfer's ``window_left`` (keys p - window_left .. p, -1 = unbounded) as
    podcute's window_size: (window_left, -1), which with causal is (window_left, 0) and
    without it bounds the left side only, as FlashInfer does."""
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"{name} must be an int (-1: no sliding window), got "
                        f"{type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"{name} must be -1 (no sliding window) or >= 0, got {window_left}")
    return (int(window_left), -1)


def _softcap(name: str, logits_soft_cap) -> float:
    """FlashInfer's ``logits_soft_cap`` (None or 0: off) as podcute's softcap."""
    if logits_soft_cap is None:
        return 0.0
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(logits_soft_cap).__name__}")
    return float(logits_soft_cap)


def _check_features(**given) -> None:
    """NotImplementedError for any FlashInfer feature podcute lacks that is switched on."""
    for name, value in given.items():
        ok, supported = _FEATURES[re.sub(r"_[pd]$", "", name)]
        if not ok(value):
            shown = f"<{type(value).__name__}>" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"{name}={shown} is not supported by podcute "
                                      f"(supported: {supported})")


def _check_bool(name, v, optional=False) -> None:
    if not (isinstance(v, bool) or (optional and v is None)):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got "
                        f"{type(v).__name__}")


def _check_layout(name, kv_layout) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{name} must be one of {KV_LAYOUTS}, got {kv_layout!r}")


def _as_dtype(name, dtype) -> torch.dtype:
    """A torch dtype or its name ("bfloat16"), as FlashInfer accepts it."""
    if isinstance(dtype, str):
        found = getattr(torch, dtype, None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{name}={dtype!r} names no torch dtype")
        return found
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or its name, got {type(dtype).__name__}")
    return dtype


def _plan_dtype(q_data_type, kv_data_type=None, data_type=None) -> tuple:
    """FlashInfer's dtype arguments resolved its way (the deprecated `data_type` fills
    whichever of the two is None; kv_data_type defaults to q's): (q's dtype, the cache's).
    podcute takes bf16/fp16 queries (and output) over a cache in q's dtype or in fp8."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    q = _as_dtype("q_data_type", q_data_type)
    kv = q if kv_data_type is None else _as_dtype("kv_data_type", kv_data_type)
    if q not in DTYPES:
        raise NotImplementedError(f"q_data_type={q} is not supported by podcute (supported: "
                                  "torch.bfloat16, torch.float16)")
    if kv != q and kv not in FP8_DTYPES:
        raise NotImplementedError(f"kv_data_type={kv} with q_data_type={q} is not supported by "
                                  "podcute (supported: q's dtype, torch.float8_e4m3fn, "
                                  "torch.float8_e5m2)")
    return q, kv


def _scales(attn: PODAttention, q_scale, k_scale, v_scale) -> tuple:
    """run()'s scales, checked now (before a wrapper's first launch): (PODAttention.run's
    keyword arguments, the factor for the output). An fp8 cache takes k_scale/v_scale as
    the kernel's dequantisation tensors; a 16-bit cache, as FlashInfer, multiplies the
    output by v_scale (a float; the LSE is unscaled) and takes k_scale None or 1. q_scale
    must be None or 1: queries are never fp8."""
    _check_features(q_scale=q_scale)
    if not attn.fp8:
        _check_features(k_scale=k_scale)
        if _is_unit(v_scale):
            return {}, None
        if isinstance(v_scale, torch.Tensor):  # one value, multiplied on the device
            if v_scale.numel() != 1 or not v_scale.dtype.is_floating_point:
                raise ValueError(f"v_scale must be a float or a one-element float tensor with a "
                                 f"bf16/fp16 cache, got a {v_scale.dtype} tensor of shape "
                                 f"{tuple(v_scale.shape)}")
            return {}, v_scale.reshape(())
        if isinstance(v_scale, bool) or not isinstance(v_scale, (int, float)):
            raise TypeError(f"v_scale must be a float or None with a bf16/fp16 cache, got "
                            f"{type(v_scale).__name__}")
        if not math.isfinite(v_scale):
            raise ValueError(f"v_scale must be finite, got {v_scale}")
        return {}, float(v_scale)
    return {name: scale_tensor(name, x, attn.num_kv_heads, attn.device, attn._scales)
            for name, x in (("k_scale", k_scale), ("v_scale", v_scale))}, None


def _scaled(out: torch.Tensor, factor, rows: int) -> torch.Tensor:
    """out's first `rows` rows multiplied by a 16-bit cache's v_scale (None: unchanged)."""
    if factor is not None:
        out[:rows].mul_(factor)
    return out


def _workspace_device(buf, name="float_workspace_buffer") -> torch.device:
    """The device of a FlashInfer workspace buffer (podcute does not use its memory)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} must be on a CUDA device (or the CPU, to plan on the host "
                         f"only), got {buf.device}")
    return buf.device


def _int32(name, a: np.ndarray) -> np.ndarray:
    """A host index array as the int32 the planner takes (sums of int32 inputs may not be)."""
    if a.dtype == np.int32:
        return a
    if a.size and (a.max() >= 2**31 or a.min() < -2**31):
        raise ValueError(f"{name} does not fit int32 (values up to {int(a.max())})")
    return a.astype(np.int32, copy=False)


# --------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------


def _with_page_dim(t, kv_layout, ndim, name):
    """FlashInfer lets page_size 1 drop its dimension; put it back (a view)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == ndim - 1:
        return t.unsqueeze(-3 if kv_layout == "NHD" else -2)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D ({ndim - 1}-D for page_size 1), got shape "
                         f"{tuple(t.shape)}")
    return t


def unpack_paged_kv_cache(paged_kv_cache, kv_layout="NHD", name="paged_kv_cache"):
    """(k_cache, v_cache) views of FlashInfer's paged KV cache argument, never a copy:
    one ``[P, 2, page_size, Hkv, D]`` (NHD) or ``[P, 2, Hkv, page_size, D]`` (HND) tensor
    (its ``[:, 0]`` and ``[:, 1]``), or a ``(k, v)`` tuple of ``[P, page_size, Hkv, D]`` /
    ``[P, Hkv, page_size, D]`` tensors; with page_size 1 the page dimension may be left out."""
    _check_layout("kv_layout", kv_layout)
    if isinstance(paged_kv_cache, tuple):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{name} as a tuple must be (k_cache, v_cache), got "
                             f"{len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        return (_with_page_dim(k, kv_layout, 4, f"{name}[0]"),
                _with_page_dim(v, kv_layout, 4, f"{name}[1]"))
    if not isinstance(paged_kv_cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [P, 2, ...] or a (k, v) tuple, got "
                        f"{type(paged_kv_cache).__name__}")
    kv = _with_page_dim(paged_kv_cache, kv_layout, 5, name)
    if kv.shape[1] != 2:
        raise ValueError(f"{name} must hold K and V along dim 1 ([P, 2, ...]), got shape "
                         f"{tuple(kv.shape)}")
    return kv[:, 0], kv[:, 1]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _check_cache_dtype(name, k, v, dtype) -> None:
    if k.dtype != dtype or v.dtype != dtype:
        got = k.dtype if k.dtype != dtype else v.dtype
        raise TypeError(f"{name} must be {dtype} (plan()'s kv_data_type), got {got}")


def _check_q(name, q, attn: PODAttention, rows: int, exact=False) -> None:
    """q_p / q_d / q: [rows (or more, unless exact), Hq, D] in the planned dtype, on the
    wrapper's device."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != attn.dtype:
        raise TypeError(f"{name} must be {attn.dtype} (plan()'s q_data_type), got {q.dtype}")
    want = (attn.num_qo_heads, attn.head_dim)
    if q.dim() != 3 or tuple(q.shape[1:]) != want:
        raise ValueError(f"{name} must be [rows, num_qo_heads={want[0]}, head_dim={want[1]}], "
                         f"got shape {tuple(q.shape)}")
    if q.shape[0] < rows or (exact and q.shape[0] != rows):
        raise ValueError(f"{name} has {q.shape[0]} rows; the planned batch has {rows} query "
                         f"tokens{'' if exact else ' (more rows are padding)'}")
    if not same_device(q.device, attn.device):
        raise ValueError(f"{name} is on {q.device}, the wrapper on {attn.device} (its "
                         "workspace buffer's device)")


def _rows_in_sequence(a: torch.Tensor, b: torch.Tensor):
    """[a; b] as one view when b's rows directly follow a's in memory (q_p and q_d cut
    from one q tensor), else None."""
    if (a.stride() != b.stride() or a.device != b.device
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.shape[0] * a.stride(0)):
        return None
    return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride())


def _ragged_as_pages(x: torch.Tensor, layout_in: str, page_size: int, layout_out: str):
    """Contiguous ragged K or V, [L, Hkv, D] (NHD) or [Hkv, L, D] (HND), as a paged cache
    of L / page_size pages in `layout_out` (a view: page j holds tokens j*page .. +page)."""
    tokens = x if layout_in == "NHD" else x.transpose(0, 1)
    pages = tokens.unflatten(0, (tokens.shape[0] // page_size, page_size))
    return pages if layout_out == "NHD" else pages.transpose(1, 2)


# --------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------


class _Wrapper:
    """What the wrappers share: their device and KV layout, and one PODAttention per
    configuration and role, created on first use (its compiled kernels are shared)."""

    def __init__(self, device, kv_layout: str):
        _check_layout("kv_layout", kv_layout)
        self.device = device  # PODAttention checks it (when plan() first creates one)
        self._kv_layout = kv_layout
        self._attns: dict = {}

    def _attention(self, role, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                   kv_dtype=None, head_dim_name="head_dim", head_dim_vo=None,
                   **capacities) -> PODAttention:
        """The PODAttention of a role and configuration; `capacities` (PODAttention's
        max_batch_size / max_num_pages) size a new one, as FlashInfer sizes a CUDA-graph
        wrapper from the buffers the caller hands it. `head_dim_vo`: a value head dim of
        its own (BatchAttention's head_dim_vo), else None."""
        for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        (head_dim_name, head_dim), ("page_size", page_size)):
            check_int(name, v)
        key = (role, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype,
               head_dim_vo)
        attn = self._attns.get(key)
        if attn is None:
            with renamed_errors({"head_dim": head_dim_name, "kv_dtype": "kv_data_type"}):
                attn = PODAttention(num_qo_heads, num_kv_heads, head_dim, page_size,
                                    dtype=dtype, kv_layout=self._kv_layout, device=self.device,
                                    kv_dtype=kv_dtype, head_dim_vo=head_dim_vo, **capacities)
            self._attns[key] = attn
        return attn


def _end_forward(self) -> None:
    """Does nothing (FlashInfer's deprecated counterpart of begin_forward)."""


def _require_plan(planned):
    if planned is None:
        raise RuntimeError("run() called before plan(): plan the batch first")
    return planned


class BatchPODWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's batched POD wrapper: a paged prefill batch and a paged decode batch in
    one podcute launch.

    plan() concatenates the two batches on the host (prefill requests first, then decode
    requests; CSR indptrs rebased and offset) into one podcute plan; run() gives the
    kernel q_p and q_d as one q (a view when q_d's rows directly follow q_p's in memory,
    else one copy into a wrapper-owned staging buffer) and returns views of one output.

    When ``paged_kv_cache_p`` and ``paged_kv_cache_d`` are different tensors, the launch
    reads each side's pages from its own cache (the prefill requests from the second cache
    of a `second_cache` kernel variant). Limits of the one-launch design (each raises a
    named error, except the first):

    - separate caches in fp8, or with ``causal_p=True`` and a decode request of more than
      one query token: each side runs over its own cache in a launch of its own (two
      launches, each side planned on first use from plan()'s copies; the decode side
      without a mask);
    - ``q_p`` must have exactly ``qo_indptr_p[-1]`` rows (FlashInfer's documented shape)
      since the decode rows follow them; ``q_d`` may have padding rows past
      ``qo_indptr_d[-1]`` (never written);
    - ``causal_p=True`` with a decode request of more than one query token: FlashInfer
      runs its decode side non-causally, podcute masks a launch one way.

    The workspace buffer is checked, not used (podcute's planner owns its buffers). Unlike
    FlashInfer's, run() is CUDA-graph capturable (podcute README, "CUDA graphs"): run it
    eagerly once, capture, then plan() later batches and replay; the prefill token count
    (``qo_indptr_p[-1]``) is then fixed by the capture, the decode batch may change within
    the captured ``q_d`` rows.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        super().__init__(_workspace_device(float_workspace_buffer), kv_layout)
        self._float_workspace_buffer = float_workspace_buffer
        self._attn = None  # the PODAttention of the planned configuration
        self._batch = None  # host arrays of the planned (concatenated) batch
        self._causal = False  # causal_p of the last run(): what plan() plans
        self._staging: dict = {}  # PODAttention -> q buffer [rows, Hq, D]
        self._captured_rows_p = None  # q_p's rows in a captured run()
        self._sides = None  # (causal_p, [prefill, decode] PODAttentions): separate caches

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False  # FlashInfer's flag (its BatchPOD has no CUDA-graph mode)

    def plan(self, qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, qo_indptr_d,
             kv_indptr_d, kv_indices_d, last_page_len_d, num_qo_heads, num_kv_heads,
             head_dim, page_size, pos_encoding_mode="NONE", window_left=-1,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True) -> None:
        """Plan the prefill batch (``*_p``) and the decode batch (``*_d``) as one podcute
        batch. Index tensors are int32, on the CPU (no device sync) or on the wrapper's
        device (one device->host copy for all eight)."""
        _check_features(pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                        rope_theta=rope_theta)
        window = _window("window_left", window_left)
        _check_bool("non_blocking", non_blocking)
        dtype, kv_dtype = _plan_dtype(q_data_type, kv_data_type, data_type)
        self._attn = self._batch = self._sides = None  # a failed plan() leaves no stale plan
        attn = self._attention("pod", num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                               kv_dtype)
        named = {}
        for side, tensors in (("p", (qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p)),
                              ("d", (qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d))):
            named.update(_checked_side(side, tensors, attn.device))
        h = host_arrays(named)  # at most one device->host copy
        p, d = _side(h, "p"), _side(h, "d")
        if self._captured_rows_p is not None and p.total != self._captured_rows_p:
            raise ValueError(f"qo_indptr_p[-1]={p.total}, but a captured CUDA graph holds "
                             f"q_p with {self._captured_rows_p} rows (the decode rows follow "
                             "them); after a capture the prefill token count is fixed")
        self._batch = SimpleNamespace(
            num_prefill=p.batch_size, total_p=p.total, total_d=d.total,
            max_q_d=int(np.diff(d.qo).max(initial=0)), sm_scale=sm_scale, window=window,
            cu=_int32("qo_indptr_p[-1] + qo_indptr_d", np.concatenate([p.qo, d.qo[1:] + p.total])),
            indptr=_int32("kv_indptr", np.concatenate([p.indptr, d.indptr[1:] + p.indptr[-1]])),
            indices=_int32("kv_indices", np.concatenate([p.indices, d.indices])),
            last_page_len=_int32("last_page_len", np.concatenate([p.lpl, d.lpl])))
        if attn in self._staging:  # grow it now, not in run()
            self._stage_rows(attn, p.total + d.total)
        self._attn = attn
        try:
            self._plan_batch(self._causal)
        except Exception:
            self._attn = self._batch = None
            raise

    begin_forward = plan
    end_forward = _end_forward

    def _plan_batch(self, causal: bool) -> None:
        b = self._batch
        note = (f" (BatchPOD plans the {b.num_prefill} prefill requests as requests 0.."
                f"{b.num_prefill - 1}, then decode request i as request {b.num_prefill} + i)")
        names = {"cu_seqlens_q": "qo_indptr_p/qo_indptr_d", "kv_indices": "kv_indices_p/_d",
                 "kv_indptr": "kv_indptr_p/_d", "last_page_len": "last_page_len_p/_d"}
        with renamed_errors(names, note):
            self._attn.plan(b.cu, kv_indptr=b.indptr, kv_indices=b.indices,
                            last_page_len=b.last_page_len, causal=causal, sm_scale=b.sm_scale,
                            window_size=b.window, _second_cache_requests=b.num_prefill)

    def _stage_rows(self, attn: PODAttention, rows: int) -> torch.Tensor:
        """The wrapper-owned q buffer with >= rows rows; it grows only until a capture."""
        buf = self._staging.get(attn)
        if buf is None or buf.shape[0] < rows:
            if attn.planner.frozen or capturing():
                raise CapacityError(f"q_p and q_d need {rows} rows of the q staging buffer, "
                                    f"which holds {0 if buf is None else buf.shape[0]} and cannot "
                                    "grow under a CUDA graph: run() once eagerly with the "
                                    "largest batch before capturing")
            rows = max(rows, 2 * buf.shape[0]) if buf is not None else rows
            buf = torch.empty(rows, attn.num_qo_heads, attn.head_dim, dtype=attn.dtype,
                              device=attn.device)
            self._staging[attn] = buf
        return buf

    def run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p=None,
            packed_custom_mask_p=None, causal_p=False, q_scale=None, k_scale=None,
            v_scale=None, return_lse=False, use_fp16_qk_reduction=False, enable_pdl=None):
        """Attention of the planned prefill and decode batches in one launch.

        Returns ``(out_p, out_d)``, or with ``return_lse`` ``((out_p, out_d), (lse_p,
        lse_d))`` (FlashInfer's code returns this order) with base-2 LSE float32
        ``[rows, num_qo_heads]``. The outputs are views of one fresh buffer per call.
        """
        _check_features(custom_mask_p=custom_mask_p, packed_custom_mask_p=packed_custom_mask_p,
                        use_fp16_qk_reduction=use_fp16_qk_reduction)
        _check_bool("causal_p", causal_p)
        _check_bool("return_lse", return_lse)
        _check_bool("enable_pdl", enable_pdl, optional=True)
        attn, b = _require_plan(self._attn), self._batch
        scales, out_scale = _scales(attn, q_scale, k_scale, v_scale)
        _check_q("q_p", q_p, attn, b.total_p, exact=True)
        _check_q("q_d", q_d, attn, b.total_d)
        k, v = unpack_paged_kv_cache(paged_kv_cache_p, self._kv_layout, "paged_kv_cache_p")
        k_d, v_d = unpack_paged_kv_cache(paged_kv_cache_d, self._kv_layout, "paged_kv_cache_d")
        _check_cache_dtype("paged_kv_cache_p", k, v, attn.kv_dtype)
        second, names = None, {}
        two_caches = not (_same_view(k, k_d) and _same_view(v, v_d))
        if two_caches:
            _check_cache_dtype("paged_kv_cache_d", k_d, v_d, attn.kv_dtype)
        if b.num_prefill == 0:
            # (no request reads the prefill cache: one launch over the decode cache, whose
            # plan may share prefixes)
            k, v = k_d, v_d
            names = {"k_cache": "paged_kv_cache_d (k)", "v_cache": "paged_kv_cache_d (v)"}
        elif two_caches:
            if attn.fp8 or (causal_p and b.max_q_d > 1):
                return self._run_sides(q_p, (k, v), q_d, (k_d, v_d), causal_p, return_lse,
                                       scales, out_scale)
            # One launch: the prefill requests (plan requests [0, num_prefill)) read the
            # second cache, the decode requests the first.
            second, (k, v) = (k, v), (k_d, v_d)
            names = _TWO_CACHE_NAMES
        if causal_p and b.max_q_d > 1:
            raise NotImplementedError(
                f"causal_p=True with a decode request of {b.max_q_d} query tokens is not "
                "supported: FlashInfer runs the decode batch without a mask, podcute masks "
                "its one launch one way (supported: causal_p=False, or decode q_len 1)")
        if attn.current_plan.causal != causal_p:
            if capturing():
                raise RuntimeError(f"run(causal_p={causal_p}) under CUDA-graph capture needs a "
                                   "new plan; run it once eagerly before capturing")
            self._plan_batch(causal_p)
        self._causal = causal_p
        q = _rows_in_sequence(q_p, q_d)
        if q is None:
            rows = q_p.shape[0] + q_d.shape[0]
            q = self._stage_rows(attn, rows)[:rows]
            torch.cat((q_p, q_d), out=q)
        with renamed_errors(names):
            res = attn.run(q, k, v, return_lse=return_lse, _second_cache=second, **scales)
        if capturing():
            self._captured_rows_p = b.total_p
        n = q_p.shape[0]
        if not return_lse:
            _scaled(res, out_scale, n + b.total_d)
            return res[:n], res[n:]
        out, lse = res
        _scaled(out, out_scale, n + b.total_d)
        lse.mul_(LOG2E)
        return (out[:n], out[n:]), (lse[:n], lse[n:])


    def _run_sides(self, q_p, cache_p, q_d, cache_d, causal_p, return_lse, scales,
                   out_scale):
        """Separate prefill and decode caches where one launch cannot serve them (fp8
        caches, which have no second-cache variant; causal_p with a decode request of
        several query tokens, which FlashInfer runs without a mask): each side over its
        own cache, two launches, each side planned from the plan()'s copies on first use
        (the decode side without a mask, as FlashInfer runs it)."""
        b = self._batch
        if self._sides is None or self._sides[0] != causal_p:
            if capturing():
                raise RuntimeError("run() with separate prefill and decode caches under "
                                   "CUDA-graph capture needs new plans; run it once eagerly "
                                   "before capturing")
            n, ip = b.num_prefill, b.indptr
            split = int(ip[n])
            sides = []
            for role, cu, indptr, indices, last, causal in (
                    ("pod_p", b.cu[: n + 1], ip[: n + 1], b.indices[:split],
                     b.last_page_len[:n], causal_p),
                    ("pod_d", b.cu[n:] - b.cu[n], ip[n:] - split, b.indices[split:],
                     b.last_page_len[n:], False)):
                attn = self._attention(role, self._attn.num_qo_heads, self._attn.num_kv_heads,
                                       self._attn.head_dim, self._attn.page_size,
                                       self._attn.dtype, self._attn.kv_dtype)
                with renamed_errors({"cu_seqlens_q": f"qo_indptr_{role[-1]}"}):
                    attn.plan(cu, kv_indptr=indptr, kv_indices=indices, last_page_len=last,
                              causal=causal, sm_scale=b.sm_scale, window_size=b.window)
                sides.append(attn)
            self._sides = (causal_p, sides)  # (a side's attention holds one plan)
        sides = self._sides[1]
        res = []
        for attn, q, (k, v), rows in ((sides[0], q_p, cache_p, b.total_p),
                                      (sides[1], q_d, cache_d, b.total_d)):
            r = attn.run(q, k, v, return_lse=return_lse, **scales)
            _scaled(r[0] if return_lse else r, out_scale, rows)
            if return_lse:
                r[1][:rows].mul_(LOG2E)
            res.append(r)
        if not return_lse:
            return res[0], res[1]
        return (res[0][0], res[1][0]), (res[0][1], res[1][1])


# run()'s error names for BatchPOD's separate caches (the decode cache is the launch's
# first, the prefill cache its second).
_TWO_CACHE_NAMES = {"the second k cache": "paged_kv_cache_p (k)",
                    "the second v cache": "paged_kv_cache_p (v)",
                    "the second cache": "paged_kv_cache_p", "the first cache": "paged_kv_cache_d",
                    "k_cache": "paged_kv_cache_d (k)", "v_cache": "paged_kv_cache_d (v)"}


def _checked_side(side: str, tensors, device) -> dict:
    """One side's four index tensors by FlashInfer name, checked: int32 1-D tensors on the
    CPU or `device`, kv_indptr of batch_size + 1 and last_page_len of batch_size entries."""
    names = [f"{n}_{side}" for n in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len")]
    check_index(names[0], tensors[0], device, 1)
    B = tensors[0].shape[0] - 1
    if B < 0:
        raise ValueError(f"{names[0]} must have batch_size + 1 >= 1 entries, got 0")
    for name, t, length in zip(names[1:], tensors[1:], (B + 1, None, B)):
        check_index(name, t, device, 1, length)
    return dict(zip(names, tensors))


def _side(h: dict, side: str) -> SimpleNamespace:
    """One side ("p" or "d") of a BatchPOD plan from host arrays, checked under its names:
    qo_indptr from 0 and non-decreasing, kv_indptr rebased to 0 with the indices it uses."""
    qo = h[f"qo_indptr_{side}"].astype(np.int64)
    ip = h[f"kv_indptr_{side}"].astype(np.int64)
    indices = h[f"kv_indices_{side}"]
    if qo[0] != 0 or (np.diff(qo) < 0).any():
        raise ValueError(f"qo_indptr_{side} must start at 0 and be non-decreasing, got "
                         f"{qo[:8].tolist()}{'...' if qo.size > 8 else ''}")
    if ip[0] < 0 or (np.diff(ip) < 0).any():
        raise ValueError(f"kv_indptr_{side} must be non-negative and non-decreasing")
    if ip[-1] > indices.size:
        raise ValueError(f"kv_indptr_{side}[-1]={int(ip[-1])} exceeds len(kv_indices_{side})="
                         f"{indices.size}")
    return SimpleNamespace(qo=qo, total=int(qo[-1]), batch_size=qo.size - 1,
                           indptr=ip - ip[0], indices=indices[ip[0]: ip[-1]],
                           lpl=h[f"last_page_len_{side}"])


class PODWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's older POD wrapper: one prefill request over contiguous ragged K/V
    (``k_p``, ``v_p``) plus a paged decode batch (one query token per request).

    **One launch**: run() plans the prefill and the decode batch as one podcute batch (the
    prefill is its request 0) and launches the kernel's ``ragged`` variant, which reads
    request 0's K/V rows from ``k_p``/``v_p`` and every other request's from the paged
    cache. The queries go in as one tensor: a view when ``q_d``'s rows follow ``q_p``'s
    in memory, else one copy (``torch.cat``); ``out_p``/``out_d`` are views of one output.
    Two launches (the prefill over its K/V seen as pages, a view: pages of the decode
    page_size when it divides the KV length, else of one token; then the decode batch)
    serve what one plan cannot: an fp8 decode cache, a prefill ``sm_scale_p`` or
    ``window_left_p`` other than plan()'s, ``causal_p`` with a decode request that has no
    KV, and a prefill without KV.

    As in FlashInfer, run() returns ``(out_p, out_d)`` whatever ``return_lse_p`` /
    ``return_lse_d`` say (so no LSE is computed), and takes the decode side's settings
    from plan(): ``kv_layout_d`` and ``causal_d`` change nothing (one query token per
    request sees its whole KV either way); a ``sm_scale_d`` other than plan()'s raises.
    The batch is planned inside run() and re-planned only when the prefill's shape,
    ``causal_p``, ``sm_scale_p`` or ``window_left_p`` change; plan() re-plans it at once
    for the last run()'s prefill (so a captured run() replays the new decode batch beside
    the prefill shape it was captured with). ``use_cuda_graph`` and the fixed index
    buffers are accepted and checked as FlashInfer checks them, but unused: podcute copies
    the page table into its own fixed buffers at plan().
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 jit_args=None) -> None:
        _check_features(jit_args=jit_args)
        _check_bool("use_cuda_graph", use_cuda_graph)
        super().__init__(_workspace_device(float_workspace_buffer), kv_layout)
        self._fixed_batch_size = 0
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not isinstance(buf, torch.Tensor):
                    raise ValueError(f"{name} must be a torch.Tensor with use_cuda_graph=True")
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("paged_kv_indptr_buffer must have batch_size + 1 entries "
                                 "(batch_size = len(paged_kv_last_page_len_buffer))")
        self._use_cuda_graph = use_cuda_graph
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = None
        self._decode = None  # the decode batch's PODAttention, planned
        self._decode_inputs = None  # its host (indptr, indices, last_page_len)
        self._prefill_key = None  # what the prefill's current plan was made for
        self._fused = None  # the fused batch's PODAttention, planned for _fused_key
        self._fused_key = None  # the prefill facts of the fused plan (kept across plan())

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor,
                               int_workspace_buffer: torch.Tensor) -> None:
        """Swap the (unused) workspace buffers; they must stay on the wrapper's device."""
        for name, buf in (("float_workspace_buffer", float_workspace_buffer),
                          ("int_workspace_buffer", int_workspace_buffer)):
            if not same_device(_workspace_device(buf, name), self.device):
                raise ValueError(f"{name} is on {buf.device}; this wrapper plans for "
                                 f"{self.device}")
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
             rope_theta=None, non_blocking=True) -> None:
        """Plan the decode batch: request i has one query token and the CSR pages
        ``indices[indptr[i]:indptr[i+1]]`` with ``last_page_len[i]`` tokens in the last."""
        _check_features(pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                        rope_theta=rope_theta)
        window = _window("window_left", window_left)
        _check_bool("non_blocking", non_blocking)
        dtype, kv_dtype = _plan_dtype(q_data_type, kv_data_type, data_type)
        self._decode = None
        sizes = {}
        if self._use_cuda_graph:  # FlashInfer sizes a graph wrapper from its buffers
            sizes = dict(max_batch_size=max(self._fixed_batch_size, 1),
                         max_num_pages=max(len(self._paged_kv_indices_buf), 1))
        attn = self._attention("decode", num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                               kv_dtype, **sizes)
        check_index("last_page_len", last_page_len, attn.device, 1)
        B = last_page_len.shape[0]
        check_index("indptr", indptr, attn.device, 1, B + 1)
        check_index("indices", indices, attn.device, 1)
        if self._use_cuda_graph:
            if B != self._fixed_batch_size:
                raise ValueError(f"batch size {B} (len(last_page_len)) differs from the "
                                 f"{self._fixed_batch_size} fixed by the CUDA-graph buffers")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError(f"len(indices)={len(indices)} exceeds "
                                 f"paged_kv_indices_buffer's {len(self._paged_kv_indices_buf)}")
        h = host_arrays(dict(indptr=indptr, indices=indices, last_page_len=last_page_len))
        ip = _int32("indptr", h["indptr"])
        # One query token sees its whole KV with or without the causal mask unless it has
        # no KV; plan causal then, so this launch shares the kernel of a causal prefill.
        causal = bool((np.diff(ip) > 0).all())
        indices = _int32("indices", h["indices"])
        last = _int32("last_page_len", h["last_page_len"])
        with renamed_errors({"kv_indptr": "indptr", "kv_indices": "indices"}):
            attn.plan(np.arange(B + 1, dtype=np.int32), kv_indptr=ip, kv_indices=indices,
                      last_page_len=last, causal=causal, sm_scale=sm_scale, window_size=window)
        self._decode = attn
        # Copies, as FlashInfer copies at plan(): run() may plan the fused batch from them,
        # and the caller may write its tensors after plan().
        self._decode_inputs = (ip.copy(), indices[: ip[-1]].copy(), last.copy())
        if self._fused_key is not None:
            # Re-plan the fused batch for the last prefill now, so a captured run()
            # replays this decode batch.
            key, self._fused_key = self._fused_key, None
            if self._fusable(*key[1:]):
                self._plan_fused(*key)
            elif self._fused.planner.frozen:
                raise ValueError("this decode batch cannot share one launch with the prefill "
                                 "a CUDA graph captured (a request without KV beside a "
                                 "causal prefill): capture again")

    begin_forward = plan
    end_forward = _end_forward

    def run(self, q_p, k_p, v_p, q_d, paged_kv_cache_d, custom_mask_p=None,
            packed_custom_mask_p=None, causal_p=False, kv_layout_p="NHD",
            pos_encoding_mode_p="NONE", sm_scale_p=None, window_left_p=-1, rope_scale_p=None,
            rope_theta_p=None, return_lse_p=False, custom_mask_d=None,
            packed_custom_mask_d=None, causal_d=False, kv_layout_d="NHD",
            pos_encoding_mode_d="NONE", sm_scale_d=None, window_left_d=-1, rope_scale_d=None,
            rope_theta_d=None, q_scale=None, k_scale=None, v_scale=None, return_lse_d=False,
            use_fp16_qk_reduction=False, enable_pdl=None, *args):
        """The prefill (``q_p`` over ``k_p``/``v_p``, [kv_len, Hkv, D] for
        ``kv_layout_p="NHD"``, [Hkv, kv_len, D] for "HND") and the planned decode batch
        (``q_d`` over ``paged_kv_cache_d``): two podcute launches. Returns
        ``(out_p, out_d)``."""
        if args:
            raise TypeError(f"run() takes no arguments past enable_pdl, got {len(args)} more")
        _check_features(
            custom_mask_p=custom_mask_p, packed_custom_mask_p=packed_custom_mask_p,
            pos_encoding_mode_p=pos_encoding_mode_p,
            rope_scale_p=rope_scale_p, rope_theta_p=rope_theta_p, custom_mask_d=custom_mask_d,
            packed_custom_mask_d=packed_custom_mask_d, pos_encoding_mode_d=pos_encoding_mode_d,
            rope_scale_d=rope_scale_d, rope_theta_d=rope_theta_d,
            use_fp16_qk_reduction=use_fp16_qk_reduction)
        for name, v in (("causal_p", causal_p), ("return_lse_p", return_lse_p),
                        ("causal_d", causal_d), ("return_lse_d", return_lse_d)):
            _check_bool(name, v)
        _check_bool("enable_pdl", enable_pdl, optional=True)
        _check_layout("kv_layout_p", kv_layout_p)
        _check_layout("kv_layout_d", kv_layout_d)
        window_p = _window("window_left_p", window_left_p)
        decode = _require_plan(self._decode)
        # the decode side's, as FlashInfer's
        scales, out_scale = _scales(decode, q_scale, k_scale, v_scale)
        planned = decode.current_plan.options.window_left
        if _window("window_left_d", window_left_d)[0] not in (-1, planned):
            raise ValueError(f"window_left_d={window_left_d} differs from plan()'s window_left "
                             f"({planned}); the decode side uses plan()'s")
        if sm_scale_d is not None and sm_scale_d != decode.current_plan.sm_scale:
            raise ValueError(f"sm_scale_d={sm_scale_d!r} differs from plan()'s sm_scale "
                             f"({decode.current_plan.sm_scale}); the decode side uses plan()'s")
        kv_len = self._check_prefill(q_p, k_p, v_p, kv_layout_p)
        _check_q("q_d", q_d, decode, decode.current_plan.total_q)
        k_d, v_d = unpack_paged_kv_cache(paged_kv_cache_d, self._kv_layout, "paged_kv_cache_d")
        _check_cache_dtype("paged_kv_cache_d", k_d, v_d, decode.kv_dtype)
        if q_p.dtype == decode.dtype and k_d.shape[0] > 0 and self._fusable(
                kv_len, causal_p, sm_scale_p, window_p):
            key = (q_p.shape[0], kv_len, causal_p, sm_scale_p, window_p)
            if self._fused_key != key:
                if capturing():
                    raise RuntimeError("the prefill's shape or settings changed under "
                                       "CUDA-graph capture; run() once eagerly with them "
                                       "before capturing")
                self._plan_fused(*key)
            q = _rows_in_sequence(q_p, q_d)
            if q is None:
                q = torch.cat((q_p, q_d))
            # k_p / v_p as one page of all their tokens (canonical: the kernel's own view)
            ragged = [_ragged_as_pages(t, kv_layout_p, kv_len, "NHD") for t in (k_p, v_p)]
            out = self._fused.run(q, k_d, v_d, _ragged_kv=ragged, **scales)
            n = q_p.shape[0]
            _scaled(out[n:], out_scale, decode.current_plan.total_q)
            return out[:n], out[n:]
        prefill, k_pages, v_pages = self._plan_prefill(q_p, k_p, v_p, kv_layout_p, causal_p,
                                                       sm_scale_p, window_p, kv_len)
        out_d = decode.run(q_d, k_d, v_d, **scales)
        return (prefill.run(q_p, k_pages, v_pages),
                _scaled(out_d, out_scale, decode.current_plan.total_q))

    def _fusable(self, kv_len, causal_p, sm_scale_p, window_p) -> bool:
        """Whether the prefill can join the planned decode batch in one plan: a 16-bit
        cache, the decode side's sm_scale and window, KV to read, and no decode request
        without KV beside a causal prefill (causal needs q_len <= kv_len)."""
        decode = self._decode
        plan = decode.current_plan
        with renamed_errors({"sm_scale": "sm_scale_p"}):
            scale_p = decode.planner.kernel_scale(sm_scale_p)  # (the planner's default)
        return (not decode.fp8 and kv_len > 0 and scale_p == plan.sm_scale
                and window_p[0] == plan.options.window_left and (plan.causal or not causal_p))

    def _plan_fused(self, q_len, kv_len, causal_p, sm_scale_p, window_p) -> None:
        """Plan [prefill; decode batch] as one batch: the prefill is request 0, whose page
        entries (page 0, looked up but never read) stand for its ragged K/V."""
        decode = self._decode
        ip, indices, last = self._decode_inputs
        page = decode.page_size
        n0 = -(-kv_len // page)
        attn = self._attention("fused", decode.num_qo_heads, decode.num_kv_heads,
                               decode.head_dim, page, decode.dtype)
        names = {"cu_seqlens_q": "q_p.shape[0]", "kv_indptr": "indptr",
                 "kv_indices": "indices", "sm_scale": "sm_scale_p"}
        with renamed_errors(names):
            attn.plan(np.concatenate(([0], q_len + np.arange(len(ip)))).astype(np.int32),
                      kv_indptr=np.concatenate(([0], n0 + ip)).astype(np.int32),
                      kv_indices=np.concatenate((np.zeros(n0, np.int32), indices)),
                      last_page_len=np.concatenate(([kv_len - (n0 - 1) * page], last)
                                                   ).astype(np.int32),
                      causal=causal_p, sm_scale=decode.current_plan.sm_scale,
                      window_size=window_p, share_prefixes=False)  # (ragged request 0)
        self._fused, self._fused_key = attn, (q_len, kv_len, causal_p, sm_scale_p, window_p)

    def _check_prefill(self, q_p, k_p, v_p, kv_layout_p) -> int:
        """Check the prefill's tensors; its KV length."""
        hq, hkv, d = self._decode.num_qo_heads, self._decode.num_kv_heads, self._decode.head_dim
        if not isinstance(q_p, torch.Tensor):
            raise TypeError(f"q_p must be a torch.Tensor, got {type(q_p).__name__}")
        if q_p.dtype not in DTYPES:
            raise TypeError(f"q_p must be torch.bfloat16 or torch.float16, got {q_p.dtype}")
        if q_p.dim() != 3 or tuple(q_p.shape[1:]) != (hq, d):
            raise ValueError(f"q_p must be [qo_len, num_qo_heads={hq}, head_dim={d}], got "
                             f"shape {tuple(q_p.shape)}")
        for name, t in (("k_p", k_p), ("v_p", v_p)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != q_p.dtype:
                raise TypeError(f"{name} must have q_p's dtype {q_p.dtype}, got {t.dtype}")
            heads = t.shape[1 if kv_layout_p == "NHD" else 0] if t.dim() == 3 else None
            if t.dim() != 3 or heads != hkv or t.shape[2] != d or t.shape != k_p.shape:
                want = "[kv_len, Hkv, D]" if kv_layout_p == "NHD" else "[Hkv, kv_len, D]"
                raise ValueError(f"{name} must be {want} with Hkv={hkv}, D={d} "
                                 f"(kv_layout_p={kv_layout_p!r}) and k_p's shape, got shape "
                                 f"{tuple(t.shape)}")
        return k_p.shape[0 if kv_layout_p == "NHD" else 1]

    def _plan_prefill(self, q_p, k_p, v_p, kv_layout_p, causal_p, sm_scale_p, window_p,
                      kv_len):
        """Plan the prefill alone (unless planned already for this shape) and return its
        PODAttention with k_p / v_p viewed as its pages (the two-launch path)."""
        hq, hkv, d = self._decode.num_qo_heads, self._decode.num_kv_heads, self._decode.head_dim
        page = self._decode.page_size if kv_len % self._decode.page_size == 0 else 1
        attn = self._attention("prefill", hq, hkv, d, page, q_p.dtype)
        key = (attn, q_p.shape[0], kv_len, causal_p, sm_scale_p, window_p)
        if self._prefill_key != key:
            if capturing():
                raise RuntimeError("the prefill's shape or settings changed under CUDA-graph "
                                   "capture; run() once eagerly with them before capturing")
            self._prefill_key = None
            n = kv_len // page
            names = {"cu_seqlens_q": "q_p.shape[0]", "kv_lens": "the KV length of k_p",
                     "sm_scale": "sm_scale_p"}
            with renamed_errors(names):
                attn.plan(np.array([0, q_p.shape[0]], np.int32), np.array([kv_len], np.int32),
                          kv_indptr=np.array([0, n], np.int32),
                          kv_indices=np.arange(n, dtype=np.int32), causal=causal_p,
                          sm_scale=sm_scale_p, window_size=window_p)
            self._prefill_key = key
        return (attn, _ragged_as_pages(k_p, kv_layout_p, page, self._kv_layout),
                _ragged_as_pages(v_p, kv_layout_p, page, self._kv_layout))


class BatchAttention(_Wrapper):
    """FlashInfer's holistic BatchAttention: one paged batch of prefill and decode
    requests, one podcute launch (podcute classifies each request itself).

    FlashInfer allocates workspace buffers on ``device``; podcute's planner owns its own,
    so this only records the device, checked by the first plan() (``"cpu"`` plans on the
    host only). plan() copies
    ``kv_indices`` into the planner's buffers: a change to the tensor after plan() is not
    seen by run() (FlashInfer reads it at run()).
    """

    def __init__(self, kv_layout: str = "NHD", device: str = "cuda"):
        super().__init__(device, kv_layout)
        self._attn = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_qo_heads, num_kv_heads,
             head_dim_qk, head_dim_vo, page_size, causal=False, sm_scale=None,
             logits_soft_cap=None, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
             use_profiler=False) -> None:
        """Plan a batch: request i has queries ``qo_indptr[i]:qo_indptr[i+1]``, KV length
        ``kv_len_arr[i]`` and pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``."""
        _check_features(use_profiler=use_profiler)
        softcap = _softcap("logits_soft_cap", logits_soft_cap)
        check_int("head_dim_qk", head_dim_qk)
        check_int("head_dim_vo", head_dim_vo)
        dtype, kv_dtype = _plan_dtype(q_data_type, kv_data_type)
        self._attn = None
        attn = self._attention("batch", num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                               dtype, kv_dtype, head_dim_name="head_dim_qk",
                               head_dim_vo=head_dim_vo)
        with renamed_errors({"cu_seqlens_q": "qo_indptr"}):
            attn.plan(qo_indptr, kv_len_arr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                      causal=causal, sm_scale=sm_scale, softcap=softcap, _kv_name="kv_len_arr")
        self._attn = attn

    def run(self, q, kv_cache, out=None, lse=None, k_scale=None, v_scale=None,
            logits_soft_cap=0.0, profiler_buffer=None, kv_cache_sf=None):
        """Attention of the planned batch. Returns ``(out, lse)``: out [rows, Hq, head_dim_vo] in
        q's dtype, lse float32 [rows, Hq] in base 2 (FlashInfer's); ``out``/``lse`` are
        filled when given (rows past ``qo_indptr[-1]`` are left as they are)."""
        _check_features(profiler_buffer=profiler_buffer, kv_cache_sf=kv_cache_sf)
        attn = _require_plan(self._attn)
        scales, out_scale = _scales(attn, None, k_scale, v_scale)
        cap = _softcap("logits_soft_cap", logits_soft_cap)
        if cap not in (0.0, attn.current_plan.options.softcap):
            raise ValueError(f"logits_soft_cap={logits_soft_cap} differs from plan()'s "
                             f"({attn.current_plan.options.softcap}); pass it to plan()")
        k, v = unpack_paged_kv_cache(kv_cache, self._kv_layout, "kv_cache")
        out, lse = attn.run(q, k, v, out=out, return_lse=True, lse=lse, **scales)
        rows = attn.current_plan.total_q
        _scaled(out, out_scale, rows)
        lse[:rows].mul_(LOG2E)
        return out, lse
