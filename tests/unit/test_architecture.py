"""The layering the design fixes: only the trace package knows the wire keys, the import graph has no cycle, and a
lower layer (trace <- record, replay, compare <- report, cli <- tui) never imports a higher one. Each idea lives once:
a stored tensor is rebuilt, the compared results of an op are listed and a verdict's severity is computed in one
place each (rebuilding and judging a recorded op is the bottom module ``rebuild_and_judge``, which replay uses and
``replaydiff repro`` copies as the standalone script)."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "replaydiff"

# The one- and two-letter keys of op records and tensor references (replaydiff/trace/schema/keys.py).
_WIRE = r"i|ph|mod|fwd|src|srt|stp|lo|a|k|w|o|u|x|coll|rng|T|dt|sh|st|of|sb|f|s|rg|cj|ng|unsupported"
_WIRE_USE = re.compile(rf"""(\[\s*["']({_WIRE})["']\s*\]|\.get\(\s*["']({_WIRE})["']|\{{\s*["']({_WIRE})["']\s*:)""")


def _python_files(*dirs: Path) -> list[Path]:
    return [p for d in dirs for p in sorted(d.rglob("*.py")) if "__pycache__" not in p.parts]


def test_no_module_outside_the_trace_package_reads_a_wire_key() -> None:
    offenders = []
    for p in _python_files(PKG, ROOT / "tests", ROOT / "tui", ROOT / "fixtures"):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("replaydiff/trace/") or rel in ("tests/integration/test_trace_format.py",
                                                          "tests/unit/test_architecture.py"):
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if _WIRE_USE.search(line) and not line.endswith("# wire-ok: damages a record on purpose"):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def test_the_op_record_keys_are_spelled_once_in_schema_keys() -> None:
    """Inside the trace package too, the op record and tensor reference keys are spelled in trace/schema/keys.py only:
    the reader, the writer and the other schema modules name them through its constants, so no second module
    assigns one of those strings to a key constant or reads a record by it."""
    keys_module = PKG / "trace" / "schema" / "keys.py"
    wire = set(_WIRE.split("|"))
    offenders = []
    for p in _python_files(PKG / "trace"):
        if p == keys_module:
            continue
        rel = p.relative_to(ROOT).as_posix()
        tree = ast.parse(p.read_text())
        for node in tree.body:
            # a key constant: NAME = "key", or A, B = "key", "key"
            values = node.value.elts if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) else \
                [node.value] if isinstance(node, ast.Assign) else []
            if values and all(isinstance(v, ast.Constant) and v.value in wire for v in values):
                offenders.append(f"{rel}:{node.lineno}: {ast.get_source_segment(p.read_text(), node)}")
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if _WIRE_USE.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []
    assert {v.value for v in ast.walk(ast.parse(keys_module.read_text()))
            if isinstance(v, ast.Constant) and isinstance(v.value, str)} >= wire


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


_BOTTOM = {"replaydiff.aten", "replaydiff.errors", "replaydiff.rebuild_and_judge", "replaydiff.device"}
LAYERS = {  # a package may import only from these (besides itself)
    # rebuilding and judging a recorded op, below everything: `replaydiff repro` copies it as the standalone script,
    # which runs where replaydiff is not installed, so it imports nothing of replaydiff
    "replaydiff.rebuild_and_judge": set(),
    "replaydiff.aten": {"replaydiff.rebuild_and_judge"},
    "replaydiff.errors": {"replaydiff.rebuild_and_judge"},  # its lines show strings from a trace as ``shown``
    # everything device-specific (events, streams, capture, pinned memory, generators): below the trace writer,
    # which waits on its events; the standalone repro script cannot import it and keeps to torch's generic API
    "replaydiff.device": set(),
    # planted faults sit at the bottom too: the recorder enters one below itself for `record --plant`
    "replaydiff.faults": {"replaydiff.aten"},
    "replaydiff.trace": _BOTTOM | {"replaydiff.faults"},  # a plant's effect, read back from the manifest
    # the table of known causes (what a recorded setting does to numerics), read by diff and report
    "replaydiff.causes": {"replaydiff.trace"},
    "replaydiff.compare": _BOTTOM,
    "replaydiff.record": _BOTTOM | {"replaydiff.trace", "replaydiff.faults"},
    "replaydiff.replay": _BOTTOM | {"replaydiff.trace", "replaydiff.compare"},
    "replaydiff.diff": _BOTTOM | {"replaydiff.trace", "replaydiff.compare", "replaydiff.replay", "replaydiff.causes"},
    # analysis over the steps of a trace (trend, where a difference enters): results that report/ renders
    "replaydiff.trend": _BOTTOM | {"replaydiff.trace", "replaydiff.compare", "replaydiff.replay", "replaydiff.diff"},
    # the health report of a replay: its checks, and causes found with their evidence (re-running the culprit)
    "replaydiff.health": _BOTTOM | {"replaydiff.trace", "replaydiff.compare", "replaydiff.replay", "replaydiff.causes"},
    # batch invariance: each op that reads the batch re-run on slices of it (replay's rebuilding of its inputs)
    "replaydiff.invariance": _BOTTOM | {"replaydiff.trace", "replaydiff.compare", "replaydiff.replay"},
    "replaydiff.report": _BOTTOM | {"replaydiff.trace", "replaydiff.record", "replaydiff.compare", "replaydiff.replay",
                                    "replaydiff.diff", "replaydiff.causes", "replaydiff.trend", "replaydiff.health",
                                    "replaydiff.repro", "replaydiff.invariance"},
    # writing a repro directory: the op's description (what replay compares, its limits) and the script
    "replaydiff.repro": _BOTTOM | {"replaydiff.trace", "replaydiff.compare", "replaydiff.replay"},
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


# aten.py, and the bottom module for what the standalone repro script needs too (the operators a graph may call)
_OP_KNOWLEDGE = ("replaydiff/aten.py", "replaydiff/rebuild_and_judge.py")


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
            if rel not in _OP_KNOWLEDGE and len(names & ops) >= 5:
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


# -- each idea once ----------------------------------------------------------------------------------------------
SCRIPT = PKG / "rebuild_and_judge.py"  # the bottom module: `replaydiff repro` copies it as DIR/repro.py


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_the_repro_script_imports_only_the_standard_library_torch_and_safetensors() -> None:
    """A kernel owner runs it with torch and safetensors alone, so what it shares with replay must be defined in it."""
    imported = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." if node.level else (node.module or "").split(".")[0])
    assert imported - set(sys.stdlib_module_names) - {"__future__", "torch", "safetensors"} == set()


def test_a_stored_tensor_is_rebuilt_in_one_place() -> None:
    """Strided views over a storage's elements with the conj/neg bits (the reader, the replayer and the repro each
    had their own) are made by ``rebuild_and_judge.as_recorded`` only; numpy's as_strided (recording's statistics over a
    live tensor) is not a rebuild."""
    copies = []
    for p in _python_files(PKG, ROOT / "tui"):
        if p == SCRIPT:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\.as_strided\(|_neg_view\(", line) and "stride_tricks" not in line:
                copies.append(f"{_rel(p)}:{n}: {line.strip()}")
    assert copies == []


def _functions(p: Path) -> list[ast.AST]:
    return [n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _attributes(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def test_the_compared_results_of_an_op_are_listed_in_one_place() -> None:
    """Which outputs and written arguments of an op are compared (runner._pairs and repro._checks each decided it)
    is ``replay.compared.compared_outputs``: no other function walks an op's writes and outputs by storage version,
    and none but it leaves kernel-path outputs out."""
    owner = PKG / "replay" / "compared.py"
    copies = []
    for p in _python_files(PKG, ROOT / "tui"):
        if p == owner or _rel(p).startswith(("replaydiff/trace/", "replaydiff/record/")):
            continue  # the trace defines writes and outputs; the recorder writes them
        if "KERNEL_PATH_OUTPUTS" in p.read_text() and p != PKG / "aten.py":
            copies.append(f"{_rel(p)}: reads KERNEL_PATH_OUTPUTS")
        for f in _functions(p):
            if {"writes", "outputs", "version"} <= _attributes(f):
                copies.append(f"{_rel(p)}:{f.lineno} {f.name}")
    assert copies == []


def test_measuring_and_judging_are_defined_once_in_the_module_the_repro_script_is() -> None:
    """What the script and replay share is defined in the bottom module alone and is the very object replay uses:
    the measure, the verdict's judging, the dtypes replayed at, the reference settings, the graph's allowed
    operators."""
    from replaydiff import aten, rebuild_and_judge
    from replaydiff.compare import metrics, verdict
    from replaydiff.replay import policy

    names = ("how_far_over", "calibrated_limits", "calibrate", "float_severity", "ill_conditioned_note",
             "same_scalar", "same_nonfinite", "measure", "graph_operator", "reference_numerics")
    defined = sorted(f"{_rel(p)} {f.name}" for p in _python_files(PKG, ROOT / "tui") for f in _functions(p)
                     if f.name in names)
    assert defined == sorted(f"replaydiff/rebuild_and_judge.py {n}" for n in names)
    assert all(getattr(verdict, n) is getattr(rebuild_and_judge, n) for n in names[:6])
    assert verdict.Calibration is rebuild_and_judge.Calibration
    assert metrics.measure is rebuild_and_judge.measure and metrics.FloatError is rebuild_and_judge.FloatError
    assert policy.UPCAST is rebuild_and_judge.UPCAST and aten.graph_operator is rebuild_and_judge.graph_operator
    # no second table of dtypes to upcast to, nor of reference settings
    copies = [f"{_rel(p)}:{n}: {line.strip()}" for p in _python_files(PKG, ROOT / "tui") if p != SCRIPT
              for n, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"torch\.float16: torch\.float|^\s*torch\.(_C\._set|use)_deterministic_algorithms\("
                           r"|os\.environ\[.*CUBLAS|cudnn\.flags\(", line)]
    assert copies == []


_FIGURES = {"norm_max", "norm_rel", "max_abs", "rel_l2"}  # a verdict's raw figures
_LIMITS = {"limit_max", "limit_rel"}
_JUDGING = {"how_far_over", "calibrated_limits", "calibrate", "float_severity"}


def _names_read(node: ast.AST) -> set[str]:
    """Attribute names and string keys (``m["norm_max"]``, ``getattr(x, "norm_max")``) read in ``node``."""
    out = _attributes(node)
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def score_computations(source: str) -> list[str]:
    """Where ``source`` computes how bad a verdict is from its raw figures: a figure divided by or compared with a
    limit, the judging functions called, or a ranking (``key=``) by a figure or a limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            pairs = [(node.left, node.right)]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            pairs = list(zip(sides, sides[1:]))
        for a, b in pairs:
            na, nb = _names_read(a), _names_read(b)
            if (na & _FIGURES and nb & _LIMITS) or (na & _LIMITS and nb & _FIGURES):
                found.append(f"{node.lineno}: a figure against a limit")
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _JUDGING:
                found.append(f"{node.lineno}: calls {name}")
            for kw in node.keywords:
                if kw.arg == "key" and _names_read(kw.value) & (_FIGURES | _LIMITS):
                    found.append(f"{node.lineno}: ranks by a raw figure")
    return found


