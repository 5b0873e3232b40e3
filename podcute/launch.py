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


# (device, dtype, plan config object, plan options, has_lse, has_sinks) -> (plan config,
# kernel). The plan config object lives as long as its planner; holding it keeps its id()
# unique.
_variants: dict = {}


def _kernel(device, dtype, plan_config, options, has_lse: bool, has_sinks: bool):
    """The compiled kernel for a plan's configuration: a dict hit after the first call."""
    facts = (device, dtype, id(plan_config), options.variant, has_lse, has_sinks)
    hit = _variants.get(facts)
    if hit is None or hit[0] is not plan_config:
        require_sm90(device)
        cfg = plan_config.kernel.with_flags(has_lse=has_lse, has_sinks=has_sinks,
                                            **options.kernel_flags())
        hit = (plan_config, compile_variant(VariantKey.make(cfg)))
        _variants[facts] = hit
    return hit[1]


def launch(plan, q, k_cache, v_cache, out, lse, kv_layout: str = "NHD", sinks=None,
           k_scale=None, v_scale=None):
    """Run the fused POD kernel for `plan` (one launch; split-KV groups merge in-kernel).

    `out` is [T, Hq, D] (q's dtype), `lse` is [T, Hq] float32 or None, `sinks` [Hq]
    float32 or None, `k_scale`/`v_scale` (fp8 caches) float32 [1] or [Hkv]. Every metadata
    argument is a whole planner buffer (`plan.kernel_args`), the same for every plan, so a
    captured launch replays with whatever plan() wrote last.
    Raises RuntimeError naming what is needed when no sm_90 GPU is available.
    """
    pod = _kernel(q.device, q.dtype, plan.config, plan.options, lse is not None,
                  sinks is not None)
    if kv_layout == "HND":
        # The kernel addresses (page, slot, head, dim); HND is that view with two strides
        # swapped (layouts.canonical_kv in torch terms), so both layouts share one variant.
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    pod(q, k_cache, v_cache, out, lse, sinks, k_scale, v_scale, *plan.kernel_args)
