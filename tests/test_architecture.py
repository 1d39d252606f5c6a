"""The layering the design fixes: only the trace package knows the wire keys, the import graph has no cycle, and a
lower layer (trace <- record, replay, compare <- report, cli <- tui) never imports a higher one."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "replaydiff"

# The one- and two-letter keys of op records and tensor references (replaydiff/trace/schema.py).
_WIRE = r"i|ph|mod|fwd|src|srt|stp|a|k|w|o|u|x|coll|rng|T|dt|sh|st|of|sb|f|s|rg|cj|ng|unsupported"
_WIRE_USE = re.compile(rf"""(\[\s*["']({_WIRE})["']\s*\]|\.get\(\s*["']({_WIRE})["']|\{{\s*["']({_WIRE})["']\s*:)""")


def _python_files(*dirs: Path) -> list[Path]:
    return [p for d in dirs for p in sorted(d.rglob("*.py")) if "__pycache__" not in p.parts]


def test_no_module_outside_the_trace_package_reads_a_wire_key() -> None:
    offenders = []
    for p in _python_files(PKG, ROOT / "tests", ROOT / "tui", ROOT / "fixtures"):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("replaydiff/trace/") or rel in ("tests/test_trace_format.py",
                                                          "tests/test_architecture.py"):
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if _WIRE_USE.search(line) and not line.endswith("# wire-ok: damages a record on purpose"):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def _module_name(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in _python_files(PKG)}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, p in files.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("replaydiff"):
                    graph[mod].add(t)
    return graph


def test_import_graph_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t] if t in stack else [m, t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


LAYERS = {  # a package may import only from these (besides itself)
    "replaydiff.aten": set(),
    "replaydiff.errors": set(),
    # planted faults sit at the bottom too: the recorder enters one below itself for `record --plant`
    "replaydiff.faults": {"replaydiff.aten"},
    "replaydiff.trace": {"replaydiff.aten", "replaydiff.errors"},
    # the table of known causes (what a recorded setting does to numerics), read by diff and report
    "replaydiff.causes": {"replaydiff.trace"},
    "replaydiff.compare": {"replaydiff.aten", "replaydiff.errors"},
    "replaydiff.record": {"replaydiff.aten", "replaydiff.errors", "replaydiff.trace", "replaydiff.faults"},
    "replaydiff.replay": {"replaydiff.aten", "replaydiff.errors", "replaydiff.trace", "replaydiff.compare"},
    "replaydiff.diff": {"replaydiff.aten", "replaydiff.errors", "replaydiff.trace", "replaydiff.compare",
                        "replaydiff.replay", "replaydiff.causes"},
    "replaydiff.report": {"replaydiff.aten", "replaydiff.errors", "replaydiff.trace", "replaydiff.compare",
                          "replaydiff.replay", "replaydiff.diff", "replaydiff.causes"},
}


def _package(m: str) -> str:
    parts = m.split(".")
    return ".".join(parts[:2])


def test_lower_layers_never_import_higher_ones() -> None:
    graph = _graph()
    bad = []
    for m, targets in graph.items():
        allowed = LAYERS.get(_package(m))
        if allowed is None:
            continue
        for t in targets:
            if _package(t) != _package(m) and _package(t) not in allowed:
                bad.append(f"{m} imports {t}")
    assert bad == []


def _op_name_sets(p: Path) -> list[tuple[int, frozenset[str]]]:
    """Literal sets, frozensets, tuples and lists of three or more op-like names (``mm``, ``_convolution``) in a file."""
    found = []
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)) and len(node.elts) >= 3 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) and re.fullmatch(r"_*[a-z][a-z0-9_]*", e.value)
                for e in node.elts):
            found.append((node.lineno, frozenset(e.value for e in node.elts)))
    return found


def test_op_knowledge_lives_in_aten_only() -> None:
    """The same set of op names written in two modules is a copy that will drift (it did: the matmul list)."""
    ops = {aten_name for aten_name in dir(__import__("torch").ops.aten)}
    seen: dict[frozenset[str], str] = {}
    copies = []
    for p in _python_files(PKG, ROOT / "tui"):
        rel = p.relative_to(ROOT).as_posix()
        for line, names in _op_name_sets(p):
            if len(names & ops) < 3:  # only sets of real aten op names
                continue
            if names in seen and not seen[names].startswith(rel + ":"):
                copies.append(f"{rel}:{line} repeats {seen[names]}")
            seen.setdefault(names, f"{rel}:{line}")
            if rel != "replaydiff/aten.py" and len(names & ops) >= 5:
                copies.append(f"{rel}:{line}: a set of {len(names)} op names outside replaydiff/aten.py")
    assert copies == []


def test_every_package_folder_is_installed_and_the_tui_as_replaydiff_tui() -> None:
    """pyproject lists the packages by hand (the tui/ folder installs as replaydiff.tui): a new folder must be added
    there, or a wheel install would lack it while the checkout's editable install works."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(replaydiff(?:\.[a-z_]+)*)"', text[text.index("packages = ["):text.index("]", text.index(
        "packages = ["))]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")} | {
        ".".join(("replaydiff",) + p.parent.relative_to(ROOT).parts) for p in (ROOT / "tui").rglob("__init__.py")}
    assert listed == folders
    assert '"replaydiff.tui" = "tui"' in text


