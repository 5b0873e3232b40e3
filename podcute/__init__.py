"""podcute: fused prefill+decode (POD) paged attention for Hopper, in the CuTe DSL."""

from podcute.reference import pod_attention_reference  # noqa: F401

__all__ = ["pod_attention_reference"]
__version__ = "0.1.0"
