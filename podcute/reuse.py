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
- NumPy index arrays (no version counter) are compared by content, and so are CPU
  tensors made under ``torch.inference_mode()`` (inference tensors have no version
  counter either). An inference tensor on the device cannot be compared without a device
  sync: a call with one plans every time (one device-to-host copy). Engines keep reuse by
  allocating their metadata buffers outside inference mode and writing them in place
  (slices and in-place writes made inside inference mode keep a normal tensor's counter),
  as vLLM's persistent buffers are.

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
        if x.is_inference():
            # Made under torch.inference_mode(): no version counter to see writes by.
            if x.device.type == "cpu":  # compared by content, like a NumPy array
                return ("inference", x.data_ptr(), x.shape, x.stride(), x.dtype,
                        x.numpy().tobytes())
            return object()  # equal to no later call's: reading it back would sync; plan again
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
        self._same = None  # reuses()'s record of the last call: (plan, scalars, tensors)
        _planners.add(self)

    def invalidate(self) -> None:
        """Forget the last plan: the next call plans again."""
        self._key = None
        self._held = ()
        self._same = None

    def reuses(self, tensors: tuple, scalars: tuple) -> bool:
        """The per-layer test, cheaper than comparing fingerprints: True if `tensors`
        are the very objects of the last call that planned or reused (None where it had
        None), none written since (version counter), none re-pointed or reshaped (address,
        shape and strides: a ``.data =`` assignment moves no version counter), the scalars
        are equal and the attention still holds that plan. False sends the call to
        plan(), which compares fingerprints (new tensor objects over the same memory) and
        plans if they differ."""
        same = self._same
        if same is None or same[0] is not self.attn._plan or same[1] != scalars:
            return False
        held = same[2]
        if len(tensors) != len(held):
            return False
        for t, h in zip(tensors, held):
            if h is None:
                if t is not None:
                    return False
            elif (t is not h[0] or t._version != h[1] or t.data_ptr() != h[2]
                  or t.shape != h[3] or t.stride() != h[4]):
                return False
        return True

    def plan(self, tensors: tuple, scalars: tuple, plan_fn) -> bool:
        """Make sure `attn` holds the plan of this metadata: `plan_fn()` plans it unless
        the previous call's `tensors` (index arguments, any of them None) and `scalars`
        were the same. Returns True if the previous plan was reused."""
        if self.reuses(tensors, scalars):
            return True
        key = (tuple(map(fingerprint, tensors)), scalars)
        if key == self._key and self.attn.current_plan is not None:
            self._remember(tensors, scalars)
            return True
        self._key = self._same = None  # a failed plan() leaves nothing to reuse
        plan_fn()
        self._key = key
        self._held = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        self._remember(tensors, scalars)
        return False

    def _remember(self, tensors: tuple, scalars: tuple) -> None:
        """reuses()'s record; none when an argument has no version counter (a NumPy
        array, an inference tensor) or is a tensor subclass: those calls compare
        fingerprints in plan()."""
        held = []
        for t in tensors:
            if t is None:
                held.append(None)
            elif type(t) is torch.Tensor and not t.is_inference():
                held.append((t, t._version, t.data_ptr(), t.shape, t.stride()))
            else:
                self._same = None
                return
        self._same = (self.attn._plan, scalars, tuple(held))


def invalidate_plans() -> None:
    """Make every one-shot or compat entry point plan its next call again (after writing
    index tensors in a way torch's version counter does not see)."""
    for p in list(_planners):
        p.invalidate()
