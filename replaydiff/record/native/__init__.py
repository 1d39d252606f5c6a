"""The compiled statistics kernel (``stats.c``): built on first use with the system C compiler, cached, loaded with
ctypes; None wherever that cannot happen, and the numpy path (``record/stats.py``) measures instead.

Why compiled: a statistics recording's extra time on a CPU job went to copying each tensor's values and summing them
in numpy batches (a copy, a queue, ~10 numpy calls a batch). The kernel reads a tensor's memory in place, once, and
sums in numpy's own order, so both paths write the same bytes. Why built here and not at install: installing stays
``pip install``, with no build step and no new dependency; where there is no compiler, the build fails, or
``REPLAYDIFF_NATIVE=0`` is set, recording carries on with numpy and says so only in a debug log line (the recorder is
a guest in someone's job). The library is cached per user (``$XDG_CACHE_HOME/replaydiff`` or
``~/.cache/replaydiff``) under a hash of the source, the compiler and the platform, written under a temporary name
and renamed, so ranks that build at once all end with one good file.

Where Python's own headers are installed, the same source is also built into an extension module with the
recorder's other per-op helpers (``hotpath.c``: ``extension()``): the kernel called once per tensor without ctypes'
argument conversion (~10x cheaper on a tiny tensor, returning the statistics themselves), and op records taken off
the cyclic garbage collector's lists (``untrack()``). Without the headers (or where that build fails) the ctypes
library measures alone, with the same results, and the records stay on the collector's lists. Not on a
free-threaded Python either: loading a module that does not declare it runs without the GIL turns the GIL back on
for the whole job.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("replaydiff")

SOURCE = Path(__file__).with_name("stats.c")
EXT_SOURCE = Path(__file__).with_name("hotpath.c")  # the extension module; it includes SOURCE
EXT_NAME = "_replaydiff_hotpath"  # its PyInit__replaydiff_hotpath
# No -march=native: the cache may be shared by machines of one architecture. No fused multiply-add, no fast-math:
# the sums must round as numpy's do.
FLAGS = ["-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
BUILD_SECONDS = 120

_lock = threading.Lock()
_loaded: list = []  # [the kernel or None] once tried in this process
_ext_loaded: list = []  # [the extension module or None] once tried in this process


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "replaydiff"


def compiler() -> list[str] | None:
    """The C compiler's command: $CC, else cc, else gcc; None when there is none."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def kernel():
    """The loaded ``replaydiff_stats`` function (argtypes set), or None; built at the first call in a process."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            fn = None
            if os.environ.get("REPLAYDIFF_NATIVE", "1") == "0":
                log.debug("statistics kernel: off (REPLAYDIFF_NATIVE=0), numpy measures")
            else:
                try:
                    fn = load(build())
                except Exception as exc:  # no compiler, a failed build, an unwritable cache: numpy measures
                    log.debug("statistics kernel unavailable, numpy measures: %s: %s", type(exc).__name__, exc)
            _loaded.append(fn)
    return _loaded[0]


def extension():
    """The loaded extension module (``measure``, ``dense_numel``, ``untrack_tree``: see hotpath.c), or None; built at
    the first call in a process, where a C compiler and Python's headers are (``REPLAYDIFF_NATIVE=0`` turns it off,
    as it does the ctypes kernel; never on a free-threaded Python: see there)."""
    if _ext_loaded:
        return _ext_loaded[0]
    with _lock:
        if not _ext_loaded:
            mod = None
            if free_threaded():
                # A module without a Py_mod_gil slot turns the GIL back on for the whole process when it loads (with
                # a RuntimeWarning): the job would run differently because it was recorded. untrack_tree's walk also
                # assumes the GIL (no other thread changes a record's containers, or their collector bits, meanwhile).
                log.debug("native extension not loaded on a free-threaded Python (the ctypes kernel measures, op "
                          "records stay on the collector's lists)")
            elif os.environ.get("REPLAYDIFF_NATIVE", "1") != "0":
                try:
                    mod = load_extension(build_extension())
                except Exception as exc:  # no headers, no compiler, a failed build: Python does its work
                    log.debug("native extension unavailable (the ctypes kernel measures, op records stay on the "
                              "collector's lists): %s: %s", type(exc).__name__, exc)
            _ext_loaded.append(mod)
    return _ext_loaded[0]


def free_threaded() -> bool:
    """Whether this is a free-threaded Python (built with ``--disable-gil``), where the extension is not loaded."""
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def untrack():
    """``untrack_tree`` (hotpath.c: an op record off the cyclic collector's lists), or None where the extension is
    not built (the records then stay on them, as before)."""
    mod = extension()
    return getattr(mod, "untrack_tree", None) if mod is not None else None


def library_path(cc: list[str], flags: list[str], sources: tuple[Path, ...] = (SOURCE,), suffix: str = ".so",
                 stem: str = "stats", extra: str = "") -> Path:
    """Where the library built from these sources by this compiler with these flags on this platform lives."""
    version = subprocess.run([*cc, "--version"], capture_output=True, timeout=BUILD_SECONDS, check=True).stdout
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in sources), shlex.join(cc).encode(), version, " ".join(flags).encode(),
                 f"{sys.platform} {platform.machine()} {sys.maxsize}{extra}".encode()):
        key.update(hashlib.sha256(part).digest())
    return cache_dir() / f"{stem}-{key.hexdigest()[:20]}{suffix}"


def build(defines: tuple[str, ...] = ()) -> Path:
    """The cached library, compiled first if it is not there (raises when it cannot be). ``defines`` (tests): e.g.
    ``("REPLAYDIFF_NO_AVX",)`` or ``("REPLAYDIFF_SCALAR",)`` build the paths this processor would not take."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    flags = [*FLAGS, *(f"-D{d}" for d in defines)]
    return _compile(cc, flags, library_path(cc, flags), SOURCE)


def build_extension() -> Path:
    """The cached extension module (hotpath.c with stats.c), compiled first if it is not there (raises when it
    cannot be: no compiler, no Python.h). Keyed by this Python's headers and ABI as well: another interpreter
    builds its own."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise FileNotFoundError(f"no Python.h in {include!r} (Python's development headers are not installed)")
    flags = [*FLAGS, f"-I{include}"]
    if sys.platform == "darwin":  # the interpreter's symbols are found when the module loads
        flags += ["-undefined", "dynamic_lookup"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = library_path(cc, flags, (SOURCE, EXT_SOURCE), suffix, "hotpath", f" {sys.version} {suffix}")
    return _compile(cc, flags, target, EXT_SOURCE)


def load_extension(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(EXT_NAME, str(path))
    spec = importlib.util.spec_from_file_location(EXT_NAME, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _compile(cc: list[str], flags: list[str], target: Path, source: Path) -> Path:
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True,
                              timeout=BUILD_SECONDS)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(cc)} exited {done.returncode}: "
                               f"{done.stderr.decode(errors='replace').strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a rank building at the same time replaces it with the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path):
    # PyDLL: the call keeps the GIL. Released (CDLL), taking it back after a sub-microsecond call can wait for
    # another thread's whole switch interval.
    fn = ctypes.PyDLL(str(path)).replaydiff_stats
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn
