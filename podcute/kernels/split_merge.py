"""Exact merge of split-KV partials: out = sum_s exp(lse_s - lse) * O_s, lse = logsumexp_s.

Run inside the fused kernel by the consumer warpgroup of the CTA that finishes a merge
group's last split (counted by a per-group semaphore), so a batch is one launch. Splits
whose rows saw no key carry lse = -inf and weigh 0. Partials never include an attention
sink; the merge adds it once, as one more term of the logsumexp with no value. The
splits are reduced in slot order (= KV order), whichever CTA merges.
"""

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from podcute import layouts
from podcute.kernels.args import PlanTensors, PodTensors
from podcute.kernels.barriers import barrier_or
from podcute.kernels.metadata import MergeCol

# A merge is bound by load latency, not bytes (a 128-row group of two splits is 128 KB,
# about a microsecond of an SM's L2 bandwidth). Read a split and a row at a time, its LSE
# maximum first, it took 5 dependent L2 round trips a row pass (~25 us for 128 rows on
# 4 warps, which the fused launch's split pieces paid: docs/notes/split-merge.md). So one
# sweep, rescaling as the maximum grows (the online softmax's step), with the LSE and
# partials of SPLITS_IN_FLIGHT splits loaded before any is used: one round trip a pass
# for two splits; and 8 columns a thread, 8 rows a pass at D 128 (4 columns took twice
# the passes: 1.6-2.8 % of M1/M5/P1's fused time on the H200). (More splits or rows in
# flight moved ptxas's register allocation of the warp kernel's tile loops on sm_90,
# which sit at its 255-register limit; these two leave their local memory as it was.
# The sm_90a kernel keeps more in flight: PodKernelBase.merge_splits.) A thread's 8
# columns move as 16-byte vectors (`_row_chunk`).
COLS_PER_THREAD = 8
SPLITS_IN_FLIGHT = 2


