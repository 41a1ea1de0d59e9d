"""The one resolver of cache descriptions: what every ``--kv`` option and ``QuantizedCache(config, x)`` accept.

:func:`resolve_kv` turns any of these into a :class:`~kvsqueeze.spec.CacheSpec` (or a registered peer):

* a ``CacheSpec`` (returned as is);
* a preset name (``kvsqueeze presets`` lists them), e.g. ``kivi-2``;
* a spec string, e.g. ``k2c32-v2t32-w128-s4`` (2-bit keys per channel over 32-token groups, 2-bit values per
  token in 32-channel groups, a 128-token window, 4 sinks);
* JSON: a dict, or a string starting with ``{`` (the form of :meth:`CacheSpec.to_dict`);
* a calibration artifact directory (``kvsqueeze calibrate``), or a folder holding exactly one artifact
  directly inside it (``kvsqueeze calibrate --out DIR`` writes ``DIR/<name of settings>/``);
* the name of a peer: another library's cache that an evaluation module registered with :func:`register_peer`
  (``kvsqueeze.eval.peers`` registers transformers' caches when it is imported).

Names win over folders: a folder called like a preset is reached as ``./NAME``.  Every failure is a
:class:`~kvsqueeze.errors.KvsqueezeError` with one message that names what is allowed; nothing is allocated.

This module sits just above the artifact format: it imports only ``spec``, ``artifact`` and ``errors``.  Peers
come to it by registration, never by an import of the modules that define them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Protocol

from .artifact import SPEC_FILE, artifacts_in, holds_artifact_files, load_artifact, user_path
from .errors import (
    ArtifactError,
    CacheSpecError,
    KvsqueezeError,
    MissingDependencyError,
    UnknownCacheError,
    UnsupportedCacheError,
)
from .spec import PRESETS, CacheSpec, QuantSpec, preset

SPEC_STRING_EXAMPLE = "k2c32-v2t32-w128-s4"


class RegisteredPeer(Protocol):
    """What :func:`register_peer` needs of a peer: a name, and whether its optional library is installed."""

    name: str

    @property
    def available(self) -> bool: ...

    @property
    def requires(self) -> tuple[str, str] | None:
        """(module, pip package) of the optional library, or None when nothing optional is needed."""

    @property
    def install_hint(self) -> str: ...


Resolved = CacheSpec | RegisteredPeer
_PEERS: dict[str, RegisteredPeer] = {}
_FAMILIES: dict[str, Any] = {}  # name prefix -> callable(name) -> peer, for peers named by a parameter


# ------------------------------------------------------------------------------------------------ peers
def register_peer(peer: RegisteredPeer) -> None:
    """Make ``peer`` selectable by its name wherever a cache is named (registering the same name again replaces
    the earlier peer).  A peer cannot take a preset's name."""
    name = getattr(peer, "name", None)
    if not isinstance(name, str) or not name:
        raise KvsqueezeError(f"a peer needs a non-empty string name, got {name!r}")
    if name in PRESETS:
        raise KvsqueezeError(f"a peer cannot be named like the preset {name!r}")
    _PEERS[name] = peer


def unregister_peer(name: str) -> None:
    """Forget the peer called ``name`` (no error when there is none)."""
    _PEERS.pop(name, None)


def register_peer_family(prefix: str, make: Any) -> None:
    """Make every name starting with ``prefix`` (e.g. ``vllm:``) resolve to ``make(name)``, a peer, for peers
    whose name carries a parameter; ``make`` raises a KvsqueezeError naming the allowed values otherwise."""
    if not prefix or not prefix.endswith(":"):
        raise KvsqueezeError(f"a peer family's prefix ends with ':', got {prefix!r}")
    _FAMILIES[prefix] = make


def registered_peers() -> dict[str, RegisteredPeer]:
    """The registered peers by name, in registration order (a copy)."""
    return dict(_PEERS)


def is_peer(kv: Any) -> bool:
    """Whether ``kv`` (a :func:`resolve_kv` result) is a peer rather than a kvsqueeze CacheSpec."""
    return not isinstance(kv, CacheSpec)


