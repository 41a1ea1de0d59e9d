"""The one module that touches transformers' internals.

* :class:`QuantizedCache` is a ``transformers.Cache`` whose layers wrap :class:`~kvsqueeze.cache.layer.LayerKV`.
  ``update`` only stages the step's new K/V and returns them tagged with their layer; the attention function
  registered here as ``"kvsqueeze"`` recognises the tag and attends over the packed cache chunk by chunk.
* Routing leaves nothing behind.  A forward step that uses a :class:`QuantizedCache` switches the model's attention
  implementation to ``"kvsqueeze"`` when its first layer stages K/V (transformers looks the attention function up
  after ``cache.update``) and restores the previous one when the step's last layer is done or the step fails.
  Steps of several caches in flight on one model at once (threads) share the switch: the first switches, the last
  to end restores (meanwhile other caches' steps on that model also run through ``"kvsqueeze"``, i.e. SDPA).
  ``with kvsqueeze.patch(model):`` routes a model for a whole block instead (needed for models whose attention
  implementation builds masks kvsqueeze cannot read, e.g. flash attention), undone on exit.
* Attention and mask functions are registered together: the mask side is transformers' SDPA mask (boolean,
  sliding-window aware), so sliding layers get their sliding mask rather than a plain causal one.
* The backend switch lives here: ``backend=`` names a kernel module (reference, C++ CPU, Triton) whose
  ``attend(query, plan, mask, scaling)`` reads the layer's segment plan; the Triton quantize-and-pack is handed to
  the block stores as their fast encoder.  Kernels never see a cache or a codec.
* Untagged K/V (a model run without our cache) are passed to transformers' SDPA, so a patched model's results
  never change for other caches.
* The cache argument's name: transformers 5.24 renamed ``past_key_values=`` of ``forward``/``generate`` to
  ``cache=`` (the old name warns, removal announced for 5.40).  :func:`cache_kwargs` and :func:`output_cache` are
  how the rest of kvsqueeze passes a cache and reads it back, naming it as the model's own signature does.
* Each attention step records the path it ran on (:func:`attention_paths`), for reports.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation import GenerationMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .cache.accounting import ByteTotals
from .cache.arena import BlockArena
from .cache.layer import LayerKV, StepTracker
from .cache.static import StaticLayerKV, static_refusal
from .errors import CacheEditError
from .heap import release_freed_memory
from .kernels import reference
from .layout import kv_layout
from .resolve import resolve_cache_spec
from .spec import CacheSpec

ATTN_NAME = "kvsqueeze"
TRIM_AFTER_TOKENS = 64  # steps with at least this many new tokens end by returning freed heap pages (kvsqueeze.heap)
_TAG = "_kvsqueeze_layer"


# ---------------------------------------------------------------------------------------------- cache argument
@functools.cache
def _default_cache_arg() -> str:
    """The name this transformers' generation code uses (read once from its own signature)."""
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


@functools.cache
def _cache_arg_of(cls: type) -> str:
    # the signature sees through transformers' decorators (functools.wraps); a model class written before the rename
    # (remote code) still names past_key_values and is served that way
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return _default_cache_arg()
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    return _default_cache_arg()


def cache_arg(model=None) -> str:
    """``"cache"`` where the model's ``forward`` (and so ``generate``) takes it, else ``"past_key_values"``."""
    return _default_cache_arg() if model is None else _cache_arg_of(type(model))


def cache_kwargs(model, cache) -> dict:
    """``model(**cache_kwargs(model, cache), ...)`` / ``model.generate(..., **cache_kwargs(model, cache))``: the
    cache under the name this transformers expects, so no deprecation warning on new versions and no
    TypeError on old ones."""
    return {cache_arg(model): cache}


def output_cache(out):
    """The cache a forward returned (``out.cache`` on transformers with the rename; reading ``past_key_values``
    there warns)."""
    return getattr(out, "cache" if hasattr(type(out), "cache") else "past_key_values", None)


# ---------------------------------------------------------------------------------------------- backends
BACKEND_NAMES = ("auto", "torch", "cpu", "triton")
# name -> kernel module defining ``attend(query, plan, mask, scaling)`` and ``available()``; imported on first use,
# so ``import kvsqueeze`` never needs Triton, a compiler or a GPU
_KERNELS = {"torch": "kvsqueeze.kernels.reference", "cpu": "kvsqueeze.kernels.cpu",
            "triton": "kvsqueeze.kernels.triton_decode"}


