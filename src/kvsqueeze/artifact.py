"""Calibration artifacts: a directory with ``kvsqueeze_artifact.json`` (method, bits, groups, clip ratios,
calibration provenance, model layout) and ``tensors.safetensors`` (permutations, clip ratios, pre-RoPE ranges,
codebooks, the RoPE table).  Written to a temporary directory and renamed into place, so a failure never
leaves a half-written artifact; loaded with full validation (:class:`~kvsqueeze.errors.ArtifactError`, one line,
for anything missing, corrupt or inconsistent).  The JSON file carries SHA-256 checksums of the tensors file and
of its own content (``checksums``): a truncated or altered file is refused instead of loading as a different
artifact.  Artifacts written before the checksums existed load without that check.

``QuantizedCache(config, "path/to/artifact")`` and every ``--kv`` option accept the directory, or the folder
holding it when it is the only one there (:func:`kvsqueeze.resolve_kv`, which uses :func:`artifacts_in`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .atomic_dir import staged_directory
from .errors import ArtifactError, KvsqueezeError
from .quant.extras import GroupExtras, PreRopeExtras, TransformExtras
from .spec import CacheSpec, QuantSpec

FORMAT = "kvsqueeze-calibration"
VERSION = 1
SPEC_FILE = "kvsqueeze_artifact.json"
TENSORS_FILE = "tensors.safetensors"
SIDE_KINDS = ("none", "plain", "group", "prerope")
_QUANT_FIELDS = tuple(f.name for f in dataclasses.fields(QuantSpec) if f.name != "extras")


@dataclass
class Side:
    """How one of keys/values of one layer is stored: a QuantSpec plus calibrated tensors.

    kind "none" (full precision), "plain" (a QuantSpec, no tensors), "group" (SKVQ: ``perm`` [H, D] and/or
    ``clip`` [H, D/group]), "prerope" (KVQuant-style keys: ``lo``, ``hi`` [H, D], optional ``codebook``).
    Any kind but "prerope" may also carry an invertible transform applied before it: ``transform`` (A) and
    ``transform_inv`` (A^-1) [H, D, D], with ``settings["transform"]["family"]`` ("rope-commuting" or "general").
    """

    kind: str
    quant: QuantSpec
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        q = {k: getattr(self.quant, k) for k in _QUANT_FIELDS}
        return {"kind": self.kind, "quant": q, "settings": self.settings, "tensors": sorted(self.tensors)}


@dataclass
class Artifact:
    method: str
    name: str
    model: dict[str, Any]  # name, num_layers, num_kv_heads, head_dim, rope_theta
    window: int
    sinks: int
    calibration: dict[str, Any]
    settings: dict[str, Any]
    layers: list[dict[str, Side]]  # per layer {"key": Side, "value": Side}
    # {"inv_freq": Tensor, "scaling": float} of the first layer, and "layers": [(inv_freq, scaling)] per layer
    # when the layers' tables differ (per-layer-type RoPE); an empty inv_freq for a model without RoPE
    rope: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    # -------------------------------------------------------------------- cache spec
    def _quant(self, side: Side, layer: int = 0) -> QuantSpec:
        q = self._inner_quant(side, layer)
        if "transform" not in side.tensors:
            return q
        if side.kind == "prerope":
            raise ValueError("a transform cannot be combined with pre-RoPE keys")
        info = side.settings.get("transform") or {}
        ex = TransformExtras(side.tensors["transform"], side.tensors["transform_inv"], info.get("family") or
                             "general", inner=q.extras, name=info.get("name") or "transform")
        return dataclasses.replace(q, extras=ex)

    def layer_rope(self, i: int) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling) of layer ``i``."""
        if "layers" in self.rope:
            return self.rope["layers"][i]
        return self.rope["inv_freq"], self.rope["scaling"]

    def _inner_quant(self, side: Side, layer: int = 0) -> QuantSpec:
        t = side.tensors
        if side.kind in ("none", "plain"):
            return side.quant
        if side.kind == "group":
            return dataclasses.replace(side.quant, extras=GroupExtras(t.get("perm"), t.get("clip")))
        s = side.settings
        inv_freq, scaling = self.layer_rope(layer)
        ex = PreRopeExtras(t["lo"], t["hi"], inv_freq, scaling, t.get("codebook"),
                           outliers=s["outliers"], bits=s["bits"], param_dtype=side.quant.param_dtype)
        return dataclasses.replace(side.quant, extras=ex)

    def cache_spec(self) -> CacheSpec:
        """The CacheSpec a cache built from this artifact uses: one (key, value) QuantSpec per layer; the window,
        sinks and flush size come from the artifact's top level."""
        overrides = tuple((self._quant(lay["key"], i), self._quant(lay["value"], i))
                          for i, lay in enumerate(self.layers))
        first = next((o for o in overrides if o[0].quantized or o[1].quantized), overrides[0])
        types = self.model.get("layer_types") or []
        # sliding layers calibrated within their window are quantized with their own sides
        sliding = any(t == "sliding_attention" and (o[0].quantized or o[1].quantized)
                      for t, o in zip(types, overrides))
        return CacheSpec(key=first[0], value=first[1], window=self.window, sinks=self.sinks, name=self.name,
                         meta={"artifact": self.path, "method": self.method, "model_layout": self.layout()},
                         layer_overrides=overrides, quantize_sliding=sliding)

    def layout(self) -> dict[str, int]:
        return {k: int(self.model[k]) for k in ("num_layers", "num_kv_heads", "head_dim")}

    def with_values_folded(self) -> Artifact:
        """A copy whose value permutations are dropped: use it with a model folded by
        :func:`kvsqueeze.calibrate.fold.fold_value_permutation`."""
        layers = []
        for lay in self.layers:
            v = lay["value"]
            t = {k: x for k, x in v.tensors.items() if k != "perm"}  # clip ratios follow the stored groups
            layers.append({"key": lay["key"], "value": dataclasses.replace(v, tensors=t,
                                                                           settings={**v.settings, "folded": True})})
        return dataclasses.replace(self, layers=layers, name=self.name + "-vfolded", path=None,
                                   settings={**self.settings, "values_folded": True})

    def transforms(self, side: str) -> list[tuple[torch.Tensor, torch.Tensor, str] | None]:
        """Per layer (A, A^-1, family) of ``side`` ("key" or "value"), or None where it has no transform."""
        out = []
        for lay in self.layers:
            s = lay[side]
            t = s.tensors
            out.append((t["transform"], t["transform_inv"], (s.settings.get("transform") or {}).get("family") or
                        "general") if "transform" in t else None)
        return out

    def with_transforms_folded(self) -> Artifact:
        """A copy without its transforms, for the model they were folded into
        (:func:`kvsqueeze.calibrate.fold.fold_transforms`).  ValueError if a key transform is not RoPE-commuting
        (it cannot be folded before RoPE and must stay online)."""
        online = [i for i, t in enumerate(self.transforms("key")) if t is not None and t[2] != "rope-commuting"]
        if online:
            raise ValueError(f"the key transforms of layers {online[:5]}{'...' if len(online) > 5 else ''} are not "
                             "RoPE-commuting (online transforms): they cannot be folded into a checkpoint; "
                             "calibrate with --transform learned-folded or smooth to export")
        layers = []
        for lay in self.layers:
            new = {}
            for name, s in lay.items():
                t = {k: x for k, x in s.tensors.items() if k not in ("transform", "transform_inv")}
                new[name] = dataclasses.replace(s, tensors=t, settings={**s.settings, "folded": "transform" in
                                                                        s.tensors})
            layers.append(new)
        return dataclasses.replace(self, layers=layers, name=self.name + "-folded", path=None,
                                   settings={**self.settings, "transforms_folded": True})

    # -------------------------------------------------------------------- files
    def save(self, parent: str | Path, overwrite: bool = False) -> Path:
        """Write ``parent/<name>/`` atomically (temporary directory, then rename); returns the directory."""
        dest = Path(parent).expanduser() / self.name
        if dest.exists() and not overwrite:
            raise ValueError(f"{dest} already exists; remove it or pass --overwrite")
        return self.save_to(dest)

    def save_to(self, dest: str | Path) -> Path:
        """Write the artifact as the directory ``dest`` (replacing it), atomically; returns ``dest``."""
        from safetensors.torch import save_file

        dest = Path(dest).expanduser()
        with staged_directory(dest) as tmp:
            tensors = {"rope.inv_freq": self.rope["inv_freq"].float().contiguous()}
            rope_doc: dict[str, Any] = {"scaling": self.rope["scaling"]}
            if "layers" in self.rope:  # per-layer tables (written only when the layers' tables differ)
                rope_doc["layers_scaling"] = [float(sc) for _, sc in self.rope["layers"]]
                for i, (inv_freq, _) in enumerate(self.rope["layers"]):
                    tensors[f"rope.layers.{i}.inv_freq"] = inv_freq.float().contiguous().clone()
            for i, lay in enumerate(self.layers):
                for side_name, side in lay.items():
                    for tname, t in side.tensors.items():
                        tensors[f"layers.{i}.{side_name}.{tname}"] = t.contiguous().clone()  # no shared storage
            save_file(tensors, str(tmp / TENSORS_FILE))
            doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "name": self.name, "method": self.method,
                   "model": self.model, "cache": {"window": self.window, "sinks": self.sinks},
                   "rope": rope_doc, "calibration": self.calibration,
                   "settings": self.settings,
                   "layers": [{k: s.to_json() for k, s in lay.items()} for lay in self.layers],
                   "tensor_shapes": {k: list(v.shape) for k, v in tensors.items()}}
            doc = json.loads(json.dumps(doc, default=_json_default))
            (tmp / SPEC_FILE).write_text(json.dumps(seal_document(doc, tmp / TENSORS_FILE), indent=1) + "\n")
        self.path = str(dest)
        return dest


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _document_digest(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "checksums"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal_document(doc: dict[str, Any], tensors_path: str | Path) -> dict[str, Any]:
    """``doc`` with its ``checksums`` entry: the SHA-256 of the tensors file and of the document itself."""
    doc = {k: v for k, v in doc.items() if k != "checksums"}
    doc["checksums"] = {TENSORS_FILE: _sha256_file(Path(tensors_path)), SPEC_FILE: _document_digest(doc)}
    return doc


def _check_sums(p: Path, doc: dict[str, Any], tpath: Path) -> None:
    sums = doc.get("checksums")
    if sums is None:  # written before checksums existed
        return
    if not isinstance(sums, dict) or not all(isinstance(sums.get(k), str) for k in (SPEC_FILE, TENSORS_FILE)):
        raise ArtifactError(f"corrupt artifact {p}: its checksums entry is malformed")
    if sums[SPEC_FILE] != _document_digest(doc):
        raise ArtifactError(f"corrupt artifact {p}: {SPEC_FILE} does not match its checksum (altered or damaged; "
                            "calibrate again)")
    if sums[TENSORS_FILE] != _sha256_file(tpath):
        raise ArtifactError(f"corrupt artifact {p}: {TENSORS_FILE} does not match the checksum recorded in "
                            f"{SPEC_FILE} (truncated, altered or from another artifact; calibrate again)")


def _check_name(p: Path, name: Any) -> str:
    """An artifact's name becomes a folder name when it is saved again: one plain path component."""
    if (not isinstance(name, str) or not name or name.startswith(".") or len(name) > 255
            or any(c in name for c in "/\\\0") or not name.isprintable()):
        raise ArtifactError(f"corrupt artifact {p}: its name {name!r} is not a plain folder name")
    return name


def _json_default(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def user_path(x: str | Path) -> Path:
    """``x`` with a leading ``~`` expanded where it names a home directory; ``~name`` for a user that does not
    exist stays as written (a relative path that is then not found) instead of raising RuntimeError."""
    try:
        return Path(x).expanduser()
    except RuntimeError:
        return Path(x)


def is_artifact_dir(x: Any) -> bool:
    """Whether ``x`` names an existing directory (then it must be an artifact; loading says what is wrong)."""
    if not isinstance(x, (str, Path)) or (isinstance(x, str) and (not x or x.lstrip().startswith("{"))):
        return False
    try:
        return user_path(x).is_dir()
    except OSError:
        return False


def holds_artifact_files(folder: str | Path) -> bool:
    """Whether ``folder`` itself is meant as an artifact: it holds the spec file or the tensors file (loading
    then says what else is missing)."""
    p = user_path(folder)
    return (p / SPEC_FILE).is_file() or (p / TENSORS_FILE).is_file()


def artifacts_in(folder: str | Path) -> list[Path]:
    """The artifact directories directly inside ``folder`` (``kvsqueeze calibrate --out FOLDER`` writes
    ``FOLDER/<name of settings>/``), sorted by name.  Hidden folders (a write in progress, an old copy being
    replaced) are not artifacts."""
    p = user_path(folder)
    try:
        children = sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith("."))
    except OSError:
        return []
    return [c for c in children if holds_artifact_files(c)]


def load_artifact(path: str | Path) -> Artifact:
    """Read and validate an artifact directory; :class:`~kvsqueeze.errors.ArtifactError` (a ``ValueError``), in
    one line naming the problem, for anything missing, corrupt or inconsistent."""
    p = user_path(path)
    try:
        return _load(p)
    except KvsqueezeError as exc:
        raise ArtifactError(" ".join(str(exc).split())) from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError, RuntimeError,
            OSError) as exc:
        msg = " ".join(str(exc).split())[:300]
        raise ArtifactError(f"corrupt artifact {p}: {SPEC_FILE} or {TENSORS_FILE} lacks or mistypes an entry "
                            f"({type(exc).__name__}: {msg})") from None


