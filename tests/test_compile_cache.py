"""The compile cache: distinct keys for distinct code, disk round trip, one compile
across processes, corrupt entries rebuilt, unsupported architectures refused."""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from podcute.compile import VariantKey, _kernel_source_files, cache_dir
from podcute.kernels.config import KernelConfig

pytestmark = pytest.mark.compile

SCRIPT = textwrap.dedent("""
    import time, torch
    from podcute.compile import VariantKey, compile_variant
    from podcute.kernels.config import KernelConfig
    key = VariantKey.make(KernelConfig.select("bfloat16", 64, 4, True, False, page_size=16))
    t = time.perf_counter()
    pod = compile_variant(key)
    print(f"seconds {time.perf_counter() - t:.3f}", type(pod).__name__)
""")


def run_script(cache, log):
    env = dict(os.environ, PODCUTE_CACHE_DIR=str(cache), PODCUTE_COMPILE_LOG=str(log),
               CUTE_DSL_ARCH="sm_90a")
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def compiles(log):
    return log.read_text().splitlines() if log.exists() else []


def test_keys_differ_for_different_code():
    configs = list(itertools.product(("bfloat16", "float16"), (64, 128), (1, 4, 7),
                                     (True, False), (True, False), (16, 128)))
    keys = {VariantKey.make(KernelConfig.select(*c)) for c in configs}
    assert len(keys) == len(configs)
    assert VariantKey.make(KernelConfig.select("bfloat16", 128, 4, True, True)) == \
        VariantKey.make(KernelConfig.select("bfloat16", 128, 4, True, True))


def test_fingerprint_covers_every_kernel_source():
    """Kernels, the layouts package (wherever the install put it) and the compiled
    signature: a change to any of them is a different key."""
    import podcute.kernels
    import podcute.layouts

    files = {str(f) for f in _kernel_source_files()}
    kernels = os.path.dirname(podcute.kernels.__file__)
    layouts = os.path.dirname(podcute.layouts.__file__)
    for folder in (kernels, layouts):
        for name in os.listdir(folder):
            if name.endswith(".py"):
                assert os.path.realpath(os.path.join(folder, name)) in {
                    os.path.realpath(f) for f in files}, name
    assert any(f.endswith("compile.py") for f in files)


def test_two_processes_compile_once_then_disk_hits(tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "compiles.log"
    procs = [run_script(cache, log) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(compiles(log)) == 1, compiles(log)
    # A third process loads from disk without compiling.
    third = run_script(cache, log)
    out, err = third.communicate(timeout=600)
    assert third.returncode == 0, err
    assert len(compiles(log)) == 1
    entries = list((cache / cache_dir().name).glob("*.o"))
    assert len(entries) == 1 and entries[0].stat().st_size > 0


def test_corrupt_entry_is_rebuilt(tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "compiles.log"
    p = run_script(cache, log)
    assert p.wait(timeout=600) == 0
    (entry,) = (cache / cache_dir().name).glob("*.o")
    entry.write_bytes(b"not an object file")
    p = run_script(cache, log)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert len(compiles(log)) == 2
    assert entry.stat().st_size > 1000


def test_cache_dir_is_namespaced(monkeypatch, tmp_path):
    monkeypatch.setenv("PODCUTE_CACHE_DIR", str(tmp_path))
    d = cache_dir("sm_90a")
    assert d.parent == tmp_path and d.name.startswith("sm_90a-cutlass-dsl-")
