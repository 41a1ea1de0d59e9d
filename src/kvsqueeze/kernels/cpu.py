"""CPU attention directly over the packed cache: a small C++ extension, JIT-built on first use.

The extension (``_csrc/packed_attention.cpp``) reads every block's packed codes and parameters in place, splits the
context into chunks scored in parallel on torch's intra-op threads (flash-decoding) and merges the chunk partials
with an exact log-sum-exp.  It serves decode-sized steps (up to ``MAX_QUERIES`` new tokens); longer steps (a
prompt continued on top of a cache) go to the block-by-block reference, whose per-block dequantization is then
amortised over many queries and whose matmuls use BLAS.

The build is cached under ``$TORCH_EXTENSIONS_DIR/kvsqueeze`` (default ``~/.cache/torch_extensions/kvsqueeze``),
keyed by a hash of the source and of this machine's CPU flags (it is compiled with ``-march=native``).  If the
compiler or ninja is missing, or ``KVSQUEEZE_NO_CPP=1`` is set, :func:`available` is False and ``auto`` uses the
reference.  Builds are serialised by an advisory file lock that the operating system releases when its holder
dies, so a build interrupted by Ctrl-C or a kill leaves nothing that makes the next process wait for ever (torch's
own ``lock`` file would: it is removed here when found under the held lock).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from ..cache.codecs import Codec, Fp8Codec, FullCodec, IntChannelCodec, IntTokenCodec
from ..cache.codecs_rotated import RotatedCodec
from .dispatch import reference_attend_layer

MAX_QUERIES = 16  # new tokens per step served by the fused kernel; more go to the reference
CHUNK_TOKENS = 256  # tokens per parallel work item
_SOURCE = Path(__file__).with_name("_csrc") / "packed_attention.cpp"
_FP, _INT_TOKEN, _INT_CHANNEL, _FP8, _CODEBOOK = 0, 1, 2, 3, 4

_lock = threading.Lock()
_ext: ModuleType | None = None
_failed: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_name() -> str:
    digest = hashlib.sha256(_SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode())
    return f"kvsqueeze_packed_attention_{digest.hexdigest()[:12]}"


def _build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "kvsqueeze" / name


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an exclusive lock on ``build_dir`` across processes; a stale torch ``lock`` file found under it is
    removed (only a process that died mid-build leaves one, since every builder takes this lock first)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file is the only guard
        yield
        return
    with open(build_dir / "kvsqueeze.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_extension(verbose: bool = False) -> ModuleType | None:
    """Build (first time only) and import the C++ extension; None when it cannot be built here."""
    global _ext, _failed
    if _ext is not None or _failed is not None:
        return _ext
    with _lock:
        if _ext is not None or _failed is not None:
            return _ext
        if os.environ.get("KVSQUEEZE_NO_CPP", "") not in ("", "0"):
            _failed = "disabled by KVSQUEEZE_NO_CPP"
            return None
        try:
            from torch.utils.cpp_extension import load

            name = _build_name()
            build_dir = _build_directory(name)
            with _build_lock(build_dir):
                _ext = load(name=name, sources=[str(_SOURCE)], verbose=verbose, build_directory=str(build_dir),
                            extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast"])
        except Exception as err:  # no compiler, no ninja, headers missing: fall back to the reference
            _failed = f"{type(err).__name__}: {err}"
            warnings.warn(f"kvsqueeze: the C++ attention kernel could not be built ({_failed.splitlines()[0]}); "
                          f"using the pure-torch reference", RuntimeWarning, stacklevel=2)
    return _ext


def available() -> bool:
    return load_extension() is not None


def supports(layer) -> bool:
    """Exact codec types only: calibrated codecs (permuted channels, pre-RoPE keys, ternary) and rotated codebooks
    with a residual sign sketch use the reference."""
    return layer.store is None or all(type(c) in _KNOWN and not getattr(c, "sketch", False)
                                      for c in layer.store.codecs.values())


def _fmt(codec: Codec) -> list[int]:
    """The six ints describing a codec to the kernel: kind, bits, group, symmetric, fp8 variant, fixed scale."""
    if type(codec) is FullCodec:
        return [_FP, 16, 1, 0, 0, 0]
    if type(codec) is RotatedCodec:
        return _codebook_side(codec)[0]
    s = codec.spec
    if type(codec) is IntTokenCodec:
        return [_INT_TOKEN, s.bits, codec.group, int(s.symmetric), 0, 0]
    if type(codec) is IntChannelCodec:
        return [_INT_CHANNEL, s.bits, codec.group, int(s.symmetric), 0, 0]
    if type(codec) is Fp8Codec:
        return [_FP8, 8, 1, 0, int(s.fmt == "fp8-e5m2"), int(s.fp8_scale != "token")]
    raise TypeError(f"no fused kernel for codec {type(codec).__name__}")


_EMPTY = torch.empty(0)
_KNOWN = (FullCodec, IntTokenCodec, IntChannelCodec, Fp8Codec, RotatedCodec)


def _codebook_side(codec: RotatedCodec, parts: dict[str, torch.Tensor] | None = None, side: str = "k"
                   ) -> tuple[list[int], list[torch.Tensor]]:
    """The rotated codebook kind: its six format ints (high width, high-width coordinates, low width) and, for a
    block's parts, its three tensors (packed codes, norms, the codec's rotation + level table)."""
    sp = codec.split
    tensors = [] if parts is None else [parts[f"{side}.codes"], parts[f"{side}.norm"], codec.kernel_table()]
    return [_CODEBOOK, sp.bits_hi, sp.n_hi, sp.bits_lo, 0, 0], tensors


def _side_parts(codec: Codec, parts: dict[str, torch.Tensor], side: str) -> list[torch.Tensor]:
    if isinstance(codec, FullCodec):
        return [parts[f"{side}.x"], _EMPTY, _EMPTY]
    if isinstance(codec, RotatedCodec):
        return _codebook_side(codec, parts, side)[1]
    if isinstance(codec, Fp8Codec) and codec.spec.fp8_scale != "token":
        return [parts[f"{side}.codes"], codec.fixed_scale, _EMPTY]
    return [parts[f"{side}.codes"], parts[f"{side}.scale"], parts.get(f"{side}.zero", _EMPTY)]


def packed_segments(layer) -> tuple[list[torch.Tensor], list[int], list[int], list[int], list[int], list[int]]:
    """Flatten a layer's stored state into the kernel's segment lists (no copies: tensors as stored)."""
    parts: list[torch.Tensor] = []
    pos: list[int] = []
    num: list[int] = []
    new: list[int] = []
    fmt: list[int] = []

    def fp(start: int, k: torch.Tensor, v: torch.Tensor, is_new: bool) -> None:
        parts.extend((k, _EMPTY, _EMPTY, v, _EMPTY, _EMPTY))
        pos.append(start)
        num.append(k.shape[2])
        new.append(int(is_new))
        fmt.append(0)

    fmts = [_FP, 16, 1, 0, 0, 0] * 2
    if layer.sink_k is not None and layer.sink_k.shape[2]:
        fp(0, layer.sink_k, layer.sink_v, False)
    store = layer.store
    if store is not None:
        kc, vc = store.codecs["k"], store.codecs["v"]
        fmts += _fmt(kc) + _fmt(vc)
        base = layer.n_sinks
        for blk in store.blocks:
            if blk.used:
                parts.extend(_side_parts(kc, blk.parts, "k") + _side_parts(vc, blk.parts, "v"))
                pos.append(base + blk.start)
                num.append(blk.used)
                new.append(0)
                fmt.append(1)
        if layer.window.length:
            wk, wv = layer.window.view()
            fp(base + store.end, wk, wv, False)
    if layer.pending is not None:
        fp(layer.n_total, layer.pending[0], layer.pending[1], True)
    return parts, pos, num, new, fmt, fmts


def attend_layer(query: torch.Tensor, layer, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything ``layer`` stores plus its pending tokens."""
    ext = load_extension()
    if ext is None or query.device.type != "cpu" or query.shape[2] > MAX_QUERIES or not supports(layer):
        return reference_attend_layer(query, layer, mask, scaling)
    parts, pos, num, new, fmt, fmts = packed_segments(layer)
    if not pos:
        raise ValueError("attention over an empty cache with no new tokens")
    if mask is not None:
        kv_len = layer.n_total - layer.first_visible + query.shape[2]
        if mask.dim() != 4 or mask.shape[-1] < kv_len or mask.shape[-2] != query.shape[2]:
            # the reference fails the same way (a RuntimeError from slicing); never read past the mask
            raise RuntimeError(f"attention mask of shape {tuple(mask.shape)} does not cover {query.shape[2]} "
                               f"queries x {kv_len} key positions")
    f = layer.spec.flush_tokens
    chunk = max(f, CHUNK_TOKENS // f * f)
    q = query.contiguous() if query.dtype == torch.float32 else query.float().contiguous()
    m = _EMPTY if mask is None else mask
    out = ext.attend(q, parts, pos, num, new, fmt, fmts, m, layer.first_visible, layer.n_total, float(scaling),
                     chunk)
    return out.to(query.dtype)
