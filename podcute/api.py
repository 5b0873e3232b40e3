"""Public entry points: :class:`PODAttention` (plan once per step, run per layer) and the
one-shot :func:`pod_attention`.

All input validation lives here and happens before anything touches a GPU, so a bad
argument is reported as such on any machine; each error is a TypeError (wrong dtype or
type) or ValueError (wrong shape, device, value) whose message names the argument.
run() re-checks only what can change between layers (the tensors), not what plan()
validated (lengths, page tables).
"""

from __future__ import annotations

import math

import torch

from podcute.compile import unsupported_arch_message
from podcute.kernels.config import (FP8_KV_DTYPES, SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES,
                                    check_fp8_kv)
from podcute.launch import launch, require_arch, resolve_arch
from podcute.plan import F32_MAX, F32_TINY, CapacityError, Plan, PlanOptions, Planner, PlanSummary
from podcute.reuse import CallPlanner

__all__ = ["PODAttention", "pod_attention", "PlanSummary", "CapacityError", "KV_LAYOUTS"]

KV_LAYOUTS = ("NHD", "HND")
_DTYPES = (torch.bfloat16, torch.float16)
# fp8 KV caches (queries and output stay 16-bit): torch dtype -> KernelConfig.kv_dtype.
_FP8_DTYPES = {getattr(torch, name): name for name in FP8_KV_DTYPES}


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


def _check_int(name, v, allowed=None, positive=True):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if allowed is not None and v not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {v}")
    if positive and v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


def check_head_dim(head_dim, name: str = "head_dim") -> None:
    """A head dim podcute compiles, else NotImplementedError (a positive int: a model's
    head size the kernels lack) or TypeError/ValueError (no head size at all)."""
    if head_dim in SUPPORTED_HEAD_DIMS and type(head_dim) is int:
        return
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"{name} must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"{name} must be >= 1, got {head_dim}")
    raise NotImplementedError(f"{name}={head_dim} is not supported by podcute (supported: "
                              f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))})")


def _check_sm_scale(sm_scale, name: str = "sm_scale") -> None:
    """None or a real number (its value is the planner's to check: a positive float32)."""
    if sm_scale is not None and (isinstance(sm_scale, bool)
                                 or not isinstance(sm_scale, (int, float))):
        raise TypeError(f"{name} must be a float or None, got {type(sm_scale).__name__}")


def _check_layout(kv_layout):
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


def _check_index(name, t, device, ndim, length=None, optional=False):
    """An int32 index tensor on the CPU or on `device` (numpy int32 arrays are accepted:
    the planner reads them on the host anyway)."""
    if t is None:
        if optional:
            return
        raise ValueError(f"{name} is required")
    if isinstance(t, torch.Tensor):
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor, got {t.dtype}")
        if t.device.type != "cpu" and not _same_device(t.device, device):
            raise ValueError(f"{name} is on {t.device}; index tensors must be on the CPU or on "
                             f"the attention's device ({device})")
        if ndim == 2 and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides "
                             f"{tuple(t.stride())}")
    elif hasattr(t, "dtype") and hasattr(t, "shape"):  # numpy
        if str(t.dtype) != "int32":
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    else:
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if len(t.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries along dim 0, got shape "
                         f"{tuple(t.shape)}")


def _check_aligned_rows(*named):
    """The kernel moves rows in 16-byte pieces (cp.async): every row must start 16-byte
    aligned, i.e. an aligned data pointer and strides that are multiples of 16 bytes (8
    elements of a 16-bit tensor, 16 of an fp8 cache)."""
    for name, t in named:
        elems = 16 // t.element_size()
        if t.data_ptr() % 16 or any(s % elems for s in t.stride()[:-1]):
            raise ValueError(f"{name} rows must be 16-byte aligned: data pointer % 16 == 0 and "
                             f"strides (except the last) multiples of {elems} elements; got "
                             f"strides {tuple(t.stride())} and data pointer {t.data_ptr():#x}")


def _check_rows_like(name: str, t, q: torch.Tensor, want: tuple, what: str) -> None:
    """A tensor of rows the kernel moves beside q's: dense, q's dtype and device, shape
    `want` (described as `what`), a contiguous last dim and 16-byte rows."""
    _check_dense(name, t)
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must be {what} = {want}, got {tuple(t.shape)}")
    if not _same_device(t.device, q.device):
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides "
                         f"{tuple(t.stride())}")
    _check_aligned_rows((name, t))


