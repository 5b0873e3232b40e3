"""What a plan computes besides the batch: :class:`PlanOptions` (docs/contract.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from podcute.planning.types import MAX_KV_LEN


@dataclass(frozen=True)
class PlanOptions:
    """What a plan computes besides the batch (docs/contract.md): the mask, soft-capping,
    and whether split points may depend on the batch. Validated by :meth:`make`."""

    causal: bool = True
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # as given (causal clips it to 0)
    softcap: float = 0.0  # 0: off
    batch_invariant: bool = False

    @staticmethod
    def make(causal=True, window_size=(-1, -1), softcap=0.0,
             batch_invariant=False) -> "PlanOptions":
        """Options from plan()'s arguments; TypeError/ValueError naming a bad one."""
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        if not isinstance(batch_invariant, (bool, np.bool_)):
            raise TypeError(f"batch_invariant must be a bool, got "
                            f"{type(batch_invariant).__name__}")
        if window_size is None:
            window_size = (-1, -1)
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            raise TypeError(f"window_size must be a pair (left, right) of ints, got "
                            f"{window_size!r}")
        for side, v in zip(("left", "right"), window_size):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"window_size {side} must be an int (-1: unbounded), got "
                                f"{type(v).__name__}")
            if not -1 <= v <= MAX_KV_LEN:
                raise ValueError(f"window_size {side} must be -1 (unbounded) or in [0, "
                                 f"{MAX_KV_LEN}], got {v}")
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float,
                                                                             np.floating)):
            raise TypeError(f"softcap must be a float (0: off), got {type(softcap).__name__}")
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap >= 0):
            raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap}")
        if 0 < softcap < 1e-30:
            raise ValueError(f"softcap {softcap} is too small for float32 (use 0 for off)")
        return PlanOptions(bool(causal), int(window_size[0]), int(window_size[1]), softcap,
                           bool(batch_invariant))

    @property
    def bounded_right(self) -> bool:
        """Keys right of a limit are masked (the kernel's `causal` flag)."""
        return self.causal or self.window_right >= 0

    @property
    def right(self) -> int:
        """The right limit's offset from the query position (0 when causal)."""
        return 0 if self.causal else max(self.window_right, 0)

    @property
    def has_window(self) -> bool:
        """The kernel reads window edges from the plan (its `window` flag)."""
        return self.window_left >= 0 or (not self.causal and self.window_right >= 0)

    def kernel_flags(self) -> dict:
        return dict(causal=self.bounded_right, window=self.has_window,
                    softcap=self.softcap > 0)

    @cached_property
    def variant(self) -> tuple:
        """kernel_flags() as a tuple, made once (launch's per-call dict key)."""
        return tuple(self.kernel_flags().values())
