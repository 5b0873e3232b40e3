"""Variant key -> compiled kernel, cached in memory and on disk.

Every static fact that changes the generated code is in the key; everything that
varies per batch (lengths, page counts, head counts, strides) stays a runtime value of
the compiled function, which is built from fake tensors with symbolic shapes so it can
be compiled on a machine without a GPU (CUTE_DSL_ARCH=sm_90a) and called later with
torch tensors through TVM-FFI (no per-call DLPack conversion in Python).
"""

import ctypes
import fcntl
import hashlib
import importlib.util
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from podcute.kernels.config import (FP8_HEAD_DIMS, SUPPORTED_ARCHS, WARP_MMA_ARCHS, KernelConfig,
                                    arch_head_dims, feature_flags, tile_head_dim)
from podcute.kernels.args import PlanTensors, PodTensors
from podcute.kernels.metadata import MERGE_COLS, NUM_PARAMS, WORK_COLS


def _kernel_source_files() -> list[Path]:
    """Every file that shapes a compiled kernel: podcute/kernels/, the layouts package
    (found through the import system, so a regular install, an editable one and a source
    tree all hash what they actually import) and this module (the compiled signature)."""
    here = Path(__file__).resolve().parent
    spec = importlib.util.find_spec("podcute.layouts")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("podcute.layouts is not importable: reinstall podcute")
    layouts = Path(list(spec.submodule_search_locations)[0])
    return (sorted((here / "kernels").glob("*.py")) + sorted(layouts.glob("*.py"))
            + [Path(__file__).resolve()])


