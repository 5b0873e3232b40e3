"""When a one-shot or compat call may skip planning (docs/contract.md, "Plan reuse").

An engine calls attention once per layer with the same metadata (lengths, page table):
planning every call would cost the host ~0.1-1 ms per layer. A call reuses an earlier
plan in exactly two cases:

- **by content**: every index argument lives on the host (a CPU tensor or a NumPy
  array) and holds, at this call, the very values the plan was made from (dtype, shape
  and every element, compared against the plan's own snapshot). No way of writing them
  can serve a stale plan: torch writes, NumPy views, DLPack aliases, ``ctypes``, a
  re-pointed ``.data``, freed memory handed to a new tensor, a fresh
  ``torch.from_numpy(buf)`` each step all come down to the values compared here;
- **by name**: the caller passes the plan itself, a :class:`StepPlan` from
  ``flash_attn_varlen_plan`` as ``scheduler_metadata`` (FlashAttention 3's argument for
  the same thing), as FlashInfer's plan()/run() and :class:`~podcute.PODAttention` do.
  The caller then vouches for its index tensors; the kernel reads the copy the plan
  made and validated at plan time, and a handle whose plan was replaced is refused.

Index tensors on the device are never compared (that is a device sync per layer), so a
call with device metadata and no handle plans every time (one device-to-host copy).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

__all__ = ["CallPlanner", "StepPlan", "host_view", "invalidate_plans", "capturing"]

_planners: "weakref.WeakSet[CallPlanner]" = weakref.WeakSet()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_view(x):
    """x's current values as a NumPy array without a copy when they live on the host (a
    CPU tensor, inference tensors included, or a NumPy array); None otherwise (a device
    tensor, whose values cannot be read without a sync, or anything NumPy cannot view)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        try:
            return torch.Tensor.numpy(x)
        except (RuntimeError, TypeError):  # e.g. a tensor subclass without storage
            return None
    return None


def _snapshot(tensors: tuple):
    """Copies of the index arguments' values (None where an argument is None), or None
    when one of them cannot be compared later (it lives on the device)."""
    snap = []
    for t in tensors:
        if t is None:
            snap.append(None)
            continue
        a = host_view(t)
        if a is None:
            return None
        snap.append(np.array(a, copy=True))
    return tuple(snap)


class CallPlanner:
    """The plan of the last call of one :class:`~podcute.PODAttention` and the index
    values it was made from: reused while a call's values are those (module docstring)."""

    def __init__(self, attn):
        self.attn = attn
        self._made = None  # (plan, scalars, snapshot of the index arguments)
        _planners.add(self)

    def invalidate(self) -> None:
        """Forget the last plan: the next call plans again."""
        self._made = None

    def reuses(self, tensors: tuple, scalars: tuple) -> bool:
        """True if the attention still holds the plan made from these scalars and index
        values: each argument None where it was, else on the host with the same dtype,
        shape and elements as the snapshot."""
        made = self._made
        if made is None or made[0] is not self.attn._plan or made[1] != scalars:
            return False
        snap = made[2]
        if len(tensors) != len(snap):
            return False
        for t, s in zip(tensors, snap):
            if s is None:
                if t is not None:
                    return False
                continue
            a = host_view(t)
            if (a is None or a.shape != s.shape or a.dtype != s.dtype
                    or not np.array_equal(a, s)):
                return False
        return True

    def plan(self, tensors: tuple, scalars: tuple, plan_fn, where: str = "") -> bool:
        """Make sure the attention holds the plan of this metadata: `plan_fn()` plans it
        unless reuses() says the held one is it. Returns True if it was reused. Under
        CUDA-graph capture nothing is planned (the graph would keep the copies): a call
        that cannot reuse raises RuntimeError."""
        if self.reuses(tensors, scalars):
            return True
        self._made = None  # a failed plan() leaves nothing to reuse
        if capturing():
            raise RuntimeError(
                f"{where}under CUDA-graph capture this call would plan: its index tensors "
                "live on the device (their values cannot be compared without a sync) or "
                "hold other values than the last plan's. Plan the step before capturing "
                "and name that plan (podcute.compat.flash_attn: scheduler_metadata="
                "flash_attn_varlen_plan(...); or PODAttention.plan()/run())")
        plan_fn()
        snap = _snapshot(tensors)
        if snap is not None:
            self._made = (self.attn._plan, scalars, snap)
        return False


class StepPlan:
    """A plan the caller names (``flash_attn_varlen_plan``'s return value, taken back as
    ``scheduler_metadata``): the attention that holds it, the plan, and the scalars
    (causal, scale, window, softcap) it was made with."""

    __slots__ = ("attn", "plan", "scalars", "__weakref__")

    def __init__(self, attn, plan, scalars: tuple):
        self.attn, self.plan, self.scalars = attn, plan, scalars

    def check(self, scalars: tuple, where: str = "") -> None:
        """ValueError unless the attention still holds this plan and the call's scalars
        are the plan's."""
        if self.attn._plan is not self.plan:
            raise ValueError(
                f"{where}scheduler_metadata names a plan that a later plan of the same "
                "configuration replaced (each step's flash_attn_varlen_plan replaces the "
                "last one's); pass the handle of the current step")
        if scalars != self.scalars:
            names = ("causal", "softmax_scale", "window_size", "softcap")
            diff = [f"{n}={b!r} (planned {a!r})" for n, a, b in
                    zip(names, self.scalars, scalars) if a != b]
            raise ValueError(f"{where}this call's {', '.join(diff)} differ from the plan "
                             "named by scheduler_metadata; plan with the call's values")

    def __repr__(self) -> str:
        p = self.plan
        return (f"StepPlan(requests={p.batch_size}, query_tokens={p.total_q}, "
                f"causal={p.causal}, current={self.attn._plan is p})")


def invalidate_plans() -> None:
    """Make every one-shot or compat entry point plan its next call again (never needed
    for correctness: reuse compares values; this only drops the snapshots)."""
    for p in list(_planners):
        p.invalidate()
