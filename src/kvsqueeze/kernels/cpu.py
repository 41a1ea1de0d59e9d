"""CPU attention directly over the packed cache: a small C++ extension, JIT-built on first use.

The extension (``_csrc/packed_attention.cpp``) reads every block's packed codes and parameters in place, splits the
context into chunks scored in parallel on torch's intra-op threads (flash-decoding) and merges the chunk partials
with an exact log-sum-exp.  It serves decode-sized steps (up to ``MAX_QUERIES`` new tokens).  Longer steps (a
prompt fed in chunks on top of a packed history) go to its multi-query entry point ``attend_multi``: work items
of ``Q_TILE`` queries (times the GQA group's heads) that dequantize ``K_TILE`` stored tokens at a time into a small
float32 tile, score and accumulate it with two BLAS GEMMs and an exact online softmax, skipping tiles the mask
hides (the module comment above it in the C++ source says why this design).  Formats the kernel cannot read
(calibrated extras, sign sketches) go to the block-by-block reference at any step length.

The build is cached under ``$TORCH_EXTENSIONS_DIR/kvsqueeze`` (default ``~/.cache/torch_extensions/kvsqueeze``),
keyed by a hash of the source, the compiler flags and this machine's CPU flags (it is compiled with ``-march=native``).  If the
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
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import torch

from ..cache.plan import EXACT, SegmentPlan
from ..quant.codebook import rotated_kernel_table, split_bits
from ..quant.format import StorageFormat
from . import reference

MAX_QUERIES = 16  # new tokens per step served by the decode kernel; more go to the tiled multi-query kernel
CHUNK_TOKENS = 256  # decode: tokens per parallel work item
Q_TILE = 64  # multi-query: queries per work item (times the GQA group's heads)
K_TILE = 256  # multi-query: tokens dequantized and scored at a time
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


# -fopenmp, not only -fopenmp-simd: at::parallel_for is a header template whose "omp parallel" is compiled into
# this extension; without it every work item ran on one thread whatever torch's thread count (the same libgomp
# torch loads serves it, by soname).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_LDFLAGS = ["-fopenmp"]


def _build_name() -> str:
    sources = b"".join(f.read_bytes() for f in sorted(_SOURCE.parent.glob("*.[ch]*")))
    digest = hashlib.sha256(sources + _cpu_flags().encode() + torch.__version__.encode()
                            + " ".join(_CFLAGS + _LDFLAGS).encode())
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
                            extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS)
        except Exception as err:  # no compiler, no ninja, headers missing: fall back to the reference
            _failed = f"{type(err).__name__}: {err}"
            warnings.warn(f"kvsqueeze: the C++ attention kernel could not be built ({_failed.splitlines()[0]}); "
                          f"using the pure-torch reference", RuntimeWarning, stacklevel=2)
    return _ext


def available() -> bool:
    return load_extension() is not None


def describe() -> dict:
    """What serves CPU attention here, for reports and ``kvsqueeze env``: whether the C++ kernel is built (building
    it on first call), the instruction-set path it uses, and why not when it is not."""
    ext = load_extension()
    flags = set(_cpu_flags().split())
    isa = "avx512-vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else "avx2" if "avx2" in flags else "generic"
    return {"built": ext is not None, "isa": isa if ext is not None else None,
            "path": f"C++ kernel ({isa})" if ext is not None else "torch reference",
            "reason": _failed, "build_dir": str(_build_directory(_build_name())) if ext is not None else None}


def _kernel_ready(fmt: StorageFormat | None) -> bool:
    return fmt is None or (fmt.plain and fmt.kind in ("fp", "int", "fp8", "rot"))


def supports(plan: SegmentPlan) -> bool:
    """Plain formats only: calibrated ones (permuted channels, pre-RoPE keys, transforms, ternary) and rotated
    codebooks with a residual sign sketch use the reference."""
    return _kernel_ready(plan.key_format) and _kernel_ready(plan.value_format)


def _fmt(fmt: StorageFormat) -> list[int]:
    """The six ints describing a format to the kernel: kind, bits, group, symmetric, fp8 variant, fixed scale."""
    if fmt.kind == "fp":
        return [_FP, 16, 1, 0, 0, 0]
    if fmt.kind == "int":
        return [_INT_TOKEN if fmt.axis == "token" else _INT_CHANNEL, fmt.bits, fmt.group, int(fmt.symmetric), 0, 0]
    if fmt.kind == "rot":  # high width, how many coordinates take it, low width, centring group (0: none)
        sp = split_bits(fmt.bits, fmt.head_dim)
        return [_CODEBOOK, sp.bits_hi, sp.n_hi, sp.bits_lo, fmt.token_group if fmt.axis == "channel" else 0, 0]
    return [_FP8, 8, 1, 0, int(fmt.fp8_variant == "e5m2"), int(fmt.fixed_scale)]


_EMPTY = torch.empty(0)


def _side_parts(fmt: StorageFormat, parts: Mapping[str, torch.Tensor], shared: Mapping[str, torch.Tensor]
                ) -> list[torch.Tensor]:
    if fmt.kind == "fp":
        return [parts["x"], _EMPTY, _EMPTY]
    if fmt.kind == "rot":  # packed codes, scales (centred: group means + scales), the rotation + level table
        scales = parts["stats"] if fmt.axis == "channel" else parts["norm"]
        return [parts["codes"], scales, rotated_kernel_table(fmt.head_dim, fmt.bits)]
    if fmt.fixed_scale:
        return [parts["codes"], shared["scale"], _EMPTY]
    return [parts["codes"], parts["scale"], parts.get("zero", _EMPTY)]


def packed_segments(plan: SegmentPlan) -> tuple[list[torch.Tensor], list[int], list[int], list[int], list[int],
                                                list[int]]:
    """Flatten a plan into the kernel's segment lists (no copies: tensors as stored)."""
    parts: list[torch.Tensor] = []
    pos: list[int] = []
    num: list[int] = []
    new: list[int] = []
    fmt: list[int] = []
    fmts = [_FP, 16, 1, 0, 0, 0] * 2
    if plan.key_format is not None:
        fmts += _fmt(plan.key_format) + _fmt(plan.value_format)
    for seg in plan.segments:
        if not seg.length:
            continue
        if seg.kind == EXACT:
            parts.extend((seg.k, _EMPTY, _EMPTY, seg.v, _EMPTY, _EMPTY))
        else:
            parts.extend(_side_parts(plan.key_format, seg.k_parts, plan.key_shared)
                         + _side_parts(plan.value_format, seg.v_parts, plan.value_shared))
        pos.append(seg.start)
        num.append(seg.length)
        new.append(int(seg.is_new))
        fmt.append(int(seg.kind != EXACT))
    return parts, pos, num, new, fmt, fmts


def attend(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything the plan holds."""
    ext = load_extension()
    if ext is None or query.device.type != "cpu" or not supports(plan):
        return reference.attend(query, plan, mask, scaling)
    parts, pos, num, new, fmt, fmts = packed_segments(plan)
    if not pos:
        raise ValueError("attention over an empty cache with no new tokens")
    # the reference fails the same way on a short mask (a RuntimeError from slicing); never read past the mask
    plan.check_mask(mask, query.shape[2])
    f = plan.flush_tokens
    chunk = max(f, CHUNK_TOKENS // f * f)
    q = query.contiguous() if query.dtype == torch.float32 else query.float().contiguous()
    m = _EMPTY if mask is None else mask
    if query.shape[2] > MAX_QUERIES:
        out = ext.attend_multi(q, parts, pos, num, new, fmt, fmts, m, plan.first_visible, plan.query_start,
                               float(scaling), Q_TILE, K_TILE)
    else:
        out = ext.attend(q, parts, pos, num, new, fmt, fmts, m, plan.first_visible, plan.query_start,
                         float(scaling), chunk)
    return out.to(query.dtype)
