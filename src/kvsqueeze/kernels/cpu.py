"""CPU attention directly over the packed cache: a small C++ extension, JIT-built on first use.

The extension (``_csrc/packed_attention.cpp``) reads every block's packed codes and parameters in place, splits the
context into chunks scored in parallel on torch's intra-op threads (flash-decoding) and merges the chunk partials
with an exact log-sum-exp.  It serves decode-sized steps (up to ``MAX_QUERIES`` new tokens).  Longer steps (a
prompt fed in chunks on top of a packed history) go to its multi-query entry point ``attend_multi``: work items
of ``Q_TILE`` queries (times the GQA group's heads) that dequantize ``K_TILE`` stored tokens at a time into a small
float32 tile, score and accumulate it with two BLAS GEMMs and an exact online softmax, skipping tiles the mask
hides (the module comment above it in the C++ source says why this design).  Formats the kernel cannot read
(calibrated extras, sign sketches) go to the block-by-block reference at any step length.

Each instruction-set path (:data:`ISAS`: ``avx512-vbmi``, ``avx512-vnni``, ``avx2``, ``generic``) is its own build
with explicit target flags, cached under ``$TORCH_EXTENSIONS_DIR/kvsqueeze`` (default
``~/.cache/torch_extensions/kvsqueeze``) and keyed by a hash of the sources, the flags and torch's version; ``auto``
takes the best this CPU runs and
``KVSQUEEZE_CPU_ISA`` (or :func:`use_isa`) forces one.  If the compiler or ninja is missing, or
``KVSQUEEZE_NO_CPP=1`` is set, :func:`available` is False and ``auto`` uses the reference.  Builds are serialised by an advisory file lock that the operating system releases when its holder
dies, so a build interrupted by Ctrl-C or a kill leaves nothing that makes the next process wait for ever (torch's
own ``lock`` file would: it is removed here when found under the held lock).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ..cache.plan import EXACT, SegmentPlan
from ..errors import KvsqueezeError
from ..quant.codebook import rotated_kernel_table, split_bits
from ..quant.format import StorageFormat
from ..quant.params import PARAM_DTYPE_NAMES, scale_floor
from . import reference

MAX_QUERIES = 16  # new tokens per step served by the decode kernel; more go to the tiled multi-query kernel
CHUNK_TOKENS = 256  # decode: tokens per parallel work item
Q_TILE = 64  # multi-query: queries per work item (times the GQA group's heads)
K_TILE = 256  # multi-query: tokens dequantized and scored at a time
_SOURCE = Path(__file__).with_name("_csrc") / "packed_attention.cpp"
_FP, _INT_TOKEN, _INT_CHANNEL, _FP8, _CODEBOOK = 0, 1, 2, 3, 4

_lock = threading.Lock()
_exts: dict[str, ModuleType | None] = {}  # one build per instruction-set path, loaded on first use
_failed: dict[str, str] = {}
_forced: str | None = None  # use_isa()'s choice, over KVSQUEEZE_CPU_ISA
_forced_order: str | None = None  # use_order()'s choice, over KVSQUEEZE_CPU_ORDER


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# Instruction-set paths, best first.  Each is its own build with explicit target flags (never -march=native), so a
# build made on one machine runs on any machine with that path's features, and every path can be forced and tested
# on a machine that has it.  avx512-vnni: key scores by vpdpwssd (vpdpbusd for fields past 64 channels), 16-lane
# float vectors; avx512-vbmi: the same plus VBMI's vpmultishiftqb and vpermb, which place a rotated codebook's codes
# in one instruction per vector, so its keys are scored and its values weighted by int16 levels (Ice Lake, Zen 4 and
# later; Cascade Lake has VNNI without it); avx2: by vpmaddwd over codes
# widened to int16, 8 lanes; generic: the compiler's baseline for the architecture (float path only).
ISAS = ("avx512-vbmi", "avx512-vnni", "avx2", "generic")
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# GCC's generic tuning splits unaligned 256-bit loads and stores into 128-bit halves, which cost the AVX2 build a
# store-forwarding stall per row (4x slower fp32 decode than unsplit): the -mno-avx256-split flags keep them whole.
_NO_SPLIT = ["-mno-avx256-split-unaligned-load", "-mno-avx256-split-unaligned-store"]
_ISA_CFLAGS = {"avx512-vbmi": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi", *_NO_SPLIT],
               "avx512-vnni": ["-march=x86-64-v4", "-mavx512vnni", *_NO_SPLIT],
               "avx2": ["-march=x86-64-v3", *_NO_SPLIT], "generic": []}
_ISA_NEEDS = {"avx512-vnni": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx2", "fma",
                              "f16c", "bmi2", "movbe"},
              "avx2": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}, "generic": set()}
_ISA_NEEDS["avx512-vbmi"] = _ISA_NEEDS["avx512-vnni"] | {"avx512vbmi"}
# -fopenmp, not only -fopenmp-simd: at::parallel_for is a header template whose "omp parallel" is compiled into
# this extension; without it every work item ran on one thread whatever torch's thread count (the same libgomp
# torch loads serves it, by soname).
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast"]
_LDFLAGS = ["-fopenmp"]


def runnable_isas() -> list[str]:
    """The instruction-set paths this CPU can run, best first (``generic`` always)."""
    return list(_runnable())


@functools.cache
def _runnable() -> tuple[str, ...]:
    # read once: /proc/cpuinfo costs ~0.1 ms, and every attention call asks (30 layers a decode step)
    flags = set(_cpu_flags().split())
    flags |= {"bmi1"} if "bmi1" in flags or "bmi" in flags else set()
    return tuple(i for i in ISAS if i == "generic" or (_X86 and _ISA_NEEDS[i] <= flags))


def selected_isa() -> str:
    """The path ``attend`` uses: :func:`use_isa`'s, else ``$KVSQUEEZE_CPU_ISA`` (``auto`` or a name in ISAS), else
    the best this CPU runs."""
    want = _forced or os.environ.get("KVSQUEEZE_CPU_ISA", "auto") or "auto"
    runnable = _runnable()
    if want == "auto":
        return runnable[0]
    if want not in ISAS:
        raise KvsqueezeError(f"KVSQUEEZE_CPU_ISA={want!r} is not a CPU kernel path; allowed: auto, {', '.join(ISAS)}")
    if want not in runnable:
        raise KvsqueezeError(f"the CPU kernel path {want!r} needs CPU features this machine lacks; it runs: "
                             f"{', '.join(runnable)}")
    return want


@contextlib.contextmanager
def use_isa(isa: str):
    """Force an instruction-set path inside the block (tests and benchmarks compare paths in one process)."""
    global _forced
    prev, _forced = _forced, isa
    try:
        selected_isa()  # refuse a path this CPU cannot run before anything uses it
        yield
    finally:
        _forced = prev


def _flags(isa: str) -> list[str]:
    return _CFLAGS + (_ISA_CFLAGS[isa] if _X86 else [])


def _build_name(isa: str) -> str:
    # torch's location too: two virtualenvs with the same torch (kvsqueeze's and vLLM's, docs/vllm.md) compile
    # against different include paths, and sharing one build folder made ninja rebuild whenever they alternated
    sources = b"".join(f.read_bytes() for f in sorted(_SOURCE.parent.glob("*.[ch]*")))
    digest = hashlib.sha256(sources + torch.__version__.encode() + str(Path(torch.__file__).parent).encode()
                            + " ".join(_flags(isa) + _LDFLAGS).encode())
    return f"kvsqueeze_packed_attention_{isa.replace('-', '_')}_{digest.hexdigest()[:12]}"


def _build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "kvsqueeze" / name


def _stage_sources(build_dir: Path) -> Path:
    """Copy the sources into the build folder and return the copy of the main file: ninja's build file names the
    source path, so two checkouts (or virtualenvs) with identical sources would otherwise rebuild in turn."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for f in sorted(_SOURCE.parent.glob("*.[ch]*")):
        target = staged / f.name
        data = f.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            tmp = staged / f".{f.name}.tmp-{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, target)
    return staged / _SOURCE.name


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


