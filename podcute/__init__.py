"""podcute: fused prefill+decode (POD) paged attention for Hopper, in the CuTe DSL."""

from podcute.api import PODAttention
from podcute.one_shot import invalidate_plans, pod_attention
from podcute.planning import CapacityError, PlanSummary
from podcute.reference import pod_attention_reference

__all__ = ["PODAttention", "pod_attention", "pod_attention_reference", "PlanSummary",
           "CapacityError", "invalidate_plans"]
__version__ = "0.1.0"
