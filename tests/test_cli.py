"""The dispatcher: bad input is one line on stderr and exit code 2; shared options are defined once."""

from __future__ import annotations

import argparse
import types

import pytest

from kvsqueeze import cli
from kvsqueeze.cli import COMMANDS, build_parser, main
from kvsqueeze.commands import _options
from kvsqueeze.errors import KvsqueezeError, MissingDependencyError


def _fake_command(monkeypatch, run):
    """Make ``kvsqueeze presets`` run ``run`` (with one --json option, as real commands define it)."""
    fake = types.SimpleNamespace(add_arguments=_options.add_json, run=run)
    real = cli._load
    monkeypatch.setattr(cli, "_load", lambda module: fake if module == "presets" else real(module))


def _raiser(exc):
    def run(args):
        raise exc
    return run


@pytest.mark.parametrize("exc, line", [
    (KvsqueezeError("bad cache"), "kvsqueeze presets: error: bad cache"),
    (MissingDependencyError("needs x: pip install x"), "kvsqueeze presets: error: needs x: pip install x"),
    (ValueError("--chunks must be at least 1"), "kvsqueeze presets: error: --chunks must be at least 1"),
    (KvsqueezeError("first line\n  second line"), "kvsqueeze presets: error: first line second line"),
])
def test_user_errors_are_one_line_and_exit_2(monkeypatch, capsys, exc, line):
    _fake_command(monkeypatch, _raiser(exc))
    assert main(["presets"]) == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""


def test_a_bug_keeps_its_traceback(monkeypatch):
    _fake_command(monkeypatch, _raiser(RuntimeError("broken invariant")))
    with pytest.raises(RuntimeError, match="broken invariant"):
        main(["presets"])


@pytest.mark.parametrize("argv, line", [
    (["ppl"], "kvsqueeze ppl: error: the following arguments are required: --kv (see kvsqueeze ppl --help)"),
    (["speed", "--kv", "int4", "--threads", "0"],
     "kvsqueeze speed: error: argument --threads: must be at least 1, got 0 (see kvsqueeze speed --help)"),
    (["generate", "--prompt", "x", "--threads", "two"],
     "kvsqueeze generate: error: argument --threads: expected a positive integer, got 'two' (see kvsqueeze "
     "generate --help)"),
])
def test_argument_errors_are_one_line_and_exit_2(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_json_into_a_directory_is_refused_before_running(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ppl", "--kv", "int4", "--json", str(tmp_path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"kvsqueeze ppl: error: argument --json: {tmp_path} is a directory; give a "
                                       f"file name, or - for standard output (see kvsqueeze ppl --help)\n")


def test_json_dash_keeps_stdout_for_the_document(monkeypatch, capsys):
    def run(args):
        print("a human-readable line")
        _options.write_json(args, {"ppl": float("nan"), "n": 3})
        return 0

    _fake_command(monkeypatch, run)
    assert main(["presets", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert captured.out == '{\n  "ppl": null,\n  "n": 3\n}\n'  # NaN as null, as in the JSON files
    assert captured.err == "a human-readable line\n"


def _parsed(command: str, *argv: str) -> argparse.Namespace:
    needs = {"generate": ["--prompt", "x"], "static-generate": ["--prompt", "x"], "calibrate":
             ["--method", "skvq", "--out", "o"], "export": ["--kv", "a", "--folded", "f"]}
    required_kv = ["--kv", "int4"] if command in ("ppl", "speed", "retrieval") else []
    return build_parser(command).parse_args([command, *needs.get(command, []), *required_kv, *argv])


def _option(command: str, flag: str) -> argparse.Action | None:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return next((a for a in sub._actions if flag in a.option_strings), None)


def test_shared_options_have_one_definition_and_one_default():
    with_model = [c for c in COMMANDS if _option(c, "--model")]
    with_threads = [c for c in COMMANDS if _option(c, "--threads")]
    with_json = [c for c in COMMANDS if _option(c, "--json")]
    assert with_model == ["generate", "ppl", "retrieval", "speed", "bench", "frontier", "static-generate", "calibrate",
                          "export"]
    assert with_threads == ["generate", "ppl", "retrieval", "speed", "bench", "frontier", "static-generate",
                            "calibrate"]
    assert with_json == ["ppl", "retrieval", "speed", "env"]
    for c in with_model:
        assert _parsed(c).model is None
    for c in with_threads:
        action = _option(c, "--threads")
        assert _parsed(c).threads == _options.DEFAULT_THREADS == 2 and action.type is _options.positive_int
        assert action.help == "torch CPU threads, fixed for the whole run (default 2)"
    for c in with_json:
        assert _parsed(c).json is None and _option(c, "--json").type is _options.json_destination
    for c in ("ppl", "retrieval", "speed"):
        assert _option(c, "--kv").help == _options.KV_HELP and _option(c, "--kv").required
    assert _parsed("generate").kv == "kivi-4"