def load_extension(verbose: bool = False, isa: str | None = None) -> ModuleType | None:
    """Build (first time only) and import the C++ extension of an instruction-set path (default: the selected one);
    None when it cannot be built here."""
    isa = isa or selected_isa()
    if isa in _exts:
        return _exts[isa]
    with _lock:
        if isa in _exts:
            return _exts[isa]
        ext = None
        if os.environ.get("KVSQUEEZE_NO_CPP", "") not in ("", "0"):
            _failed[isa] = "disabled by KVSQUEEZE_NO_CPP"
        else:
            try:
                from torch.utils.cpp_extension import load

                name = _build_name(isa)
                build_dir = _build_directory(name)
                with _build_lock(build_dir):
                    source = _stage_sources(build_dir)
                    ext = load(name=name, sources=[str(source)], verbose=verbose, build_directory=str(build_dir),
                               extra_cflags=_flags(isa), extra_ldflags=list(_LDFLAGS))  # load() appends to it
            except Exception as err:  # no compiler, no ninja, headers missing: fall back to the reference
                _failed[isa] = f"{type(err).__name__}: {err}"
                warnings.warn(f"kvsqueeze: the C++ attention kernel ({isa}) could not be built "
                              f"({_failed[isa].splitlines()[0]}); using the pure-torch reference", RuntimeWarning,
                              stacklevel=2)
        _exts[isa] = ext
    return ext


