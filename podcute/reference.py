"""Float32 torch reference of the podcute contract (docs/contract.md).

Slow but exact enough to judge the kernels: every request gathers only its own pages,
sliced to `kv_len`, so garbage elsewhere in the pool (even NaN) cannot leak, and all
heads of a request go through one batched matmul (GQA by reshaping, no K/V copies per
query head). Works on any device. Sliding windows, logit soft-capping and attention
sinks (docs/contract.md, "Model features") are masks and terms on the same scores.
"""

import contextlib
import math
import numbers

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


def _gather_tokens(cache, pages, kv_len, kv_layout, scale=None):
    """[kv_len, Hkv, D] float32 tokens of one request, in order; an fp8 cache's tokens
    dequantised (x scale, per KV head or per tensor)."""
    g = cache.index_select(0, pages)
    if kv_layout == "HND":
        g = g.transpose(1, 2)  # -> [n, page_size, Hkv, D]
    tokens = g.reshape(-1, g.shape[-2], g.shape[-1])[:kv_len].float()
    if scale is not None:
        tokens = tokens * scale.view(-1, 1)  # [Hkv] or [1] against [kv_len, Hkv, D]
    return tokens


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_scale(name, scale, cache, hkv, device):
    """The dequantisation scale of an fp8 cache as a float32 [Hkv] or [1] tensor, or None
    for a 16-bit cache (which takes no scale)."""
    if cache.dtype not in FP8_DTYPES:
        if scale is not None:
            raise ValueError(f"{name} is only for fp8 caches; this cache is {cache.dtype}")
        return None
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        if scale.dim() > 1 or scale.numel() not in (1, hkv) or (scale.dim() == 1 and
                                                                scale.numel() != hkv):
            raise ValueError(f"{name} must be a float, or a tensor of shape [] or [Hkv] = "
                             f"[{hkv}], got shape {list(scale.shape)}")
        t = scale.to(device=device, dtype=torch.float32).reshape(-1)
    else:
        t = torch.tensor([float(scale)], dtype=torch.float32, device=device)
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(f"{name} must be finite and > 0")
    return t


