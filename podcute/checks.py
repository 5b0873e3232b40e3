"""The argument checks every entry point shares (PODAttention, the one-shot calls and the
engine-shaped wrappers in podcute.compat): each raises a TypeError (wrong type or dtype),
ValueError (wrong shape, device, value) or NotImplementedError (a feature podcute lacks)
whose message names the argument, before anything touches a GPU."""

from __future__ import annotations

import contextlib
import math
import re

import torch

from podcute.kernels.config import (FP8_KV_DTYPES, HEAD_DIM_STEP, MAX_HEAD_DIM,
                                    SUPPORTED_PAGE_SIZES, tile_head_dim)
from podcute.planning import F32_MAX, F32_TINY

__all__ = ["KV_LAYOUTS", "DTYPES", "FP8_DTYPES", "check_int", "check_head_dim", "check_sm_scale",
           "check_page_size", "check_layout", "check_index", "check_aligned_rows",
           "check_rows_like",
           "check_dense", "check_distinct", "check_out_memory", "overlapped", "byte_range",
           "extent", "scale_tensor", "same_device", "renamed_errors"]

KV_LAYOUTS = ("NHD", "HND")
DTYPES = (torch.bfloat16, torch.float16)
# fp8 KV caches (queries and output stay 16-bit): torch dtype -> KernelConfig.kv_dtype.
FP8_DTYPES = {getattr(torch, name): name for name in FP8_KV_DTYPES}


def check_int(name, v, allowed=None, positive=True):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if allowed is not None and v not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {v}")
    if positive and v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


def _check_size(value, supported: tuple, name: str) -> None:
    """One of the sizes podcute compiles, else NotImplementedError (a positive int: a size
    models or engines use that the kernels lack) or TypeError/ValueError (no size at all)."""
    if value in supported and type(value) is int:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    raise NotImplementedError(f"{name}={value} is not supported by podcute (supported: "
                              f"{', '.join(map(str, supported))})")


def check_head_dim(head_dim, name: str = "head_dim") -> None:
    """A head dim podcute serves: a multiple of 8 up to 256 (each on the next compiled tile,
    config.tile_head_dim; rows of 16 bytes, which the copies need): _check_size."""
    try:
        tile_head_dim(head_dim)
    except ValueError:
        _check_size(head_dim, (f"multiples of {HEAD_DIM_STEP} up to {MAX_HEAD_DIM}",), name)


def check_page_size(page_size, name: str = "page_size") -> None:
    """A page size podcute compiles (SUPPORTED_PAGE_SIZES; FlashAttention 2's 512 is not
    one): _check_size."""
    _check_size(page_size, SUPPORTED_PAGE_SIZES, name)


def check_sm_scale(sm_scale, name: str = "sm_scale") -> None:
    """None or a real number (its value is the planner's to check: a positive float32)."""
    if sm_scale is not None and (isinstance(sm_scale, bool)
                                 or not isinstance(sm_scale, (int, float))):
        raise TypeError(f"{name} must be a float or None, got {type(sm_scale).__name__}")


def check_layout(kv_layout):
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


def check_index(name, t, device, ndim, length=None, optional=False):
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
        if t.device.type != "cpu" and not same_device(t.device, device):
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


def check_aligned_rows(*named):
    """The kernel moves rows in 16-byte pieces (cp.async): every row must start 16-byte
    aligned, i.e. an aligned data pointer and strides that are multiples of 16 bytes (8
    elements of a 16-bit tensor, 16 of an fp8 cache)."""
    for name, t in named:
        elems = 16 // t.element_size()
        if t.data_ptr() % 16 or any(s % elems for s in t.stride()[:-1]):
            raise ValueError(f"{name} rows must be 16-byte aligned: data pointer % 16 == 0 and "
                             f"strides (except the last) multiples of {elems} elements; got "
                             f"strides {tuple(t.stride())} and data pointer {t.data_ptr():#x}")


def check_rows_like(name: str, t, q: torch.Tensor, want: tuple, what: str) -> None:
    """A tensor of rows the kernel moves beside q's: dense, q's dtype and device, shape
    `want` (described as `what`), a contiguous last dim and 16-byte rows."""
    check_dense(name, t)
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must be {what} = {want}, got {tuple(t.shape)}")
    if not same_device(t.device, q.device):
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides "
                         f"{tuple(t.stride())}")
    check_aligned_rows((name, t))


def byte_range(ptr: int, shape, stride, elem_size: int) -> tuple[int, int]:
    """[first, last + 1) byte addresses of the elements of a tensor with this data
    pointer, shape and strides (torch strides are >= 0); (0, 0) when it is empty."""
    if 0 in shape:
        return 0, 0
    span = 1
    for n, st in zip(shape, stride):
        span += (n - 1) * st
    return ptr, ptr + span * elem_size


def extent(t: torch.Tensor) -> tuple[int, int]:
    """byte_range of a tensor."""
    return byte_range(t.data_ptr(), t.shape, t.stride(), t.element_size())


def check_dense(name: str, t) -> None:
    """A tensor argument: a torch.Tensor with a strided (dense) layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def check_distinct(t: torch.Tensor, name: str) -> None:
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


def check_out_memory(out: torch.Tensor, named) -> None:
    """`out` must not write where the kernel reads (q, the caches) and no two of its
    elements may share memory (zero or overlapping strides)."""
    check_distinct(out, "out")
    name = overlapped(out, named)
    if name is not None:
        raise ValueError(f"out overlaps {name} in memory; the kernel reads {name} while it "
                         "writes out, so out must be a separate buffer (not q itself)")


def overlapped(out: torch.Tensor, named):
    """The name of the first (name, tensor) whose byte range meets out's, or None."""
    lo, hi = extent(out)
    for name, t in named:
        tlo, thi = extent(t)
        if lo < thi and tlo < hi:
            return name
    return None


def scale_tensor(name: str, scale, num_kv_heads: int, device, cache: dict):
    """An fp8 cache's dequantisation scale as the float32 [1] or [Hkv] device tensor the
    kernel reads: a Python float (finite, > 0) becomes a cached one-element tensor; a
    float32 tensor of shape [], [1] or [Hkv] on the attention's device is used as it is
    (its values stay on the device: an engine may change them between graph replays,
    and they are not checked here, which would cost a device sync)."""
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        check_dense(name, scale)
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {scale.dtype}")
        if scale.dim() > 1 or scale.numel() not in (1, num_kv_heads):
            raise ValueError(f"{name} must be a float or a float32 tensor of shape [], [1] or "
                             f"[num_kv_heads] = [{num_kv_heads}], got shape {tuple(scale.shape)}")
        if not same_device(scale.device, device):
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


def same_device(a: torch.device, b: torch.device) -> bool:
    if a == b:
        return True
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib




@contextlib.contextmanager
def renamed_errors(names: dict, note: str = "", prefix: str = ""):
    """Re-raise a check's TypeError/ValueError/NotImplementedError under the caller's
    argument names (whole words of `names` replaced), with `prefix` and `note` added: how
    an engine-shaped entry point reports podcute's errors in its own vocabulary."""
    try:
        yield
    except (TypeError, ValueError, NotImplementedError) as err:
        msg = str(err)
        for ours, theirs in names.items():
            msg = re.sub(rf"\b{ours}\b", theirs, msg)
        raise type(err)(prefix + msg + note) from err
