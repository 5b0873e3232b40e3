"""Float32 torch reference of the podcute contract (docs/contract.md).

Slow but exact enough to judge the kernels: every request gathers only its own pages,
sliced to `kv_len`, so garbage elsewhere in the pool (even NaN) cannot leak, and all
heads of a request go through one batched matmul (GQA by reshaping, no K/V copies per
query head). Works on any device.
"""

import contextlib
import math

import torch

__all__ = ["pod_attention_reference", "full_fp32_matmul"]

# Upper bound on float32 score elements per matmul; long prefills are cut into query
# chunks so that (chunk x Hq x kv_len) stays below it (1 GiB of scores).
_SCORE_BUDGET = 1 << 28


@contextlib.contextmanager
def full_fp32_matmul():
    """Keep a caller's TF32 setting from silently degrading the reference."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _request_pages(i, n, block_table, kv_indptr_host, kv_indices):
    """First `n` page ids of request `i` as an index tensor."""
    if block_table is not None:
        pages = block_table[i, :n]
    else:
        start, end = kv_indptr_host[i], kv_indptr_host[i + 1]
        pages = kv_indices[start : min(end, start + n)]
    if pages.numel() < n:
        raise ValueError(f"request {i} needs {n} pages but its page list has {pages.numel()}")
    return pages.long()


def _gather_tokens(cache, pages, kv_len, kv_layout):
    """[kv_len, Hkv, D] float32 tokens of one request, in order."""
    g = cache.index_select(0, pages)
    if kv_layout == "HND":
        g = g.transpose(1, 2)  # -> [n, page_size, Hkv, D]
    return g.reshape(-1, g.shape[-2], g.shape[-1])[:kv_len].float()


def _attend(q, k, v, first_pos, causal, sm_scale):
    """Attention of `q` [m, Hq, D] (query r at position first_pos + r) over `k`, `v`
    [kv_len, Hkv, D], all float32. Returns out [m, Hq, D] and lse [m, Hq]."""
    m, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    g = hq // hkv
    # Rows of one KV head: its G query heads x m tokens, so K/V are used as they are.
    qh = q.reshape(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d)
    s = torch.bmm(qh, k.permute(1, 2, 0)).view(hkv, g, m, kv_len) * sm_scale
    if causal:
        pos = torch.arange(first_pos, first_pos + m, device=q.device)
        keys = torch.arange(kv_len, device=q.device)
        s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees no key
    # Such rows would give exp(-inf - -inf) = NaN; shifting by 0 gives P = 0, O = 0.
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.bmm(p.view(hkv, g * m, kv_len), v.transpose(0, 1)).view(hkv, g, m, d)
    return o.permute(2, 0, 1, 3).reshape(m, hq, d), lse.permute(2, 0, 1).reshape(m, hq)


def pod_attention_reference(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    seqused_k,
    block_table=None,
    kv_indptr=None,
    kv_indices=None,
    causal=True,
    sm_scale=None,
    kv_layout="NHD",
    return_lse=False,
):
    """Paged attention of a mixed prefill/decode batch, computed in float32.

    q: [total_q, Hq, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D] ("NHD") or
    [num_pages, Hkv, page_size, D] ("HND"), any strides. Pages come from `block_table`
    [B, max_pages] or from CSR `kv_indptr` [B+1] / `kv_indices`; `seqused_k` [B] holds
    the KV lengths. Query j of request i sits at position kv_len - q_len + j (causal is
    bottom-right aligned). Returns out [total_q, Hq, D] in q's dtype, and with
    `return_lse` also the natural-log LSE [total_q, Hq] float32.

    A row that sees no key (kv_len == 0, or causal with q_len > kv_len, which the API
    rejects) gets out 0 and lse -inf; so do rows of q that no request covers.
    Only the minimum is validated here; the API validates its inputs fully.
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    csr = kv_indptr is not None or kv_indices is not None
    if (block_table is not None) == csr:
        raise ValueError("give exactly one page format: block_table, or kv_indptr and kv_indices")
    if csr and (kv_indptr is None or kv_indices is None):
        raise ValueError("kv_indptr and kv_indices go together")
    total_q, hq, d = q.shape
    if hq % k_cache.shape[-2 if kv_layout == "NHD" else 1]:
        raise ValueError("the number of query heads must be a multiple of the KV heads")
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)

    # One host sync per metadata tensor, not per request.
    q_starts = cu_seqlens_q.tolist()
    kv_lens = seqused_k.tolist()
    kv_indptr_host = kv_indptr.tolist() if block_table is None else None

    out = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=q.device)
    with full_fp32_matmul():
        for i, kv_len in enumerate(kv_lens):
            q0, q1 = q_starts[i], q_starts[i + 1]
            if q1 == q0:
                continue  # padding request: writes nothing
            n_pages = -(-kv_len // page_size)
            pages = _request_pages(i, n_pages, block_table, kv_indptr_host, kv_indices)
            k = _gather_tokens(k_cache, pages, kv_len, kv_layout)
            v = _gather_tokens(v_cache, pages, kv_len, kv_layout)
            first_pos = kv_len - (q1 - q0)
            chunk = max(1, _SCORE_BUDGET // max(1, hq * kv_len))
            for c0 in range(q0, q1, chunk):
                c1 = min(q1, c0 + chunk)
                o_c, lse_c = _attend(
                    q[c0:c1].float(), k, v, first_pos + (c0 - q0), causal, scale
                )
                out[c0:c1] = o_c
                lse[c0:c1] = lse_c
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