def _source_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in _kernel_source_files():
        digest.update(f"{path.parent.name}/{path.name}".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _dsl_version() -> str:
    import cutlass

    return getattr(cutlass, "__version__", "unknown")


@dataclass(frozen=True)
class VariantKey:
    config: KernelConfig  # every static choice of the kernel (tiles, flags, dtype, arch)
    sources: str
    dsl: str

    @property
    def arch(self) -> str:
        return self.config.arch

    @staticmethod
    def make(config: KernelConfig) -> "VariantKey":
        if config.arch not in SUPPORTED_ARCHS:
            raise ValueError(unsupported_arch_message(config.arch))
        ok, why = config.can_implement()
        if not ok:
            raise ValueError(f"podcute cannot build this kernel configuration: {why}")
        return VariantKey(config=config, sources=_FINGERPRINT, dsl=_dsl_version())


_FINGERPRINT = _source_fingerprint()


def kernel_sources() -> str:
    """The fingerprint of the kernel sources this process compiles (part of every cache
    key): a benchmark records it, so its numbers name the kernels that made them even where
    the tree's git metadata is another commit's (a device copy)."""
    return _FINGERPRINT


ARCH_NAMES = {"sm_90a": "Hopper: H100/H200", "sm_80": "A100/A30", "sm_86": "A10/A40/RTX 30",
              "sm_89": "L4/L40S/RTX 40", "sm_120a": "RTX 50/RTX PRO 6000 Blackwell",
              "sm_90": "the portable kernel on Hopper, by option"}


def unsupported_arch_message(found: str) -> str:
    """The one message for hardware podcute cannot run on (compile CLI, VariantKey, run())."""
    listed = ", ".join(f"{a} ({ARCH_NAMES[a]})" for a in SUPPORTED_ARCHS)
    return (f"podcute needs an NVIDIA GPU it has a kernel for; supported architectures: "
            f"{listed}; found {found}")


def _fake_args(key: VariantKey):
    """Fake tensors with symbolic sizes/strides: the compiled function's runtime signature."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from podcute.kernels.dtypes import DTYPES

    cfg = key.config
    dtype = DTYPES[cfg.dtype]
    kv_dtype = DTYPES[cfg.kv_dtype] if cfg.fp8 else dtype
    # the tile's (workspace), the caller's query-key and value head dims (its tensors)
    d, d_io, d_vo = cfg.head_dim, cfg.io_dim, cfg.vo_dim

    def sym(div=1):
        return cute.sym_int64(divisibility=div)

    # Rows of q/out/K/V are 16-byte aligned (checked by the API): strides divisible by 8.
    def rows3(cols):
        return make_fake_tensor(dtype, (sym(), sym(), cols), (sym(8), sym(8), 1),
                                assumed_align=16)

    def cache(cols):  # (16-byte rows: strides divisible by 16 / element size)
        div = 16 // (kv_dtype.width // 8)
        return make_fake_tensor(
            kv_dtype, (sym(), sym(), sym(), cols), (sym(div), sym(div), sym(div), 1),
            assumed_align=16
        )

    def ivec():
        return make_fake_tensor(cutlass.Int32, (sym(),), (1,), assumed_align=4)

    rows = cfg.partial_rows
    # lse [T, Hq] with any strides: a caller's buffer may be the transpose of [Hq, T]
    # (FlashAttention's varlen convention).
    lse = (make_fake_tensor(cutlass.Float32, (sym(), sym()), (sym(), sym()), assumed_align=4)
           if cfg.has_lse else None)
    work = make_fake_tensor(cutlass.Int32, (sym(), WORK_COLS), (WORK_COLS, 1), assumed_align=16)
    partial_o = make_fake_tensor(cutlass.Float32, (sym(), rows, d), (rows * d, d, 1),
                                 assumed_align=16)
    partial_lse = make_fake_tensor(cutlass.Float32, (sym(), rows), (rows, 1), assumed_align=16)
    merge = make_fake_tensor(cutlass.Int32, (sym(), MERGE_COLS), (MERGE_COLS, 1), assumed_align=4)
    params = make_fake_tensor(cutlass.Float32, (NUM_PARAMS,), (1,), assumed_align=16)
    iparams = make_fake_tensor(cutlass.Int32, (NUM_PARAMS,), (1,), assumed_align=16)
    sinks = (make_fake_tensor(cutlass.Float32, (sym(),), (1,), assumed_align=4)
             if cfg.has_sinks else None)
    # fp8 dequantisation scales: [Hkv] or [1] float32 each (launch makes floats tensors).
    scales = ((make_fake_tensor(cutlass.Float32, (sym(),), (1,), assumed_align=4),
               make_fake_tensor(cutlass.Float32, (sym(),), (1,), assumed_align=4))
              if cfg.fp8 else (None, None))
    # The second K/V source: the ragged request's K/V, [1, kv_len, Hkv, D] views as a
    # cache's (ragged_kv), or a second cache (second_cache).
    ragged = ((cache(d_io), cache(d_vo)) if cfg.ragged_kv or cfg.second_cache
              else (None, None))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    io = PodTensors(mQ=rows3(d_io), mK=cache(d_io), mV=cache(d_vo), mO=rows3(d_vo),
                    mLSE=lse, mSinks=sinks,
                    mKScale=scales[0], mVScale=scales[1], mK2=ragged[0],
                    mV2=ragged[1])
    plan = PlanTensors(mWork=work, mCtaPtr=ivec(), mQStart=ivec(), mKvLen=ivec(),
                       mPageStart=ivec(), mPageList=ivec(), mPartialO=partial_o,
                       mPartialLSE=partial_lse, mMerge=merge, mSlotMerge=ivec(),
                       mMergeSem=ivec(), mParams=params, mIParams=iparams, mShared=ivec(),
                       page_shift=cutlass.Int32(4))
    # The compiled signature (kernels/args.py): both bundles flat, the grid, the stream.
    return (*io, *plan, cutlass.Int32(1), stream)


_cache: dict = {}
_lock = threading.Lock()


def cache_dir(arch: str = "sm_90a") -> Path:
    """On-disk cache folder, namespaced by architecture and DSL version."""
    root = Path(os.environ.get("PODCUTE_CACHE_DIR", Path.home() / ".cache" / "podcute"))
    return root / f"{arch}-cutlass-dsl-{_dsl_version()}"


def _entry_name(key: VariantKey) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


_runtime_loaded = False


def _load_runtime_libraries() -> None:
    # Exported kernels resolve the DSL runtime's symbols at dlopen time, so the runtime
    # must be loaded globally first (load_module alone loads it RTLD_LOCAL).
    global _runtime_loaded
    if not _runtime_loaded:
        import cutlass.cute as cute

        for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
            if Path(lib).exists():
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True


def _load_entry(path: Path):
    """The kernel from an exported object file, or None if missing or unloadable."""
    if not path.exists():
        return None
    import cutlass.cute as cute

    _load_runtime_libraries()
    try:
        module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
        return module.podcute_pod
    except Exception:  # truncated/corrupt entry: a miss; the rebuild replaces it
        return None


def _export_entry(path: Path, pod) -> None:
    """Write the kernel's object file atomically: a temporary name, then a rename, so an
    entry is either whole or absent (a killed export leaves no partial entry)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.o")
    try:
        pod.export_to_c(object_file_path=str(tmp), function_name="podcute_pod")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shipped_variants(arch: str = "sm_90a", head_dims=None, groups=(1, 4, 7, 8),
                     features=("",), kv_dtypes=("",), dtypes=("bfloat16",)):
    """The variants `python -m podcute compile` builds ahead of time (and CI compiles).

    bf16 only by default: fp16 variants compile on first use unless `dtypes` asks for
    them (`--dtypes bfloat16,float16`); fp16 kernels differ from bf16 ones only in the
    MMA's input type, and CI's compile budget (90 min on 2 cores for every architecture)
    has no room for both (CI still compiles the fp16 variants with every model feature,
    the heaviest, for spills). GQA groups 1 (MHA), 4, 7 and 8 cover the common models; any other group (MQA of 32
    heads, say) compiles on first use (~3 s on an H200), as does every variant with a
    model feature (window, softcap, sinks) unless `features` asks for it
    (`python -m podcute compile --features window+sinks,softcap`). Page sizes 128, 16 and
    1 stand for the three page classes of sm_90a (whole-tile TMA boxes, 16-slot TMA boxes,
    cp.async gather); the warp-level kernel of the other architectures gathers every page
    size, so it has one. fp8 KV caches (`kv_dtypes`, e.g. ("float8_e4m3fn",)) compile on
    first use too unless asked for; they have no head_dim 256 variant, which such a list
    skips, and only sm_90a has them. `head_dims` defaults to the arch's own
    (config.arch_head_dims); other head dims in the list are skipped. An entry may be a
    (query-key, value) pair, e.g. (192, 128) (16-bit caches, on a tile the arch has).
    """
    own = arch_head_dims(arch)
    head_dims = own if head_dims is None else head_dims
    if arch in WARP_MMA_ARCHS and any(kv_dtypes):
        raise ValueError(f"fp8 KV caches need the sm_90a kernel; {arch} has none")

    def dims(entry):  # (head_dim, head_dim_vo, whether this list compiles it)
        if isinstance(entry, tuple):
            d, dv = entry
            return d, dv, max(tile_head_dim(d), tile_head_dim(dv)) in own
        return entry, entry, entry in own

    keys = [
        VariantKey.make(KernelConfig.select(dtype, d, group, causal, has_lse,
                                            page_size, arch=arch, kv_dtype=kv,
                                            head_dim_vo=dv, **feature_flags(spec)))
        for kv in kv_dtypes
        for spec in features
        for page_size in (128, 16, 1)
        for dtype in dtypes
        for d, dv, ok in map(dims, head_dims)
        if ok and (not kv or (d == dv and d in FP8_HEAD_DIMS))
        for group in groups
        for causal in (True, False)
        for has_lse in (True, False)
    ]
    return list(dict.fromkeys(keys))  # (one page class: the same key three times)


def compile_variant(key: VariantKey, keep_ptx: bool = False):
    """The fused kernel for `key`: from memory, else from disk, else compiled
    (and written to disk). With `keep_ptx` it always compiles and returns the DSL's
    compiled objects, whose `__ptx__` holds the generated code (for checks)."""
    with _lock:
        hit = None if keep_ptx else _cache.get(key)
        if hit is not None:
            return hit
        folder = cache_dir(key.arch)
        folder.mkdir(parents=True, exist_ok=True)
        entry = folder / f"{_entry_name(key)}.o"
        # One compile per key across processes: whoever holds the lock compiles and
        # exports; the others wait, then load what it wrote.
        with open(folder / f"{entry.stem}.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                kernel = None if keep_ptx else _load_entry(entry)
                if kernel is None:
                    kernel = _compile(key, keep_ptx)
                    try:
                        _export_entry(entry, kernel)
                    except Exception as err:  # noqa: BLE001
                        # No disk cache (read-only home, no `ld`): still usable in memory.
                        warnings.warn(f"podcute: could not write kernel cache {entry}: {err}")
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        if keep_ptx:
            return kernel
        kernel = _positional_call(kernel)
        _cache[key] = kernel
        return kernel


def _positional_call(fn):
    """The bare TVM-FFI function of a freshly compiled kernel (what a disk load returns):
    the DSL's wrapper adds a Python keyword-argument layer to every call."""
    raw = getattr(fn, "__tvm_ffi_object__", None)
    return raw() if callable(raw) and raw() is not None else fn


def _compile(key: VariantKey, keep_ptx: bool):
    os.environ.setdefault("CUTE_DSL_ARCH", key.arch)
    log = os.environ.get("PODCUTE_COMPILE_LOG")  # one line per cold compile (tests, ops)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {time.time():.3f} {_entry_name(key)}\n")
    import cutlass.cute as cute

    pod_args = _fake_args(key)
    # The target comes with each compile (one process may build several architectures).
    options = f"--enable-tvm-ffi --gpu-arch {key.arch}"
    if keep_ptx:  # kept in memory (__ptx__); the dump itself goes to a scratch folder
        scratch = ptx_dump_dir()
        scratch.mkdir(parents=True, exist_ok=True)
        options += f" --keep-ptx --keep-cubin --dump-dir {scratch}"
    pod = cute.compile(key.config.kernel_class()(key.config), *pod_args, options=options)
    return pod


def ptx_dump_dir() -> Path:
    """Where a `keep_ptx` compile of this process dumps its PTX and cubin. One folder per
    process: the dumps of every variant share file names, and parallel compiles
    (compile_many) would read each other's half-written files."""
    return Path(tempfile.gettempdir()) / "podcute-ptx" / str(os.getpid())


def _compile_one(key: VariantKey, check: bool):
    """Worker of compile_many: (seconds, {op: count in the PTX} or None)."""
    t0 = time.perf_counter()
    pod = compile_variant(key, keep_ptx=check)
    counts = None
    if check:
        ptx = pod.__ptx__ or ""
        counts = {op: ptx.count(op) for op in CHECKED_OPS[key.config.warp_mma]}
    return time.perf_counter() - t0, counts


# compile --check: the instructions each kernel's PTX must hold (the DSL would fall back
# silently): wgmma and setmaxnreg for sm_90a, mma.sync fed by ldmatrix for the others.
CHECKED_OPS = {False: ("wgmma.mma_async", "setmaxnreg"), True: ("mma.sync", "ldmatrix")}


def compile_many(keys, jobs: int = 1, check: bool = False):
    """Compile `keys` in `jobs` processes (the DSL compiles one kernel per process at a
    time); yields (key, seconds, PTX op counts or None) in order."""
    from concurrent.futures import ProcessPoolExecutor

    if jobs <= 1:
        for key in keys:
            yield (key, *_compile_one(key, check))
        return
    with ProcessPoolExecutor(jobs) as pool:
        for key, res in zip(keys, pool.map(_compile_one, keys, [check] * len(keys))):
            yield (key, *res)


def compile_all(arch: str, check: bool = False, out=None, jobs: int | None = None,
                variants=None) -> int:
    """`python -m podcute compile`: build every shipped variant (or `variants`); return
    an exit code.

    Works without a GPU (cross-compilation for `arch`, into the arch's own cache folder),
    in `jobs` processes (default: the CPU count). With `check`, also verifies the
    generated PTX uses wgmma and setmaxnreg (sm_90a) or mma.sync and ldmatrix (the
    warp-level kernel): the compiler falls back silently otherwise.
    """
    import sys

    out = out or sys.stdout
    if arch not in SUPPORTED_ARCHS:
        print(unsupported_arch_message(f"--arch {arch}"), file=sys.stderr)
        return 2
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    variants = shipped_variants(arch) if variants is None else variants
    jobs = jobs or os.cpu_count() or 1
    start, failures = time.perf_counter(), []
    for i, (key, secs, counts) in enumerate(compile_many(variants, jobs, check), 1):
        note = ""
        if counts is not None:
            note = "".join(f" {op.split('.')[0]}={n}" for op, n in counts.items())
            if not all(counts.values()):
                failures.append(key)
        bar = "#" * (30 * i // len(variants))
        c = key.config
        dims = (f"d{c.head_dim}" if c.io_dim == c.vo_dim == c.head_dim
                else f"d{c.io_dim}:{c.vo_dim} (tile {c.head_dim})")
        print(f"[{bar:<30}] {i}/{len(variants)} {c.dtype} {dims} g{c.group} "
              f"causal={c.causal} lse={c.has_lse} kv_box={c.kv_box}"
              f"{' kv=' + c.kv_dtype if c.fp8 else ''}"
              f"{' ' + c.features if c.features else ''} {secs:.1f}s{note}", file=out,
              flush=True)
    print(f"compiled {len(variants)} variants for {arch} in {time.perf_counter() - start:.1f}s"
          f" ({jobs} processes); {len(failures)} failed checks", file=out)
    return 1 if failures else 0
