"""Hostile and damaged calibration artifacts: every file truncated at many points, bytes altered, files missing,
JSON fields given wrong types, huge shapes and ``../`` names.  Loading each variant either gives a one-line
:class:`~kvsqueeze.errors.KvsqueezeError`, or (for changes the format allows, such as whitespace or a changed
free-text field) an artifact whose cache works; never a traceback, never a silently different artifact."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from kvsqueeze.adapter import QuantizedCache, cache_kwargs
from kvsqueeze.artifact import SPEC_FILE, TENSORS_FILE, load_artifact, seal_document
from kvsqueeze.calibrate import CalibrationSettings, calibrate
from kvsqueeze.calibrate.collect import CalibrationData
from kvsqueeze.errors import KvsqueezeError
from kvsqueeze.resolve import resolve_kv

from ._counts import record


@pytest.fixture(scope="module")
def artifact_dir(tiny_llama, tmp_path_factory):
    ids = torch.randint(2, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    data = CalibrationData(ids, {"source": "random ids (test)"})
    settings = CalibrationSettings(method="hybrid", nuq=True, window=16, sinks=2, clip="group")
    art = calibrate(tiny_llama, data, settings, "tiny", progress=False)
    return art.save(tmp_path_factory.mktemp("art"))


def _fingerprint(art) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([art.method, art.name, art.model, art.window, art.sinks], sort_keys=True).encode())
    for i, lay in enumerate(art.layers):
        for side in ("key", "value"):
            s = lay[side]
            h.update(json.dumps([i, side, s.kind, repr(s.quant), s.settings], sort_keys=True, default=str).encode())
            for name in sorted(s.tensors):
                h.update(name.encode() + s.tensors[name].numpy().tobytes())
    h.update(art.rope["inv_freq"].numpy().tobytes() + repr(art.rope["scaling"]).encode())
    return h.hexdigest()


def _outcome(path: Path, original: str, model, *, may_differ: bool) -> str:
    """'refused' or 'same' or 'works'; fails the test for a traceback or a silent difference."""
    try:
        art = load_artifact(path)
        resolve_kv(str(path))
    except KvsqueezeError as exc:
        assert str(exc) and "\n" not in str(exc), f"{path.name}: not one line: {exc!r}"
        return "refused"
    if _fingerprint(art) == original:
        return "same"
    assert may_differ, f"{path.name}: loaded silently as a different artifact"
    try:  # a change the format allows: the cache it describes must work, or be refused in one line
        cache = QuantizedCache(model.config, str(path))
        with torch.no_grad():
            model(torch.arange(2, 42).view(1, -1), **cache_kwargs(model, cache), use_cache=True)
    except KvsqueezeError as exc:
        assert "\n" not in str(exc)
        return "refused"
    return "works"


def _variants_dir(tmp_path: Path, artifact_dir: Path, tag: str) -> Path:
    d = tmp_path / tag
    shutil.copytree(artifact_dir, d)
    return d


def test_truncated_and_missing_files(artifact_dir, tiny_llama, tmp_path):
    original = _fingerprint(load_artifact(artifact_dir))
    n = 0
    for fname in (SPEC_FILE, TENSORS_FILE):
        data = (artifact_dir / fname).read_bytes()
        size = len(data)
        points = sorted({0, 1, 7, 8, 9, 16, 100, size // 8, size // 4, size // 2, 3 * size // 4, size - 100,
                         size - 8, size - 2, size - 1} - {size})
        for cut in points:
            d = _variants_dir(tmp_path, artifact_dir, f"trunc-{fname}-{cut}")
            (d / fname).write_bytes(data[:cut])
            res = _outcome(d, original, tiny_llama, may_differ=False)
            # a JSON file cut just after its closing brace (only the newline lost) is still the same artifact
            assert res == "refused" or (fname == SPEC_FILE and cut == size - 1), (fname, cut, res)
            n += 1
        d = _variants_dir(tmp_path, artifact_dir, f"missing-{fname}")
        (d / fname).unlink()
        assert _outcome(d, original, tiny_llama, may_differ=False) == "refused"
        d = _variants_dir(tmp_path, artifact_dir, f"dir-{fname}")
        (d / fname).unlink()
        (d / fname).mkdir()
        assert _outcome(d, original, tiny_llama, may_differ=False) == "refused"
        n += 2
    record("corrupted artifacts", "truncated or missing", n)


@pytest.mark.parametrize("fname", [SPEC_FILE, TENSORS_FILE])
def test_altered_bytes(artifact_dir, tiny_llama, tmp_path, fname):
    original = _fingerprint(load_artifact(artifact_dir))
    data = (artifact_dir / fname).read_bytes()
    positions = sorted({int(i * (len(data) - 1) / 79) for i in range(80)} | set(range(0, 12)))
    outcomes = {"refused": 0, "same": 0}
    for pos in positions:
        for flip in (0xFF, 0x01):
            d = tmp_path / f"flip-{pos}-{flip}"
            shutil.copytree(artifact_dir, d)
            b = bytearray(data)
            b[pos] ^= flip
            (d / fname).write_bytes(bytes(b))
            outcomes[_outcome(d, original, tiny_llama, may_differ=False)] += 1
            shutil.rmtree(d)
    record("corrupted artifacts", f"altered bytes ({fname})", sum(outcomes.values()))
    assert outcomes["refused"] > 0


def _leaves(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(doc, list) and doc:
        for i, v in enumerate(doc):
            yield from _leaves(v, (*prefix, i))
    if prefix:
        yield prefix


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


WRONG = [None, "x", -1, 10**15, 1e308, [], {"a": 1}, True]


def test_json_fields_with_wrong_types(artifact_dir, tiny_llama, tmp_path):
    """Every field of the JSON file replaced by values of wrong types or sizes; the file is re-sealed (its
    checksum recomputed) so that the loader's own validation is what is tested, as for a hand-written file."""
    original = _fingerprint(load_artifact(artifact_dir))
    doc = json.loads((artifact_dir / SPEC_FILE).read_text())
    paths = [p for p in _leaves(doc) if p[0] != "checksums"]
    counts: dict[str, int] = {}
    for path in paths:
        for value in WRONG:
            bad = copy.deepcopy(doc)
            _set(bad, path, value)
            d = tmp_path / "field"
            shutil.copytree(artifact_dir, d)
            (d / SPEC_FILE).write_text(json.dumps(seal_document(bad, d / TENSORS_FILE)))
            res = _outcome(d, original, tiny_llama, may_differ=True)
            counts[res] = counts.get(res, 0) + 1
            shutil.rmtree(d)
    record("corrupted artifacts", "JSON field mutated", sum(counts.values()))
    assert counts.get("refused", 0) > 0


