"""`kvsqueeze` command line: a thin dispatcher.

Each sub-command lives in ``kvsqueeze.commands.<module>`` with ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so ``kvsqueeze --help`` stays fast.

Bad input ends in one line on stderr and exit code 2, never a traceback: a
:class:`~kvsqueeze.errors.KvsqueezeError` (or any other ``ValueError``) raised by a command, and argparse's own
errors.  Other exceptions are bugs and keep their traceback.  With ``--json -`` the command's JSON document is the
only thing written to stdout: everything else it prints goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import KvsqueezeError

# command name -> (module under kvsqueeze.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "generate text with a quantized KV cache and report its size"),
    "ppl": ("ppl", "perplexity of a KV-cache preset on a corpus"),
    "retrieval": ("retrieval", "passkey retrieval accuracy over context lengths and depths"),
    "speed": ("speed", "prefill time, decode ms/token and memory of a preset"),
    "bench": ("bench", "the main job: quality, retrieval, speed and memory of every preset and peer"),
    "frontier": ("frontier", "perplexity against bits: per budget, the best kvsqueeze cache and the best peer"),
    "static-generate": ("static_generate", "greedy generation on ONNX Runtime through the static-shape KV manager"),
    "presets": ("presets", "list the named presets and their bits per element"),
    "env": ("env", "versions, CPU and GPU, which kernel path runs, corpus and model cache (--json)"),
    "calibrate": ("calibrate", "calibrate SKVQ / KVQuant-style / invertible-transform quantization and write an "
                               "artifact for --kv"),
    "export": ("export", "fold an artifact's transforms into the model: a plain transformers checkpoint"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2, as argparse's own), like every other kvsqueeze error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All sub-commands are listed; only ``command``'s module is imported to add its arguments."""
    parser = _Parser(prog="kvsqueeze", description="Small and fast quantized KV caches.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == command:
            _load(module).add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(f"kvsqueeze.commands.{module}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in COMMANDS), None)
    try:
        return _main(argv, command)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT; outputs are staged, none is partial
        print(f"kvsqueeze{' ' + command if command else ''}: interrupted; nothing partial was written",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvsqueeze presets | head`: the reader left; no traceback, no second error at exit
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command whose reader left


def _main(argv: list[str], command: str | None) -> int:
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    from .atomic_dir import disk_error
    from .commands._options import json_output

    try:
        with json_output(args):  # --json -: the JSON document alone on stdout, the rest on stderr
            return int(_load(args._module).run(args) or 0)
    except (KvsqueezeError, ValueError) as exc:  # bad input: one clear line, exit code 2
        print(f"kvsqueeze {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk or read-only target the writer did not name itself: still one line
        err = disk_error(exc, exc.filename)
        if err is None:
            raise
        print(f"kvsqueeze {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