# ------------------------------------------------------------------------------------------------ resolver
def resolve_kv(x: Any) -> Resolved:
    """The CacheSpec (or registered peer) that ``x`` names; see the module docstring for the accepted forms.

    Raises :class:`~kvsqueeze.errors.UnknownCacheError` naming the presets, the registered peers, the spec-string
    form and artifact directories when ``x`` is none of them, :class:`~kvsqueeze.errors.CacheSpecError` for a
    malformed spec string or JSON, :class:`~kvsqueeze.errors.ArtifactError` for a folder that holds no artifact,
    several, or a corrupt one, and :class:`~kvsqueeze.errors.MissingDependencyError` for a peer whose optional
    library is not installed.
    """
    if isinstance(x, CacheSpec):
        return x
    if isinstance(x, dict):
        return _from_json(x)
    if isinstance(x, os.PathLike):
        return _from_folder(Path(x))
    if not isinstance(x, str):
        peer = _PEERS.get(getattr(x, "name", None))
        if peer is not None and peer == x:
            return _available(peer)
        raise UnknownCacheError(f"a cache is named by a string, a dict, a path or a CacheSpec, not "
                                f"{type(x).__name__}; {allowed_kv()}")
    if x in _PEERS:
        return _available(_PEERS[x])
    family = next((make for prefix, make in _FAMILIES.items() if x.startswith(prefix)), None)
    if family is not None:
        return _available(family(x))
    if x in PRESETS:
        return PRESETS[x]
    if x.lstrip().startswith("{"):
        try:
            doc = json.loads(x)
        except json.JSONDecodeError as exc:
            raise CacheSpecError(f"the JSON cache spec is not valid JSON ({exc})") from None
        return _from_json(doc)
    try:
        return preset(x)  # a spec string
    except ValueError as exc:
        if not str(exc).startswith(f"unknown preset {x!r}"):  # a malformed spec string: its own message
            raise CacheSpecError(str(exc)) from exc
    path = user_path(x) if x else None
    try:
        is_dir, exists = (path.is_dir(), path.exists()) if path is not None else (False, False)
    except OSError:  # a name the file system cannot hold (too long, ...): not a folder of ours either
        is_dir = exists = False
    if is_dir:
        return _from_folder(path)
    if exists:
        raise ArtifactError(f"{x} is a file; a calibration artifact is a directory ({SPEC_FILE} and tensors)")
    raise UnknownCacheError(f"unknown cache {x!r} (not a preset, a peer, a spec string or a directory); "
                            f"{allowed_kv()}")


def resolve_cache_spec(x: Any, user: str = "QuantizedCache") -> CacheSpec:
    """:func:`resolve_kv` for code that builds kvsqueeze's own cache: a peer's name is refused (``user`` says who
    refuses it), before its optional library is even looked for."""
    if isinstance(x, str) and (x in _PEERS or any(x.startswith(p) for p in _FAMILIES)):
        raise UnsupportedCacheError(
            f"{x!r} is a peer (another library's cache, measured by kvsqueeze ppl / speed / retrieval / "
            f"bench); {user} builds kvsqueeze's own caches only: use a preset, a spec string like "
            f"'{SPEC_STRING_EXAMPLE}', JSON or a calibration artifact directory")
    kv = resolve_kv(x)
    if is_peer(kv):  # a peer object registered under another name
        raise UnsupportedCacheError(f"{user} builds kvsqueeze's own caches only, not the peer {kv.name!r}")
    return kv


def allowed_kv() -> str:
    """What a cache may be named by, with today's presets and registered peers."""
    peers = ", ".join([*_PEERS, *(f"{p}..." for p in _FAMILIES)]) or (
        "none registered (import kvsqueeze.eval.peers for transformers' caches)")
    return (f"allowed: a preset ({', '.join(PRESETS)}); a peer ({peers}); a spec string like "
            f"'{SPEC_STRING_EXAMPLE}' or its JSON form; or a calibration artifact directory (or a folder holding "
            f"exactly one)")


def _available(peer: RegisteredPeer) -> RegisteredPeer:
    if not peer.available:
        package = peer.requires[1] if peer.requires else "an optional library"
        raise MissingDependencyError(f"the peer {peer.name} needs the optional library {package}, which is not "
                                     f"installed: {peer.install_hint}")
    return peer


_CACHE_FIELDS = [f.name for f in dataclasses.fields(CacheSpec) if f.name not in ("meta", "layer_overrides")]
_QUANT_FIELDS = [f.name for f in dataclasses.fields(QuantSpec) if f.name != "extras"]


def _from_json(doc: Any) -> CacheSpec:
    if not isinstance(doc, dict):
        raise CacheSpecError(f"a JSON cache spec is an object, not {type(doc).__name__}")
    for side in ("key", "value"):
        if side in doc and not isinstance(doc[side], dict):
            raise CacheSpecError(f"the JSON cache spec's {side!r} must be an object with fields "
                                 f"{', '.join(_QUANT_FIELDS)}")
    try:
        return CacheSpec.from_dict(doc)
    except TypeError as exc:  # an unknown field
        raise CacheSpecError(f"the JSON cache spec is not valid ({exc}); fields: {', '.join(_CACHE_FIELDS)}; "
                             f"key and value fields: {', '.join(_QUANT_FIELDS)}") from None
    except ValueError as exc:
        raise CacheSpecError(str(exc)) from exc


def _from_folder(path: Path) -> CacheSpec:
    """The artifact at ``path``, or the one artifact directly inside it."""
    path = user_path(path)
    if not path.is_dir():
        raise ArtifactError(f"calibration artifact not found: {path} is not a directory")
    if holds_artifact_files(path):
        target = path
    else:
        found = artifacts_in(path)
        if not found:
            raise ArtifactError(f"{path} is not a kvsqueeze calibration artifact: neither it nor any folder directly "
                                f"inside it holds {SPEC_FILE} (write one with kvsqueeze calibrate --out {path})")
        if len(found) > 1:
            raise ArtifactError(f"{path} holds {len(found)} calibration artifacts; name one of them: "
                                f"{', '.join(str(f) for f in found)}")
        target = found[0]
    try:
        return load_artifact(target).cache_spec()
    except KvsqueezeError:
        raise
    except ValueError as exc:
        raise ArtifactError(str(exc)) from exc
