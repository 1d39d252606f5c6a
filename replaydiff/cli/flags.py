"""Flags that several verbs take, spelled one way across them: ``--op GLOB`` (repeatable) and ``--rank R`` (repeatable,
or ``R,R,...``). The spellings older versions took (``replay --ops``, ``record --ranks R,R``) still work, hidden from
--help."""
from __future__ import annotations

import argparse


def rank_list(text: str) -> list[int]:
    """``--rank 3`` or ``--rank 0,3``: the ranks named (each >= 0)."""
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"--rank takes a rank or ranks separated by commas, e.g. 0,3, not {text!r}")
    return ranks


def add_rank_arg(p: argparse.ArgumentParser, help: str, old: str | None = None) -> None:
    """``--rank R`` (repeatable; ``R,R,...`` too) into ``args.ranks``; ``old``: a former spelling kept working."""
    p.add_argument("--rank", dest="ranks", type=rank_list, action="extend", metavar="R", help=help)
    if old:
        p.add_argument(old, dest="ranks", type=rank_list, action="extend", help=argparse.SUPPRESS)


def add_op_arg(p: argparse.ArgumentParser, help: str, old: str | None = None) -> None:
    """``--op GLOB`` (repeatable) into ``args.ops``; ``old``: a former spelling kept working."""
    p.add_argument("--op", dest="ops", action="append", metavar="GLOB", help=help)
    if old:
        p.add_argument(old, dest="ops", action="append", help=argparse.SUPPRESS)


def ranks_of(args: argparse.Namespace) -> list[int] | None:
    """The ranks given, each once, in order (None: none given)."""
    ranks = getattr(args, "ranks", None)
    return None if ranks is None else sorted(set(ranks))
