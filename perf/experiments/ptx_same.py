"""Does a change leave the generated kernels as they were? Compiles representative variants
of this tree and of another git revision (CPU only) and compares their PTX, instruction for
instruction and register counts, with kernel and parameter names normalised (the kernel's
name spells its argument types; parameter order may move with a refactor of its
signature):

    python -m perf.experiments.ptx_same REV [NAME ...]

REV is checked out into a temporary worktree; NAME picks variants of VARIANTS (default:
all). Prints one line a variant: "bit-identical", "same instructions" (only operands
renumbered, e.g. by another parameter order), the number of differing instructions, or
"only in ..." for a variant one of the trees cannot build.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> (KernelConfig.select positional args, keyword args): every page class of sm_90a,
# fp8 caches, D 256, the model features, both second K/V sources, the warp-level kernel.
VARIANTS = {
    "tma128": (("bfloat16", 128, 4, True, True, 128), {}),
    "tma16": (("bfloat16", 128, 4, True, False, 16), {}),
    "gather": (("bfloat16", 128, 8, False, True, 1), {}),
    "d256": (("bfloat16", 256, 4, True, True, 16), {}),
    "d256gather": (("bfloat16", 256, 1, True, True, 2), {"softcap": True}),
    "features": (("float16", 64, 1, True, True, 16),
                 {"window": True, "softcap": True, "has_sinks": True}),
    "ragged": (("bfloat16", 128, 4, True, True, 16), {"ragged_kv": True}),
    "ragged_gather": (("bfloat16", 128, 8, False, True, 1),
                      {"ragged_kv": True, "has_sinks": True}),
    "fp8_tma": (("bfloat16", 128, 4, True, True, 64), {"kv_dtype": "float8_e4m3fn"}),
    "fp8_box": (("bfloat16", 96, 1, False, False, 16), {"kv_dtype": "float8_e5m2"}),
    "fp8_d256": (("bfloat16", 256, 4, True, True, 16), {"kv_dtype": "float8_e4m3fn"}),
    "fp8_gather": (("float16", 128, 8, True, True, 1),
                   {"kv_dtype": "float8_e4m3fn", "window": True}),
    "cache2": (("bfloat16", 128, 4, True, True, 128), {"second_cache": True}),
    "cache2_gather": (("float16", 64, 8, False, True, 1), {"second_cache": True}),
    "sm80": (("bfloat16", 128, 4, True, True, 16, "sm_80"), {}),
    "sm86": (("float16", 64, 1, False, True, 8, "sm_86"), {}),
    "sm90_portable": (("bfloat16", 128, 4, True, True, 16, "sm_90"),
                      {"window": True, "softcap": True, "has_sinks": True, "ragged_kv": True}),
}

# Run in each tree's own interpreter (its podcute on sys.path): dump the normalised PTX.
_DUMP = r"""
import json, os, re, sys
from podcute.compile import VariantKey, compile_variant
from podcute.kernels.config import KernelConfig
out, cases = sys.argv[1], json.loads(sys.argv[2])
for name, (args, kw) in cases.items():
    try:
        cfg = KernelConfig.select(*args, **kw)
    except (TypeError, ValueError, NotImplementedError) as e:  # a variant this tree lacks
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        continue
    os.environ["CUTE_DSL_ARCH"] = cfg.arch
    ptx = compile_variant(VariantKey.make(cfg), keep_ptx=True).__ptx__
    ptx = re.sub(r"[A-Za-z0-9_]*_param_(\d+)", r"P\1", ptx)
    ptx = re.sub(r"\bkernel_[A-Za-z0-9_]+", "KERNEL", ptx)
    open(os.path.join(out, name + ".ptx"), "w").write(ptx)
"""


def _dump(tree: Path, out: Path, cases: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), CUTE_DSL_ARCH="sm_90a",
               PODCUTE_CACHE_DIR=str(out / "cache"))
    subprocess.run([sys.executable, "-c", _DUMP, str(out), json.dumps(cases)], cwd=tree,
                   env=env, check=True)


def _instructions(ptx: str) -> list[str]:
    skip = ("//", ".param", "ld.param", ".reg", ".visible", ".entry", "{", "}", "(", ")")
    lines = (l.strip() for l in ptx.splitlines())
    return [l.split()[0] for l in lines if l and not l.startswith(skip) and not l.endswith(":")]


def _registers(ptx: str) -> list[str]:
    return re.findall(r"\.reg \.\w+ \s*%\w+<(\d+)>", ptx)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    rev, names = argv[0], argv[1:] or list(VARIANTS)
    cases = {n: VARIANTS[n] for n in names}
    here = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(base), rev],
                       check=True, capture_output=True)
        made = []
        try:
            for tree in (base, here):  # podcute.layouts is the top-level layouts/
                link = tree / "podcute" / "layouts"
                if not link.exists():
                    link.symlink_to("../layouts")
                    made.append(link)
            _dump(base, Path(tmp) / "old", cases)
            _dump(here, Path(tmp) / "new", cases)
            differ = 0
            for name in cases:
                found = [Path(tmp) / side / f"{name}.ptx" for side in ("old", "new")]
                if not all(f.exists() for f in found):
                    print(f"{name:16s} only in {'this tree' if found[1].exists() else rev}")
                    continue
                old, new = (f.read_text() for f in found)
                a, b = _instructions(old), _instructions(new)
                if old == new:
                    verdict = "bit-identical"
                elif a == b and _registers(old) == _registers(new):
                    verdict = "same instructions"
                else:
                    n = sum(1 for d in difflib.ndiff(a, b) if d[0] in "+-")
                    verdict = f"{n} instructions differ"
                    differ += 1
                print(f"{name:16s} {verdict}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(base)],
                           capture_output=True)
            for link in made:
                link.unlink(missing_ok=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
