"""The arguments of an op that are not tensors (a learning rate, a scale, an epsilon), compared between the single
process's op and the ranks': an op whose inputs map onto the reference's and whose result does not, run with another
``alpha`` on the ranks, is where a hyperparameter or a scale differs, not a value the ranks compute apart."""
from __future__ import annotations

from fractions import Fraction

from replaydiff.trace.schema import OpRecord, TensorRef


def _plain(label: str, v: object, out: list[tuple[str, object]]) -> None:
    if isinstance(v, TensorRef):
        return
    if isinstance(v, (list, tuple)):
        for k, x in enumerate(v):
            _plain(f"{label}[{k}]", x, out)
        return
    out.append((label, v))


def plain_arguments(op: OpRecord) -> list[tuple[str, object]]:
    """(where, value) of each argument that is not a tensor: 'argument 2', 'argument 3[0]', 'alpha'."""
    out: list[tuple[str, object]] = []
    for k, a in enumerate(op.args):
        _plain(f"argument {k}", a, out)
    for name, a in op.kwargs.items():
        _plain(str(name), a, out)
    return out


def differing_arguments(ref: OpRecord, ranks: list[OpRecord]) -> list[tuple[str, object, object, tuple[int, ...]]]:
    """(where, the single process's value, the first differing rank's, the ranks that give that value) for each
    argument that is not a tensor and that some rank gives otherwise; empty when every rank runs the op with the
    reference's arguments."""
    mine = dict(plain_arguments(ref))
    out: list[tuple[str, object, object, tuple[int, ...]]] = []
    for rank, top in enumerate(ranks):
        for where, v in plain_arguments(top):
            if where not in mine or mine[where] == v:
                continue
            k = next((k for k, (w, _, _, _) in enumerate(out) if w == where), None)
            if k is None:
                out.append((where, mine[where], v, (rank,)))
            elif out[k][2] == v:
                out[k] = out[k][:3] + (out[k][3] + (rank,),)
    return out


def _where(parts: tuple[int, ...], world: int, rank_of: list[int] | None) -> str:
    """'the ranks', 'rank 1', or (a rank running the op once per micro-batch) "rank 1's micro-batch 2"."""
    if rank_of is not None and len(parts) < len(rank_of):
        def nth(k: int) -> int:
            return sum(1 for j in range(k) if rank_of[j] == rank_of[k]) + 1
        return ", ".join(f"rank {rank_of[k]}'s micro-batch {nth(k)}" for k in parts)
    ranks = parts if rank_of is None else tuple(dict.fromkeys(rank_of[k] for k in parts))
    return "the ranks" if len(ranks) == world else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def arguments_text(found: list[tuple[str, object, object, tuple[int, ...]]], world: int,
                   rank_of: list[int] | None = None) -> str:
    """'alpha -0.2 on the ranks, -0.1 in the single process (2x: the world size)' ('on rank 1' where only some
    ranks give it), joined by '; '. ``rank_of``: the rank of each op the ranks ran (several a rank where it runs
    the op once per micro-batch); None: one a rank."""
    said = []
    for where, ref, theirs, parts in found[:4]:
        ratio = ""
        if isinstance(ref, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(ref, bool) and ref:
            r = Fraction(theirs / ref).limit_denominator(64)
            if r != 1 and abs(float(r) - theirs / ref) <= 1e-6 * abs(theirs / ref):
                ratio = f" ({r.numerator if r.denominator == 1 else r}x" + \
                    (": the world size)" if r == world else ": 1 over the world size)" if r == Fraction(1, world)
                     else ")")
        said.append(f"{where} {theirs!r} on {_where(parts, world, rank_of)}, {ref!r} in the single process{ratio}")
    more = len(found) - 4
    return "; ".join(said) + (f"; +{more} more" if more > 0 else "")