def check_backend(name: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {', '.join(BACKEND_NAMES)}")
    return name


def _kernel(name: str):
    try:
        mod = importlib.import_module(_KERNELS[name])
    except ImportError:
        return None
    return mod if mod.available() else None


def resolve_backend(name: str, device: torch.device) -> Callable:
    """The attend function of a backend; ``auto`` takes the fastest available for the device and falls back to the
    reference, an explicit name that is unavailable here is an error."""
    check_backend(name)
    if name == "auto":
        for cand in ("triton",) if device.type == "cuda" else ("cpu",) if device.type == "cpu" else ():
            mod = _kernel(cand)
            if mod is not None:
                return mod.attend
        return reference.attend
    mod = _kernel(name)
    if mod is None:
        raise ValueError(f"attention backend {name!r} is not available here (module {_KERNELS[name]} missing or "
                         f"no suitable device); allowed here: torch")
    return mod.attend


def _triton_packs(x: torch.Tensor) -> bool:
    """Whether the Triton pack encodes ``x``: CUDA tensors (``KVSQUEEZE_TRITON_ENCODE=0`` switches it off, ``=1``
    also takes CPU tensors, under Triton's interpreter)."""
    flag = os.environ.get("KVSQUEEZE_TRITON_ENCODE", "")
    return flag != "0" and (x.is_cuda or flag == "1")


def fast_encoder(fmt, x: torch.Tensor, into=None, cpp: bool = True):
    """The Triton quantize-and-pack where _triton_packs says so, else for CPU tensors the C++ one (``cpp``;
    bit-identical to the torch codec; ``KVSQUEEZE_CPU_ENCODE=0`` switches it off); None hands the tokens back to the
    torch codec.  ``into`` (a pooled store's PoolTarget): written into the pool's slots in place (Triton only)."""
    if _triton_packs(x):
        from .kernels import triton_pack  # lazy: importing kvsqueeze never imports Triton

        return triton_pack.encode(fmt, x, into)
    if cpp and into is None and x.device.type == "cpu" and os.environ.get("KVSQUEEZE_CPU_ENCODE", "") != "0":
        from .kernels import cpu

        return cpu.encode(fmt, x)
    return None


def ring_encoder(fmt, ring: torch.Tensor, parts: dict, count: torch.Tensor, sinks: int, window: int, group: int,
                 rows: int) -> bool:
    """A static layer's flush by the Triton pack, reading its ring and count on the device (where fast_encoder
    would run); False hands it back to the torch codec."""
    if not _triton_packs(ring):
        return False
    from .kernels import triton_pack

    return triton_pack.encode_ring(fmt, ring, parts, count, sinks, window, group, rows)


# ---------------------------------------------------------------------------------------------- attention
def kvsqueeze_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    layer: LayerKV | None = getattr(key, _TAG, None)
    if isinstance(layer, StaticLayerKV):
        return _static_attention(layer, query, attention_mask, scaling)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    try:
        if softcap is not None:  # attention-logit soft-capping (Gemma-2): only the reference kernel applies it
            _count_path(layer, "reference")
            out = reference.attend(query, layer.plan(), attention_mask, scaling, softcap=softcap)
        elif layer.n_total == layer.first_visible:  # nothing stored is visible: a prompt
            _count_path(layer, "sdpa")
            out = _attend_new_only(query, key, value, attention_mask, scaling)
        else:
            if layer.attend is None:
                layer.attend = resolve_backend(layer.backend, query.device)
            out = _attend_counted(layer, layer.attend, query, layer.plan(), attention_mask, scaling)
        layer.finish_step()  # commits this layer now (quantizing what left the window); undone if the step fails
    except BaseException:
        if layer.step is not None:
            layer.step.abort()  # a failed step leaves every layer as it was before the step
        else:
            layer.pending = None
        for lay in (layer.step.layers if layer.step is not None else [layer]):
            if getattr(lay, "end_of_step", None) is not None:
                lay.end_of_step()
        raise
    layer.attended = True  # read by QuantizedCache.update of the next layer
    if getattr(layer, "end_of_step", None) is not None:
        layer.end_of_step()
        if query.shape[2] >= TRIM_AFTER_TOKENS:  # a prompt chunk's activations are freed: hand their pages back
            release_freed_memory()
    return out.transpose(1, 2).contiguous(), None


def _static_attention(layer: StaticLayerKV, query, mask, scaling):
    """A static layer's step: a prompt (staged, eager) is attended and committed as in the dynamic cache; a decode
    step (written to the ring by ``update``) goes through the opaque operator, which also flushes."""
    from .kernels.static_op import static_attend, static_attend_graphed

    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if layer.pending is not None:
        try:
            out = layer.attend(query, layer.plan_from(layer.tensors(), query.shape[2]), mask, scaling)
        except BaseException:
            layer.pending = None
            raise
        layer.padded = layer.padded or _hides_a_position(mask, int(layer.count) + query.shape[2])
        layer.commit()
    else:
        # a decode step sees every position its plan holds unless the prompt had padding: the mask a compiled step
        # always builds (it cannot test it) is then not read at all
        op = static_attend_graphed if layer.graphed else static_attend
        state = layer.tensors()
        cut = layer.STATE
        out = op(query, mask if layer.padded else None, state[:cut], state[cut:], layer.op_id, float(scaling))
    return out.transpose(1, 2).contiguous(), None


def _hides_a_position(mask, n: int) -> bool:
    """Whether a prompt's mask hides any of the first n positions from its last query (padding; causal masking
    hides nothing from the last one)."""
    if mask is None:
        return False
    last = mask[:, :, -1, :n]
    return not bool(last.all() if last.dtype == torch.bool else (last == 0).all())


def _attend_counted(layer, attend: Callable, query, plan, mask, scaling):
    """``attend(query, plan, mask, scaling)``, the path it takes counted on ``layer`` (attention_paths)."""
    _count_path(layer, _kernel_path(attend, query, plan))
    return attend(query, plan, mask, scaling)


def _kernel_path(attend: Callable, query, plan) -> str:
    """What the attend function will run for this step (its module's ``path``), e.g. 'cpu-kernel avx2'."""
    mod = sys.modules.get(getattr(attend, "__module__", ""), None)
    fn = getattr(mod, "path", None)
    return fn(query, plan) if fn is not None else getattr(attend, "__qualname__", "custom")


def _count_path(layer, name: str) -> None:
    # per layer, per step: a Counter on the LayerKV, read by attention_paths()
    paths = getattr(layer, "paths", None)
    if paths is None:
        paths = layer.paths = Counter()
    paths[name] += 1


def attention_paths(cache, model=None) -> dict[str, int]:
    """Layer-steps per attention path a cache ran on so far: ``{'cpu-kernel avx512-vnni': 960, 'sdpa': 30}`` for a
    kvsqueeze cache ('sdpa' counts prompts with nothing stored yet, 'reference' the pure-torch kernel); for any
    other cache the model's own attention implementation (e.g. ``{'sdpa': 0}``), where ``model`` is given."""
    if isinstance(cache, (QuantizedCache, StaticQuantizedCache)):
        tot: Counter = Counter()
        for layer in cache.layers:
            tot.update(getattr(layer.kv, "paths", None) or {})
        return dict(tot.most_common())
    if model is not None:
        return {str(model.config.get_text_config(decoder=True)._attn_implementation or "eager"): 0}
    return {}


def describe_paths(paths: dict[str, int]) -> str:
    """'cpu-kernel avx2' for the decode path, the others after it with their share: for one report line."""
    if not paths:
        return "n/a"
    total = sum(paths.values())
    main = [k for k in paths if k != "sdpa"] or list(paths)  # a prompt's SDPA is not the cache's path
    if len(main) == 1 or not total:
        return main[0]
    return ", ".join(f"{k} {100 * paths[k] / total:.0f}%" for k in paths)


def _attend_new_only(query, key, value, mask, scaling):
    """Nothing stored yet (a prompt): exact attention among the new tokens with torch's SDPA."""
    causal = mask is None and query.shape[2] > 1
    if mask is not None:
        mask = mask[..., -key.shape[2]:]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])