def test_no_module_outside_compare_computes_a_severity() -> None:
    """How far an op is over its limit is ``Verdict.severity`` (compare/verdict.py); replay, the report, the repro
    and the TUI read it and never compute their own from norm_max, limit_max and the like. The bottom module is the
    home of the judging functions the verdict calls, and its script calls them as the verdict does: it may call
    them, never compare a figure with a limit or rank by one itself."""
    offenders = []
    for p in _python_files(PKG, ROOT / "tui"):
        if _rel(p).startswith("replaydiff/compare/"):
            continue
        offenders += [f"{_rel(p)}:{x}" for x in score_computations(p.read_text())
                      if not (p == SCRIPT and ": calls " in x)]
    assert offenders == []


def test_the_severity_check_catches_a_planted_copy() -> None:
    planted = """
def worst(results):
    return max(results, key=lambda r: r.verdict.measure.norm_max)

def over(v):
    return v.measure.norm_max / v.limit_max

def ok(m):
    return m["norm_max"] <= m["limit_max"]

def far(v, m):
    return how_far_over((m.norm_max, m.norm_rel), (v.limit_max, v.limit_rel))
"""
    assert [x.split(": ", 1)[1] for x in score_computations(planted)] == [
        "ranks by a raw figure", "a figure against a limit", "a figure against a limit", "calls how_far_over"]


