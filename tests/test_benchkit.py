"""kvsqueeze.eval.benchkit, what the benchmark scripts share: options, interleaved timing, machine block, JSON."""

from __future__ import annotations

import argparse
import json

from kvsqueeze.eval import benchkit


def test_common_args_defaults_and_values():
    p = argparse.ArgumentParser()
    benchkit.add_common_args(p, threads=2)
    args = p.parse_args([])
    assert (args.model, args.threads, args.json) == (None, 2, None)
    args = p.parse_args(["--model", "m.gguf", "--threads", "1", "--json", "out.json"])
    assert (args.model, args.threads, args.json) == ("m.gguf", 1, "out.json")


def test_interleaved_medians_round_robin_and_median():
    calls: list[str] = []
    ticks = iter(range(1000))

    def clock() -> float:
        return float(next(ticks))

    def fn(name: str, cost: int):
        def run():
            calls.append(name)
            for _ in range(cost - 1):  # each call advances the fake clock by `cost`
                next(ticks)
        return run

    med = benchkit.interleaved_medians({"a": fn("a", 1), "b": fn("b", 3)}, repeats=3, warmup=1, clock=clock)
    assert len(calls) == 8 and calls[:2] == ["a", "b"]  # one warm-up round, then call i of each before call i+1 of any
    rounds = [calls[i:i + 2] for i in range(2, 8, 2)]
    assert all(sorted(r) == ["a", "b"] for r in rounds)
    assert med == {"a": 1.0, "b": 3.0}


def test_interleaved_medians_vary_the_order():
    calls: list[str] = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abcd"}
    benchkit.interleaved_medians(fns, repeats=12, warmup=0)
    rounds = {tuple(calls[i:i + 4]) for i in range(0, 48, 4)}
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len({r[0] for r in rounds}) > 1  # not always the same function first


def test_machine_block_and_json_round_trip(tmp_path):
    block = benchkit.machine_block(threads=1)
    assert block["threads"] == 1 and isinstance(block["isa_flags"], list) and block["cpu"]
    assert set(block["isa_flags"]) <= set(benchkit.ISA_FLAGS)
    path = benchkit.write_json(tmp_path / "sub" / "r.json", {"machine": block, "x": float("nan")})
    doc = json.loads(path.read_text())
    assert doc["x"] is None and doc["machine"]["threads"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind
    assert "thread(s)" in benchkit.machine_line(1)