def available() -> bool:
    return load_extension() is not None


def is_built(isa: str | None = None) -> bool:
    """Whether the path's extension is loaded or its build is cached on disk (so using it costs no compile)."""
    isa = isa or selected_isa()
    if _exts.get(isa) is not None:
        return True
    name = _build_name(isa)
    return any(_build_directory(name).glob(f"{name}*.so"))


def describe(build: bool = True) -> dict:
    """What serves CPU attention here, for reports and ``kvsqueeze env``: whether the C++ kernel is built (building
    it on first call unless ``build=False``), the instruction-set path it uses, the paths this CPU could run, and
    why not when it is not.  With ``build=False`` and no cached build, ``path`` says what a first use would do."""
    isa = selected_isa()
    if not build and isa not in _exts:
        cached = is_built(isa) and os.environ.get("KVSQUEEZE_NO_CPP", "") in ("", "0")
        return {"built": cached, "isa": isa, "runnable": runnable_isas(), "reason": None if cached else "not built yet",
                "path": f"C++ kernel ({isa})" + ("" if cached else ", built on first use (about a minute)"),
                "build_dir": str(_build_directory(_build_name(isa)))}
    ext = load_extension(isa=isa)
    return {"built": ext is not None, "isa": isa if ext is not None else None,
            "path": f"C++ kernel ({isa})" if ext is not None else "torch reference",
            "runnable": runnable_isas(), "reason": _failed.get(isa),
            "build_dir": str(_build_directory(_build_name(isa))) if ext is not None else None}


_ENCODE_PARAMS = ("fp32", "fp16", "bf16")  # parameter dtypes encode_int stores (not fp8)
_ENCODE_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def encode_supports(fmt: StorageFormat, x: torch.Tensor) -> bool:
    """Whether :func:`encode` takes ``x`` [B, H, T, D] in ``fmt``: CPU tensors in a plain integer format with float
    zero-points and fp32/fp16/bf16 parameters (not 1-bit symmetric: its scale is a mean), whole packing units per
    row and, per channel, whole groups of tokens (the torch codec reports a ragged call itself)."""
    if fmt.kind != "int" or not fmt.plain or fmt.zero_domain != "float":
        return False
    if PARAM_DTYPE_NAMES.get(fmt.param_dtype) not in _ENCODE_PARAMS:
        return False
    if (fmt.symmetric and fmt.bits == 1) or x.device.type != "cpu" or x.dtype not in _ENCODE_X_DTYPES:
        return False
    if x.dim() != 4 or x.shape[-1] != fmt.head_dim or x.shape[2] == 0 or not fmt.group:
        return False
    per = 1 if fmt.bits >= 5 else 8 if fmt.bits == 3 else 8 // fmt.bits
    within = x.shape[-1] % fmt.group == 0 if fmt.axis == "token" else x.shape[2] % fmt.group == 0
    return x.shape[-1] % per == 0 and within


