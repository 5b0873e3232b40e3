"""Named hardware barriers of the fused kernel (id 0 is __syncthreads).

Thread counts come from the KernelConfig (``num_mma_threads``, ``num_threads``, one
warpgroup = 128), so the ids below are the only barrier facts written down. Where one
side arrives and the other syncs (``bar.arrive`` / ``bar.sync``), each barrier instance
gets exactly one arriving group and one syncing group, so every count is the sum of two
warpgroups' threads. Shared-memory data handed between MMA warpgroups goes through an
mbarrier that every thread arrives on (the decode combine), which compute-sanitizer's
racecheck follows, where it flagged the named-barrier hand-overs.
"""

from enum import IntEnum

from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from podcute.kernels.ptx import asm32

MAX_MMA_WARPGROUPS = 2


class NamedBarrier(IntEnum):
    # Every MMA thread: the shared V-tail zeroing of a prefill tile, the split merge.
    MMA = 1
    # + warpgroup index: one MMA warpgroup (its V-tail zeroing in a decode item, its O
    # staging tile in the epilogue).
    WARPGROUP = 2
    # + warpgroup index: ping-pong turn, "this MMA warpgroup may issue its GEMMs"; the
    # other warpgroup arrives after issuing its own.
    SCHEDULE = WARPGROUP + MAX_MMA_WARPGROUPS
    # The producer warpgroup: a KV tile's page lookups are in shared memory.
    PRODUCER = SCHEDULE + MAX_MMA_WARPGROUPS
    # End of the CTA: the MMA warpgroups arrive when their last item is done; the
    # producer warpgroup syncs, so no warp of the CTA exits while others still run.
    # (The decode combine hands over through an mbarrier pipeline, not a named barrier.)
    CTA_END = PRODUCER + 1


@dsl_user_op
def barrier_or(pred, barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> Int32:
    """A named barrier (`bar.red.or`) that also returns 1 to every participating thread if
    any of them passed a nonzero `pred`, else 0: one thread's verdict reaches all
    without a shared-memory flag (which racecheck saw as a hand-over across a named
    barrier). The DSL's barrier has no reduction form, hence the PTX."""
    return asm32(
        Int32, [Int32(pred)],
        "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, $1, 0;\n\t"
        f"bar.red.or.pred q, {int(barrier_id)}, {int(number_of_threads)}, p;\n\t"
        "selp.u32 $0, 1, 0, q;\n\t}",
        side_effects=True, loc=loc, ip=ip)
