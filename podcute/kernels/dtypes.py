"""KernelConfig dtype names -> DSL element types (both kernels and compile.py's fake
arguments)."""

import cutlass

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
          "float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}
