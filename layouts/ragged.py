"""CuTe views of the ragged (concatenated-request) q / out / lse tensors.

GQA packing: the ``group = Hq // Hkv`` query heads that share a KV head and the
request's ``num_tokens`` query tokens are stacked into ``group * num_tokens`` *packed
rows*, row ``r`` = (token ``r // group``, head ``kv_head*group + r % group``). K/V of
that head are then read once for all of them, and a decode request (one token) still
fills a useful number of MMA rows.

This is one CuTe mode with shape ``(group, num_tokens)`` and strides
``(stride_head, stride_token)``: CuTe splits a flat row index colexicographically
(first sub-mode fastest), which is exactly the packing above, so ``view[r, d]`` with a
flat ``r`` needs no index arithmetic in the kernel. A range of packed rows starting
mid-group is not an affine layout, so index the full view with ``row_start + i``
rather than tiling it with ``local_tile``.

Strides are taken from the input tensor as they are (never rebuilt from Python ints
or cast), so Int64 strides from ``from_dlpack`` survive.
"""

import cutlass.cute as cute


def packed_coord(r, group: int):
    """(token, head within group) of packed row ``r``; matches the view's flattening.

    ``group`` is compile time: a power of two becomes shift/mask, else a division by a
    constant. ``r`` must be >= 0. The token is what causal masking needs.
    """
    if group & (group - 1) == 0:
        return r >> (group.bit_length() - 1), r & (group - 1)
    return r // group, r % group


def packed_head(r, kv_head, group: int):
    """Query head of packed row ``r`` of KV head ``kv_head`` (a per-head value such as an
    attention sink is indexed with it)."""
    return kv_head * group + packed_coord(r, group)[1]


def packed_rows(mX: cute.Tensor, token_start, num_tokens, kv_head, group: int) -> cute.Tensor:
    """``((group, num_tokens), D)`` view of q/out ``[total_q, Hq, D]`` for one request
    (tokens ``token_start ..``) and one KV head.

    Strides ``((stride_head, stride_token), stride_dim)`` of ``mX`` (stride_dim is 1
    for the required contiguous last dim); origin at ``(token_start, kv_head*group, 0)``.
    ``group`` (1..32, any value) is compile time; ``num_tokens`` may be dynamic.
    """
    if cute.rank(mX) != 3:
        raise ValueError(f"q/out must be rank 3 [total_q, Hq, D], got layout {mX.layout}")
    origin = cute.domain_offset((token_start, kv_head * group, 0), mX)
    s_tok, s_head, s_dim = mX.stride
    layout = cute.make_layout(((group, num_tokens), mX.shape[2]),
                              stride=((s_head, s_tok), s_dim))
    return cute.make_tensor(origin.iterator, layout)


def packed_lse(mLSE: cute.Tensor, token_start, num_tokens, kv_head, group: int) -> cute.Tensor:
    """``((group, num_tokens),)`` view of lse ``[total_q, Hq]`` (float32), packed like
    :func:`packed_rows`, so the same flat row index addresses a row's O and LSE."""
    if cute.rank(mLSE) != 2:
        raise ValueError(f"lse must be rank 2 [total_q, Hq], got layout {mLSE.layout}")
    origin = cute.domain_offset((token_start, kv_head * group), mLSE)
    s_tok, s_head = mLSE.stride
    layout = cute.make_layout(((group, num_tokens),), stride=((s_head, s_tok),))
    return cute.make_tensor(origin.iterator, layout)


def partial_rows(mPartialO: cute.Tensor, slot) -> cute.Tensor:
    """``(tile_m, D)`` fp32 partial-O rows of split slot ``slot`` of the workspace
    ``[slots, tile_m, D]``; row i is packed row ``row_start + i`` of the work item."""
    return mPartialO[slot, None, None]


def partial_lse(mPartialLSE: cute.Tensor, slot) -> cute.Tensor:
    """``(tile_m,)`` fp32 partial LSE of split slot ``slot`` of ``[slots, tile_m]``."""
    return mPartialLSE[slot, None]