def _byte_range(ptr: int, shape, stride, elem_size: int) -> tuple[int, int]:
    """[first, last + 1) byte addresses of the elements of a tensor with this data
    pointer, shape and strides (torch strides are >= 0); (0, 0) when it is empty."""
    if 0 in shape:
        return 0, 0
    span = 1
    for n, st in zip(shape, stride):
        span += (n - 1) * st
    return ptr, ptr + span * elem_size


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """_byte_range of a tensor."""
    return _byte_range(t.data_ptr(), t.shape, t.stride(), t.element_size())


def _check_dense(name: str, t) -> None:
    """A tensor argument: a torch.Tensor with a strided (dense) layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def _check_distinct(t: torch.Tensor, name: str) -> None:
    """No two elements of an output may share memory (zero or overlapping strides)."""
    for n, s in zip(t.shape, t.stride()):
        if n > 1 and s == 0:
            raise ValueError(f"{name} must not have zero strides (an expanded view), got "
                             f"strides {tuple(t.stride())}")
    # Elements are distinct when, with dims ordered by stride, each stride exceeds the span
    # of all smaller dims (sufficient, and true of every dense or sliced tensor).
    span = 0
    dims = sorted(((s, n) for n, s in zip(t.shape, t.stride()) if n > 1))
    for s, n in dims:
        if s <= span:
            raise ValueError(f"{name}'s elements overlap each other (shape {tuple(t.shape)}, "
                             f"strides {tuple(t.stride())}); pass a non-overlapping buffer")
        span += (n - 1) * s


def _check_out_memory(out: torch.Tensor, named) -> None:
    """`out` must not write where the kernel reads (q, the caches) and no two of its
    elements may share memory (zero or overlapping strides)."""
    _check_distinct(out, "out")
    name = _overlapped(out, named)
    if name is not None:
        raise ValueError(f"out overlaps {name} in memory; the kernel reads {name} while it "
                         "writes out, so out must be a separate buffer (not q itself)")


def _overlapped(out: torch.Tensor, named):
    """The name of the first (name, tensor) whose byte range meets out's, or None."""
    lo, hi = _extent(out)
    for name, t in named:
        tlo, thi = _extent(t)
        if lo < thi and tlo < hi:
            return name
    return None


def _scale_tensor(name: str, scale, num_kv_heads: int, device, cache: dict):
    """An fp8 cache's dequantisation scale as the float32 [1] or [Hkv] device tensor the
    kernel reads: a Python float (finite, > 0) becomes a cached one-element tensor; a
    float32 tensor of shape [], [1] or [Hkv] on the attention's device is used as it is
    (its values stay on the device: an engine may change them between graph replays,
    and they are not checked here, which would cost a device sync)."""
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        _check_dense(name, scale)
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {scale.dtype}")
        if scale.dim() > 1 or scale.numel() not in (1, num_kv_heads):
            raise ValueError(f"{name} must be a float or a float32 tensor of shape [], [1] or "
                             f"[num_kv_heads] = [{num_kv_heads}], got shape {tuple(scale.shape)}")
        if not _same_device(scale.device, device):
            raise ValueError(f"{name} is on {scale.device}; it must be on {device} (or a float)")
        flat = scale.reshape(-1)
        if flat.numel() > 1 and flat.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {flat.stride(0)}")
        if flat.data_ptr() % 4:
            raise ValueError(f"{name} must be 4-byte aligned, got data pointer "
                             f"{flat.data_ptr():#x}")
        return flat
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or a float32 tensor, got {type(scale).__name__}")
    try:
        scale = float(scale)
    except OverflowError:  # an int past float64
        scale = math.inf
    if not F32_TINY <= scale <= F32_MAX:  # the kernel's float32, no subnormal (fast math)
        raise ValueError(f"{name} must be finite and > 0, a normal float32 (1.2e-38 .. "
                         f"3.4e38), got {scale}")
    hit = cache.get(scale)
    if hit is None:
        # (a fill kernel, not a host copy: it may run under CUDA-graph capture, where it is
        # captured too; only tensors made outside a capture are kept for later calls)
        hit = torch.full((1,), scale, dtype=torch.float32, device=device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing and len(cache) < 256:
            cache[scale] = hit
    return hit


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a == b:
        return True
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


# --------------------------------------------------------------------------------------
# PODAttention
# --------------------------------------------------------------------------------------


class PODAttention:
    """Fused prefill+decode paged attention for one head/page configuration.

    ``plan()`` once per batch (host work, no GPU sync when the index tensors are on the
    CPU), then ``run()`` once per layer. Buffers are sized from the capacities
    (``max_batch_size`` requests, ``max_num_tokens`` query tokens, ``max_num_pages``
    page-list entries: see :class:`~podcute.plan.Planner`) and grow for a bigger batch
    only until a ``run()`` is captured in a CUDA graph; after that, ``plan()`` raises
    :class:`~podcute.plan.CapacityError` for a batch that does not fit (README, CUDA graphs).
    ``arch`` (or ``$PODCUTE_ARCH``) forces a kernel target, e.g. ``"sm_90"`` for the
    warp-level kernel on Hopper; by default the device's own (sm_90a on a CPU planner).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, kv_layout: str = "NHD",
                 device="cuda", max_batch_size: int = 256, max_num_tokens: int = 16384,
                 max_num_pages: int | None = None, kv_dtype: torch.dtype | None = None,
                 arch: str | None = None):
        _check_int("num_qo_heads", num_qo_heads)
        _check_int("num_kv_heads", num_kv_heads)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        check_head_dim(head_dim)
        _check_int("page_size", page_size, SUPPORTED_PAGE_SIZES)
        _check_int("max_batch_size", max_batch_size)
        _check_int("max_num_tokens", max_num_tokens)
        if max_num_pages is not None:
            _check_int("max_num_pages", max_num_pages)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if kv_dtype is None:
            kv_dtype = dtype
        if kv_dtype != dtype and kv_dtype not in _FP8_DTYPES:
            raise TypeError(f"kv_dtype must be None, dtype ({dtype}) or an fp8 type "
                            f"(torch.float8_e4m3fn, torch.float8_e5m2), got {kv_dtype}")
        if kv_dtype in _FP8_DTYPES:
            check_fp8_kv(head_dim, _FP8_DTYPES[kv_dtype])
        _check_layout(kv_layout)
        if not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"device must be a str, int or torch.device, got "
                            f"{type(device).__name__}")
        try:
            device = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device {device!r} is not a valid torch device ({err})") from None
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a CUDA device (or 'cpu' to plan on the host "
                             f"only), got {device}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(unsupported_arch_message(
                "no CUDA device (construct with device='cpu' to plan on the host only)"))
        if device.type == "cuda" and device.index is None:
            # An explicit index makes run()'s device checks one equality test.
            device = torch.device("cuda", torch.cuda.current_device())
        # The kernel's architecture: `arch` or $PODCUTE_ARCH (e.g. "sm_90": the portable
        # kernel on Hopper), else the device's own (sm_90a for a host-only planner).
        self.arch = resolve_arch(device, arch)
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.dtype, self.kv_layout, self.device = dtype, kv_layout, device
        self.kv_dtype = kv_dtype
        self.fp8 = kv_dtype in _FP8_DTYPES
        # run()'s one-pass check: cache element bytes, and the stride mask of 16-byte rows
        self._kv_elem = 1 if self.fp8 else 2
        self._kv_stride_mask = 16 // self._kv_elem - 1
        self._scales: dict = {}  # float scale -> its device tensor (fp8 caches)
        self.planner = Planner(num_qo_heads, num_kv_heads, head_dim, page_size, device=device,
                               max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                               max_num_pages=max_num_pages,
                               dtype=str(dtype).replace("torch.", ""),
                               kv_dtype=_FP8_DTYPES.get(kv_dtype, ""), arch=self.arch)
        self._plan: Plan | None = None
        self._device_ok = False  # run()'s require_arch passed (it cannot fail later)
        self._page_arg = "block_table"
        self._cache_tail = ((page_size, num_kv_heads, head_dim) if kv_layout == "NHD"
                            else (num_kv_heads, page_size, head_dim))
        self._q_tail = (num_qo_heads, head_dim)

    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    def plan(self, cu_seqlens_q, kv_lens=None, block_table=None, kv_indptr=None,
             kv_indices=None, last_page_len=None, causal: bool = True,
             sm_scale: float | None = None, *, window_size=(-1, -1), softcap: float = 0.0,
             batch_invariant: bool = False, _kv_name: str = "kv_lens") -> PlanSummary:
        """Plan a batch. `cu_seqlens_q` int32 [B+1]; KV lengths from `kv_lens` int32 [B] or
        FlashInfer's `last_page_len` (with CSR pages); pages from `block_table` int32
        [B, max_pages] or CSR `kv_indptr` [B+1] + `kv_indices`. Index tensors may live on
        the CPU (no GPU sync) or on the device (one device->host copy).

        `window_size=(left, right)`: sliding window, FlashAttention's convention (-1 =
        unbounded); `softcap > 0`: logits soft-capped to softcap * tanh(s / softcap);
        `batch_invariant`: a request's output is bitwise the same whatever shares its
        batch (docs/contract.md). A plan serves the layers that share these."""
        # One pass over what a serving loop passes (int32 CPU tensors of the right ranks and
        # lengths); anything else takes the detailed checks, which name the argument.
        if not self._plan_common_case(cu_seqlens_q, kv_lens, block_table, kv_indptr,
                                      kv_indices, last_page_len, causal, sm_scale):
            self._validate_plan(cu_seqlens_q, kv_lens, block_table, kv_indptr, kv_indices,
                                last_page_len, causal, sm_scale, _kv_name)
        # A failed plan() leaves no stale plan behind. The old plan is released only once
        # the new one is built: freed first, its memory (the top of the heap, on a large
        # batch) goes back to the OS and the new plan's arrays fault their pages in again.
        old, self._plan = self._plan, None
        self._plan = self.planner.plan(cu_seqlens_q, kv_lens, block_table=block_table,
                                       kv_indptr=kv_indptr, kv_indices=kv_indices,
                                       last_page_len=last_page_len, causal=causal,
                                       sm_scale=sm_scale, window_size=window_size,
                                       softcap=softcap, batch_invariant=batch_invariant,
                                       _kv_name=_kv_name)
        del old
        self._page_arg = "block_table" if block_table is not None else "kv_indices"
        return self._plan.summary

    @staticmethod
    def _plan_common_case(cu_seqlens_q, kv_lens, block_table, kv_indptr, kv_indices,
                          last_page_len, causal, sm_scale) -> bool:
        """True if the plan() arguments pass _validate_plan: int32 dense CPU tensors of the
        right ranks and lengths (block table rows contiguous), kv_lens (not
        last_page_len), one page format, a bool causal, sm_scale None or a float."""
        def ok(t, ndim, length=None):
            return (type(t) is torch.Tensor and t.dtype is torch.int32 and t.is_cpu
                    and t.layout is torch.strided and t.dim() == ndim
                    and (length is None or t.shape[0] == length)
                    and (ndim == 1 or t.shape[1] <= 1 or t.stride(1) == 1))

        if not ok(cu_seqlens_q, 1) or last_page_len is not None:
            return False
        B = cu_seqlens_q.shape[0] - 1
        if block_table is not None:
            pages = ok(block_table, 2, B) and kv_indptr is None and kv_indices is None
        else:
            pages = ok(kv_indptr, 1, B + 1) and ok(kv_indices, 1)
        return (pages and B >= 0 and ok(kv_lens, 1, B) and (causal is True or causal is False)
                and (sm_scale is None or type(sm_scale) is float))

    def _validate_plan(self, cu_seqlens_q, kv_lens, block_table, kv_indptr, kv_indices,
                       last_page_len, causal, sm_scale, _kv_name) -> None:
        """Every plan() argument check, each raising a TypeError/ValueError that names the
        argument (the values are the planner's to check)."""
        dev = self.device
        _check_index("cu_seqlens_q", cu_seqlens_q, dev, 1)
        B = cu_seqlens_q.shape[0] - 1
        if B < 0:
            raise ValueError("cu_seqlens_q must have B+1 >= 1 entries, got 0")
        if (kv_lens is None) == (last_page_len is None):
            raise ValueError(f"pass exactly one of {_kv_name} or last_page_len")
        _check_index(_kv_name, kv_lens, dev, 1, B, optional=True)
        _check_index("last_page_len", last_page_len, dev, 1, B, optional=True)
        csr = kv_indptr is not None or kv_indices is not None
        if (block_table is not None) == csr:
            raise ValueError("pass exactly one page format: block_table, or kv_indptr and "
                             "kv_indices")
        if csr:
            _check_index("kv_indptr", kv_indptr, dev, 1, B + 1)
            _check_index("kv_indices", kv_indices, dev, 1)
        else:
            _check_index("block_table", block_table, dev, 2, B)
        if last_page_len is not None and not csr:
            raise ValueError("last_page_len needs the CSR page format (kv_indptr, kv_indices)")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        _check_sm_scale(sm_scale)  # (its value is the planner's to check)

    def _common_case(self, plan: Plan, q, k_cache, v_cache, out) -> bool:
        """True if the run() arguments are valid: right types, dtypes, device, shapes,
        contiguous last dims, 16-byte aligned rows, pages inside the cache (the checks of
        _validate_run, conservatively: False sends a call to them). Runs once per layer,
        so it is written for the interpreter: each tensor's shape, strides and address
        are read once, the checks are unrolled for q's 3 and the caches' 4 dims (a loop
        or a torch.Size slice costs more than the comparisons)."""
        T, dev, kv_dt = torch.Tensor, self.device, self.kv_dtype
        try:
            if (type(q) is not T or type(k_cache) is not T or type(v_cache) is not T
                    or q.dtype is not self.dtype or k_cache.dtype is not kv_dt
                    or v_cache.dtype is not kv_dt or q.device != dev
                    or k_cache.device != dev or v_cache.device != dev):
                return False
            # stride() raises (RuntimeError) for a sparse or other non-strided layout
            qn, qs, qp = q.shape, q.stride(), q.data_ptr()
            kn, ks, kp = k_cache.shape, k_cache.stride(), k_cache.data_ptr()
            vs, vp = v_cache.stride(), v_cache.data_ptr()
            Hq, D = self._q_tail
            a, b, c = self._cache_tail
            m = self._kv_stride_mask  # 16-byte rows
            if (len(qn) != 3 or qn[1] != Hq or qn[2] != D or qs[2] != 1
                    or (qs[0] | qs[1]) & 7 or qp & 15
                    or not plan.total_q <= qn[0] < 2**31
                    or len(kn) != 4 or kn[1] != a or kn[2] != b or kn[3] != c
                    or v_cache.shape != kn or ks[3] != 1 or vs[3] != 1
                    or (ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) & m or (kp | vp) & 15
                    or not plan.pages_within(kn[0])):
                return False
            if out is None:
                return True
            if type(out) is not T or out.dtype is not self.dtype or out.device != dev:
                return False
            on, os_, op = out.shape, out.stride(), out.data_ptr()
            # out's elements distinct (dense row order, no zero strides) and 16-byte rows
            if (on != qn or os_[2] != 1 or os_[1] < D or os_[0] < Hq * os_[1]
                    or (os_[0] | os_[1]) & 7 or op & 15):
                return False
            # ... and apart from everything the kernel reads (byte ranges [first, end) of
            # non-empty tensors; an empty one takes the detailed checks)
            if qn[0] == 0 or kn[0] == 0:
                return False
            e, ke = 2, self._kv_elem
            o_end = op + ((on[0] - 1) * os_[0] + (Hq - 1) * os_[1] + D) * e
            q_end = qp + ((qn[0] - 1) * qs[0] + (Hq - 1) * qs[1] + D) * e
            kspan = (kn[0] - 1) * ks[0] + (a - 1) * ks[1] + (b - 1) * ks[2] + c
            vspan = (kn[0] - 1) * vs[0] + (a - 1) * vs[1] + (b - 1) * vs[2] + c
            return not ((op < q_end and qp < o_end) or (op < kp + kspan * ke and kp < o_end)
                        or (op < vp + vspan * ke and vp < o_end))
        except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
            return False

    def _validate_run(self, plan: Plan, q, k_cache, v_cache, out) -> None:
        """Every run() argument check, each raising a ValueError/TypeError that names the
        argument and what was expected."""
        Hq, Hkv, D, ps = self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            _check_dense(name, t)
        if q.dtype != self.dtype:
            raise TypeError(f"q must be {self.dtype} (this PODAttention's dtype), got {q.dtype}")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            what = ("this PODAttention's kv_dtype" if self.fp8 else
                    "q's dtype (pass kv_dtype= to PODAttention for an fp8 cache)")
            raise TypeError(f"k_cache and v_cache must be {self.kv_dtype} ({what}), got "
                            f"{k_cache.dtype} and {v_cache.dtype}")
        if not _same_device(q.device, self.device):
            raise ValueError(f"q is on {q.device} but this PODAttention plans for {self.device}")
        if not (_same_device(k_cache.device, q.device) and _same_device(v_cache.device, q.device)):
            raise ValueError(f"q, k_cache and v_cache must be on one device, got {q.device}, "
                             f"{k_cache.device} and {v_cache.device}")
        if q.dim() != 3 or q.shape[1] != Hq or q.shape[2] != D:
            raise ValueError(f"q must be [total_q, num_qo_heads={Hq}, head_dim={D}], got "
                             f"shape {tuple(q.shape)}")
        if q.shape[0] < plan.total_q:
            raise ValueError(f"q has {q.shape[0]} rows but the planned batch has "
                             f"cu_seqlens_q[-1] = {plan.total_q} query tokens (q may have more "
                             "rows: padding, never read or written)")
        if q.shape[0] >= 2**31:
            raise ValueError(f"q has {q.shape[0]} rows; podcute indexes rows with int32 (< 2**31)")
        want = ("[num_pages, page_size, num_kv_heads, head_dim]" if self.kv_layout == "NHD"
                else "[num_pages, num_kv_heads, page_size, head_dim]")
        exp = (ps, Hkv, D) if self.kv_layout == "NHD" else (Hkv, ps, D)
        if k_cache.dim() != 4 or tuple(k_cache.shape[1:]) != exp:
            raise ValueError(f"k_cache must be {want} = [num_pages, {', '.join(map(str, exp))}] "
                             f"for kv_layout={self.kv_layout!r}, got shape {tuple(k_cache.shape)}")
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                             f"{tuple(k_cache.shape)}")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got "
                                 f"strides {tuple(t.stride())}")
        _check_aligned_rows(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
        # Security boundary: no request may read outside the pool (O(1) in the usual case).
        plan.check_pages(k_cache.shape[0], self._page_arg)
        if out is not None:
            _check_rows_like("out", out, q, tuple(q.shape), "[total_q, Hq, D]")
            _check_out_memory(out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, return_lse: bool = False,
            lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
            k_scale=None, v_scale=None, *, _ragged_kv=None):
        """Attention of the planned batch. q [T, Hq, D] with T >= cu_seqlens_q[-1] (rows
        past it are padding: never read, never written); caches [num_pages, page_size,
        Hkv, D] (NHD) or [num_pages, Hkv, page_size, D] (HND), any strides with a
        contiguous last dim. Returns out [T, Hq, D] (q's dtype; `out` if given, which must
        not overlap q or the caches), and with return_lse also lse [T, Hq] float32
        (natural log; `lse` if given: any strides, e.g. the transpose of an [Hq, T]
        buffer, not overlapping the other tensors; giving it implies return_lse).
        `sinks`: float32 [Hq] per-head sink logits (gpt-oss), one extra key with no value
        in every row's softmax denominator; lse then includes it (docs/contract.md).
        `k_scale`, `v_scale` (fp8 caches only): dequantisation scales, keys k_fp8 * k_scale
        and values v_fp8 * v_scale; each a float (default 1.0) or a float32 device tensor
        of shape [], [1] or [Hkv], read by the kernel (a captured graph sees new values).
        CUDA-graph capturable: the first captured call fixes the planner's buffers
        (README, CUDA graphs).
        `_ragged_kv` (internal: podcute.compat's legacy POD wrapper): (k, v) views
        [1, kv_len, Hkv, D] of one contiguous-rows K/V, which request 0 reads instead of
        its pages (its page-table entries must still be valid pages: they are looked up)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("PODAttention.run() called before plan(): plan the batch first")
        # One pass over what a serving loop always passes right; anything else (or an
        # error) takes the detailed checks below, which name the argument at fault.
        self._check_tensors(plan, q, k_cache, v_cache, out)
        return self._run_checked(plan, q, k_cache, v_cache, out, return_lse, lse, sinks,
                                 k_scale, v_scale, _ragged_kv)

    def _check_tensors(self, plan: Plan, q, k_cache, v_cache, out) -> None:
        """run()'s checks of q, the caches and out: the one-pass common case, else the
        detailed checks that name the argument at fault."""
        if not self._common_case(plan, q, k_cache, v_cache, out):
            self._validate_run(plan, q, k_cache, v_cache, out)

    def _run_checked(self, plan: Plan, q, k_cache, v_cache, out, return_lse, lse, sinks,
                     k_scale, v_scale, _ragged_kv=None):
        """run() once q, the caches and out passed _common_case or _validate_run for
        `plan` (the one-shot entry points call it after their own _common_case): the
        optional tensors' checks, then the launch."""
        if lse is not None:
            self._check_lse(lse, q, k_cache, v_cache, out)
            return_lse = True
        if sinks is not None:
            self._check_sinks(sinks, q)
        if self.fp8:
            k_scale = _scale_tensor("k_scale", k_scale, self.num_kv_heads, self.device,
                                    self._scales)
            v_scale = _scale_tensor("v_scale", v_scale, self.num_kv_heads, self.device,
                                    self._scales)
        elif k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale are for fp8 KV caches only (this "
                             f"PODAttention's caches are {self.kv_dtype})")
        if _ragged_kv is not None:
            self._check_ragged_kv(plan, q, _ragged_kv)
        # Only now the device: never fall back to the reference silently. (q is on
        # self.device, checked above; a device that passed once always passes.)
        if not self._device_ok:
            require_arch(self.device, self.arch)
            self._device_ok = True
        if not self.planner.frozen and torch.cuda.is_current_stream_capturing():
            # the graph holds the buffers' addresses, and this plan's kernel variant
            self.planner.freeze(plan.options)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if return_lse and lse is None:
            lse = torch.empty(q.shape[0], self.num_qo_heads, dtype=torch.float32,
                              device=q.device)
        launch(plan, q, k_cache, v_cache, out, lse, kv_layout=self.kv_layout, sinks=sinks,
               k_scale=k_scale, v_scale=v_scale, ragged_kv=_ragged_kv)
        return (out, lse) if return_lse else out

    def _check_ragged_kv(self, plan: Plan, q, ragged_kv) -> None:
        """run()'s `_ragged_kv`: (k, v) [1, kv_len of request 0, Hkv, D] in q's dtype on
        q's device with 16-byte rows (a 16-bit cache's PODAttention only)."""
        if self.fp8:
            raise ValueError("a ragged K/V source needs a 16-bit cache (this PODAttention's "
                             f"caches are {self.kv_dtype})")
        want = (1, int(plan.kv_lens[0]) if plan.batch_size else 0, self.num_kv_heads,
                self.head_dim)
        for name, t in zip(("ragged k", "ragged v"), ragged_kv):
            _check_rows_like(name, t, q, want, "[1, kv_len of request 0, Hkv, D]")

    def _check_sinks(self, sinks, q) -> None:
        """sinks: a float32 [Hq] tensor on q's device with unit stride (its values, like
        q's, are the caller's: -inf is a sink that weighs nothing)."""
        _check_dense("sinks", sinks)
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks must be float32 (one logit per query head), got "
                            f"{sinks.dtype}")
        if tuple(sinks.shape) != (self.num_qo_heads,):
            raise ValueError(f"sinks must be [num_qo_heads] = [{self.num_qo_heads}], got shape "
                             f"{tuple(sinks.shape)}")
        if not _same_device(sinks.device, q.device):
            raise ValueError(f"sinks is on {sinks.device}, q on {q.device}")
        if self.num_qo_heads > 1 and sinks.stride(0) != 1:
            raise ValueError(f"sinks must be contiguous (stride 1), got stride {sinks.stride(0)}")
        if sinks.data_ptr() % 4:
            raise ValueError(f"sinks must be 4-byte aligned, got data pointer "
                             f"{sinks.data_ptr():#x}")

    def _check_lse(self, lse, q, k_cache, v_cache, out) -> None:
        """A caller-given lse: float32 [q.shape[0], Hq] on q's device, distinct elements,
        not overlapping what the kernel reads or writes."""
        _check_dense("lse", lse)
        if lse.dtype != torch.float32:
            raise TypeError(f"lse must be float32, got {lse.dtype}")
        want = (q.shape[0], self.num_qo_heads)
        if tuple(lse.shape) != want:
            raise ValueError(f"lse must be [total_q, num_qo_heads] = {want}, got "
                             f"{tuple(lse.shape)}")
        if not _same_device(lse.device, q.device):
            raise ValueError(f"lse is on {lse.device}, q on {q.device}")
        if lse.data_ptr() % 4:
            raise ValueError(f"lse must be 4-byte aligned, got data pointer {lse.data_ptr():#x}")
        named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
        if out is not None:
            named.append(("out", out))
        _check_distinct(lse, "lse")
        name = _overlapped(lse, named)
        if name is not None:
            raise ValueError(f"lse overlaps {name} in memory; pass a separate buffer")