# Every key of the manifest, of the environment snapshot (as record/environment.py writes it now), of the record
# options and of a compiled region: what the trace package (trace/schema/) alone may read by string.
_MANIFEST_KEYS = {"rank", "world_size", "environment", "options", "started_at", "source_root", "compiled_regions",
                  "unseen_writes", "ops_seen", "record_seconds", "disabled", "custom_ops", "source_files", "planted",
                  "complete", "lost", "flight", "version", "format", "ops_written", "last_op", "written_at", "command"}
_REGION_KEYS = {"region", "kind", "calls", "how", "calls_by_how", "backend", "fullgraph", "ops_in_trace",
                "fullgraph_errors_suppressed", "note"}


def _metadata_keys() -> set[str]:
    from dataclasses import fields

    from replaydiff.record.environment import environment_snapshot
    from replaydiff.record.options import RecordOptions

    env = environment_snapshot(0, 1)
    keys = set(env) | set(env["flags"]) | {"index", "name", "capability", "memory", "type", "processors"}
    return keys | {f.name for f in fields(RecordOptions)} | _MANIFEST_KEYS | _REGION_KEYS


def test_trace_metadata_is_read_through_typed_attributes_only() -> None:
    """RankTrace.environment, .options and .compiled_regions are typed once in trace/schema/; no module outside the
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
    from replaydiff import health  # noqa: F401  (registers the health report's finders)
    from replaydiff.causes import CAUSES, finders
    from replaydiff.diff.environment import environment_diff

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


_RESULT_FIELDS = {"status", "reason", "verdict"}


def _result_writes(p: Path) -> list[tuple[int, str]]:
    """Assignments to a ``status``, ``reason`` or ``verdict`` attribute (``res.reason = ...``, ``a.status, a.reason =
    ...``, ``res.reason += ...``) in ``p``, with the function they are in; an object keeping its own fields
    (``self.status = ...``: OpResult's __post_init__, the TUI model's column of statuses) is not one."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and el.attr in _RESULT_FIELDS and not (
                                isinstance(el.value, ast.Name) and el.value.id == "self"):
                            found.append((child.lineno, func))
            visit(child, func)

    visit(ast.parse(p.read_text()), "<module>")
    return found