_registered = False
# attention implementations whose masks the kvsqueeze attention reads (boolean or additive float masks)
ROUTABLE = ("sdpa", "eager", ATTN_NAME)


def register() -> None:
    """Register the attention function and its mask function with transformers (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, kvsqueeze_attention)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True


def _configs(config) -> list:
    text = config.get_text_config(decoder=True)
    return list({id(config): config, id(text): text}.values())


def _set_impl(configs: list, impls: list[str]) -> None:
    for cfg, impl in zip(configs, impls):
        cfg._attn_implementation = impl


class AttentionPatch:
    """Routes a model's attention through kvsqueeze until :meth:`undo` (or the end of a ``with`` block)."""

    def __init__(self, config):
        register()
        self.configs = _configs(config)
        self.saved = [c._attn_implementation for c in self.configs]
        _set_impl(self.configs, [ATTN_NAME] * len(self.configs))

    def undo(self) -> None:
        _set_impl(self.configs, self.saved)

    def __enter__(self) -> AttentionPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch(model) -> AttentionPatch:
    """Route ``model``'s attention through kvsqueeze: ``with kvsqueeze.patch(model): model.generate(...)``, or keep
    the returned handle and call ``.undo()``.  Results of runs without a kvsqueeze cache are unchanged (SDPA)."""
    return AttentionPatch(model.config)


