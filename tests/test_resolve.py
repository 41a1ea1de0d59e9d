"""kvsqueeze.resolve_kv: the one resolver of cache names, its messages, its peers registry and its layering."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvsqueeze
from kvsqueeze import resolve
from kvsqueeze.artifact import SPEC_FILE, Artifact, Side
from kvsqueeze.errors import (
    ArtifactError,
    CacheSpecError,
    KvsqueezeError,
    MissingDependencyError,
    UnknownCacheError,
    UnsupportedCacheError,
)
from kvsqueeze.resolve import register_peer, resolve_cache_spec, resolve_kv
from kvsqueeze.spec import PRESETS, CacheSpec, QuantSpec

SRC = Path(resolve.__file__).parent


@dataclass(frozen=True)
class FakePeer:
    name: str
    installed: bool = True

    @property
    def available(self) -> bool:
        return self.installed

    @property
    def requires(self):
        return None if self.installed else ("fakelib", "fake-lib")

    @property
    def install_hint(self) -> str:
        return "pip install fake-lib"


@pytest.fixture
def no_peers(monkeypatch):
    """An empty registry for this test (kvsqueeze.eval.peers may have registered transformers' caches)."""
    monkeypatch.setattr(resolve, "_PEERS", {})
    monkeypatch.setattr(resolve, "_FAMILIES", {})


def _artifact(parent: Path, name: str, layers: int = 2, heads: int = 2, head_dim: int = 64) -> Path:
    """A small 'plain' artifact (no calibrated tensors): 4-bit keys per channel, 2-bit values per token."""
    k = QuantSpec(fmt="int", bits=4, axis="channel", group=32)
    v = QuantSpec(fmt="int", bits=2, axis="token", group=32)
    art = Artifact(method="skvq", name=name,
                   model={"name": "tiny", "num_layers": layers, "num_kv_heads": heads, "head_dim": head_dim,
                          "rope_theta": 10000.0},
                   window=32, sinks=2, calibration={"source": "test"}, settings={},
                   layers=[{"key": Side("plain", k), "value": Side("plain", v)} for _ in range(layers)],
                   rope={"inv_freq": torch.ones(head_dim // 2), "scaling": 1.0})
    return art.save(parent)


# ------------------------------------------------------------------------------------------------ names
def test_presets_and_specs_come_back_as_they_are():
    for name, spec in PRESETS.items():
        assert resolve_kv(name) is spec
    custom = CacheSpec(window=7)
    assert resolve_kv(custom) is custom


def test_spec_string_parses_to_the_expected_cache_spec():
    assert resolve_kv("k2c32-v2t32-w128-s4") == CacheSpec(
        key=QuantSpec(fmt="int", bits=2, axis="channel", group=32),
        value=QuantSpec(fmt="int", bits=2, axis="token", group=32), window=128, sinks=4,
        name="k2c32-v2t32-w128-s4")
    assert resolve_kv("k4t-v8t64") == CacheSpec(key=QuantSpec(bits=4), value=QuantSpec(bits=8, group=64),
                                                 name="k4t-v8t64")


def test_json_string_and_dict_give_the_same_spec():
    spec = PRESETS["kivi-2-sink4"]
    assert resolve_kv(json.dumps(spec.to_dict())) == spec
    assert resolve_kv(spec.to_dict()) == spec
    # CacheSpec.from_dict fills a missing side with QuantSpec() (8-bit per token), not full precision
    assert resolve_kv('  {"window": 64, "sinks": 4}') == CacheSpec(QuantSpec(), QuantSpec(), window=64, sinks=4)


def test_bad_json_says_what_is_wrong():
    with pytest.raises(CacheSpecError, match=r"^the JSON cache spec is not valid JSON \(Expecting"):
        resolve_kv("{window: 4}")
    with pytest.raises(CacheSpecError) as err:
        resolve_kv('{"windw": 4}')
    assert "unexpected keyword argument 'windw'" in str(err.value)
    assert str(err.value).endswith("); fields: key, value, window, sinks, quantize_sliding, block_tokens, name; "
                                   "key and value fields: fmt, bits, axis, group, symmetric, clip, param_dtype, "
                                   "fp8_scale")
    with pytest.raises(CacheSpecError, match=r"^the JSON cache spec's 'key' must be an object with fields fmt, "):
        resolve_kv({"key": 4})
    with pytest.raises(CacheSpecError, match=r"^unsupported bits 9; allowed: 1, 2"):
        resolve_kv({"key": {"bits": 9}})


def test_malformed_spec_string_keeps_its_own_message():
    with pytest.raises(CacheSpecError, match=r"^unsupported bits 9; allowed: 1, 2, 3, 4, 5, 6, 7, 8$"):
        resolve_kv("k9t32-v2t32")
    with pytest.raises(CacheSpecError, match=r"^window 48 is not a multiple of the key/value token group 32"):
        resolve_kv("k2c32-v2t32-w48")


def test_unknown_name_is_one_message_naming_everything_allowed(no_peers):
    presets = ", ".join(PRESETS)
    with pytest.raises(UnknownCacheError) as err:
        resolve_kv("kivi-9")
    assert str(err.value) == (
        f"unknown cache 'kivi-9' (not a preset, a peer, a spec string or a directory); allowed: a preset "
        f"({presets}); a peer (none registered (import kvsqueeze.eval.peers for transformers' caches)); a spec "
        f"string like 'k2c32-v2t32-w128-s4' or its JSON form; or a calibration artifact directory (or a folder "
        f"holding exactly one)")
    register_peer(FakePeer("peer-a"))
    register_peer(FakePeer("peer-b"))
    with pytest.raises(UnknownCacheError, match=r"; a peer \(peer-a, peer-b\); a spec string"):
        resolve_kv("")
    with pytest.raises(UnknownCacheError, match=r"^a cache is named by a string, a dict, a path or a CacheSpec, "
                                                r"not int; allowed: a preset"):
        resolve_kv(4)


# ------------------------------------------------------------------------------------------------ peers
def test_registered_peers_resolve_and_a_missing_library_is_one_line(no_peers):
    ok, missing = FakePeer("peer-ok"), FakePeer("peer-missing", installed=False)
    register_peer(ok)
    register_peer(missing)
    assert resolve_kv("peer-ok") is ok and resolve_kv(ok) is ok
    assert list(resolve.registered_peers()) == ["peer-ok", "peer-missing"]
    with pytest.raises(MissingDependencyError) as err:
        resolve_kv("peer-missing")
    assert str(err.value) == ("the peer peer-missing needs the optional library fake-lib, which is not installed: "
                              "pip install fake-lib")
    with pytest.raises(KvsqueezeError, match="a peer cannot be named like the preset 'kivi-2'"):
        register_peer(FakePeer("kivi-2"))
    resolve.unregister_peer("peer-ok")
    with pytest.raises(UnknownCacheError, match="unknown cache 'peer-ok'"):
        resolve_kv("peer-ok")


def test_quantized_cache_refuses_a_peer_before_looking_for_its_library(no_peers):
    register_peer(FakePeer("peer-missing", installed=False))
    with pytest.raises(UnsupportedCacheError) as err:
        resolve_cache_spec("peer-missing", "QuantizedCache")
    assert str(err.value) == (
        "'peer-missing' is a peer (another library's cache, measured by kvsqueeze ppl / speed / retrieval / "
        "bench); QuantizedCache builds kvsqueeze's own caches only: use a preset, a spec string like "
        "'k2c32-v2t32-w128-s4', JSON or a calibration artifact directory")


def test_quantized_cache_uses_the_resolver(tiny_llama):
    from kvsqueeze.eval import peers  # noqa: F401  (registers hf-dynamic)

    with pytest.raises(UnsupportedCacheError, match="^'hf-dynamic' is a peer .*QuantizedCache builds"):
        kvsqueeze.QuantizedCache(tiny_llama.config, "hf-dynamic")
    with pytest.raises(UnknownCacheError, match="^unknown cache 'kivi-9'"):
        kvsqueeze.QuantizedCache(tiny_llama.config, "kivi-9")
    cache = kvsqueeze.QuantizedCache(tiny_llama.config, '{"key": {"fmt": "none"}, "value": {"fmt": "none"}}')
    assert cache.spec == CacheSpec()


# ------------------------------------------------------------------------------------------------ artifacts
def test_artifact_directory_and_the_folder_holding_it(tmp_path):
    path = _artifact(tmp_path / "out", "tiny-a")
    direct = resolve_kv(str(path))
    assert direct.layer_overrides is not None and len(direct.layer_overrides) == 2
    assert direct.meta["artifact"] == str(path) and direct.window == 32 and direct.sinks == 2
    assert direct.layer_overrides[0][0] == QuantSpec(fmt="int", bits=4, axis="channel", group=32)
    (tmp_path / "out" / ".tiny-b.tmp-123").mkdir()  # an unfinished write is not an artifact
    for form in (str(tmp_path / "out"), tmp_path / "out", path):
        spec = resolve_kv(form)
        assert spec.meta["artifact"] == str(path) and spec.layer_overrides == direct.layer_overrides


def test_folder_with_several_artifacts_or_none(tmp_path):
    a, b = _artifact(tmp_path / "out", "tiny-a"), _artifact(tmp_path / "out", "tiny-b")
    with pytest.raises(ArtifactError) as err:
        resolve_kv(str(tmp_path / "out"))
    assert str(err.value) == f"{tmp_path / 'out'} holds 2 calibration artifacts; name one of them: {a}, {b}"
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ArtifactError) as err:
        resolve_kv(str(tmp_path / "empty"))
    assert str(err.value) == (f"{tmp_path / 'empty'} is not a kvsqueeze calibration artifact: neither it nor any "
                              f"folder directly inside it holds {SPEC_FILE} (write one with kvsqueeze calibrate "
                              f"--out {tmp_path / 'empty'})")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ArtifactError, match="file.txt is a file; a calibration artifact is a directory"):
        resolve_kv(str(tmp_path / "file.txt"))


def test_corrupt_artifact_is_an_artifact_error(tmp_path):
    path = _artifact(tmp_path, "tiny-a")
    (path / SPEC_FILE).write_text("{not json")
    with pytest.raises(ArtifactError, match=f"^corrupt artifact {path}: {SPEC_FILE} is not valid JSON"):
        resolve_kv(str(path))
    with pytest.raises(ArtifactError, match=f"^corrupt artifact {path}"):
        resolve_kv(str(tmp_path))  # found as the one artifact inside: its own message


def test_names_win_over_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _artifact(tmp_path / "kivi-2", "tiny-a")
    assert resolve_kv("kivi-2") is PRESETS["kivi-2"]
    assert resolve_kv("./kivi-2").layer_overrides is not None


def test_quantized_cache_accepts_the_folder_calibrate_wrote(tmp_path, tiny_llama):
    _artifact(tmp_path / "out", "tiny-a")
    cache = kvsqueeze.QuantizedCache(tiny_llama.config, str(tmp_path / "out"))
    assert cache.spec.name == "tiny-a" and cache.spec.layer_overrides is not None


# ------------------------------------------------------------------------------------------------ house rules
def test_errors_share_one_base_that_is_a_value_error():
    assert kvsqueeze.KvsqueezeError is KvsqueezeError and issubclass(KvsqueezeError, ValueError)
    for cls in (UnknownCacheError, CacheSpecError, ArtifactError, MissingDependencyError, UnsupportedCacheError):
        assert issubclass(cls, KvsqueezeError)
    assert kvsqueeze.resolve_kv is resolve_kv and "resolve_kv" in kvsqueeze.__all__


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, lazy imports included, as absolute kvsqueeze names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["kvsqueeze", *([] if not base else [base])])
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("kvsqueeze")}