def _attend(q, k, v, first_pos, causal, sm_scale, window=(-1, -1), softcap=0.0, sinks=None):
    """Attention of `q` [m, Hq, D] (query r at position first_pos + r) over `k`, `v`
    [kv_len, Hkv, D] (v's D may differ: the value head dim), all float32. `window` is
    (left, right), -1 unbounded; `softcap` 0 is off; `sinks` is None or float32 [Hq].
    Returns out [m, Hq, v's D] and lse [m, Hq]."""
    m, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    dv = v.shape[-1]
    g = hq // hkv
    left, right = window
    if causal:
        right = 0  # causal caps any right bound at the query's own position
    # Keys outside [lo, hi) are masked for every row of this chunk: skip them. Without a
    # window nothing is cut (the matmul keeps the shapes it always had).
    lo, hi = 0, kv_len
    if left >= 0:
        lo = min(kv_len, max(0, first_pos - left))
    if window[1] >= 0:  # the user's right bound; causal alone does not cut
        hi = max(lo, min(kv_len, first_pos + m + right))
    if (lo, hi) != (0, kv_len):
        k, v = k[lo:hi], v[lo:hi]
    n = hi - lo
    # Rows of one KV head: its G query heads x m tokens, so K/V are used as they are.
    qh = q.reshape(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d)
    s = torch.bmm(qh, k.permute(1, 2, 0)).view(hkv, g, m, n) * sm_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if right >= 0 or left >= 0:  # causal is right == 0 here
        pos = torch.arange(first_pos, first_pos + m, device=q.device)[:, None]
        keys = torch.arange(lo, hi, device=q.device)[None, :]
        hide = None
        if right >= 0:
            hide = keys > pos + right  # with causal: keys > pos, exactly as without windows
        if left >= 0:
            before = keys < pos - left
            hide = before if hide is None else hide | before
        s = s.masked_fill(hide, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees no key
    if sinks is not None:
        # The sink is one more logit in the normaliser, with no value. logsumexp shifts by
        # the row max and logaddexp by max(that, sink): stable for any finite sink, and a
        # row that sees no key gets lse = sink exactly (logaddexp(-inf, x) == x).
        lse = torch.logaddexp(lse, sinks.reshape(hkv, g, 1))
    # Rows with lse -inf would give exp(-inf - -inf) = NaN; shifting by 0 gives P = 0, O = 0.
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.bmm(p.view(hkv, g * m, n), v.transpose(0, 1)).view(hkv, g, m, dv)
    return o.permute(2, 0, 1, 3).reshape(m, hq, dv), lse.permute(2, 0, 1).reshape(m, hq)


def _check_features(window_size, softcap, sinks, hq, device):
    """Validated (window, softcap, sinks) for _attend."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)
        or min(window_size) < -1
    ):
        raise ValueError(
            f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), "
            f"got {window_size!r}"
        )
    window = (int(window_size[0]), int(window_size[1]))
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        raise ValueError(f"softcap must be a float >= 0 (0: off), got {softcap!r}") from None
    if not (0.0 <= cap < math.inf):  # also refuses NaN
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise ValueError(f"sinks must be None or a float tensor of shape [{hq}]")
        if tuple(sinks.shape) != (hq,):
            raise ValueError(
                f"sinks must have shape [Hq] = [{hq}] (one logit per query head), "
                f"got {list(sinks.shape)}"
            )
        sinks = sinks.to(device=device, dtype=torch.float32)
    return window, cap, sinks


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
    window_size=(-1, -1),
    softcap=0.0,
    sinks=None,
    k_scale=None,
    v_scale=None,
):
    """Paged attention of a mixed prefill/decode batch, computed in float32.

    q: [total_q, Hq, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D] ("NHD") or
    [num_pages, Hkv, page_size, D] ("HND"), any strides. Pages come from `block_table`
    [B, max_pages] or from CSR `kv_indptr` [B+1] / `kv_indices`; `seqused_k` [B] holds
    the KV lengths. Query j of request i sits at position kv_len - q_len + j (causal is
    bottom-right aligned). v_cache's head dim may differ from q's and k_cache's (a value
    head dim of its own). Returns out [total_q, Hq, v_cache's D] in q's dtype, and with
    `return_lse` also the natural-log LSE [total_q, Hq] float32.

    Model features (docs/contract.md, "Model features"): `window_size=(left, right)`,
    ints, -1 unbounded, FlashAttention's convention: the query at position p sees keys
    p - left <= t <= p + right (with causal also t <= p). `softcap` > 0 turns each
    score s = sm_scale * q.k into softcap * tanh(s / softcap) before masking. `sinks`
    [Hq] adds exp(sinks[h]) to the softmax denominator (a key with no value, not
    soft-capped); lse is then the full normaliser log(sum_t exp(s_t) + exp(sink)).

    A row that sees no key (kv_len == 0, the first q_len - kv_len rows with causal and
    q_len > kv_len, or a window that excludes every key) gets out 0 and lse -inf (lse = sink
    with sinks); rows of q that no request covers get 0 and -inf.

    fp8 caches (torch.float8_e4m3fn / float8_e5m2, docs/contract.md "fp8 KV caches"):
    keys are k_fp8 * k_scale and values v_fp8 * v_scale, each scale a float or a float32
    tensor of shape [] or [Hkv] (default 1.0); the attention is computed on those
    dequantised values in float32. 16-bit caches take no scale.
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
    window, cap, sinks = _check_features(window_size, softcap, sinks, hq, q.device)
    hkv = k_cache.shape[-2 if kv_layout == "NHD" else 1]
    k_scale = _check_scale("k_scale", k_scale, k_cache, hkv, q.device)
    v_scale = _check_scale("v_scale", v_scale, v_cache, hkv, q.device)

    # One host sync per metadata tensor, not per request.
    q_starts = cu_seqlens_q.tolist()
    kv_lens = seqused_k.tolist()
    kv_indptr_host = kv_indptr.tolist() if block_table is None else None

    out = torch.zeros(total_q, hq, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=q.device)
    with full_fp32_matmul():
        for i, kv_len in enumerate(kv_lens):
            q0, q1 = q_starts[i], q_starts[i + 1]
            if q1 == q0:
                continue  # padding request: writes nothing
            n_pages = -(-kv_len // page_size)
            pages = _request_pages(i, n_pages, block_table, kv_indptr_host, kv_indices)
            k = _gather_tokens(k_cache, pages, kv_len, kv_layout, k_scale)
            v = _gather_tokens(v_cache, pages, kv_len, kv_layout, v_scale)
            first_pos = kv_len - (q1 - q0)
            chunk = max(1, _SCORE_BUDGET // max(1, hq * kv_len))
            for c0 in range(q0, q1, chunk):
                c1 = min(q1, c0 + chunk)
                o_c, lse_c = _attend(
                    q[c0:c1].float(),
                    k,
                    v,
                    first_pos + (c0 - q0),
                    causal,
                    scale,
                    window=window,
                    softcap=cap,
                    sinks=sinks,
                )
                out[c0:c1] = o_c
                lse[c0:c1] = lse_c
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
