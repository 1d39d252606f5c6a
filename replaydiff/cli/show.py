"""Summarise a trace (ranks, ops per phase, most frequent ops, bytes, environment), or print one op whole."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from replaydiff.errors import UsageError
from replaydiff.record.encode import TENSOR_KEY, iter_tensor_refs
from replaydiff.trace import open_trace
from replaydiff.trace.reader import RankReader

NAME = "show"
HELP = "summarise a trace, or print one op with --op N"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory")
    p.add_argument("--op", type=int, metavar="N", help="print op N whole")
    p.add_argument("--rank", type=int, default=None, help="rank to show (default: all for the summary, 0 for --op)")
    p.add_argument("--top", type=int, default=10, help="how many of the most frequent ops to list")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def rank_summary(r: RankReader, top: int) -> dict[str, Any]:
    phases: Counter = Counter()
    ops: Counter = Counter()
    n = 0
    for op in r:
        n += 1
        phases[op.get("ph", "?")] += 1
        ops[op["op"]] += 1
    env = r.environment
    return {
        "rank": r.rank,
        "ops": n,
        "complete": r.complete,
        "truncated_after": r.truncated_after,
        "phases": dict(phases),
        "most_frequent": ops.most_common(top),
        "distinct_ops": len(ops),
        "bytes_on_disk": _bytes_on_disk(r.root),
        "tensors": (r.manifest.get("options") or {}).get("tensors"),
        "lost": r.lost,
        "environment": env,
    }


def _render_summary(path: str, summaries: list[dict], out: TextIO) -> None:
    total = sum(s["bytes_on_disk"] for s in summaries)
    out.write(f"trace {path}: {len(summaries)} rank(s), {sum(s['ops'] for s in summaries)} ops, "
              f"{_human(total)} on disk\n")
    for s in summaries:
        state = "complete" if s["complete"] else f"TRUNCATED after op {s['truncated_after']}"
        phases = ", ".join(f"{k} {v}" for k, v in sorted(s["phases"].items()))
        out.write(f"\nrank {s['rank']}: {s['ops']} ops ({state}; tensors={s['tensors']}; "
                  f"{_human(s['bytes_on_disk'])})\n  phases: {phases}\n  most frequent of {s['distinct_ops']} "
                  f"distinct ops:\n")
        for name, n in s["most_frequent"]:
            out.write(f"    {n:>6}  {name}\n")
        for lost in s["lost"]:
            out.write(f"  LOST: {lost}\n")
    env = summaries[0]["environment"] if summaries else {}
    flags = env.get("flags") or {}
    out.write(f"\nenvironment (rank {summaries[0]['rank'] if summaries else 0}): torch {env.get('torch')}, "
              f"cuda {env.get('cuda')}, cudnn {env.get('cudnn')}, nccl {env.get('nccl')}, "
              f"host {env.get('hostname')}, world size {env.get('world_size')}, threads {env.get('num_threads')}\n")
    for d in env.get("devices") or []:
        out.write(f"  device {d.get('index')}: {d.get('name')} (capability {d.get('capability')})\n")
    out.write("  flags: " + ", ".join(f"{k}={v}" for k, v in flags.items()) + "\n")
    variables = env.get("variables") or {}
    if variables:
        out.write("  variables: " + ", ".join(f"{k}={v}" for k, v in variables.items()) + "\n")


def producers_of(r: RankReader, index: int) -> dict[int, int]:
    """Storage version -> number of the op (before ``index``) that produced it."""
    made: dict[int, int] = {}
    for op in r:
        if op["i"] >= index:
            break
        for ref in iter_tensor_refs([op.get("o"), [a for _, a in op.get("w") or []]]):
            v = ref.get(TENSOR_KEY)
            if v is not None:
                made.setdefault(v, op["i"])
    return made


def _tensor_text(ref: dict, made: dict[int, int] | None) -> str:
    s = f"tensor {ref.get('dt')}{list(ref.get('sh') or [])} stride {ref.get('st')} offset {ref.get('of')} " \
        f"{ref.get('dev')}"
    if ref.get("unsupported"):
        s += f" (not stored: {ref['unsupported']})"
    if ref.get("u"):
        s += " (uninitialised)"
    if "s" in ref and ref["s"]:
        n, mean, amax, l2, var, nan, inf = ref["s"]
        s += f" mean {mean:.4g} absmax {amax:.4g} l2 {l2:.4g} var {var:.4g} nan {nan} inf {inf}"
    if made is not None:
        p = made.get(ref.get(TENSOR_KEY))
        s += f"  <- op #{p}" if p is not None else "  <- from outside the trace"
    return s


def _value_text(v: Any, made: dict[int, int] | None) -> str:
    if isinstance(v, dict) and TENSOR_KEY in v:
        return _tensor_text(v, made)
    if isinstance(v, list) and any(isinstance(x, dict) and TENSOR_KEY in x for x in v):
        return "[\n" + "".join(f"        {_value_text(x, made)}\n" for x in v) + "      ]"
    return json.dumps(v)


def render_op(r: RankReader, index: int, out: TextIO) -> dict:
    try:
        op = r.op(index)
    except KeyError:
        raise UsageError(f"rank {r.rank} has no op #{index} (last is #{r.last_index})") from None
    made = producers_of(r, index)
    out.write(f"op #{op['i']} {op['op']}  rank {r.rank}\n")
    out.write(f"  phase   {op.get('ph')}\n  module  {op.get('mod')}\n  source  {op.get('src')}\n")
    if op.get("fwd") is not None:
        fwd = r.op(op["fwd"])
        out.write(f"  forward op #{fwd['i']} {fwd['op']} ({fwd.get('src')})\n")
    if op.get("rng"):
        out.write(f"  random: generator state recorded ({op['rng'].get('dev')})\n")
    if op.get("coll"):
        out.write(f"  collective: {json.dumps(op['coll'])}\n")
    out.write("  arguments:\n")
    for i, a in enumerate(op.get("a") or []):
        out.write(f"    [{i}] {_value_text(a, made)}\n")
    for k, v in (op.get("k") or {}).items():
        out.write(f"    {k}= {_value_text(v, made)}\n")
    for path, after in op.get("w") or []:
        out.write(f"  writes {path[0]}[{path[1]}], after: {_value_text(after, None)}\n")
    out.write(f"  outputs{' (uninitialised)' if op.get('u') else ''}:\n")
    outs = op.get("o")
    for i, o in enumerate(outs if isinstance(outs, list) else [outs]):
        out.write(f"    [{i}] {_value_text(o, None)}\n")
    return op


def run(args: argparse.Namespace) -> int:
    trace = open_trace(args.trace)
    if args.op is not None:
        r = trace.rank(args.rank if args.rank is not None else min(trace.ranks))
        if args.json:
            try:
                sys.stdout.write(json.dumps(r.op(args.op), indent=1) + "\n")
            except KeyError:
                raise UsageError(f"rank {r.rank} has no op #{args.op} (last is #{r.last_index})") from None
        else:
            render_op(r, args.op, sys.stdout)
        return 0
    readers = [trace.rank(args.rank)] if args.rank is not None else [trace.ranks[k] for k in sorted(trace.ranks)]
    summaries = [rank_summary(r, args.top) for r in readers]
    for s in summaries:
        if not s["complete"]:
            sys.stderr.write(f"replaydiff: warning: rank {s['rank']} is truncated after op {s['truncated_after']} "
                             f"(the recording did not finish)\n")
    if args.json:
        sys.stdout.write(json.dumps({"trace": args.trace, "ranks": summaries}, indent=1) + "\n")
    else:
        _render_summary(args.trace, summaries, sys.stdout)
    return 0