HOSTILE = {
    "name ../": ("name", "../../escaped"),
    "name /abs": ("name", "/tmp/abs"),
    "name with NUL": ("name", "a\x00b"),
    "name hidden": ("name", ".hidden"),
    "name empty": ("name", ""),
    "tensor name ../": ("layers", 0, "key", "tensors", 0, "../../etc/passwd"),
    "huge head_dim": ("model", "head_dim", 2**40),
    "huge layer count": ("model", "num_layers", 2**31),
    "huge window": ("cache", "window", 10**60),
    "negative sinks": ("cache", "sinks", -5),
    "huge tensor shape": ("tensor_shapes", "rope.inv_freq", [2**40, 2**40]),
    "huge bits": ("layers", 0, "value", "quant", "bits", 10**9),
    "huge group": ("layers", 0, "value", "quant", "group", 2**62),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_fields_are_refused(artifact_dir, tiny_llama, tmp_path, case):
    *path, value = HOSTILE[case]
    doc = json.loads((artifact_dir / SPEC_FILE).read_text())
    _set(doc, path, value)
    d = tmp_path / "hostile"
    shutil.copytree(artifact_dir, d)
    (d / SPEC_FILE).write_text(json.dumps(seal_document(doc, d / TENSORS_FILE)))
    assert _outcome(d, _fingerprint(load_artifact(artifact_dir)), tiny_llama, may_differ=True) == "refused"
    record("corrupted artifacts", "hostile field")


def test_extra_huge_tensor_dims(artifact_dir, tiny_llama, tmp_path):
    """Tensors whose shapes do not fit the model (an extra dimension, a huge one) are refused when loading."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(artifact_dir / TENSORS_FILE))
    n = 0
    for name in sorted(tensors):
        for change in ("extra dim", "doubled", "empty"):
            t = dict(tensors)
            x = t[name]
            t[name] = {"extra dim": x.unsqueeze(0).repeat(2, *([1] * x.dim())), "doubled": torch.cat([x, x]),
                       "empty": x[:0]}[change].contiguous()
            d = tmp_path / "dims"
            shutil.copytree(artifact_dir, d)
            save_file(t, str(d / TENSORS_FILE))
            doc = json.loads((d / SPEC_FILE).read_text())
            (d / SPEC_FILE).write_text(json.dumps(seal_document(doc, d / TENSORS_FILE)))
            assert _outcome(d, "", tiny_llama, may_differ=True) == "refused", (name, change)
            shutil.rmtree(d)
            n += 1
    record("corrupted artifacts", "tensor shape changed", n)