@contextlib.contextmanager
def attention_override(model, fn: Callable) -> Iterator[None]:
    """Temporarily make ``model`` call ``fn`` (transformers' attention signature) in every attention layer.

    The mask passed to ``fn`` is SDPA's boolean mask (True = attend) or None for a plain causal pattern.
    Used by evaluation protocols that emulate a cache inside one forward pass.
    """
    name = f"kvsqueeze-override-{id(fn)}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    configs = {id(model.config): model.config, id(model.config.get_text_config(decoder=True)):
               model.config.get_text_config(decoder=True)}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


class AttentionClock:
    """Wall time spent inside the attention functions transformers looks up by name (its SDPA, kvsqueeze's) while
    :func:`attention_clock` runs: ``seconds`` and ``calls`` in all.  kvsqueeze's function includes the step's commit
    (quantizing what left the window); a transformers cache updates itself before its model calls the attention
    function, outside the clock."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


_CLOCKED = ("sdpa", ATTN_NAME)


@contextlib.contextmanager
def attention_clock() -> Iterator[AttentionClock]:
    """Time every call of the SDPA and kvsqueeze attention functions until the block ends (what a decode step spends
    in attention, beside the projections, MLPs and head around it).  Models on transformers' "eager" attention call
    a function of their own module, which is not seen.  Host wall time: on a GPU it counts launches, not kernels."""
    register()
    clock = AttentionClock()
    originals = {name: AttentionInterface()[name] for name in _CLOCKED}

    def timed(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.calls += 1
        return run

    try:
        for name, fn in originals.items():
            AttentionInterface.register(name, timed(fn))
        yield clock
    finally:
        for name, fn in originals.items():
            AttentionInterface.register(name, fn)


# ---------------------------------------------------------------------------------------------- cache
class _HFLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True

    def __init__(self, spec: CacheSpec, sliding_window: int | None, backend: str, step: StepTracker,
                 arena: BlockArena):
        super().__init__()
        self.spec, self.sliding_window, self.backend, self.step = spec, sliding_window, backend, step
        self.arena = arena
        self.is_sliding = sliding_window is not None
        self.end_of_step: Callable[[], None] | None = None  # set on the last layer by QuantizedCache
        self.kv = self._new_kv()

    def _new_kv(self) -> LayerKV:
        kv = LayerKV(self.spec, self.sliding_window)
        kv.backend, kv.attend = self.backend, None  # the attend function is resolved on first use
        # backend "torch" (the reference) stays torch end to end on a CPU: no C++ build for its encoder either
        kv.fast_encode = fast_encoder if self.backend != "torch" else functools.partial(fast_encoder, cpp=False)
        kv.arena = self.arena
        kv.pooled = True if self.backend == "triton" else None  # the Triton kernels walk a pool in one launch
        kv.step = self.step
        kv.end_of_step = self.end_of_step
        return kv

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    @property
    def attended(self) -> bool:
        return getattr(self.kv, "attended", True)

    def update(self, key_states, value_states, *args, **kwargs):
        self.kv.stage(key_states, value_states)
        self.kv.attended = False
        self.is_initialized = True
        tagged = key_states.view_as(key_states)
        setattr(tagged, _TAG, self.kv)
        return tagged, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.kv.seq_length()

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self.kv = self._new_kv()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            self.kv.crop(max(0, self.kv.seq_length() + tokens_to_remove))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.kv.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.kv.shape is None:
            return
        idx = indices.to(self.kv.store.device)  # checked and made non-negative by QuantizedCache
        self.kv.map_batch(lambda t: t.index_select(0, idx))

    def offload(self):  # storage lives where the model runs; offloading is not implemented for packed blocks
        pass

    def prefetch(self):
        pass


@dataclass(frozen=True)
class KVBytes(ByteTotals):
    """Exact bytes held by the cache, split by kind, and bits per element including every scale and zero."""

    codes: int
    params: int
    full_precision: int
    allocated: int
    elements: int
    quantized_elements: int

    def summary(self) -> str:
        q = self.quantized_bits_per_element
        qtxt = f", quantized part {q:.3f} bits/element" if q == q else ""
        return (f"KV cache {self.total / 2**20:.2f} MiB (codes {self.codes / 2**20:.2f}, scales/zeros "
                f"{self.params / 2**20:.2f}, full precision {self.full_precision / 2**20:.2f}) = "
                f"{self.bits_per_element:.3f} bits/element overall{qtxt}")


# Routing shared by the caches of one model, so that threads stepping their own caches on one model concurrently
# neither undo each other's routing nor leave it behind: configs' ids -> [steps in flight, implementations to
# restore when the last of them ends].
_ROUTES: dict[tuple[int, ...], list] = {}
_ROUTE_LOCK = threading.Lock()


class QuantizedCache(Cache):
    """A quantized KV cache for transformers models.

    ``QuantizedCache(model.config, "kivi-2")`` then ``model.generate(..., cache=cache)`` (``past_key_values=cache``
    on transformers before the rename; :func:`cache_kwargs` picks the name) or a manual forward loop.  ``spec`` is
    a preset name, a spec string or a :class:`~kvsqueeze.spec.CacheSpec`.  Each forward step that uses the cache
    routes the model's attention through kvsqueeze and restores it afterwards (see the module docstring); nothing
    about the model or its config changes for good.
    ``spec`` may also be the path of a calibration artifact directory written by ``kvsqueeze calibrate``.
    ``backend`` picks the attention kernel: ``auto`` (fastest available), ``torch`` (reference), ``cpu``, ``triton``.
    """

    def __init__(self, config, spec: str | CacheSpec = "kivi-4", backend: str = "auto"):
        from .artifact import check_overrides

        # the one resolver: presets, spec strings, JSON, artifact directories (one key/value spec per layer);
        # a peer's name is refused with a message saying what this cache accepts
        spec = resolve_cache_spec(spec, "QuantizedCache")
        check_backend(backend)
        layout = kv_layout(config)
        spec.check_head_dim(layout.head_dim)  # bad settings fail before anything is allocated
        if spec.layer_overrides is not None:
            check_overrides(spec, layout)  # artifact of another model: ValueError before allocation
        self.spec, self.layout, self._config = spec, layout, config
        step = StepTracker(self._layer_kvs)  # a bound method: a deep copy's tracker follows the copy
        arena = BlockArena()  # the layers' CPU blocks, side by side in huge pages (cache/arena.py)
        layers = []
        for i, t in enumerate(layout.layer_types):
            if spec.layer_overrides is not None and (t != "sliding_attention" or spec.quantize_sliding):
                k_spec, v_spec = spec.layer_overrides[i]
                sliding = t == "sliding_attention"  # calibrated within its window, without sinks
                lspec = dataclasses.replace(spec, key=k_spec, value=v_spec, layer_overrides=None,
                                            sinks=0 if sliding else spec.sinks)
                layers.append(_HFLayer(lspec, layout.sliding_window if sliding else None, backend, step, arena))
                continue
            if t == "sliding_attention":
                lspec = spec if spec.quantize_sliding else CacheSpec(name="full", block_tokens=spec.block_tokens)
                # sinks are masked out of a sliding window anyway; they would only cost memory
                if lspec.sinks:
                    lspec = CacheSpec(key=lspec.key, value=lspec.value, window=lspec.window, sinks=0,
                                      quantize_sliding=True, block_tokens=lspec.block_tokens, name=lspec.name)
                layers.append(_HFLayer(lspec, layout.sliding_window, backend, step, arena))
            else:
                layers.append(_HFLayer(spec, None, backend, step, arena))
        super().__init__(layers=layers)
        register()
        self._route_configs = _configs(config)
        self._routing = False  # this cache's step in flight holds a share of the model's routing (_ROUTES)
        if self.layers:
            self.layers[-1].end_of_step = self.layers[-1].kv.end_of_step = self._unroute

    def _layer_kvs(self) -> list[LayerKV]:
        return [layer.kv for layer in self.layers]

    def __deepcopy__(self, memo):
        # transformers' docs copy a prompt's cache to reuse it: the copy routes the same model, so the model's
        # configs (whose attention implementation routing sets) are shared, not copied
        for c in (self._config, *self._route_configs):
            memo[id(c)] = c
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        twin._routing = False  # the original's step in flight holds the routing share, not the copy
        return twin

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self._route()
        elif not self.layers[layer_idx - 1].attended:
            # the previous layer staged K/V but its attention never reached kvsqueeze: its output ignored the cache
            self._unroute()
            self.layers[0].kv.step.abort()
            raise RuntimeError("the previous layer's attention did not go through kvsqueeze (this model looks up its "
                               "attention function before updating the cache): wrap the call in "
                               "`with kvsqueeze.patch(model):`")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _route(self) -> None:
        """Send this step's attention to kvsqueeze; the previous implementation comes back when the step ends."""
        if self._routing:
            return
        key = tuple(id(c) for c in self._route_configs)
        with _ROUTE_LOCK:
            entry = _ROUTES.get(key)
            if entry is None:
                impls = [c._attn_implementation for c in self._route_configs]
                if all(i == ATTN_NAME for i in impls):
                    return  # routed for good by kvsqueeze.patch(model)
                bad = [i for i in impls if i not in ROUTABLE]
                if bad:
                    raise RuntimeError(f"kvsqueeze's cache reads the masks of {', '.join(ROUTABLE[:2])} attention; "
                                       f"this model uses {bad[0]!r}: load it with attn_implementation='sdpa' or wrap "
                                       "the call in `with kvsqueeze.patch(model):`")
                entry = _ROUTES[key] = [0, impls]
                _set_impl(self._route_configs, [ATTN_NAME] * len(impls))
            entry[0] += 1
            self._routing = True

    def _unroute(self) -> None:
        if not self._routing:
            return
        key = tuple(id(c) for c in self._route_configs)
        with _ROUTE_LOCK:
            self._routing = False
            entry = _ROUTES[key]
            entry[0] -= 1
            if entry[0] == 0:  # the last step in flight on this model: its own implementation comes back
                del _ROUTES[key]
                _set_impl(self._route_configs, entry[1])

    # everything that reads or edits the cache first discards a step that failed part-way
    def _settled(self):
        self._unroute()  # a step that failed outside attention leaves no routing behind either
        if self.layers:
            self.layers[0].kv.step.settle()
        return self

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return Cache.get_seq_length(self._settled(), layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return Cache.get_mask_sizes(self._settled(), query_length, layer_idx)

    # edits are checked before any layer changes: a refused one leaves the cache as it was
    def crop(self, tokens_to_remove: int) -> None:
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise CacheEditError(f"crop takes the number of tokens to remove as a negative int (as transformers' "
                                 f"DynamicCache); got {tokens_to_remove!r}")
        self._settled()
        if tokens_to_remove and any(layer.kv.sliding_window is not None and layer.kv.first_visible > 0
                                    for layer in self.layers):
            raise CacheEditError("cannot crop a cache whose sliding-window layers already evicted tokens; allowed: "
                                 "crops before a sliding layer's window is full")
        Cache.crop(self, tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        Cache.reorder_cache(self._settled(), self._batch_index(beam_idx, "reorder_cache"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise CacheEditError(f"batch_repeat_interleave takes a positive int; got {repeats!r}")
        Cache.batch_repeat_interleave(self._settled(), repeats)

    def batch_select_indices(self, indices) -> None:
        Cache.batch_select_indices(self._settled(), self._batch_index(indices, "batch_select_indices"))

    def _batch_index(self, indices, what: str) -> torch.Tensor:
        """Row indices as a non-negative int64 tensor (a boolean mask gives its True rows; negative indices count from
        the end, as in transformers' own caches); anything else is one CacheEditError line."""
        batch = next((layer.kv.shape[0] for layer in self.layers if layer.kv.shape is not None), None)
        try:
            idx = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError):
            idx = None
        if idx is None or idx.dim() != 1 or not (idx.dtype == torch.bool or not idx.is_floating_point()
                                                 and not idx.is_complex()):
            raise CacheEditError(f"{what} takes a 1-D tensor of row indices or a boolean row mask; got {indices!r}")
        if idx.dtype == torch.bool:
            if batch is not None and idx.numel() != batch:
                raise CacheEditError(f"{what}: a boolean mask of {idx.numel()} rows for a batch of {batch}")
            return idx.nonzero().flatten()
        idx = idx.long()
        if batch is not None and idx.numel() and (idx.min() < -batch or idx.max() >= batch):
            raise CacheEditError(f"{what}: row indices must lie in [-{batch}, {batch - 1}] for a batch of {batch}; "
                                 f"got {idx.tolist()}")
        return idx % batch if batch else idx

    def nbytes(self) -> KVBytes:
        self._settled()
        tot = {"codes": 0, "params": 0, "fp": 0, "allocated": 0, "elements": 0, "quantized_elements": 0}
        for layer in self.layers:
            for k, v in layer.kv.nbytes().items():
                tot[k] += v
        return KVBytes(tot["codes"], tot["params"], tot["fp"], tot["allocated"], tot["elements"],
                       tot["quantized_elements"])

    def token_summary(self) -> str:
        """Where the tokens sit: how many are stored quantized, how many are still in the full-precision window, and
        at which length quantization starts (sliding-window layers evict old tokens instead)."""
        n, spec = self.get_seq_length(), self.spec
        if not spec.quantized:
            return f"{n} tokens, all full precision"
        q = spec.quantized_count(n)
        sinks = min(n, spec.sinks)
        sink_txt = f" and {sinks} attention sinks" if spec.sinks else ""
        if q == 0:
            start = spec.sinks + spec.window + spec.flush_tokens
            return (f"{n} tokens, all in the {spec.window}-token full-precision window{sink_txt}: quantization "
                    f"starts at {start} tokens, {spec.flush_tokens} at a time")
        return f"{n} tokens: {q} quantized, {n - q - sinks} in the {spec.window}-token full-precision window{sink_txt}"

    def summary(self) -> str:
        """One line for people: :meth:`token_summary`, then the exact bytes (:meth:`KVBytes.summary`)."""
        return f"{self.token_summary()}; {self.nbytes().summary()}"

    def __repr__(self) -> str:
        return f"kvsqueeze.QuantizedCache({self.spec.name}: {self.spec.label()}, layers={len(self.layers)})"


# ---------------------------------------------------------------------------------------------- static cache
class _StaticHFLayer(CacheLayerMixin):
    """A :class:`~kvsqueeze.cache.static.StaticLayerKV` for transformers: ``update`` writes a decode step's token in
    place (a prompt is staged) and hands back the ring tensors, tagged so the attention function finds the layer."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, spec: CacheSpec, max_len: int, backend: str, configs: list):
        super().__init__()
        self.kv = StaticLayerKV(spec, max_len)
        self.backend, self.configs = backend, configs

    def lazy_initialization(self, key_states, value_states) -> None:
        from .kernels.static_op import register_layer

        kv = self.kv
        kv.allocate(key_states, value_states)
        kv.ring_encode = ring_encoder
        counted = functools.partial(_attend_counted, kv, resolve_backend(self.backend, key_states.device))

        def planned(query, mask, tensors, scaling):
            return counted(query, kv.plan_from(tensors, query.shape[2]), mask, scaling)

        kv.attend, kv.step_attention, kv.graphed = counted, planned, False
        fmts = (kv.codecs["k"].fmt, kv.codecs["v"].fmt)
        if (self.backend == "triton" or self.backend == "auto" and key_states.is_cuda) and _kernel("triton"):
            from .kernels import triton_static

            if triton_static.supports(*fmts, key_states.shape[-1]):
                def graphed(query, mask, tensors, scaling):  # counts read on the device: CUDA graphs record it
                    _count_path(kv, "triton-static")  # (a replayed graph does not count again)
                    return triton_static.attend(query, mask, scaling, kv, tensors)

                kv.step_attention, kv.graphed = graphed, True
        kv.op_id = register_layer(kv)
        for t in (kv.ring_k, kv.ring_v):
            setattr(t, _TAG, kv)
        if not torch.compiler.is_compiling():  # fixed addresses: a recorded CUDA graph keeps reading them
            for t in kv.tensors():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if any(c._attn_implementation != ATTN_NAME for c in self.configs):
            raise RuntimeError("kvsqueeze's static cache needs the model routed for the whole run: wrap the calls "
                               "in `with kvsqueeze.patch(model):`")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring = self.kv.ring_k
        if (key_states.shape[:2], key_states.shape[3], key_states.dtype) != (ring.shape[:2], ring.shape[3], ring.dtype):
            raise ValueError(f"this StaticQuantizedCache holds batch {ring.shape[0]} x {ring.shape[1]} KV heads x "
                             f"head_dim {ring.shape[3]} in {ring.dtype} (fixed when it was first filled; reset() keeps "
                             f"them); got {tuple(key_states.shape)} in {key_states.dtype}: make a new cache")
        if key_states.shape[2] == 1 and self.kv.pending is None:
            self.kv.write_token(key_states, value_states)
        else:
            self.kv.stage(key_states, value_states)
        return self.kv.ring_k, self.kv.ring_v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.max_len, 0  # mask columns are absolute positions, as the layer's plan reads them

    def get_seq_length(self):
        return self.kv.count if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.kv.max_len

    def reset(self) -> None:
        self.kv.reset()

    # rows re-indexed in place (the addresses a compiled graph holds stay); edits that change shapes are refused
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.as_tensor(indices).to(self.kv.count.device)
        batch = self.kv.ring_k.shape[0]
        if idx.dim() != 1 or idx.numel() != batch or idx.dtype == torch.bool or idx.is_floating_point():
            raise CacheEditError(f"StaticQuantizedCache keeps its batch of {batch}: it takes {batch} row indices "
                                 f"(a permutation or a selection with repeats); got {indices!r}")
        for t in self.kv.tensors()[1:]:
            t.copy_(t.index_select(0, idx % batch))
        self.kv.reset_derived()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise CacheEditError("StaticQuantizedCache keeps the batch it was filled with; QuantizedCache can repeat rows")

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheEditError("StaticQuantizedCache cannot be cropped; QuantizedCache can")

    def offload(self):  # storage lives where the model runs
        pass

    def prefetch(self):
        pass


class StaticQuantizedCache(Cache):
    """A quantized cache of fixed shapes whose decode step ``torch.compile`` captures (``is_compileable``).

    ``StaticQuantizedCache(model.config, "kivi-4", max_cache_len=4096)``, used inside ``with kvsqueeze.patch(model):``
    (the compiled graph reads the attention routing as a constant, so it is set for the whole run).  Everything is
    allocated at the first step for ``max_cache_len`` tokens; a decode step writes in place and branches on no
    value (cache/static.py).  Same codes and outputs as :class:`QuantizedCache` with the same spec, sinks
    included.  Refused in one line: sliding-window layers, calibrated artifacts, fp8 with shared scales."""

    def __init__(self, config, spec: str | CacheSpec = "kivi-4", max_cache_len: int = 4096, backend: str = "auto"):
        spec = resolve_cache_spec(spec, "StaticQuantizedCache")
        check_backend(backend)
        layout = kv_layout(config)
        spec.check_head_dim(layout.head_dim)
        why = static_refusal(spec, "sliding_attention" in layout.layer_types)
        if why is not None:
            raise ValueError(f"StaticQuantizedCache does not serve {why}; QuantizedCache does")
        register()
        self.spec, self.layout = spec, layout
        configs = _configs(config)
        super().__init__(layers=[_StaticHFLayer(spec, max_cache_len, backend, configs)
                                 for _ in layout.layer_types])

    def nbytes(self) -> KVBytes:
        """Bytes allocated (every row up to ``max_cache_len``, and the ring), not bytes in use."""
        tot = {"codes": 0, "params": 0, "fp": 0, "elements": 0, "quantized_elements": 0}
        for layer in self.layers:
            kv = layer.kv
            for k, v in kv.nbytes().items():
                tot[k] += v
            if kv.allocated:
                b, h, _, d = kv.ring_k.shape
                n = int(kv.count)
                tot["elements"] += 2 * b * h * d * n
                tot["quantized_elements"] += 2 * b * h * d * kv.n_stored(n)
        return KVBytes(tot["codes"], tot["params"], tot["fp"], tot["codes"] + tot["params"] + tot["fp"],
                       tot["elements"], tot["quantized_elements"])

    def __repr__(self) -> str:
        return (f"kvsqueeze.StaticQuantizedCache({self.spec.name}: {self.spec.label()}, layers={len(self.layers)}, "
                f"max_cache_len={self.layers[0].kv.max_len if self.layers else 0})")