def test_results_are_built_once_from_a_judgement() -> None:
    """Judging returns a value (status, verdict, typed notes) and the result is made from it in one place: no module
    sets a result's status, reason or verdict field by field (replay's judging did so in about 18 places, growing the
    reason by string concatenation). The one exception is the cross-rank check, which settles a collective's
    result (already in the engine's list) from its judgement in one function."""
    writes = [f"{_rel(p)}:{line} in {func}" for p in _python_files(PKG, ROOT / "tui") for line, func in
              _result_writes(p) if (_rel(p), func) != ("replaydiff/replay/collectives.py", "settle")]
    assert writes == []
    # ... and each kind of result is constructed in one place in the package (a JSON report read back aside)
    made = {kind: sorted({f"{_rel(p)}:{f.name}" for p in _python_files(PKG) for f in _functions(p)
                          for node in ast.walk(f) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                          and node.func.id == kind})
            for kind in ("OpResult", "PairResult")}
    assert made == {"OpResult": ["replaydiff/replay/runner.py:_result",
                                 "replaydiff/report/json_report.py:load_replay_json"],
                    "PairResult": ["replaydiff/diff/pairs.py:compare"]}


_ONE_HOME = {  # what was written twice and drifted, and the one place that defines it now
    "a plant's effect": (r"^class PlantEffect\b", {"replaydiff/faults.py"}),
    "the record() context manager": (r"^def record\(", {"replaydiff/record/api.py"}),
    "the recording child's environment variable": (r"[\"']REPLAYDIFF_RECORD[\"']",
                                                   {"replaydiff/record/autostart/_replaydiff_record_env.py"}),
    "replay's precisions": (r"^PRECISIONS\s*=|^class ReplaySettings\b", {"replaydiff/replay/policy.py"}),
    "the colour of a replay status": (r"[\"']bold magenta[\"']", {"tui/styles.py"}),
    "a size in KiB/MiB/GiB": (r"[\"']KiB[\"']", {"replaydiff/record/budget.py"}),
    "whether a dtype is judged by its error": (r"startswith\(\(\"float\", \"bfloat\"", {"replaydiff/aten.py"}),
}


