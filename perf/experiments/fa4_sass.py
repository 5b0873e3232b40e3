"""FlashAttention-4's sm90 forward compiled on this CPU-only machine, its loops' event order
printed as `sass_loops --events` prints podcute's, for reading both mainloops side by side:

    python -m perf.experiments.fa4_sass FA4_SRC [--head-dim 128] [--heads 32/8] [--page 16]
        [--seqlen 8192] [--no-causal]

FA4_SRC: a folder holding FA4's `flash_attn/cute` (a checkout of Dao-AILab/flash-attention;
it is not part of podcute and is not installed). Needs the `quack-kernels` wheel
(`pip install --no-deps quack-kernels`; its package __init__ imports triton, so only its
submodules are loaded here) and `nvdisasm` (see sass_loops). FA4 compiles on a CPU in
torch's FakeTensorMode with FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH / FLASH_ATTENTION_NUM_SMS
set (its interface documents this); the cubin comes from the DSL's dump
(CUTE_DSL_KEEP=cubin).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import subprocess
import sys
import tempfile
import types


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fa4_src")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--no-causal", action="store_true")
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="fa4-sass-")
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a",
                      FLASH_ATTENTION_NUM_SMS=os.environ.get("FLASH_ATTENTION_NUM_SMS", "132"),
                      CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=dump)
    spec = importlib.util.find_spec("quack")
    if spec is None:
        sys.exit("quack not found: pip install --no-deps quack-kernels")
    quack = types.ModuleType("quack")  # its submodules without its __init__ (triton)
    quack.__path__ = list(spec.submodule_search_locations)
    sys.modules["quack"] = quack
    sys.path.insert(0, os.path.abspath(args.fa4_src))
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn.cute.interface import flash_attn_varlen_func

    hq, hkv = (int(x) for x in args.heads.split("/"))
    d, page, n = args.head_dim, args.page, args.seqlen
    with FakeTensorMode():
        cuda = dict(device="cuda")
        q = torch.empty(n, hq, d, dtype=torch.bfloat16, **cuda)
        k = torch.empty(n // page + 8, page, hkv, d, dtype=torch.bfloat16, **cuda)
        i32 = dict(dtype=torch.int32, **cuda)
        flash_attn_varlen_func(q, k, torch.empty_like(k), cu_seqlens_q=torch.empty(2, **i32),
                               seqused_k=torch.empty(1, **i32),
                               page_table=torch.empty(1, n // page, **i32), max_seqlen_q=n,
                               causal=not args.no_causal)
    from perf.experiments.sass_loops import _INSN, events, loops, nvdisasm

    cubin = max(glob.glob(os.path.join(dump, "*FlashAttentionForwardSm90*.cubin")),
                key=os.path.getmtime)
    sass = subprocess.run([nvdisasm(), "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    insns = [(int(m.group(1), 16), m.group(2), m.group(3))
             for m in map(_INSN.match, sass.splitlines()) if m]
    print(f"FA4 sm90 forward, D {d}, heads {hq}/{hkv}, page {page} ({cubin})")
    for s, e, c in loops(sass):
        if c["HGMMA"]:
            print(f"  loop {s:#x}-{e:#x}: {sum(c.values())} instructions HGMMA={c['HGMMA']} "
                  f"MUFU={c['MUFU']}\n    events: {events(insns, s, e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