def encode(fmt: StorageFormat, x: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The parts the torch integer codec stores for ``x`` [B, H, T, D] (codes packed as pack_bits packs them,
    scale and zero in the parameter dtype), bit for bit, by one call of the C++ extension (``_csrc/encode.h``)
    where the torch codec spends ~85 small tensor operations; None where :func:`encode_supports` says no or the
    extension is not built here (the caller keeps the torch codec)."""
    if not encode_supports(fmt, x):
        return None
    ext = load_extension()
    if ext is None:
        return None
    parts = ext.encode_int(x, fmt.bits, fmt.group, fmt.axis != "token", fmt.symmetric, float(fmt.clip),
                           scale_floor(PARAM_DTYPE_NAMES[fmt.param_dtype]), fmt.param_dtype)
    return dict(zip(("codes", "scale", "zero"), parts))


# head_dims the decode kernel is compiled for (_csrc/decode.h's dispatch): its SIMD and integer paths serve these
COMPILED_HEAD_DIMS = (64, 128, 256)


def integer_scores(plan: SegmentPlan) -> bool:
    """Whether the selected path scores this plan's stored keys by integer dot products (``_csrc/int_scores.h``:
    2/3/4/8-bit codes (3-bit read as 4-bit), per-channel groups of a multiple of the vector width or one per-token group
    per row; ``_csrc/codebook_int.h``: rotated codebook keys on the avx512-vbmi path, decode steps of up to 64 query
    rows per KV head): their query is rounded to about 15 bits (rotated keys: levels and query to 13-14 bits plus sign),
    so results differ from the reference by a bounded amount rather than by float32 rounding (tests/kernels: within
    INT_DOT_ATOL on O(1) outputs, and a small share of the format's own error)."""
    return integer_key_format(plan.key_format)


def integer_key_format(fmt: StorageFormat | None) -> bool:
    """:func:`integer_scores` for a key storage format."""
    isa = selected_isa()
    if fmt is not None and fmt.kind == "rot":  # _csrc/codebook_int.h: int16 levels and query
        return _integer_rotated(fmt)
    if fmt is None or isa == "generic" or fmt.kind != "int" or not fmt.plain or fmt.bits not in (2, 3, 4, 8):
        return False
    if fmt.head_dim not in COMPILED_HEAD_DIMS:  # other head_dims take the kernel's generic float path
        return False
    vw, ib = (16, 64) if isa.startswith("avx512") else (8, 32)
    bits = _read_bits(fmt)
    cb = ib // 2 if bits == 8 else ib
    rby = fmt.head_dim * bits // 8
    if not (cb % rby == 0 or rby % cb == 0) or (cb > rby and cb // rby > min(vw, 8)):
        return False
    return fmt.group == fmt.head_dim if fmt.axis == "token" else fmt.group % vw == 0


def _read_bits(fmt: StorageFormat) -> int:
    """The code width the kernel reads a side at: 3-bit rows are repacked to 4-bit ones per work item
    (``_csrc/formats.h`` as_nibbles), so they take the 4-bit paths."""
    return 4 if fmt.bits == 3 else fmt.bits


def _integer_rotated(fmt: StorageFormat) -> bool:
    """Whether the selected path reads a rotated codebook side by int16 levels: the VBMI build only
    (``_csrc/codebook_int.h``, keys and values alike)."""
    return selected_isa() == "avx512-vbmi" and fmt.plain and fmt.head_dim in COMPILED_HEAD_DIMS


def integer_values(plan: SegmentPlan) -> bool:
    """Whether the selected path weights this plan's stored values by int16 dot products (``_csrc/int_values.h``, the
    AVX-512 VNNI builds: 2/3/4-bit per-token codes (3-bit read as 4-bit) whose groups span 8 or a multiple of 16 packing
    units; ``_csrc/codebook_int.h``: rotated codebook values in decode steps on the avx512-vbmi path, their levels
    rounded to 12 bits plus sign): each query row's weights p * scale are rounded to 16 bits per work item, so results
    differ from the reference by a bounded amount (tests/kernels: within INT_DOT_ATOL on O(1) outputs, and a small share
    of the format's own error) rather than by float32 rounding."""
    return integer_value_format(plan.value_format)


def integer_value_format(fmt: StorageFormat | None) -> bool:
    """:func:`integer_values` for a value storage format."""
    if fmt is not None and fmt.kind == "rot":  # _csrc/codebook_int.h: int16 levels and weights
        return _integer_rotated(fmt)
    if fmt is None or not selected_isa().startswith("avx512") or fmt.kind != "int" or not fmt.plain:
        return False
    if fmt.bits not in (2, 3, 4) or fmt.axis != "token" or fmt.head_dim not in COMPILED_HEAD_DIMS:
        return False
    per = 8 // _read_bits(fmt)  # codes per byte; a vector holds 16 bytes' codes
    if (fmt.head_dim // per) % 16 or fmt.group % per or fmt.head_dim // fmt.group > 16:
        return False
    span = fmt.group // per
    return span % 16 == 0 or span == 8


def _kernel_ready(fmt: StorageFormat | None) -> bool:
    return fmt is None or (fmt.plain and fmt.kind in ("fp", "int", "fp8", "rot"))


def supports(plan: SegmentPlan) -> bool:
    """Plain formats only: calibrated ones (permuted channels, pre-RoPE keys, transforms, ternary) and rotated
    codebooks with a residual sign sketch use the reference."""
    return _kernel_ready(plan.key_format) and _kernel_ready(plan.value_format)


_EXACT_FORMAT = (_FP, 16, 1, 0, 0, 0)  # exact tokens (full-precision segments): format 0 of every plan


def int_codes_format(bits: int, group: int, per_channel: bool, symmetric: bool = False) -> list[int]:
    """The six ints of an integer side (codes with fp16 scale, and zero unless symmetric): ``group`` channels per
    per-token group, or tokens per per-channel group."""
    return [_INT_CHANNEL if per_channel else _INT_TOKEN, bits, group, int(symmetric), 0, 0]


def _fmt(fmt: StorageFormat) -> list[int]:
    """The six ints describing a format to the kernel: kind, bits, group, symmetric, fp8 variant, fixed scale."""
    if fmt.kind == "fp":
        return list(_EXACT_FORMAT)
    if fmt.kind == "int":
        return int_codes_format(fmt.bits, fmt.group, fmt.axis != "token", fmt.symmetric)
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


@dataclass
class KernelPlan:
    """A segment plan flattened for the kernel (no copies: tensors as stored), field for field the C++ struct of the
    same name (``_csrc/plan.h``) that both entry points take.  ``head`` is the plan's run of stored blocks,
    flattened once and reused while the layer stores the same blocks; it goes before segment ``head_at``."""

    parts: list[torch.Tensor] = field(default_factory=list)  # 6 per segment: keys (x, scale, zero), values (...)
    positions: list[int] = field(default_factory=list)  # absolute position of each segment's first token
    lengths: list[int] = field(default_factory=list)
    is_new: list[int] = field(default_factory=list)  # 1 for the step's own tokens (causal among themselves)
    format_index: list[int] = field(default_factory=list)  # 0: exact tokens, 1: the store's format
    formats: list[int] = field(default_factory=list)  # 6 ints per side (see _fmt), keys then values, per format
    mask: torch.Tensor = _EMPTY
    kv_offset: int = 0  # absolute position of mask column 0
    query_start: int = 0
    scaling: float = 1.0
    head: _StoredRun | None = None
    head_at: int = 0

    def native(self, ext: ModuleType, head_dim: int):
        out = ext.KernelPlan()
        for name in self.__dataclass_fields__:
            if name not in ("head", "head_at"):  # set below: the run as the kernel read it once
                setattr(out, name, getattr(self, name))
        if self.head is not None:
            out.head, out.head_at = self.head.native(ext, head_dim), self.head_at
        return out

    @property
    def n_segments(self) -> int:
        return len(self.positions) + (len(self.head.plan.positions) if self.head is not None else 0)


@dataclass
class _StoredRun:
    """A layer's full stored blocks flattened for the kernel, kept in the plan's ``stored_memo``: the store hands over
    the same memo while they are unchanged (a flush only adds to the block still filling).  The kernel
    reads it once into tensor views (``read_run``) and each step's plan only points at that, so a step's cost does
    not grow with the number of blocks (flattening 6 tensors per block each step cost ~0.15 ms per layer at 32k
    tokens; reading them in the kernel ~0.04 ms per layer at 8k, their headers being cold after the model's weights)."""

    store: tuple  # the formats and shared tensors it was flattened with (the store's: fixed while it lives)
    plan: KernelPlan
    natives: dict = field(default_factory=dict)  # per (extension module, head_dim): the kernel's StoredRun

    def native(self, ext: ModuleType, head_dim: int):
        key = (ext.__name__, head_dim)
        out = self.natives.get(key)
        if out is None:
            out = self.natives[key] = ext.read_run(self.plan.native(ext, head_dim), head_dim)
        return out


def _flatten(kp: KernelPlan, plan: SegmentPlan, segments) -> None:
    for seg in segments:
        if not seg.length:
            continue
        if seg.kind == EXACT:
            kp.parts.extend((seg.k, _EMPTY, _EMPTY, seg.v, _EMPTY, _EMPTY))
        else:
            kp.parts.extend(_side_parts(plan.key_format, seg.k_parts, plan.key_shared)
                            + _side_parts(plan.value_format, seg.v_parts, plan.value_shared))
        kp.positions.append(seg.start)
        kp.lengths.append(seg.length)
        kp.is_new.append(int(seg.is_new))
        kp.format_index.append(int(seg.kind != EXACT))


def _stored_run(plan: SegmentPlan, formats: list[int]) -> _StoredRun:
    store = (plan.key_format, plan.value_format, plan.key_shared, plan.value_shared)
    got = plan.stored_memo.get("kernel_run")
    if got is None or not all(a is b for a, b in zip(got.store, store)):
        kp = KernelPlan(formats=formats)
        _flatten(kp, plan, plan.stored)
        got = plan.stored_memo["kernel_run"] = _StoredRun(store, kp)
    return got


def kernel_plan(plan: SegmentPlan, mask: torch.Tensor | None = None, scaling: float = 1.0) -> KernelPlan:
    """Flatten a segment plan into the kernel's plan; its run of stored blocks comes from the previous step's
    flattening while the store holds the same blocks."""
    kp = KernelPlan(formats=list(_EXACT_FORMAT) * 2, mask=_EMPTY if mask is None else mask,
                    kv_offset=plan.first_visible, query_start=plan.query_start, scaling=float(scaling))
    if plan.key_format is not None:
        kp.formats += _fmt(plan.key_format) + _fmt(plan.value_format)
    _flatten(kp, plan, plan.before)
    if plan.stored:
        kp.head, kp.head_at = _stored_run(plan, kp.formats), len(kp.positions)
    _flatten(kp, plan, plan.after)
    return kp


def path(query: torch.Tensor, plan: SegmentPlan) -> str:
    """The path :func:`attend` takes for this step, for reports: ``cpu-kernel <isa>`` or ``reference``."""
    if load_extension() is None or query.device.type != "cpu" or not supports(plan):
        return "reference"
    return f"cpu-kernel {selected_isa()}"


def attend(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything the plan holds."""
    if path(query, plan) == "reference":
        return reference.attend(query, plan, mask, scaling)
    ext = load_extension()
    kp = kernel_plan(plan, mask, scaling)
    if not kp.n_segments:
        raise ValueError("attention over an empty cache with no new tokens")
    # the reference fails the same way on a short mask (a RuntimeError from slicing); never read past the mask
    plan.check_mask(mask, query.shape[2])
    f = plan.flush_tokens
    chunk = max(f, CHUNK_TOKENS // f * f)
    q = query.contiguous() if query.dtype == torch.float32 else query.float().contiguous()
    if query.shape[2] > MAX_QUERIES:
        out = ext.attend_multi(q, kp.native(ext, q.shape[3]), Q_TILE, K_TILE)
    else:
        out = ext.attend(q, kp.native(ext, q.shape[3]), chunk, traversal() == "heads")
    return out.to(query.dtype)


TRAVERSALS = ("chunks", "heads")


def traversal() -> str:
    """The order the decode kernel walks its work items in: ``chunks`` (every batch row and KV head of a chunk of
    tokens before the next chunk, so each block is read as one run of memory) or ``heads`` (each head's chunks in
    turn, the order before; the outputs are identical): :func:`use_order`'s, else ``$KVSQUEEZE_CPU_ORDER`` (default
    ``chunks``)."""
    want = _forced_order or os.environ.get("KVSQUEEZE_CPU_ORDER", "") or "chunks"
    if want not in TRAVERSALS:
        raise KvsqueezeError(f"KVSQUEEZE_CPU_ORDER={want!r} is not a traversal order; allowed: {', '.join(TRAVERSALS)}")
    return want


@contextlib.contextmanager
def use_order(order: str):
    """Force the decode kernel's traversal order inside the block (benchmarks compare the orders in one process)."""
    if order not in TRAVERSALS:
        raise KvsqueezeError(f"{order!r} is not a traversal order; allowed: {', '.join(TRAVERSALS)}")
    global _forced_order
    prev, _forced_order = _forced_order, order
    try:
        yield
    finally:
        _forced_order = prev


def attend_paged(query: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, exact: list[torch.Tensor | None], page_tokens: int, layout: list[int],
                 page_format: list[int], skip: int, scaling: float) -> torch.Tensor | None:
    """Causal attention of every sequence's last queries (``query`` [T, Hq, D], rows ``query_start_loc[s]`` ..
    ``query_start_loc[s + 1]``) over its pages of a paged pool (uint8 [blocks, H, bytes], read in place:
    ``_csrc/paged.h``; ``layout`` and ``page_format`` as kernels/paged.py describes a page), named by
    ``block_table`` [S, max_blocks] for ``seq_lens`` [S] tokens.  ``exact`` holds two tensors per sequence in the
    model's dtype, None where it has none: its sink copies [2, H, >= skip, D] (keys, values; they stand for the
    first page's first ``skip`` tokens) and its partial last page [2, H, page_tokens, D].  Returns float32
    [T, Hq, D], or None when the C++ kernel is not built here (the caller takes its reference)."""
    ext = load_extension()
    if ext is None or query.device.type != "cpu":
        return None
    q = query.contiguous() if query.dtype == torch.float32 else query.float().contiguous()
    formats = list(_EXACT_FORMAT) * 2 + list(page_format)
    exact = [_EMPTY if t is None else t for t in exact]  # the extension's "none" in a list of tensors
    return ext.attend_paged(q, pool, block_table, seq_lens, query_start_loc, exact, page_tokens, layout, formats,
                            skip, float(scaling), CHUNK_TOKENS, MAX_QUERIES, Q_TILE, K_TILE)