# Every key of the manifest, of the environment snapshot (as record/environment.py writes it now), of the record
# options and of a compiled region: what trace/schema.py alone may read by string.
_MANIFEST_KEYS = {"rank", "world_size", "environment", "options", "started_at", "source_root", "compiled_regions",
                  "unseen_writes", "ops_seen", "record_seconds", "disabled", "custom_ops", "source_files", "planted",
                  "complete", "lost", "flight", "version", "format", "ops_written", "last_op", "written_at"}
_REGION_KEYS = {"region", "kind", "calls", "how", "calls_by_how", "backend", "fullgraph", "ops_in_trace",
                "fullgraph_errors_suppressed", "note"}


def _metadata_keys() -> set[str]:
    from dataclasses import fields

    from replaydiff.record.environment import environment_snapshot
    from replaydiff.record.options import RecordOptions

    env = environment_snapshot(0, 1)
    keys = set(env) | set(env["flags"]) | {"index", "name", "capability", "memory"}
    return keys | {f.name for f in fields(RecordOptions)} | _MANIFEST_KEYS | _REGION_KEYS


def test_trace_metadata_is_read_through_typed_attributes_only() -> None:
    """RankTrace.environment, .options and .compiled_regions are typed once in trace/schema.py; no module outside the
    trace package reads a manifest, environment, options or compiled-region key by string."""
    keys = "|".join(re.escape(k) for k in sorted(_metadata_keys(), key=len, reverse=True))
    holder = r"\b(manifest|environment|env|cenv|options|flags|variables|compiled_regions|regions?|devices?)"
    use = re.compile(rf"""{holder}(\[\s*["']({keys})["']\s*\]|\.get\(\s*["']({keys})["'])""")
    offenders = []
    for p in _python_files(PKG, ROOT / "tui"):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("replaydiff/trace/"):
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if use.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def _hint_texts(p: Path) -> list[tuple[int, str]]:
    """String constants long enough to be a cause's hint or remedy (over 40 characters; an implicit concatenation
    is one constant)."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 40]


def test_known_causes_are_one_table() -> None:
    """The hints and remedies of known causes live in replaydiff/causes.py only: the same sentence (TF32's was in both
    the health report and diff's environment hints) in a second module is a copy that will drift."""
    from replaydiff.causes import CAUSES, finders
    from replaydiff.diff.environment import environment_diff
    from replaydiff.report import health  # noqa: F401  (registers the health report's finders)

    # both readers take their words from the table: the health report's causes and diff's hints
    assert {c.kind for c, _ in finders()} == {"tf32", "nondeterministic_kernel", "threads", "rounding", "collective"}
    (tf32,) = environment_diff({"flags": {"cudnn.allow_tf32": False}}, {"flags": {"cudnn.allow_tf32": True}})
    assert tf32.hint == CAUSES["tf32"].hint
    texts = {t for c in CAUSES.values() for t in (c.hint, c.remedy) if t}
    assert any("TF32" in t for t in texts) and any("thread" in t for t in texts)  # the table holds them
    copies = []
    for p in _python_files(PKG, ROOT / "tui"):
        rel = p.relative_to(ROOT).as_posix()
        if rel == "replaydiff/causes.py":
            continue
        for line, text in _hint_texts(p):
            if text in texts or any(text.startswith(t[:60]) for t in texts):
                copies.append(f"{rel}:{line}: {text[:60]}")
    assert copies == []
