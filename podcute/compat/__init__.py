"""Engine-shaped entry points over :class:`podcute.PODAttention`.

- :mod:`podcute.compat.flash_attn`: ``flash_attn_varlen_func`` with the paged-KV signature
  of FlashAttention 2/3 and vLLM's fork (how vLLM's FlashAttention backend calls it);
- :mod:`podcute.compat.flashinfer`: FlashInfer's ``BatchPODWithPagedKVCacheWrapper``,
  ``PODWithPagedKVCacheWrapper`` and ``BatchAttention``.

Each keeps the signature, conventions and return shapes of the function it imitates and
raises a named error for an argument podcute does not implement, instead of ignoring it.
"""