def _row_chunk(gX: cute.Tensor, row, col0, n: int) -> cute.Tensor:
    """Columns [col0, col0 + n) of row `row` of gX (contiguous columns; col0 a multiple of
    n), with the alignment they have: partial rows and out's rows start 16-byte aligned
    (the workspace's allocation, the API's check) and n columns are whole vectors. The
    DSL cannot see it through dynamic row strides, and element by element a merge row
    pass took 8 loads and 8 stores where 2 and 1 do."""
    dtype = gX.element_type
    nbytes = n * dtype.width // 8
    start = gX[row, None].iterator.toint() + Int64(col0 * (dtype.width // 8))
    ptr = cute.make_ptr(dtype, start, cute.AddressSpace.gmem, assumed_align=min(16, nbytes))
    return cute.make_tensor(ptr, cute.make_layout(n))


@cute.jit
def merge_group(
    gO: cute.Tensor,  # packed rows ((G, q_len), D) of out
    gLSE: Optional[cute.Tensor],  # packed rows ((G, q_len),) of lse, or None
    mPartialO: cute.Tensor,  # [slots, tile_m, D] fp32
    mPartialLSE: cute.Tensor,  # [slots, tile_m] fp32
    row_start: Int32,
    n_rows: Int32,
    first_slot: Int32,
    num_splits: Int32,
    tidx: Int32,
    num_threads,  # the merging threads: a Constexpr int, or an Int32 (a warp or all)
    head_dim: cutlass.Constexpr[int],
    mSinks: Optional[cute.Tensor] = None,  # [Hq] fp32 sink logits, or None
    kv_head: Int32 = 0,  # the rows' KV head (a row's sink is its query head's)
    group: cutlass.Constexpr[int] = 1,
    mShared: Optional[cute.Tensor] = None,  # a shared_prefix variant's list, or None
    own_row: Int32 = 0,  # the first partial row of these rows in their own slots
    terms_first: Int32 = 0,  # their prefix terms: (slot, partial row) pairs of mShared
    terms_count: Int32 = 0,
    splits_in_flight: cutlass.Constexpr[int] = SPLITS_IN_FLIGHT,
):
    """Merge the partials of packed rows [row_start, row_start + n_rows) into out (+ lse).

    With `mShared` (a sharer's merge, planning/sharing.py) the splits are first the
    `terms_count` prefix terms, each a (slot, partial row) pair from mShared[terms_first],
    then the own slots from partial row `own_row` on.

    A thread handles COLS_PER_THREAD columns of one row a pass (threads past the last
    whole row of a pass idle: D 96 leaves some), over the splits SPLITS_IN_FLIGHT at a
    time, in slot order. With at most SPLITS_IN_FLIGHT splits the sums are the two-pass
    merge's, operation for operation (the maximum is known before any weight).
    """
    threads_per_row = head_dim // COLS_PER_THREAD
    rows_per_pass = num_threads // threads_per_row
    col0 = (tidx % threads_per_row) * COLS_PER_THREAD
    S, C = splits_in_flight, COLS_PER_THREAD
    split_lse = cute.make_rmem_tensor(S, Float32)
    # (row-major: a split's C columns contiguous, each loaded as 16-byte vectors)
    part = cute.make_rmem_tensor(cute.make_layout((S, C), stride=(C, 1)), Float32)
    acc = cute.make_rmem_tensor(C, Float32)
    out = cute.make_rmem_tensor(C, gO.element_type)
    if tidx < rows_per_pass * threads_per_row:
        for row0 in cutlass.range(0, n_rows, rows_per_pass, unroll=1):
            row = row0 + tidx // threads_per_row
            if row < n_rows:
                # Running maximum (the sink's logit counts as one more term) and the
                # sums scaled by it; -inf: no term yet, whose sums are 0.
                row_max = -Float32.inf
                total = Float32(0.0)
                if const_expr(mSinks is not None):
                    row_max = mSinks[layouts.packed_head(row_start + row, kv_head, group)]
                    if row_max != -Float32.inf:
                        total = Float32(1.0)  # exp(sink - sink)
                acc.fill(0.0)
                total_splits = num_splits
                if const_expr(mShared is not None):
                    total_splits = num_splits + terms_count
                for s0 in cutlass.range(0, total_splits, S, unroll=1):
                    for k in cutlass.range_constexpr(S):
                        # (a split past the last: lse -inf, weight 0, partial read as 0,
                        # since 0 * an unset register could be NaN)
                        split_lse[k] = -Float32.inf
                        part[k, None].fill(0.0)
                        if s0 + k < total_splits:
                            slot = first_slot + s0 + k
                            prow = row
                            if const_expr(mShared is not None):
                                t = s0 + k
                                slot = first_slot + t - terms_count
                                prow = own_row + row
                                if t < terms_count:
                                    slot = mShared[terms_first + 2 * t]
                                    prow = mShared[terms_first + 2 * t + 1] + row
                            split_lse[k] = layouts.partial_lse(mPartialLSE, slot)[prow]
                            gPartial = layouts.partial_rows(mPartialO, slot)
                            cute.autovec_copy(_row_chunk(gPartial, prow, col0, C),
                                              part[k, None])
                    new_max = row_max
                    for k in cutlass.range_constexpr(S):
                        new_max = cutlass.max(new_max, split_lse[k])
                    # All -inf so far: shift by 0 so weights are exact 0.
                    shift = new_max
                    if new_max == -Float32.inf:
                        shift = Float32(0.0)
                    if row_max != new_max:
                        scale = Float32(0.0)  # (from -inf: the sums are 0)
                        if row_max != -Float32.inf:
                            scale = cute.math.exp(row_max - shift, fastmath=True)
                        total = total * scale
                        for j in cutlass.range_constexpr(C):
                            acc[j] = acc[j] * scale
                    row_max = new_max
                    for k in cutlass.range_constexpr(S):
                        w = cute.math.exp(split_lse[k] - shift, fastmath=True)
                        total = total + w
                        for j in cutlass.range_constexpr(C):
                            acc[j] = acc[j] + w * part[k, j]
                inv = Float32(0.0)
                if total > Float32(0.0):
                    inv = Float32(1.0) / total
                for j in cutlass.range_constexpr(C):
                    out[j] = (acc[j] * inv).to(gO.element_type)
                cute.autovec_copy(out, _row_chunk(gO, row_start + row, col0, C))
                if const_expr(gLSE is not None):
                    if tidx % threads_per_row == 0:
                        row_lse = -Float32.inf
                        if total > Float32(0.0):
                            row_lse = row_max + cute.math.log(total, fastmath=True)
                        gLSE[row_start + row] = row_lse


@cute.jit
def finish_split(
    io: PodTensors,  # (mO, mLSE and mSinks)
    plan: PlanTensors,  # (the partials, the merge rows and semaphores, mQStart)
    split_slot: Int32,
    group: cutlass.Constexpr[int],
    head_dim: cutlass.Constexpr[int],
    tidx: Int32,
    num_threads: cutlass.Constexpr[int],
    barrier_id: cutlass.Constexpr[int],
    merge_rank: Int32 = 0,
    shared: cutlass.Constexpr[bool] = False,
    splits_in_flight: cutlass.Constexpr[int] = SPLITS_IN_FLIGHT,
):
    """After a split's partials are written: count it; the group's last split merges.

    Release: every thread fences its partial stores at GPU scope before the barrier, and
    one thread then increments the group's semaphore. The thread that sees count
    splits - 1 is the last; a barrier that ORs its verdict into every thread
    (`barrier_or`) tells the others, which fence again (acquire) and read every split's
    partials; then it resets the semaphore so the next launch starts from zero.

    `shared` (a shared_prefix variant): the piece's merge is its slot's plus `merge_rank`
    (a sharer's own piece), a merge waits for MergeCol.WAIT pieces, and a shared-prefix
    piece, whose merge row is a feed row, counts into each of its sharers' merges
    instead (`count_and_merge_all`). Either merge loads `splits_in_flight` splits (or
    terms) at a time.
    """
    mMerge = plan.mMerge
    m = plan.mSlotMerge[split_slot] + merge_rank
    if const_expr(shared):
        first, count = m, Int32(1)
        if mMerge[m, MergeCol.FEED_COUNT] > 0:
            first, count = mMerge[m, MergeCol.FEED_FIRST], mMerge[m, MergeCol.FEED_COUNT]
        count_and_merge_all(io, plan, first, count, group, head_dim, tidx, num_threads,
                            barrier_id, splits_in_flight)
    else:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        count_and_merge(io, plan, m, mMerge[m, MergeCol.NUM_SPLITS], group, head_dim, tidx,
                        num_threads, barrier_id, splits_in_flight)


class MergeRow(NamedTuple):
    """One merge's metadata: its merge row and its request's rows (the prefix-term
    columns read only by a shared_prefix variant), loaded by the merging team once the
    merge completed. (Loaded before the atomics, each thread its own merge's, and handed
    to a warp's lanes by shuffles, it cost the MMA warps 12 bytes of spill in the causal
    shared variants.)"""

    q_start: Int32
    q_len: Int32
    kv_head: Int32
    row_start: Int32
    n_rows: Int32
    first_slot: Int32
    num_splits: Int32
    own_row: Int32
    terms_first: Int32
    terms_count: Int32

    @staticmethod
    def load(plan: PlanTensors, m: Int32) -> "MergeRow":
        mMerge = plan.mMerge
        req = mMerge[m, MergeCol.REQ]
        kv_head = mMerge[m, MergeCol.KV_HEAD]
        row_start = mMerge[m, MergeCol.ROW_START]
        q_start = plan.mQStart[req]
        q_len = plan.mQStart[req + 1] - q_start
        n_rows = mMerge[m, MergeCol.ROW_END] - row_start
        first_slot = mMerge[m, MergeCol.FIRST_SLOT]
        num_splits = mMerge[m, MergeCol.NUM_SPLITS]
        return MergeRow(q_start, q_len, kv_head, row_start, n_rows, first_slot, num_splits,
                        mMerge[m, MergeCol.OWN_ROW], mMerge[m, MergeCol.TERMS_FIRST],
                        mMerge[m, MergeCol.TERMS_COUNT])


@cute.jit
def merge_rows(io: PodTensors, plan: PlanTensors, r: MergeRow, group: cutlass.Constexpr[int],
               head_dim: cutlass.Constexpr[int], tidx: Int32, num_threads,
               shared: cutlass.Constexpr[bool] = False,
               splits_in_flight: cutlass.Constexpr[int] = SPLITS_IN_FLIGHT):
    """Merge the partials of merge row `r` into out (+ lse), on `num_threads` threads (a
    Constexpr int, or an Int32) from `tidx`; `shared`: with its prefix terms."""
    gO = layouts.packed_rows(io.mO, r.q_start, r.q_len, r.kv_head, group)
    gLSE = None
    if const_expr(io.mLSE is not None):
        gLSE = layouts.packed_lse(io.mLSE, r.q_start, r.q_len, r.kv_head, group)
    terms = ()
    if const_expr(shared):
        terms = (plan.mShared, r.own_row, r.terms_first, r.terms_count)
    merge_group(gO, gLSE, plan.mPartialO, plan.mPartialLSE, r.row_start, r.n_rows,
                r.first_slot, r.num_splits, tidx, num_threads, head_dim, io.mSinks,
                r.kv_head, group, *terms, splits_in_flight=splits_in_flight)


@cute.jit
def count_and_merge(io: PodTensors, plan: PlanTensors, m: Int32, wait: Int32,
                    group: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                    tidx: Int32, num_threads: cutlass.Constexpr[int],
                    barrier_id: cutlass.Constexpr[int],
                    splits_in_flight: cutlass.Constexpr[int] = SPLITS_IN_FLIGHT):
    """Count one piece into merge m (after the release barrier); the piece that completes
    it (`wait` pieces) merges, on all `num_threads` threads."""
    mMergeSem = plan.mMergeSem
    last = Int32(0)
    if tidx == 0:
        done = cute.arch.atomic_add(mMergeSem.iterator + m, Int32(1), sem="acq_rel", scope="gpu")
        last = Int32(done == wait - 1)
    if barrier_or(last, barrier_id, num_threads) != 0:
        cute.arch.fence_acq_rel_gpu()
        merge_rows(io, plan, MergeRow.load(plan, m), group, head_dim, tidx, num_threads,
                   splits_in_flight=splits_in_flight)
        if tidx == 0:
            mMergeSem[m] = Int32(0)


@cute.jit
def count_and_merge_all(io: PodTensors, plan: PlanTensors, first: Int32, count: Int32,
                        group: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                        tidx: Int32, num_threads: cutlass.Constexpr[int],
                        barrier_id: cutlass.Constexpr[int],
                        splits_in_flight: cutlass.Constexpr[int] = SPLITS_IN_FLIGHT):
    """Count one piece into each of merges [first, first + count) (a shared_prefix
    variant, whose merges wait for MergeCol.WAIT pieces), one atomic a thread, in
    parallel, after the release (a fence by every thread, then the barrier).

    One merge (a piece of its own): all threads merge it if it completed. Several (a
    prefix tile's piece, which feeds up to a tile's sharers): consecutive merges are
    counted on different warps, and each warp merges the ones its lanes completed, so a
    tile's 32 four-row merges run on 8 warps at once rather than one after another on
    the whole CTA (S1's piece that finished last spent most of the launch there). One
    merge_group site, the team's size a runtime value: a second, warp-sized site cost
    the MMA warps 12-20 bytes of spill."""
    mMergeSem = plan.mMergeSem
    warps = num_threads // 32
    lane, warp = tidx % 32, tidx // 32
    alone = count == 1
    team_tidx, team_threads = tidx, Int32(num_threads)
    if not alone:
        team_tidx, team_threads = lane, Int32(32)
    for c0 in cutlass.range(0, count, num_threads, unroll=1):
        j = c0 + lane * warps + warp  # the merge this thread counts (thread 0: c0)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        # Relaxed, so that the WAIT load below need not wait for its answer: the fence
        # before the barrier releases, the completing thread's fence after it acquires
        # (then the barrier or the warp's sync and every thread's fence).
        done = Int32(0)
        if j < count:
            done = cute.arch.atomic_add(mMergeSem.iterator + first + j, Int32(1),
                                        sem="relaxed", scope="gpu")
        wait = plan.mMerge[first + cutlass.min(j, count - 1), MergeCol.WAIT]
        last = Int32(0)
        if j < count:
            last = Int32(done == wait - 1)
        if last != 0:
            cute.arch.fence_acq_rel_gpu()
        # bit b: the merge lane b of this warp completed (alone: bit 0, merge `first`)
        pending = Int32(0)
        if alone:
            pending = barrier_or(last, barrier_id, num_threads)
        else:
            pending = Int32(cute.arch.vote_ballot_sync(last != 0))
            # (orders the completing lane's acquire before its warp's reads, as the
            # barrier does for the whole CTA)
            cute.arch.sync_warp()
        while pending != 0:
            b = Int32(cute.arch.clz(cute.arch.brev(pending)))
            pending = pending & (pending - 1)
            m = first
            if not alone:
                m = first + c0 + b * warps + warp
            r = MergeRow.load(plan, m)  # (plan constants: in flight across the fence)
            cute.arch.fence_acq_rel_gpu()
            merge_rows(io, plan, r, group, head_dim, team_tidx, team_threads, True,
                       splits_in_flight)
            if team_tidx == 0:
                mMergeSem[m] = Int32(0)
