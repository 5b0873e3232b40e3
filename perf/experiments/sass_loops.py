"""What ptxas made of a kernel's loops, on a machine without a GPU: compile variants,
disassemble their cubins and print, per loop, its instructions and the local-memory
(spill) stores and loads inside it. The ptxas spill total says how many bytes went to
local memory; this says whether they sit in a tile loop (paid every tile) or in per-item
code (paid once an item).

    python -m perf.experiments.sass_loops --arch sm_90 --head-dims 128 --groups 4 [--features ...]
        [--dtypes bfloat16] [--all-loops] [--keep DIR] [--evict-first 0|1] [--events]

Needs `nvdisasm` (`NVDISASM=...`, on PATH, or the `nvidia-cuda-nvdisasm` wheel:
`pip download --no-deps nvidia-cuda-nvdisasm` and unzip it; its binary is
nvidia/cu13/bin/nvdisasm). A loop is the span from a backward branch's target to the
branch. Nested loops are listed each on their own; by default only loops with MMAs
(HMMA, or HGMMA on sm_90a). `--events` adds, per loop, the order of its synchronising
events: wgmma groups (`HGMMA` runs, the last of a group marked by `gsb0`), their waits
(`DEPBAR<=n`, n groups left in flight), `MUFU` (the softmax's exp2), `F2FP` (P's
conversion), named barriers (`BAR`) and mbarrier operations (`SYNCS`): where ptxas put the
wait for the P V GEMM relative to the softmax (docs/notes/sm90a-kernel.md).
"""

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);")
_LABEL = re.compile(r"\s*\.L_x_(\d+):")
_TARGET = re.compile(r"\.L_x_(\d+)")
COUNTED = ("HMMA", "HGMMA", "LDSM", "MUFU", "BAR", "LDGSTS", "STL", "LDL")
EVENTS = ("HGMMA", "MUFU", "F2FP", "BAR", "SYNCS")


def find_nvdisasm() -> str | None:
    """$NVDISASM, nvdisasm on PATH, or the one of the nvidia-cuda-nvdisasm wheel (the test
    extra installs it); None if none is there."""
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            for cand in Path(root).glob("cu*/bin/nvdisasm"):
                return str(cand)
    except ImportError:
        pass
    return None


def nvdisasm() -> str:
    found = find_nvdisasm()
    if found is None:
        sys.exit("nvdisasm not found: set NVDISASM, or put it on PATH (see this module's doc)")
    return found


def loops(sass: str):
    """[(start, end, Counter of opcodes)] of every backward branch's span."""
    insns, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.match(line)
        if m:
            addr = int(m.group(1), 16)
            for label in pending:
                labels[label] = addr
            pending = []
            insns.append((addr, m.group(2), m.group(3)))
    spans = sorted({(labels[t.group(1)], addr) for addr, op, rest in insns
                    if op == "BRA" and (t := _TARGET.search(rest)) and t.group(1) in labels
                    and labels[t.group(1)] <= addr})
    return [(s, e, collections.Counter(op for a, op, _ in insns if s <= a <= e))
            for s, e in spans]


def events(insns, start: int, end: int) -> str:
    """The loop's synchronising events in order, runs of one kind merged ("MUFUx12")."""
    seq = []
    for addr, op, rest in insns:
        if not start <= addr <= end:
            continue
        kind = op
        if op == "WARPGROUP" and rest.startswith(".DEPBAR"):
            kind = "DEPBAR<=" + rest.split(",")[-1].strip()
        elif kind not in EVENTS:
            continue
        if seq and seq[-1][0] == kind:
            seq[-1][1] += 1
        else:
            seq.append([kind, 1])
    return " ".join(k if n == 1 else f"{k}x{n}" for k, n in seq)


def report(cubin: Path, all_loops: bool, show_events: bool = False) -> str:
    sass = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ops = collections.Counter(m.group(2) for m in map(_INSN.match, sass.splitlines()) if m)
    lines = [f"  kernel: {sum(ops.values())} instructions, STL {ops['STL']}, LDL {ops['LDL']}"]
    insns = [(int(m.group(1), 16), m.group(2), m.group(3))
             for m in map(_INSN.match, sass.splitlines()) if m]
    for s, e, c in loops(sass):
        if all_loops or c["HMMA"] or c["HGMMA"]:
            counts = " ".join(f"{k}={c[k]}" for k in COUNTED)
            lines.append(f"  loop {s:#x}-{e:#x}: {sum(c.values())} instructions {counts}")
            if show_events:
                lines.append(f"    events: {events(insns, s, e)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--head-dims", default=None)
    ap.add_argument("--groups", default="4")
    ap.add_argument("--features", default="")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--all-loops", action="store_true", help="also loops without MMAs")
    ap.add_argument("--keep", default=None, help="copy each cubin into this folder")
    ap.add_argument("--events", action="store_true",
                    help="print each loop's order of wgmma groups, waits, exp2s, conversions "
                         "and barriers")
    ap.add_argument("--evict-first", type=int, choices=(0, 1), default=None,
                    help="the variants without (0) / with (1) "
                         "KernelConfig.decode_kv_evict_first (default: as shipped, on)")
    args = ap.parse_args(argv)
    from podcute.compile import VariantKey, compile_variant, ptx_dump_dir, shipped_variants

    head_dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else None
    keys = shipped_variants(args.arch, head_dims=head_dims,
                            groups=tuple(int(g) for g in args.groups.split(",")),
                            features=tuple(args.features.split(",")),
                            dtypes=args.dtypes.split(","))
    if args.evict_first is not None:
        keys = [VariantKey.make(dataclasses.replace(
            k.config, decode_kv_evict_first=bool(args.evict_first))) for k in keys]
    dump = ptx_dump_dir()  # (every variant's dump has the same file names: cleared first)
    for key in keys:
        shutil.rmtree(dump, ignore_errors=True)
        compile_variant(key, keep_ptx=True)
        c = key.config
        name = (f"{c.dtype}_d{c.head_dim}_g{c.group}_causal{int(c.causal)}_lse{int(c.has_lse)}"
                f"{'_' + c.features if c.features else ''}")
        cubin = next(dump.glob("*.cubin"))
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(cubin, Path(args.keep) / f"{name}.cubin")
        print(f"{name} (tile_m_prefill {c.tile_m_prefill}, {c.num_stages} stages)")
        print(report(cubin, args.all_loops, args.events), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
