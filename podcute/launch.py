"""Glue between a Plan and the compiled kernel: pick the variant, launch it."""

import functools
import os

import torch

from podcute.compile import VariantKey, compile_variant, unsupported_arch_message
from podcute.kernels.config import SUPPORTED_ARCHS


# Compute capability -> the architecture podcute builds for it (a cubin for sm_XY runs on
# sm_XZ, Z >= Y; the "a" targets only on their own chip).
ARCH_OF_CAPABILITY = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_86", (8, 9): "sm_89",
                      (9, 0): "sm_90a", (12, 0): "sm_120a"}


def runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether a kernel compiled for `arch` runs on a GPU of `capability`."""
    digits = arch[3:].rstrip("a")
    major, minor = int(digits[:-1]), int(digits[-1])
    if arch.endswith("a"):
        return capability == (major, minor)
    return capability[0] == major and capability[1] >= minor


def requested_arch(arch: str | None) -> str | None:
    """The architecture asked for: `arch`, else $PODCUTE_ARCH (forces a kernel, e.g. sm_90:
    the portable kernel on Hopper), else None (the device's own). ValueError if unknown."""
    arch = arch if arch is not None else (os.environ.get("PODCUTE_ARCH") or None)
    if arch is not None and arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS} (or None: the device's "
                         f"own), got {arch!r}")
    return arch


def resolve_arch(device: torch.device, arch: str | None = None) -> str:
    """The architecture whose kernel serves `device`: the requested one (which must run
    there) or the device's own; sm_90a for a host-only (CPU) planner. RuntimeError naming
    the supported architectures for a GPU podcute has no kernel for."""
    arch = requested_arch(arch)
    if device.type != "cuda":
        return arch or "sm_90a"
    cap = torch.cuda.get_device_capability(device)
    if arch is None:
        arch = ARCH_OF_CAPABILITY.get(cap)
    if arch is None or not runs_on(arch, cap):
        raise RuntimeError(unsupported_arch_message(
            f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
            + (f" for arch {arch}" if arch else "")))
    return arch


@functools.lru_cache(maxsize=None)
def _device_problem(device: torch.device, arch: str) -> str | None:
    """None if `device` can run `arch`'s kernel, else what was found instead (cached)."""
    if device.type != "cuda":
        cuda = ("no CUDA device" if not torch.cuda.is_available()
                else f"{torch.cuda.device_count()} CUDA device(s)")
        return f"tensors on {device} ({cuda} on this machine)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if not runs_on(arch, cap):
        return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]}) for a {arch} plan"
    return None


def require_arch(device: torch.device, arch: str = "sm_90a") -> None:
    """Raise a RuntimeError naming what is needed unless `device` runs `arch`'s kernel."""
    problem = _device_problem(device, arch)
    if problem is not None:
        raise RuntimeError(unsupported_arch_message(problem))


# (device, dtype, plan config object, plan options, has_lse, has_sinks) -> (plan config,
# kernel). The plan config object lives as long as its planner; holding it keeps its id()
# unique.
_variants: dict = {}


def _kernel(device, dtype, plan_config, options, has_lse: bool, has_sinks: bool,
            ragged_kv: bool = False, second_cache: bool = False, shared: bool = False):
    """The compiled kernel for a plan's configuration: a dict hit after the first call."""
    facts = (device, dtype, id(plan_config), options.variant, has_lse, has_sinks, ragged_kv,
             second_cache, shared)
    hit = _variants.get(facts)
    if hit is None or hit[0] is not plan_config:
        require_arch(device, plan_config.kernel.arch)
        cfg = plan_config.kernel.with_flags(has_lse=has_lse, has_sinks=has_sinks,
                                            ragged_kv=ragged_kv, second_cache=second_cache,
                                            shared_prefix=shared, **options.kernel_flags())
        hit = (plan_config, compile_variant(VariantKey.make(cfg)))
        _variants[facts] = hit
    return hit[1]


def launch(plan, q, k_cache, v_cache, out, lse, kv_layout: str = "NHD", sinks=None,
           k_scale=None, v_scale=None, ragged_kv=None, second_cache=None):
    """Run the fused POD kernel for `plan` (one launch; split-KV groups merge in-kernel).

    `out` is [T, Hq, D] (q's dtype), `lse` is [T, Hq] float32 or None, `sinks` [Hq]
    float32 or None, `k_scale`/`v_scale` (fp8 caches) float32 [1] or [Hkv]. `ragged_kv`:
    None, or (k, v) [1, kv_len, Hkv, D] views (the canonical (page, slot, kv_head, dim) of
    one page) that request 0 of the plan reads its K/V from instead of its pages (a
    `ragged_kv` variant; that request keeps page-table entries, looked up but never used
    to address). `second_cache`: None, or (k, v) caches like k_cache / v_cache that
    requests [0, plan.second_cache_requests) read instead (a `second_cache` variant).
    Every metadata
    argument is a whole planner buffer (`plan.kernel_args`), the same for every plan, so a
    captured launch replays with whatever plan() wrote last.
    Raises RuntimeError naming what is needed when the device cannot run the plan's kernel.
    """
    # A plan serves one PODAttention, whose checks fixed q's dtype and device.
    flags = ((lse is not None) | (sinks is not None) << 1 | (ragged_kv is not None) << 2
             | (second_cache is not None) << 3)
    pod = plan._kernels[flags]
    if pod is None:
        if plan.shares and (ragged_kv is not None or second_cache is not None):
            raise ValueError("a plan that shares prefixes runs over one paged cache: plan "
                             "with share_prefixes=False for a second K/V source")
        pod = plan._kernels[flags] = _kernel(q.device, q.dtype, plan.config, plan.options,
                                             lse is not None, sinks is not None,
                                             ragged_kv is not None, second_cache is not None,
                                             plan.shares)
    k2, v2 = ragged_kv if ragged_kv is not None else second_cache or (None, None)
    if kv_layout == "HND":
        # The kernel addresses (page, slot, head, dim); HND is that view with two strides
        # swapped (layouts.canonical_kv in torch terms), so both layouts share one variant.
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        if second_cache is not None:
            k2, v2 = k2.transpose(1, 2), v2.transpose(1, 2)
    # The compiled signature (kernels/args.py): PodTensors' fields, then PlanTensors' (the
    # planner's buffers) and the grid.
    pod(q, k_cache, v_cache, out, lse, sinks, k_scale, v_scale, k2, v2, *plan.kernel_args)
