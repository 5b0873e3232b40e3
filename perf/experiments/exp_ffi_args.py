"""Experiment (issue 12, host cost): what one compiled call costs per tensor argument.
Empty kernels taking 1, 8 or 21 int32 tensors (podcute's launch passes 21 tensors and 2
ints), compiled with TVM-FFI like podcute's, each called back to back from Python; the
host time per call (min over rounds of 2000 calls) says how much of the ~11 us raw call
one metadata buffer instead of 13 tensors would save.

    python -m perf.experiments.exp_ffi_args          (on a GPU machine)
"""

import time

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor


@cute.kernel
def _empty(a: cute.Tensor):
    pass


# (written out: the DSL compiles functions from their source file)
@cute.jit
def _call1(t0: cute.Tensor,
           x: cutlass.Int32, y: cutlass.Int32, stream: cuda.CUstream):
    _empty(t0).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def _call8(t0: cute.Tensor, t1: cute.Tensor, t2: cute.Tensor, t3: cute.Tensor, t4: cute.Tensor, t5: cute.Tensor, t6: cute.Tensor, t7: cute.Tensor,
           x: cutlass.Int32, y: cutlass.Int32, stream: cuda.CUstream):
    _empty(t0).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def _call21(t0: cute.Tensor, t1: cute.Tensor, t2: cute.Tensor, t3: cute.Tensor, t4:
            cute.Tensor, t5: cute.Tensor, t6: cute.Tensor, t7: cute.Tensor, t8:
            cute.Tensor, t9: cute.Tensor, t10: cute.Tensor, t11: cute.Tensor,
            t12: cute.Tensor, t13: cute.Tensor, t14: cute.Tensor, t15:
            cute.Tensor, t16: cute.Tensor, t17: cute.Tensor, t18: cute.Tensor,
            t19: cute.Tensor, t20: cute.Tensor,
            x: cutlass.Int32, y: cutlass.Int32, stream: cuda.CUstream):
    _empty(t0).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


_CALLS = {1: _call1, 8: _call8, 21: _call21}


def main() -> int:
    dev = torch.device("cuda")
    buf = torch.zeros(4096, dtype=torch.int32, device=dev)
    for n in (1, 8, 21):
        fake = [make_fake_tensor(cutlass.Int32, (cute.sym_int64(),), (1,), assumed_align=4)
                for _ in range(n)]
        fn = cute.compile(_CALLS[n], *fake, cutlass.Int32(0), cutlass.Int32(0),
                          make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--enable-tvm-ffi")
        raw = getattr(fn, "__tvm_ffi_object__", None)
        fn = raw() if callable(raw) and raw() is not None else fn
        args = [buf[i * 16: i * 16 + 8] for i in range(n)]
        for _ in range(200):
            fn(*args, 4, 1)
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(10):
            t = time.perf_counter()
            for _ in range(2000):
                fn(*args, 4, 1)
            best = min(best, (time.perf_counter() - t) / 2000)
            torch.cuda.synchronize()
        print(f"{n:2d} tensors + 2 ints: {best * 1e6:.2f} us a call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
