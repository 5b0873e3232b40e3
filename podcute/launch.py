"""Glue between a Plan and the compiled kernel: pick the variant, launch it."""

import functools

import torch

from podcute.compile import VariantKey, compile_variant, unsupported_arch_message


@functools.lru_cache(maxsize=None)
def _hopper_problem(device: torch.device) -> str | None:
    """None if `device` can run the kernel, else what was found instead (cached)."""
    if device.type != "cuda":
        cuda = ("no CUDA device" if not torch.cuda.is_available()
                else f"{torch.cuda.device_count()} CUDA device(s)")
        return f"tensors on {device} ({cuda} on this machine)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return None


def require_sm90(device: torch.device) -> None:
    """Raise a RuntimeError naming what is needed unless `device` is a Hopper GPU."""
    problem = _hopper_problem(device)
    if problem is not None:
        raise RuntimeError(unsupported_arch_message(problem))


_variants: dict = {}


def _kernel(device, dtype, head_dim, group, causal, has_lse, tma_kv):
    """The compiled kernel for these static facts: a dict hit after the first call."""
    facts = (device, dtype, head_dim, group, causal, has_lse, tma_kv)
    kernel = _variants.get(facts)
    if kernel is None:
        require_sm90(device)
        kernel = compile_variant(
            VariantKey.make(dtype, head_dim, group, causal, has_lse, tma_kv))
        _variants[facts] = kernel
    return kernel


def launch(plan, q, k_cache, v_cache, out, lse, kv_layout: str = "NHD"):
    """Run the fused POD kernel for `plan` (one launch; split-KV groups merge in-kernel).

    `out` is [total_q, Hq, D] (q's dtype), `lse` is [total_q, Hq] float32 or None.
    Raises RuntimeError naming what is needed when no sm_90 GPU is available.
    """
    cfg = plan.config
    tma_kv = cfg.page_size % cfg.tile.tile_n == 0  # whole KV tiles per page: TMA boxes
    pod = _kernel(q.device, q.dtype, cfg.head_dim, cfg.group_size, plan.causal,
                  lse is not None, tma_kv)
    if kv_layout == "HND":
        # The kernel addresses (page, slot, head, dim); HND is that view with two strides
        # swapped (layouts.canonical_kv in torch terms), so both layouts share one variant.
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    pod(q, k_cache, v_cache, out, lse, *plan.kernel_args)