def _load(p: Path) -> Artifact:
    if not p.is_dir():
        raise ArtifactError(f"calibration artifact not found: {p} is not a directory")
    spec_path, tpath = p / SPEC_FILE, p / TENSORS_FILE
    for f in (spec_path, tpath):
        if not f.is_file():
            raise ArtifactError(f"{p} is not a complete kvsqueeze calibration artifact: {f.name} is missing "
                                f"(expected {SPEC_FILE} and {TENSORS_FILE}; write one with kvsqueeze calibrate)")
    try:
        doc = json.loads(spec_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ArtifactError(f"corrupt artifact {p}: {SPEC_FILE} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ArtifactError(f"{spec_path} is not a kvsqueeze calibration artifact (format "
                            f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r})")
    if doc.get("version") != VERSION:
        raise ArtifactError(f"artifact {p} has version {doc.get('version')!r}; this kvsqueeze reads version {VERSION}")
    _check_sums(p, doc, tpath)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        tensors = load_file(str(tpath))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise ArtifactError(f"corrupt artifact {p}: {TENSORS_FILE} cannot be read ({exc})") from None
    shapes = doc.get("tensor_shapes")
    if shapes is not None:
        if not isinstance(shapes, dict) or set(shapes) != set(tensors):
            raise ArtifactError(f"corrupt artifact {p}: the tensors in {TENSORS_FILE} are not those {SPEC_FILE} "
                                "lists")
        for k, t in tensors.items():
            if shapes[k] != list(t.shape):
                raise ArtifactError(f"corrupt artifact {p}: tensor {k} has shape {list(t.shape)}, {SPEC_FILE} "
                                    f"says {shapes[k]}")
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ArtifactError(f"corrupt artifact {p}: tensor {k} holds non-finite values")
    model = doc["model"]
    layout = {k: _count(model[k], f"model.{k}", 1 << 20) for k in ("num_layers", "num_kv_heads", "head_dim")}
    layers = []
    if not isinstance(doc["layers"], list):
        raise ArtifactError(f"corrupt artifact {p}: layers is not a list")
    if len(doc["layers"]) != layout["num_layers"]:
        raise ArtifactError(f"{len(doc['layers'])} layer entries for a model with {layout['num_layers']} layers")
    for i, lay in enumerate(doc["layers"]):
        sides = {}
        for side_name in ("key", "value"):
            js = lay[side_name]
            if js["kind"] not in SIDE_KINDS:
                raise ArtifactError(f"layer {i} {side_name}: unknown kind {js['kind']!r}; allowed: "
                                    f"{', '.join(SIDE_KINDS)}")
            t = {}
            for tname in js.get("tensors", []):
                key = f"layers.{i}.{side_name}.{tname}"
                if key not in tensors:
                    raise ArtifactError(f"tensor {key!r} is missing from {TENSORS_FILE}")
                t[tname] = tensors[key]
            settings = js.get("settings", {})
            if not isinstance(settings, dict) or not isinstance(js["quant"], dict):
                raise ArtifactError(f"layer {i} {side_name}: settings and quant must be objects")
            _check_side_numbers(js["quant"], settings, layout["head_dim"], f"layer {i} {side_name}")
            sides[side_name] = Side(js["kind"], QuantSpec(**js["quant"]), t, settings)
            sides[side_name].quant.check_head_dim(layout["head_dim"])
        layers.append(sides)
    if "rope.inv_freq" not in tensors:
        raise ArtifactError(f"tensor rope.inv_freq is missing from {TENSORS_FILE}")
    rope = {"inv_freq": tensors["rope.inv_freq"], "scaling": _finite(doc["rope"]["scaling"], "rope.scaling")}
    if rope["inv_freq"].dim() != 1 or rope["inv_freq"].numel() > layout["head_dim"] // 2:
        raise ArtifactError(f"tensor rope.inv_freq has shape {list(rope['inv_freq'].shape)}; head_dim is "
                            f"{layout['head_dim']}")
    if "layers_scaling" in doc["rope"]:
        rope["layers"] = [(tensors[f"rope.layers.{i}.inv_freq"], _finite(sc, "rope.layers_scaling"))
                          for i, sc in enumerate(doc["rope"]["layers_scaling"])]
        if len(rope["layers"]) != layout["num_layers"]:
            raise ArtifactError(f"{len(rope['layers'])} RoPE tables for {layout['num_layers']} layers")
    for k in ("calibration", "settings"):
        if not isinstance(doc.get(k, {}), dict):
            raise ArtifactError(f"corrupt artifact {p}: {k} must be an object")
    if not isinstance(doc["method"], str):
        raise ArtifactError(f"corrupt artifact {p}: method must be a string")
    art = Artifact(method=doc["method"], name=_check_name(p, doc["name"]), model=model,
                   window=_count(doc["cache"]["window"], "cache.window"),
                   sinks=_count(doc["cache"]["sinks"], "cache.sinks"), calibration=doc.get("calibration", {}),
                   settings=doc.get("settings", {}), layers=layers, rope=rope, path=str(p))
    spec = art.cache_spec()  # builds every codec parameter object: shape errors surface here
    check_overrides(spec, None)
    return art


def _count(x: Any, what: str, limit: int = 1 << 40) -> int:
    """A non-negative integer field (JSON ints only: no bools, floats or strings) no larger than ``limit``."""
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= limit:
        raise ArtifactError(f"{what} must be an integer in [0, {limit}], got {x!r}"[:200])
    return x


def _check_side_numbers(quant: dict, settings: dict, head_dim: int, what: str) -> None:
    """Widths and counts a codec would compute with (2 ** bits levels, outlier counts): bounded before use, so a
    hostile file cannot ask for astronomically large integers or tables (every format kvsqueeze writes uses 1-8
    bits, fractional ones for rotated codebooks)."""
    bits = quant.get("bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int | float) or not 1 <= bits <= 8:
        raise ArtifactError(f"{what}: quant bits must be a number in [1, 8], got {bits!r}"[:200])
    if "bits" in settings and settings["bits"] is not None:
        _count(settings["bits"], f"{what} settings.bits", 8)
    if "outliers" in settings:
        _count(settings["outliers"], f"{what} settings.outliers", head_dim)


def _finite(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ArtifactError(f"{what} must be a finite number, got {x!r}"[:200])
    return float(x)


def check_overrides(spec: CacheSpec, layout: Any | None) -> None:
    """Check a calibrated spec against a model's KV layout (``kv_layout(config)``; None checks only internal
    consistency): layer count, KV heads and head_dim must match the model the artifact was calibrated on."""
    ov = spec.layer_overrides
    if ov is None:
        return
    want = spec.meta.get("model_layout") or {}
    heads, head_dim = want.get("num_kv_heads"), want.get("head_dim")
    if layout is not None:
        got = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim}
        if len(ov) != layout.num_layers or any(want.get(k) not in (None, v) for k, v in got.items()):
            raise ValueError(f"calibration artifact {spec.name!r} was made for a model with {want} "
                             f"(layers, KV heads, head_dim); this model has {got}: calibrate it for this model")
        heads, head_dim = layout.num_kv_heads, layout.head_dim
    for i, (k, v) in enumerate(ov):
        for side, q in (("key", k), ("value", v)):
            ex = q.extras
            try:
                if isinstance(ex, TransformExtras):
                    ex.check(heads, head_dim)
                    ex = ex.inner
                if isinstance(ex, GroupExtras):
                    g = head_dim if q.group is None else q.group
                    ex.check(heads, head_dim, head_dim // g)
                elif isinstance(ex, PreRopeExtras):
                    ex.check(heads, head_dim)
            except ValueError as exc:
                raise ValueError(f"calibration artifact {spec.name!r}, layer {i} {side}: {exc}") from None