def test_each_fact_that_was_copied_has_one_home() -> None:
    found: dict[str, set[str]] = {what: set() for what in _ONE_HOME}
    for p in _python_files(PKG, ROOT / "tui"):
        text = p.read_text()
        for what, (pattern, _) in _ONE_HOME.items():
            if re.search(pattern, text, re.M):
                found[what].add(_rel(p))
    assert found == {what: home for what, (_, home) in _ONE_HOME.items()}


def test_modes_and_precisions_are_compared_as_their_types() -> None:
    """A storage mode is a TensorMode and a precision a Precision, carried typed through options and results: no
    module compares them with a string ("full", "same"), so a new mode is added where the type is defined."""
    use = re.compile(r"(tensors|mode|precision)\s*(==|!=|\bin\b)\s*[\(\[{]?[\"'](full|stats|meta|fp64|fp32|same)[\"']")
    offenders = [f"{_rel(p)}:{n}: {line.strip()}" for p in _python_files(PKG, ROOT / "tui")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if use.search(line)]
    assert offenders == []
    from replaydiff.record.options import RecordOptions
    from replaydiff.replay.policy import Precision, ReplayOptions
    from replaydiff.trace.modes import TensorMode

    assert RecordOptions(tensors="stats").tensors is TensorMode.STATS  # the CLI's and the API's spelling
    assert ReplayOptions(precision="same").precision is Precision.SAME
    assert f"{TensorMode.META} {Precision.FP32}" == "meta fp32"  # on disk, in JSON and in text as before


# -- one shape for every verb: analysis returns a result, a renderer reads it, the CLI parses, calls and exits -------
# Modules whose analysis still lives beside their rendering (none now: a module that has to be named here says why).
_NOT_YET_ONE_SHAPE: set[str] = set()
# What a CLI module may take from the trace package: the way to open the trace it was given (and its type), the
# phase names its --phase choices list, and show's analysis (``trace/summary.py``).
_CLI_TRACE_NAMES = {"open_trace", "Trace", "PHASES"}
_CLI_TRACE_MODULES = {"replaydiff.trace.summary"}


