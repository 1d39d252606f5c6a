"""Entry point: parse the verb, run it, turn library errors into one stderr line and an exit code.

Exit codes are ``errors.ExitCode`` (0 clean, 1 a problem found, 2 usage, 3 unreadable trace, 4 environment, 130
interrupted); each verb's --help lists them all with what each means for it. A traceback is shown only with ``-v``.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import textwrap
import traceback
from typing import TextIO

from replaydiff import __version__
from replaydiff.errors import ExitCode, ReplaydiffError, fail, say


class _Parser(argparse.ArgumentParser):
    """Every parser of the CLI: an option is spelled whole (``--tensor`` is not taken for ``--tensors``, nor
    ``--precisio`` for ``--precision``: a prefix that is a whole option tomorrow would change what today's command
    does), and a usage error is one line."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse exits 2 too: one line, with where the options are listed
        raise SystemExit(fail(f"{message} (see `{self.prog} --help`)"))


_CODES = tuple(c for c in ExitCode if c is not ExitCode.BROKEN_PIPE)  # a reader that left is no verb's outcome


def exit_codes_help(meanings: dict[ExitCode, str]) -> str:
    """The epilog of a verb's --help: every exit code, with what it means for the verb (``meanings``) where it says
    more than the code's own meaning."""
    return "exit codes:\n" + "".join(f"  {int(c):>3}  {meanings.get(c, c.meaning)}\n" for c in _CODES)


class _Formatter(argparse.HelpFormatter):
    """argparse's own, but the exit codes stay one to a line (each wrapped under its own text)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if not text.startswith("exit codes:\n"):
            return super()._fill_text(text, width, indent)
        head, *rows = text.splitlines()
        return "\n".join([indent + head] + [textwrap.fill(r[7:], width, initial_indent=indent + r[:7],
                                                          subsequent_indent=indent + " " * 7) for r in rows])


def build_parser() -> argparse.ArgumentParser:
    from replaydiff.cli import demo, diff, invariance, record, replay, report, repro, show, trend, tui

    p = _Parser(prog="replaydiff", description="Record a PyTorch training step, replay every op in isolation, "
                                                "and name the op that went wrong.")
    p.add_argument("--version", action="version", version=f"replaydiff {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="verb", metavar="COMMAND", parser_class=_Parser)
    for mod in (record, show, replay, diff, invariance, trend, repro, report, demo, tui):
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__, formatter_class=_Formatter,
                            epilog=exit_codes_help(getattr(mod, "EXIT_CODES", {})))
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks for errors")
        mod.prepare_parser(sp)
        sp.set_defaults(run=mod.run, verb_parser=sp)
    return p


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """' (did you mean --tensors?)' for the first unknown option close to one of the parser's."""
    import difflib

    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for u in unknown:
        if u.startswith("--"):
            close = difflib.get_close_matches(u.split("=", 1)[0], known, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a mistyped option: the usage of the verb it was given to, not the top-level one
        given = getattr(args, "verb_parser", None) or parser
        given.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(given, unknown)}")
    if not getattr(args, "verb", None):
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    guard = args.verb not in _OWN_TERMINAL
    out = sys.stdout
    if guard:  # whatever a verb writes, no control character of a trace string reaches the terminal raw
        sys.stdout = ShownStream(out)
    try:
        return _run(args)
    finally:
        if guard:
            sys.stdout = out


_OWN_TERMINAL = ("tui",)  # verbs that draw on the terminal themselves (escape sequences are their output)


class ShownStream(io.TextIOBase):
    """Standard output for a verb: each write's lines ``shown`` (their own newlines kept), the rest as the stream.
    The renderers escape each trace string where they place it (newlines included); this is the last guard."""

    def __init__(self, stream: TextIO) -> None:
        from replaydiff.rebuild_and_judge import shown_lines  # torch comes with it: imported once a verb runs

        self._stream, self._shown = stream, shown_lines

    def write(self, text: str) -> int:
        self._stream.write(self._shown(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def _run(args: argparse.Namespace) -> int:
    try:
        if isinstance(getattr(args, "json", None), str):  # --json FILE of any verb: refused before the work
            from replaydiff.cli.progress import check_json_dest

            check_json_dest(args.json)
        return int(args.run(args) or 0)
    except ReplaydiffError as exc:
        if args.verbose:
            traceback.print_exc()
        return fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        say("interrupted")
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `replaydiff show trace | head`: the reader left; leave quietly, as cat would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
