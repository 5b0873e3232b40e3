""":class:`PODAttention`: plan once per step, run per layer (the one-shot calls are in
podcute/one_shot.py, the engine-shaped ones in podcute/compat/).

Its inputs are validated here, with the shared checks of podcute/checks.py, before
anything touches a GPU, so a bad argument is reported as such on any machine, by name.
run() re-checks only what can change between layers (the tensors), not what plan()
validated (lengths, page tables).
"""

from __future__ import annotations

import torch

from podcute.checks import (DTYPES, FP8_DTYPES, check_aligned_rows, check_dense, check_distinct,
                            check_head_dim, check_index, check_int, check_layout, check_page_size,
                            check_out_memory, check_rows_like, check_sm_scale, overlapped,
                            renamed_errors, same_device, scale_tensor)
from podcute.compile import unsupported_arch_message
from podcute.kernels.config import check_fp8_kv
from podcute.launch import launch, require_arch, resolve_arch
from podcute.planning import CapacityError, Plan, Planner, PlanSummary

__all__ = ["PODAttention", "PlanSummary", "CapacityError"]



# --------------------------------------------------------------------------------------
# PODAttention
# --------------------------------------------------------------------------------------


class PODAttention:
    """Fused prefill+decode paged attention for one head/page configuration.

    ``plan()`` once per batch (host work, no GPU sync when the index tensors are on the
    CPU), then ``run()`` once per layer. Buffers are sized from the capacities
    (``max_batch_size`` requests, ``max_num_tokens`` query tokens, ``max_num_pages``
    page-list entries: see :class:`~podcute.planning.Planner`) and grow for a bigger batch
    only until a ``run()`` is captured in a CUDA graph; after that, ``plan()`` raises
    :class:`~podcute.planning.CapacityError` for a batch that does not fit (README, CUDA graphs).
    ``arch`` (or ``$PODCUTE_ARCH``) forces a kernel target, e.g. ``"sm_90"`` for the
    warp-level kernel on Hopper; by default the device's own (sm_90a on a CPU planner).
    ``head_dim_vo``: the value head dim where it differs from the query-key ``head_dim``
    (DeepSeek's prefill: 192 / 128); v_cache and out rows then have that many columns.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, kv_layout: str = "NHD",
                 device="cuda", max_batch_size: int = 256, max_num_tokens: int = 16384,
                 max_num_pages: int | None = None, kv_dtype: torch.dtype | None = None,
                 arch: str | None = None, head_dim_vo: int | None = None):
        check_int("num_qo_heads", num_qo_heads)
        check_int("num_kv_heads", num_kv_heads)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        check_head_dim(head_dim)
        if head_dim_vo is not None:
            check_head_dim(head_dim_vo, "head_dim_vo")
        head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo
        check_page_size(page_size)
        check_int("max_batch_size", max_batch_size)
        check_int("max_num_tokens", max_num_tokens)
        if max_num_pages is not None:
            check_int("max_num_pages", max_num_pages)
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if kv_dtype is None:
            kv_dtype = dtype
        if kv_dtype != dtype and kv_dtype not in FP8_DTYPES:
            raise TypeError(f"kv_dtype must be None, dtype ({dtype}) or an fp8 type "
                            f"(torch.float8_e4m3fn, torch.float8_e5m2), got {kv_dtype}")
        if kv_dtype in FP8_DTYPES:
            check_fp8_kv(head_dim, FP8_DTYPES[kv_dtype])
            if head_dim_vo != head_dim:
                raise NotImplementedError(
                    f"fp8 KV caches with head_dim_vo={head_dim_vo} other than head_dim="
                    f"{head_dim} are not supported by podcute (16-bit caches are)")
        check_layout(kv_layout)
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
        self.head_dim_vo = head_dim_vo  # V and out rows' columns (q's and K's: head_dim)
        self.dtype, self.kv_layout, self.device = dtype, kv_layout, device
        self.kv_dtype = kv_dtype
        self.fp8 = kv_dtype in FP8_DTYPES
        # run()'s one-pass check: cache element bytes, and the stride mask of 16-byte rows
        self._kv_elem = 1 if self.fp8 else 2
        self._kv_stride_mask = 16 // self._kv_elem - 1
        self._scales: dict = {}  # float scale -> its device tensor (fp8 caches)
        self.planner = Planner(num_qo_heads, num_kv_heads, head_dim, page_size, device=device,
                               max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                               max_num_pages=max_num_pages,
                               dtype=str(dtype).replace("torch.", ""),
                               kv_dtype=FP8_DTYPES.get(kv_dtype, ""), arch=self.arch,
                               head_dim_vo=head_dim_vo)
        self._plan: Plan | None = None
        self._device_ok = False  # run()'s require_arch passed (it cannot fail later)
        self._page_arg = "block_table"
        self._cache_tail = ((page_size, num_kv_heads, head_dim) if kv_layout == "NHD"
                            else (num_kv_heads, page_size, head_dim))
        self._q_tail = (num_qo_heads, head_dim)
        self._vo = None if head_dim_vo == head_dim else head_dim_vo  # (run()'s checks)

    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    def plan(self, cu_seqlens_q, kv_lens=None, block_table=None, kv_indptr=None,
             kv_indices=None, last_page_len=None, causal: bool = True,
             sm_scale: float | None = None, *, window_size=(-1, -1), softcap: float = 0.0,
             batch_invariant: bool = False, share_prefixes: bool = True,
             _kv_name: str = "kv_lens", _second_cache_requests: int = 0) -> PlanSummary:
        """Plan a batch. `cu_seqlens_q` int32 [B+1]; KV lengths from `kv_lens` int32 [B] or
        FlashInfer's `last_page_len` (with CSR pages); pages from `block_table` int32
        [B, max_pages] or CSR `kv_indptr` [B+1] + `kv_indices`. Index tensors may live on
        the CPU (no GPU sync) or on the device (one device->host copy).

        `window_size=(left, right)`: sliding window, FlashAttention's convention (-1 =
        unbounded); `softcap > 0`: logits soft-capped to softcap * tanh(s / softcap);
        `batch_invariant`: a request's output is bitwise the same whatever shares its
        batch (docs/contract.md); `share_prefixes`: leading pages that several requests
        share are attended once for all of them where that pays (found in the pages, no
        label needed; docs/notes/shared-prefix.md); False plans without looking. A plan
        serves the layers that share these.
        `_second_cache_requests` (internal: podcute.compat's BatchPOD wrapper): requests
        [0, n) read a second cache when run() is given one (`_second_cache`)."""
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
                                       share_prefixes=share_prefixes, _kv_name=_kv_name,
                                       _second_cache_requests=_second_cache_requests)
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
        check_index("cu_seqlens_q", cu_seqlens_q, dev, 1)
        B = cu_seqlens_q.shape[0] - 1
        if B < 0:
            raise ValueError("cu_seqlens_q must have B+1 >= 1 entries, got 0")
        if (kv_lens is None) == (last_page_len is None):
            raise ValueError(f"pass exactly one of {_kv_name} or last_page_len")
        check_index(_kv_name, kv_lens, dev, 1, B, optional=True)
        check_index("last_page_len", last_page_len, dev, 1, B, optional=True)
        csr = kv_indptr is not None or kv_indices is not None
        if (block_table is not None) == csr:
            raise ValueError("pass exactly one page format: block_table, or kv_indptr and "
                             "kv_indices")
        if csr:
            check_index("kv_indptr", kv_indptr, dev, 1, B + 1)
            check_index("kv_indices", kv_indices, dev, 1)
        else:
            check_index("block_table", block_table, dev, 2, B)
        if last_page_len is not None and not csr:
            raise ValueError("last_page_len needs the CSR page format (kv_indptr, kv_indices)")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        check_sm_scale(sm_scale)  # (its value is the planner's to check)

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
            Dv = D if self._vo is None else self._vo
            vn = v_cache.shape
            m = self._kv_stride_mask  # 16-byte rows
            if (len(qn) != 3 or qn[1] != Hq or qn[2] != D or qs[2] != 1
                    or (qs[0] | qs[1]) & 7 or qp & 15
                    or not plan.total_q <= qn[0] < 2**31
                    or len(kn) != 4 or kn[1] != a or kn[2] != b or kn[3] != c
                    or (vn != kn if self._vo is None else (
                        len(vn) != 4 or vn[0] != kn[0] or vn[1] != a or vn[2] != b
                        or vn[3] != Dv))
                    or ks[3] != 1 or vs[3] != 1
                    or (ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) & m or (kp | vp) & 15
                    or not plan.pages_within(kn[0])):
                return False
            if out is None:
                return True
            if type(out) is not T or out.dtype is not self.dtype or out.device != dev:
                return False
            on, os_, op = out.shape, out.stride(), out.data_ptr()
            # out's elements distinct (dense row order, no zero strides) and 16-byte rows
            if ((on != qn if self._vo is None else (
                    len(on) != 3 or on[0] != qn[0] or on[1] != Hq or on[2] != Dv))
                    or os_[2] != 1 or os_[1] < Dv or os_[0] < Hq * os_[1]
                    or (os_[0] | os_[1]) & 7 or op & 15):
                return False
            # ... and apart from everything the kernel reads (byte ranges [first, end) of
            # non-empty tensors; an empty one takes the detailed checks)
            if qn[0] == 0 or kn[0] == 0:
                return False
            e, ke = 2, self._kv_elem
            o_end = op + ((on[0] - 1) * os_[0] + (Hq - 1) * os_[1] + Dv) * e
            q_end = qp + ((qn[0] - 1) * qs[0] + (Hq - 1) * qs[1] + D) * e
            kspan = (kn[0] - 1) * ks[0] + (a - 1) * ks[1] + (b - 1) * ks[2] + c
            vspan = (kn[0] - 1) * vs[0] + (a - 1) * vs[1] + (b - 1) * vs[2] + Dv
            return not ((op < q_end and qp < o_end) or (op < kp + kspan * ke and kp < o_end)
                        or (op < vp + vspan * ke and vp < o_end))
        except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
            return False

    def _validate_run(self, plan: Plan, q, k_cache, v_cache, out, check_pages=True) -> None:
        """Every run() argument check, each raising a ValueError/TypeError that names the
        argument and what was expected (the pages too, unless `check_pages` is off: a run
        over two caches checks them per cache)."""
        Hq, Hkv, D, ps = self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_dense(name, t)
        if q.dtype != self.dtype:
            raise TypeError(f"q must be {self.dtype} (this PODAttention's dtype), got {q.dtype}")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            what = ("this PODAttention's kv_dtype" if self.fp8 else
                    "q's dtype (pass kv_dtype= to PODAttention for an fp8 cache)")
            raise TypeError(f"k_cache and v_cache must be {self.kv_dtype} ({what}), got "
                            f"{k_cache.dtype} and {v_cache.dtype}")
        if not same_device(q.device, self.device):
            raise ValueError(f"q is on {q.device} but this PODAttention plans for {self.device}")
        if not (same_device(k_cache.device, q.device) and same_device(v_cache.device, q.device)):
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
        Dv = self.head_dim_vo
        v_want = tuple(k_cache.shape[:3]) + (Dv,)
        if tuple(v_cache.shape) != v_want:
            if Dv == D:
                raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache "
                                 f"shape {tuple(k_cache.shape)}")
            raise ValueError(f"v_cache must be k_cache's shape with head_dim_vo={Dv} last = "
                             f"{v_want}, got shape {tuple(v_cache.shape)}")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got "
                                 f"strides {tuple(t.stride())}")
        check_aligned_rows(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
        # Security boundary: no request may read outside the pool (O(1) in the usual case).
        if check_pages:
            plan.check_pages(k_cache.shape[0], self._page_arg)
        if out is not None:
            check_rows_like("out", out, q, (q.shape[0], Hq, Dv), "[total_q, Hq, head_dim_vo]"
                            if Dv != D else "[total_q, Hq, D]")
            check_out_memory(out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, return_lse: bool = False,
            lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
            k_scale=None, v_scale=None, *, _ragged_kv=None, _second_cache=None):
        """Attention of the planned batch. q [T, Hq, D] with T >= cu_seqlens_q[-1] (rows
        past it are padding: never read, never written); caches [num_pages, page_size,
        Hkv, D] (NHD) or [num_pages, Hkv, page_size, D] (HND), any strides with a
        contiguous last dim (v_cache's D: head_dim_vo). Returns out [T, Hq, head_dim_vo]
        (q's dtype; `out` if given, which must
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
        its pages (its page-table entries must still be valid pages: they are looked up).
        `_second_cache` (internal: podcute.compat's BatchPOD wrapper): (k, v), a second
        cache like k_cache / v_cache, which requests [0, _second_cache_requests of the
        plan) read instead of the first (16-bit caches)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("PODAttention.run() called before plan(): plan the batch first")
        if _second_cache is not None:
            self._check_second_cache(plan, q, k_cache, v_cache, out, _second_cache)
        else:
            # One pass over what a serving loop always passes right; anything else (or an
            # error) takes the detailed checks below, which name the argument at fault.
            self._check_tensors(plan, q, k_cache, v_cache, out)
        return self._run_checked(plan, q, k_cache, v_cache, out, return_lse, lse, sinks,
                                 k_scale, v_scale, _ragged_kv, _second_cache)

    def _check_tensors(self, plan: Plan, q, k_cache, v_cache, out) -> None:
        """run()'s checks of q, the caches and out: the one-pass common case, else the
        detailed checks that name the argument at fault."""
        if not self._common_case(plan, q, k_cache, v_cache, out):
            self._validate_run(plan, q, k_cache, v_cache, out)

    def _run_checked(self, plan: Plan, q, k_cache, v_cache, out, return_lse, lse, sinks,
                     k_scale, v_scale, _ragged_kv=None, _second_cache=None):
        """run() once q, the caches and out passed _common_case or _validate_run for
        `plan` (the one-shot entry points call it after their own _common_case): the
        optional tensors' checks, then the launch."""
        if lse is not None:
            self._check_lse(lse, q, k_cache, v_cache, out, _second_cache)
            return_lse = True
        if sinks is not None:
            self._check_sinks(sinks, q)
        if self.fp8:
            k_scale = scale_tensor("k_scale", k_scale, self.num_kv_heads, self.device,
                                    self._scales)
            v_scale = scale_tensor("v_scale", v_scale, self.num_kv_heads, self.device,
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
            self.planner.freeze(plan.options, plan.shares)
        if out is None:
            out = torch.empty(q.shape[0], self.num_qo_heads, self.head_dim_vo, dtype=q.dtype,
                              device=q.device)
        if return_lse and lse is None:
            lse = torch.empty(q.shape[0], self.num_qo_heads, dtype=torch.float32,
                              device=q.device)
        launch(plan, q, k_cache, v_cache, out, lse, kv_layout=self.kv_layout, sinks=sinks,
               k_scale=k_scale, v_scale=v_scale, ragged_kv=_ragged_kv,
               second_cache=_second_cache)
        return (out, lse) if return_lse else out

    def _check_second_cache(self, plan: Plan, q, k_cache, v_cache, out, second) -> None:
        """run()'s checks with a second cache: both caches as run() checks one (the second's
        errors name it), out apart from both, and each request's pages inside its cache."""
        if self.fp8:
            raise ValueError("a second cache needs 16-bit caches (this PODAttention's caches "
                             f"are {self.kv_dtype})")
        if not isinstance(second, tuple) or len(second) != 2:
            raise TypeError(f"_second_cache must be a (k, v) tuple, got {type(second).__name__}")
        k2, v2 = second
        self._validate_run(plan, q, k_cache, v_cache, out, check_pages=False)
        with renamed_errors({"k_cache": "the second k cache", "v_cache": "the second v cache"}):
            self._validate_run(plan, q, k2, v2, out, check_pages=False)
        plan.check_second_cache_pages(k_cache.shape[0], k2.shape[0], self._page_arg)

    def _check_ragged_kv(self, plan: Plan, q, ragged_kv) -> None:
        """run()'s `_ragged_kv`: (k, v) [1, kv_len of request 0, Hkv, D] in q's dtype on
        q's device with 16-byte rows (a 16-bit cache's PODAttention only)."""
        if self.fp8:
            raise ValueError("a ragged K/V source needs a 16-bit cache (this PODAttention's "
                             f"caches are {self.kv_dtype})")
        want = (1, int(plan.kv_lens[0]) if plan.batch_size else 0, self.num_kv_heads)
        for name, t, d in zip(("ragged k", "ragged v"), ragged_kv,
                              (self.head_dim, self.head_dim_vo)):
            check_rows_like(name, t, q, want + (d,), "[1, kv_len of request 0, Hkv, D]")

    def _check_sinks(self, sinks, q) -> None:
        """sinks: a float32 [Hq] tensor on q's device with unit stride (its values, like
        q's, are the caller's: -inf is a sink that weighs nothing)."""
        check_dense("sinks", sinks)
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks must be float32 (one logit per query head), got "
                            f"{sinks.dtype}")
        if tuple(sinks.shape) != (self.num_qo_heads,):
            raise ValueError(f"sinks must be [num_qo_heads] = [{self.num_qo_heads}], got shape "
                             f"{tuple(sinks.shape)}")
        if not same_device(sinks.device, q.device):
            raise ValueError(f"sinks is on {sinks.device}, q on {q.device}")
        if self.num_qo_heads > 1 and sinks.stride(0) != 1:
            raise ValueError(f"sinks must be contiguous (stride 1), got stride {sinks.stride(0)}")
        if sinks.data_ptr() % 4:
            raise ValueError(f"sinks must be 4-byte aligned, got data pointer "
                             f"{sinks.data_ptr():#x}")

    def _check_lse(self, lse, q, k_cache, v_cache, out, second_cache=None) -> None:
        """A caller-given lse: float32 [q.shape[0], Hq] on q's device, distinct elements,
        not overlapping what the kernel reads or writes (the second cache's too)."""
        check_dense("lse", lse)
        if lse.dtype != torch.float32:
            raise TypeError(f"lse must be float32, got {lse.dtype}")
        want = (q.shape[0], self.num_qo_heads)
        if tuple(lse.shape) != want:
            raise ValueError(f"lse must be [total_q, num_qo_heads] = {want}, got "
                             f"{tuple(lse.shape)}")
        if not same_device(lse.device, q.device):
            raise ValueError(f"lse is on {lse.device}, q on {q.device}")
        if lse.data_ptr() % 4:
            raise ValueError(f"lse must be 4-byte aligned, got data pointer {lse.data_ptr():#x}")
        named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
        if second_cache is not None:
            named += [("the second k cache", second_cache[0]),
                      ("the second v cache", second_cache[1])]
        if out is not None:
            named.append(("out", out))
        check_distinct(lse, "lse")
        name = overlapped(lse, named)
        if name is not None:
            raise ValueError(f"lse overlaps {name} in memory; pass a separate buffer")