def _imports(p: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each ``from M import name`` and (line, M, '') of each ``import M`` in ``p``."""
    found = []
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names]
    return found


def renderer_reads_a_trace(p: Path) -> list[str]:
    """Where the renderer ``p`` opens a trace or takes a reader of one, instead of reading the result it was given."""
    readers = {"open_trace", "Trace", "RankTrace", "OpReader"}
    found = [f"{line}: imports {module}.{name}" for line, module, name in _imports(p)
             if module.startswith("replaydiff.trace") and (name in readers or module == "replaydiff.trace.reader")]
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open_trace":
            found.append(f"{node.lineno}: calls open_trace")
    return found


def cli_reads_the_trace_itself(p: Path) -> list[str]:
    """Where the CLI module ``p`` takes from the trace package more than the way to open the trace it was given."""
    return [f"{line}: imports {module}{'.' + name if name else ''}" for line, module, name in _imports(p)
            if module.startswith("replaydiff.trace") and module not in _CLI_TRACE_MODULES
            and name not in _CLI_TRACE_NAMES]


def test_renderers_read_results_and_open_no_trace() -> None:
    """report/ holds renderers only: each reads the result an analysis returned (TrendResult, HealthReport,
    ShowSummary, Estimate, RecordingOutcome, ReplayReport, DiffResult) and never opens the trace to compute more."""
    offenders = []
    for p in _python_files(PKG / "report"):
        if _rel(p) not in _NOT_YET_ONE_SHAPE:
            offenders += [f"{_rel(p)}:{x}" for x in renderer_reads_a_trace(p)]
    assert offenders == []


def test_cli_modules_open_the_trace_given_and_compute_nothing_else_from_it() -> None:
    """A verb's module parses, calls the analysis, renders and maps the result to an exit code: from the trace
    package it takes only ``open_trace`` (for the trace on its command line) and show's analysis."""
    offenders = []
    for p in _python_files(PKG / "cli"):
        if _rel(p) not in _NOT_YET_ONE_SHAPE:
            offenders += [f"{_rel(p)}:{x}" for x in cli_reads_the_trace_itself(p)]
    assert offenders == []


def test_the_one_shape_checks_catch_a_planted_renderer_and_cli_module(tmp_path: Path) -> None:
    renderer = tmp_path / "renderer.py"
    renderer.write_text("from replaydiff.trace import open_trace\nfrom replaydiff.trace.reader import RankTrace\n\n"
                        "def render_text(result, out):\n    t = open_trace(result.path)\n")
    assert [x.split(": ", 1)[1] for x in renderer_reads_a_trace(renderer)] == [
        "imports replaydiff.trace.open_trace", "imports replaydiff.trace.reader.RankTrace", "calls open_trace"]
    cli = tmp_path / "cli.py"
    cli.write_text("from replaydiff.trace import open_trace, describe_missing\n"
                   "from replaydiff.trace.schema import LEFT_OUT_BUDGET, PHASES\n"
                   "from replaydiff.trace.summary import summarise\nimport replaydiff.trace.sync\n")
    assert [x.split(": ", 1)[1] for x in cli_reads_the_trace_itself(cli)] == [
        "imports replaydiff.trace.describe_missing", "imports replaydiff.trace.schema.LEFT_OUT_BUDGET",
        "imports replaydiff.trace.sync"]
    assert _NOT_YET_ONE_SHAPE <= {_rel(p) for p in _python_files(PKG)}  # no stale exemption


# -- the CLI speaks one dialect ----------------------------------------------------------------------------------
_OTHERS_MESSAGES = {"replaydiff/report/diff_text.py", "replaydiff/report/repro.py"}  # parallel work in progress


def hand_typed_prefixes(source: str) -> list[int]:
    """Lines where ``source`` types the ``replaydiff: `` prefix of a line for stderr itself, instead of calling
    errors.say/warn/fail/line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and \
                first.value.startswith("replaydiff: "):
            found.append(node.lineno)
    return sorted(set(found))


def test_the_cli_and_the_renderers_say_their_lines_through_one_helper() -> None:
    offenders = [f"{_rel(p)}:{n}" for p in _python_files(PKG / "cli", PKG / "report")
                 if _rel(p) not in _OTHERS_MESSAGES for n in hand_typed_prefixes(p.read_text())]
    assert offenders == []
    assert hand_typed_prefixes('import sys\nsys.stderr.write(f"replaydiff: warning: {w}\\n")\nx = "replaydiff: hi"\n'
                               'say(f"wrote {out}")\n') == [2, 3]


def test_every_verbs_help_lists_every_exit_code(capsys) -> None:
    import pytest

    from replaydiff.cli.main import main
    from replaydiff.errors import ExitCode

    verbs = ("record", "show", "replay", "diff", "trend", "repro", "report", "demo", "tui")
    for verb in verbs:
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = capsys.readouterr().out
        listed = text[text.index("\nexit codes:\n"):].splitlines()[1:]
        codes = [int(row.split()[0]) for row in listed if row[:6].strip().isdigit()]
        assert codes == [c for c in ExitCode if c is not ExitCode.BROKEN_PIPE], verb


def test_each_verbs_result_is_frozen() -> None:
    """A renderer reads a value that analysis returned once; nothing sets its fields afterwards."""
    from dataclasses import FrozenInstanceError, fields

    import pytest

    from replaydiff.health import HealthReport
    from replaydiff.record.estimate import Estimate, WriteRate
    from replaydiff.record.outcome import RecordingOutcome
    from replaydiff.trace.summary import OpDetail, OpListing, RankSummary, ShowSummary
    from replaydiff.trend import Series, TrendResult
    from replaydiff.trend.entry import EntryFinding

    for kind in (TrendResult, Series, EntryFinding, HealthReport, ShowSummary, RankSummary, OpDetail, OpListing,
                 Estimate, WriteRate, RecordingOutcome):
        obj = object.__new__(kind)
        with pytest.raises(FrozenInstanceError):
            setattr(obj, fields(kind)[0].name, None)


def test_torch_cuda_is_called_from_the_device_module_only() -> None:
    """One module owns what is device-specific (replaydiff/device.py): every other module reaches CUDA, ROCm, XPU,
    NPU and MPS through it or through torch's generic device API, so no accelerator is a second code path."""
    offenders = []
    for p in _python_files(PKG, ROOT / "tui"):
        if p == PKG / "device.py":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\btorch\.cuda\b", line):
                offenders.append(f"{_rel(p)}:{n}: {line.strip()}")
    assert offenders == []
