"""The CLI speaks one dialect: ``--op GLOB`` and ``--rank R`` are spelled the same in every verb (the former
``replay --ops`` and ``record --ranks R,R`` still work, hidden from --help), ``show --json`` takes FILE|- as every
verb's --json does, and options are checked by their type (ReplayOptions, DiffOptions), from Python as from the CLI."""
from __future__ import annotations

import json

import pytest

import replay_helpers as rh
from replaydiff.cli.main import build_parser, main
from replaydiff.replay import ReplayOptions


def _help(capsys, verb: str) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return capsys.readouterr().out


def test_op_and_rank_are_spelled_one_way_and_the_former_spellings_still_select(capsys):
    parse = build_parser().parse_args
    replay = parse(["replay", "T", "--op", "aten.mm*", "--ops", "aten.add*", "--rank", "2", "--rank", "0,1"])
    assert replay.ops == ["aten.mm*", "aten.add*"] and sorted(replay.ranks) == [0, 1, 2]
    record = parse(["record", "--op", "aten.mm*", "--rank", "3", "--ranks", "0,1", "--", "python", "x.py"])
    assert record.ops == ["aten.mm*"] and sorted(record.ranks) == [0, 1, 3]
    for verb in ("replay", "record"):
        text = _help(capsys, verb)
        assert "--op GLOB" in text and "--rank R" in text, verb
        assert "--ops" not in text and "--ranks" not in text, verb  # the former spellings work, unlisted
    with pytest.raises(SystemExit):
        parse(["replay", "T", "--rank", "-1"])
    assert "--rank takes a rank or ranks separated by commas" in capsys.readouterr().err


def test_replay_options_are_checked_by_their_type_from_python_as_from_the_cli(capsys):
    for bad in ({"repeat": 0}, {"repeat": 1.5}, {"threads": 0}, {"precision": "fp16"}):
        with pytest.raises(ValueError, match=f"--{next(iter(bad))} must be"):
            ReplayOptions(**bad)
    assert ReplayOptions(repeat=2, threads=1).repeat == 2
    path = str(rh.step_trace("mlp"))
    assert main(["replay", path, "--repeat", "0"]) == 2
    assert capsys.readouterr().err == "replaydiff: error: --repeat must be at least 1, not 0\n"
    from replaydiff.diff import DiffOptions

    with pytest.raises(ValueError, match="--safety must be positive"):
        DiffOptions(safety=0)
    assert main(["diff", path, path, "--safety", "-1"]) == 2
    assert capsys.readouterr().err == "replaydiff: error: --safety must be positive, not -1.0\n"


def test_show_json_takes_a_file_or_dash_and_a_bare_json_is_stdout(capsys, tmp_path):
    path = str(rh.step_trace("mlp"))
    assert main(["show", path, "--json"]) == 0
    bare = capsys.readouterr().out
    assert json.loads(bare)["format"] == "replaydiff.show/1"
    assert main(["show", path, "--json", "-"]) == 0
    assert capsys.readouterr().out == bare
    dest = tmp_path / "show.json"
    assert main(["show", path, "--op", "3", "--json", str(dest)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("op #3 ")  # the text as without --json, and the JSON in the file
    assert json.loads(dest.read_text())["index"] == 3
    assert main(["show", path, "--list", "--json", str(tmp_path / "list.json")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [op["index"] for op in json.loads((tmp_path / "list.json").read_text())["ops"]] == \
        [int(row.split()[0]) for row in rows]


def test_show_list_filters_that_no_op_passes_exit_2_as_replay_does(tmp_path, capsys):
    """`show --list --op GLOB` that lists nothing is a usage error (exit 2, the line on stderr), as `replay --op GLOB`
    that matches no op is; a filter that lists something exits 0."""
    path = str(rh.step_trace("mlp"))
    assert main(["show", path, "--list", "--op", "aten.no_such_op*"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no op of rank 0 passes these filters" in captured.err
    assert main(["replay", path, "--op", "aten.no_such_op*"]) == 2
    capsys.readouterr()
    assert main(["show", path, "--list", "--op", "aten.mm*"]) == 0
    assert "aten.mm.default" in capsys.readouterr().out


def test_record_granularity_module_alone_records_statistics():
    """`record --granularity module` without --tensors records statistics (it was refused: the default, full, does
    not go with it); --tensors given is kept, and the default elsewhere is still full."""
    from replaydiff.cli.record import options_from_args

    def options(*args: str):
        return options_from_args(build_parser().parse_args(["record", "-o", "t", *args, "--", "python", "x.py"]))

    assert options("--granularity", "module").tensors.value == "stats"
    assert options("--granularity", "module", "--tensors", "meta").tensors.value == "meta"
    assert options().tensors.value == "full"
