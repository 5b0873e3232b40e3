"""Named hardware barriers of the fused kernel (id 0 is __syncthreads).

Thread counts come from the KernelConfig (``num_mma_threads``, one warpgroup = 128), so
the ids below are the only barrier facts written down.
"""

from enum import IntEnum

MAX_MMA_WARPGROUPS = 2


class NamedBarrier(IntEnum):
    # Every MMA thread: the decode combine, the shared V-tail zeroing, the split merge.
    MMA = 1
    # + warpgroup index: one MMA warpgroup (its own V-tail zeroing in a decode item).
    WARPGROUP = 2
    # + warpgroup index: ping-pong turn, "this MMA warpgroup may issue its GEMMs".
    SCHEDULE = WARPGROUP + MAX_MMA_WARPGROUPS
    # The producer warpgroup: a KV tile's page lookups are in shared memory.
    PRODUCER = SCHEDULE + MAX_MMA_WARPGROUPS
    # Decode combine: warpgroup 1's state is in the scratch / the scratch is free again.
    COMBINE_FULL = PRODUCER + 1
    COMBINE_EMPTY = PRODUCER + 2