# --------------------------------------------------------------------------------------
# One-shot
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
                       kv_dtype: torch.dtype | None = None, scalars: tuple = ()) -> tuple:
    """The (PODAttention, CallPlanner) the one-shot entry points use for a configuration
    and the plan scalars of a call (hashable; the entry point's own tuple)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    key = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout, device, kv_dtype,
           scalars)
    hit = _ONE_SHOT.get(key)
    if hit is None:
        att = PODAttention(num_qo_heads, num_kv_heads, head_dim, page_size, dtype=dtype,
                           kv_layout=kv_layout, device=device, kv_dtype=kv_dtype)
        hit = _ONE_SHOT[key] = (att, CallPlanner(att))
    return hit


def one_shot_for(q, k_cache, v_cache, kv_layout: str, *, where: str = "",
                 names: tuple = ("q", "k_cache", "v_cache"), scalars: tuple = ()) -> tuple:
    """one_shot_attention() of the configuration a call's tensors imply: q [T, Hq, D] and
    4-D caches in `kv_layout`, each check a named error before anything is planned.
    `where` prefixes the messages and `names` are what the caller calls q and the caches;
    `scalars` (hashable, validated by the caller) pick the attention of a kind of layer."""
    try:
        qn, kn = q.shape, k_cache.shape
        memo = (len(qn), qn[1], qn[2], len(kn), kn[1], kn[2], kn[3], q.dtype, k_cache.dtype,
                q.device, kv_layout, scalars)
        hit = _ONE_SHOT_FOR.get(memo)
    except (AttributeError, IndexError, TypeError):
        memo = hit = None
    if (hit is not None and type(q) is torch.Tensor and type(k_cache) is torch.Tensor
            and type(v_cache) is torch.Tensor):
        return hit
    q_name, k_name, _ = names
    for name, t in zip(names, (q, k_cache, v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"{where}{q_name} must be [total_q, num_qo_heads, head_dim], got "
                         f"shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"{where}{k_name} must be 4-D ({kv_layout}), got shape "
                         f"{tuple(k_cache.shape)}")
    if q.dtype not in _DTYPES:
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
    if ps not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"{where}page_size ({k_name}.shape[{page_dim}]) must be one of "
                         f"{SUPPORTED_PAGE_SIZES}, got {ps}")
    # An fp8 cache selects fp8 variants (PODAttention checks the head dim); any other
    # cache dtype is run()'s to refuse.
    kv_dtype = k_cache.dtype if k_cache.dtype in _FP8_DTYPES else None
    hit = one_shot_attention(Hq, Hkv, D, ps, q.dtype, kv_layout, q.device, kv_dtype, scalars)
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
    live on the CPU (or are NumPy arrays) and hold the same values (``podcute.reuse``:
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
    _check_layout(kv_layout)
    options = PlanOptions.make(causal, window, softcap, batch_invariant)  # named errors
    _check_sm_scale(sm_scale)
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

