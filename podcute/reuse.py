"""Plans reused across the calls of one engine step (the one-shot and compat entry points).

An engine calls attention once per layer with the same metadata (lengths, page table):
planning each call would cost the host ~0.1-1 ms per layer. :class:`CallPlanner` plans a
call's batch on a :class:`~podcute.PODAttention` and serves the same plan to the next
calls for as long as their metadata is *the same*, by this rule:

- every index tensor is the same tensor memory as when it was planned (data pointer,
  shape, strides, dtype, device) and torch's version counter of it has not moved (any
  in-place torch write bumps it: ``copy_``, indexing assignment, ``fill_``, a slice's
  write bumps its base), and every scalar (causal, scale, ...) is equal;
- the planner holds a reference to each tensor it planned from, so its memory cannot be
  freed and handed to a new tensor that would look the same;
- NumPy index arrays (no version counter) are compared by content.

A write that torch does not see (through a NumPy view of a CPU tensor, or by a custom
kernel into a device tensor) is not detected: pass a new tensor, or call
:meth:`CallPlanner.invalidate` (``podcute.invalidate_plans()`` for the one-shot entry
points) after such a write. Index tensors on the device are never read back to compare
(that would be a device sync per layer); the first call of a step with device metadata
costs its one device-to-host copy in ``plan()``.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

__all__ = ["CallPlanner", "fingerprint", "invalidate_plans"]

_planners: "weakref.WeakSet[CallPlanner]" = weakref.WeakSet()


def fingerprint(x):
    """What identifies an index argument's contents without reading device memory."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return (x.data_ptr(), x._version, x.shape, x.stride(), x.dtype, x.device)
    if isinstance(x, np.ndarray):
        return ("numpy", x.dtype.str, x.shape, x.tobytes())
    return ("value", x)


class CallPlanner:
    """The plan of the last call of one :class:`~podcute.PODAttention`, reused while the
    metadata stays the same (module docstring)."""

    def __init__(self, attn):
        self.attn = attn
        self._key = None
        self._held = ()
        _planners.add(self)

    def invalidate(self) -> None:
        """Forget the last plan: the next call plans again."""
        self._key = None
        self._held = ()

    def plan(self, tensors: tuple, scalars: tuple, plan_fn) -> bool:
        """Make sure `attn` holds the plan of this metadata: `plan_fn()` plans it unless
        the previous call's `tensors` (index arguments, any of them None) and `scalars`
        were the same. Returns True if the previous plan was reused."""
        key = (tuple(map(fingerprint, tensors)), scalars)
        if key == self._key and self.attn.current_plan is not None:
            return True
        self._key = None  # a failed plan() leaves nothing to reuse
        plan_fn()
        self._key = key
        self._held = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        return False


def invalidate_plans() -> None:
    """Make every one-shot or compat entry point plan its next call again (after writing
    index tensors in a way torch's version counter does not see)."""
    for p in list(_planners):
        p.invalidate()