def test_resolver_sits_just_above_the_artifact_format():
    got = _imports(SRC / "resolve.py")
    assert {"kvsqueeze.spec", "kvsqueeze.artifact", "kvsqueeze.errors"} <= got
    allowed = ("kvsqueeze.spec", "kvsqueeze.artifact", "kvsqueeze.errors")
    assert all(m.startswith(allowed) for m in got), sorted(got)
    assert _imports(SRC / "errors.py") == set()


def test_nothing_but_the_resolver_parses_user_cache_names():
    """spec.preset is the pure-spec parser behind resolve_kv; eval, the adapter and the commands never call it."""
    callers = []
    for path in [SRC / "adapter.py", *(SRC / "eval").glob("*.py"), *(SRC / "commands").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                    "preset", "load_artifact", "check_kv"):
                callers.append(f"{path.name}:{node.lineno}")
    assert callers == []


def test_a_peer_family_resolves_names_with_a_parameter(no_peers):
    made = {}

    def make(name: str) -> FakePeer:
        if name == "fam:bad":
            raise UnknownCacheError("unknown fam value 'bad'; allowed: fam:x")
        return made.setdefault(name, FakePeer(name))

    resolve.register_peer_family("fam:", make)
    assert resolve_kv("fam:x") is made["fam:x"]
    assert "a peer (fam:...)" in resolve.allowed_kv()
    with pytest.raises(UnknownCacheError, match=r"^unknown fam value 'bad'; allowed: fam:x$"):
        resolve_kv("fam:bad")
    with pytest.raises(UnsupportedCacheError, match="is a peer"):
        resolve.resolve_cache_spec("fam:x")
    with pytest.raises(KvsqueezeError, match="ends with ':'"):
        resolve.register_peer_family("fam", make)
