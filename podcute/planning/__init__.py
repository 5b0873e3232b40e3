"""Host planner: turns one mixed batch into the int32 work metadata the fused kernel runs
(:class:`Planner`; how, step by step: planner.py's docstring).

One concept a module:

- ``types``: the hard limits (``MAX_*``), :class:`CapacityError`, :class:`Plan`,
  :class:`PlanSummary`, :class:`PlanConfig`, :class:`Capacities` and :func:`capacities`,
  a work expansion's :class:`Layout`, and :class:`PlanBuffers` (the buffers the kernel
  reads, the torch twin of ``kernels.args.PlanTensors``);
- ``options``: :class:`PlanOptions` (mask, soft-capping, batch invariance);
- ``cost``: :class:`CostModel`, :class:`PrefillTiling`, the chips' HBM bytes per SM clock;
- ``inputs``: :func:`host_arrays` and the checks of the index inputs, the page set;
- ``planner``: :class:`Planner` (buffers, capacity growth, freeze, plan());
- ``expand``: the work expansion in numpy and the predictions read from it;
- ``native`` (+ ``native.c``): the same expansion in C, bit for bit;
- ``sharing``: shared prefixes found in the page lists and attended once (the batch the
  expansion plans, and the rewrite of its rows and merges);
- ``arrays``: numpy helpers the inputs and the expansion share.
"""

from podcute.planning.cost import (DEFAULT_COST_MODEL, H100_HBM_BYTES_PER_SM_CLOCK,
                                   H200_HBM_BYTES_PER_SM_CLOCK, CostModel, PrefillTiling,
                                   chip_hbm_bytes_per_sm_clock)
from podcute.planning.inputs import host_arrays
from podcute.planning.options import PlanOptions
from podcute.planning.planner import Planner
from podcute.planning.types import (F32_MAX, F32_TINY, INVARIANT_SPLIT_TOKENS, MAX_BATCH_SIZE,
                                    MAX_KV_LEN, MAX_NUM_PAGES, MAX_NUM_TOKENS, MAX_WORK_ITEMS,
                                    Capacities, CapacityError, Layout, Plan, PlanBuffers,
                                    PlanConfig, PlanSummary, capacities)

__all__ = [
    "Planner", "Plan", "PlanBuffers", "PlanSummary", "PlanOptions", "PlanConfig", "CapacityError",
    "Capacities", "capacities", "Layout", "CostModel", "DEFAULT_COST_MODEL", "PrefillTiling",
    "chip_hbm_bytes_per_sm_clock", "H100_HBM_BYTES_PER_SM_CLOCK",
    "H200_HBM_BYTES_PER_SM_CLOCK", "host_arrays", "MAX_KV_LEN", "MAX_BATCH_SIZE",
    "MAX_NUM_TOKENS", "MAX_NUM_PAGES", "MAX_WORK_ITEMS", "F32_TINY", "F32_MAX",
    "INVARIANT_SPLIT_TOKENS",
]
