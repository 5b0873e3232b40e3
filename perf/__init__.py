"""Benchmarks of podcute against its roofline and peers (``python -m perf.bench``).

``perf.workloads`` (workload definitions, roofline math) is pure Python and imports on a
CPU-only machine; ``perf.timing`` and ``perf.bench`` need a CUDA GPU to run.
"""
