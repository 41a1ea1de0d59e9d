"""Runs kvsqueeze in child processes for the interruption and full-disk tests.

``python _child.py PLAN.json RESULT.json``: the plan is a list of steps.  The heavy imports happen once here;
each step is a forked child that runs ``kvsqueeze.cli.main(argv)`` (or one of the ``PY_STEPS`` below) in its
own process, optionally under a file-size limit (``fsize``: writes past it fail with EFBIG, SIGXFSZ being
ignored) and optionally stopped by a real signal at a named point: the Nth audit event (``sys.addaudithook``:
``open`` for writing, ``os.rename``, ``shutil.rmtree``) whose path contains a given text.  After each step the
working folder is listed (every entry, hidden ones included, with a SHA-256 of each file) into the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch

import kvsqueeze.calibrate.api  # noqa: F401  (imported once, before the forks)
import kvsqueeze.calibrate.export_vllm  # noqa: F401
import kvsqueeze.commands.ppl  # noqa: F401
import kvsqueeze.eval.ppl  # noqa: F401
from kvsqueeze import cli

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _kill_hook(at: dict) -> None:
    seen = [0]
    sig = getattr(signal, f"SIG{at['signal']}")

    def hook(event: str, args: tuple) -> None:
        if event != at["event"] or not args:
            return
        if event == "open":
            mode, flags = args[1], args[2]
            if not ((mode and any(c in mode for c in "wax+")) or (mode is None and flags & WRITE_FLAGS)):
                return
        target = str(args[1] if event == "os.rename" else args[0])
        if at["match"] not in target:
            return
        seen[0] += 1
        if seen[0] == at.get("nth", 1):
            os.kill(os.getpid(), sig)  # SIGKILL ends here; SIGINT raises KeyboardInterrupt at the next bytecode

    sys.addaudithook(hook)


def _py_model_cache(cache: str) -> int:
    """load_model on a GGUF path whose conversion is a tiny random Llama (the real GGUF conversion takes 40 s
    and 0.5 GB): what is tested is the cache entry's staging and the fallback, not the GGUF parser."""
    import transformers

    from kvsqueeze.models import load_model

    real = transformers.AutoModelForCausalLM.from_pretrained
    real_tok = transformers.AutoTokenizer.from_pretrained
    model_dir = Path(os.environ["KVSQUEEZE_TEST_TINY_MODEL"])

    def model(*a, **k):
        return real(model_dir) if "gguf_file" in k else real(*a, **k)

    def tok(*a, **k):
        return real_tok(model_dir) if "gguf_file" in k else real_tok(*a, **k)

    transformers.AutoModelForCausalLM.from_pretrained = model
    transformers.AutoTokenizer.from_pretrained = tok
    gguf = Path(cache).parent / "tiny.gguf"
    if not gguf.exists():
        gguf.write_bytes(b"not a real GGUF: its conversion is the tiny model above")
    m, _ = load_model(str(gguf), cache_dir=cache, progress=False)
    ids = torch.arange(8)[None]
    print(json.dumps({"logits_sum": float(m(input_ids=ids).logits.double().sum())}))
    return 0


def _py_static_save(path: str) -> int:
    import numpy as np

    from kvsqueeze.engines.static_manager import StaticKVQuant

    h = np.ones((1, 2, 64), np.float32)
    try:
        StaticKVQuant(8, False, "channel", h, 0 * h, 2 * h, 0 * h, {"note": "x" * 200}).save(path)
    except kvsqueeze.errors.KvsqueezeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _py_plot(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvsqueeze.eval.report import _savefig

    fig, ax = plt.subplots()
    ax.plot(range(100), [i * i for i in range(100)])
    try:
        _savefig(fig, path)
    except kvsqueeze.errors.KvsqueezeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


PY_STEPS = {"model_cache": _py_model_cache, "static_save": _py_static_save, "plot": _py_plot}


def _listing(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _child(step: dict, out: str, err: str) -> None:
    try:
        os.chdir(step["cwd"])
        for k, v in step.get("env", {}).items():
            os.environ[k] = v
        for fd, name in ((1, out), (2, err)):
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        torch.set_num_threads(1)
        if step.get("fsize"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (step["fsize"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        if step.get("kill_at"):
            _kill_hook(step["kill_at"])
        if "py" in step:
            rc = PY_STEPS[step["py"]](*step.get("args", []))
        else:
            rc = cli.main(step["argv"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    except BaseException:  # a traceback is a finding: it goes to the step's stderr, exit 99
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(99)


def _warm_up(model_dir: str) -> None:
    """Import what the commands import lazily (transformers' model and tokenizer modules, matplotlib and its font
    cache) once, here, so each forked step pays only for its own work."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    from kvsqueeze.models import load_model

    model, tok = load_model(model_dir, progress=False)
    with torch.no_grad():
        model(**tok(["w1 w2 w3"], return_tensors="pt"))


def main() -> None:
    # Ctrl-C as a terminal user meets it: a test run started in the background (``cmd &`` in a script) inherits
    # SIGINT ignored, and the Ctrl-C steps then ran to completion instead of being interrupted
    signal.signal(signal.SIGINT, signal.default_int_handler)
    plan = json.loads(Path(sys.argv[1]).read_text())
    if os.environ.get("KVSQUEEZE_TEST_TINY_MODEL"):
        _warm_up(os.environ["KVSQUEEZE_TEST_TINY_MODEL"])
    results = []
    for i, step in enumerate(plan):
        out, err = f"{sys.argv[2]}.{i}.out", f"{sys.argv[2]}.{i}.err"
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            _child(step, out, err)
        _, status = os.waitpid(pid, 0)
        results.append({"name": step["name"], "rc": os.waitstatus_to_exitcode(status),
                        "seconds": round(time.perf_counter() - start, 2),
                        "stdout": Path(out).read_text(errors="replace"),
                        "stderr": Path(err).read_text(errors="replace"),
                        "files": _listing(Path(step["cwd"]))})
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    import kvsqueeze.errors

    main()
