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


def _shown(v: object, digits: int) -> str:
    """A value as people read it: a float to ``digits`` significant digits, ints and bools exact, a tuple's items
    each so, anything else (a dtype, a string) as Python writes it."""
    if isinstance(v, (bool, int)):
        return str(v)
    if isinstance(v, float):
        return format(v, f".{digits}g")
    if isinstance(v, (tuple, list)):
        inner = ", ".join(_shown(x, digits) for x in v)
        return f"({inner}{',' if len(v) == 1 else ''})" if isinstance(v, tuple) else f"[{inner}]"
    return repr(v)


def shown_pair(ref: object, theirs: object) -> tuple[str, str]:
    """The single process's value and the ranks', as people read them: 6 significant digits (a learning rate
    computed as 0.1 * 2 is 0.2, not 0.20000000000000004), more where 6 would show two different values alike."""
    for digits in (6, 9, 12):
        a, b = _shown(ref, digits), _shown(theirs, digits)
        if a != b:
            return a, b
    return repr(ref), repr(theirs)  # Python's shortest form tells any two floats apart


def ratio_words(ref: object, theirs: object, world: int) -> str:
    """' (2x: the world size)', ' (1/2x: 1 over the world size)', ' (3/2x)': the ranks' value over the single
    process's where both are numbers and their ratio is a plain fraction (denominator at most 64); else ''."""
    if not isinstance(ref, (int, float)) or not isinstance(theirs, (int, float)) or isinstance(ref, bool) or \
            isinstance(theirs, bool) or not ref:
        return ""
    r = Fraction(theirs / ref).limit_denominator(64)
    if r == 1 or abs(float(r) - theirs / ref) > 1e-6 * abs(theirs / ref):
        return ""
    said = ": the world size" if r == world else ": 1 over the world size" if r == Fraction(1, world) else ""
    return f" ({r}x{said})"


def arguments_text(found: list[tuple[str, object, object, tuple[int, ...]]], world: int,
                   rank_of: list[int] | None = None) -> str:
    """'alpha -0.2 on the ranks, -0.1 in the single process (2x: the world size)' ('on rank 1' where only some
    ranks give it), joined by '; '. ``rank_of``: the rank of each op the ranks ran (several a rank where it runs
    the op once per micro-batch); None: one a rank."""
    said = []
    for where, ref, theirs, parts in found[:4]:
        mine, other = shown_pair(ref, theirs)
        said.append(f"{where} {other} on {_where(parts, world, rank_of)}, {mine} in the single process"
                    f"{ratio_words(ref, theirs, world)}")
    more = len(found) - 4
    return "; ".join(said) + (f"; +{more} more" if more > 0 else "")
