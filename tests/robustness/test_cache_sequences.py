"""Random sequences of cache operations (prefill chunks, decode steps, crop, reorder_cache, batch_select_indices,
batch_repeat_interleave: what generate, beam search, assisted decoding and contrastive search call) applied at once
to a kvsqueeze QuantizedCache and to transformers' DynamicCache on a tiny random Llama.

After every operation the sequence lengths agree, and after every forward step:

* full-precision presets (no window; and a window with sinks, whose tokens still move through the block store):
  logits equal DynamicCache's to float rounding;
* quantized presets: logits equal a *replay*: a fresh cache of the same preset fed the surviving rows' tokens in
  the same chunks, with the same crops at the same points, and no batch operation.  Rows are independent
  (every scale and zero belongs to one row), so a reorder, select or repeat must leave each row exactly as if the
  batch had always been those rows.  Crops are replayed rather than removed because a crop by design is not a
  rebuild: token groups already quantized stay quantized, and a partial group's decoded tokens go back to the
  window (LayerKV.crop), so a cache cropped to L tokens holds more quantized tokens than one fed L tokens;
* the int8 preset (lossless enough; keys per channel in groups of 8 tokens, so crops cut quantized groups) also
  stays within int8 noise of DynamicCache, which checks that a crop keeps the right tokens in the right places
  through the quantized path, the decoded partial group included.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvsqueeze import QuantizedCache
from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.errors import KvsqueezeError
from kvsqueeze.spec import FULL, CacheSpec, QuantSpec

from ._counts import record

SEQUENCES = 12  # per preset
MAX_TOKENS = 56  # enough for the small windows below to quantize several groups
VOCAB = 128

PRESETS = {
    "full": CacheSpec(name="full", block_tokens=8),
    "full window+sinks": CacheSpec(key=FULL, value=FULL, window=4, sinks=3, block_tokens=4, name="full-w4-s3"),
    # per-channel keys: tokens are quantized 8 at a time, so crops fall inside token groups (decoded back to the window)
    "int8": CacheSpec(key=QuantSpec(bits=8, axis="channel", group=8), value=QuantSpec(bits=8, axis="token", group=32),
                      window=0, block_tokens=8, name="k8c8-v8t32-w0"),
    "kivi-4": CacheSpec(key=QuantSpec(bits=4, axis="channel", group=8), value=QuantSpec(bits=4, axis="token", group=32),
                        window=8, block_tokens=16, name="kivi-4-w8"),
    "kivi-2 sinks": CacheSpec(key=QuantSpec(bits=2, axis="channel", group=8),
                              value=QuantSpec(bits=2, axis="token", group=32), window=8, sinks=3, block_tokens=16,
                              name="kivi-2-w8-s3"),
}
EXACT = ("full", "full window+sinks")
TIGHT = dict(atol=3e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32).eval().requires_grad_(False)


# operations with their random parts as numbers in [0, 1) or small lists, mapped onto the current batch and length
# when applied (so every drawn sequence is valid whatever came before it)
_frac = st.floats(0, 1, exclude_max=True)
_rows = st.lists(st.integers(0, 3), min_size=1, max_size=4)
_op = st.one_of(
    st.tuples(st.just("prefill"), st.integers(2, 12)),
    st.tuples(st.just("decode"), st.just(1)),
    st.tuples(st.just("crop"), _frac),
    st.tuples(st.just("reorder"), _rows),
    st.tuples(st.just("select"), _rows),
    st.tuples(st.just("repeat"), st.integers(1, 2)),
)
_case = st.tuples(st.integers(2, 4), st.integers(1, 32), st.lists(_op, min_size=3, max_size=14),
                  st.integers(0, 2**16))


def _forward(model, cache, ids):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache)).logits


class _Replay:
    """The reference of a quantized preset: per row, the events (fed tokens, crops) that made it; rebuilt from
    them after a batch operation, extended in step otherwise."""

    def __init__(self, model, spec, batch: int):
        self.model, self.spec = model, spec
        self.rows: list[list[tuple[str, object]]] = [[] for _ in range(batch)]
        self.cache = QuantizedCache(model.config, spec)

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        for row, x in zip(self.rows, ids):
            row.append(("feed", x))
        return _forward(self.model, self.cache, ids)

    def crop(self, n: int) -> None:
        for row in self.rows:
            row.append(("crop", n))
        self.cache.crop(-n)

    def select(self, idx: list[int]) -> None:
        self.rows = [list(self.rows[i]) for i in idx]  # a repeated row gets its own list
        self.cache = QuantizedCache(self.model.config, self.spec)
        for j, (kind, _) in enumerate(self.rows[0]):  # every row saw the same kinds of events
            if kind == "feed":
                _forward(self.model, self.cache, torch.stack([row[j][1] for row in self.rows]))
            else:
                self.cache.crop(-self.rows[0][j][1])


def _check_length(name, cache, dyn, ref) -> None:
    n = dyn.get_seq_length()
    assert cache.get_seq_length() == n, (name, cache.get_seq_length(), n)
    if ref is not None:
        assert ref.cache.get_seq_length() == n


def _run(model, name, batch, first, ops, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    spec = PRESETS[name]
    cache, dyn = QuantizedCache(model.config, spec), DynamicCache(config=model.config)
    ref = None if name in EXACT else _Replay(model, spec, batch)
    for kind, arg in [("prefill", first), *ops]:
        n = dyn.get_seq_length()
        if kind in ("prefill", "decode"):
            t = min(arg, MAX_TOKENS - n)
            if t <= 0:
                record("cache operation sequences", f"{kind} skipped (full)")
                continue
            ids = torch.randint(2, VOCAB, (batch, t), generator=g)
            got, want = _forward(model, cache, ids), _forward(model, dyn, ids)
            if name in EXACT:
                torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"{name} vs DynamicCache: {m}")
            else:
                torch.testing.assert_close(got, ref.feed(ids), **TIGHT, msg=lambda m: f"{name} vs replay: {m}")
                if name == "int8":
                    assert (got - want).abs().max() < 0.02, "int8 left int8 noise of DynamicCache"
        elif n == 0:  # DynamicCache ignores batch operations on an empty cache: nothing to compare
            record("cache operation sequences", f"{kind} skipped (empty)")
            continue
        elif kind == "crop":
            remove = 1 + int(arg * n)  # 1 .. n tokens: down to an empty cache
            kv = cache.layers[0].kv
            if kv.n_history and n - remove < kv.n_sinks + kv.n_history and kv.spec.quantized:
                record("cache operation sequences", "crop into quantized tokens")
            for c in (cache, dyn):
                c.crop(-remove)
            if ref is not None:
                ref.crop(remove)
        elif kind in ("reorder", "select"):
            idx = [i % batch for i in arg]
            if kind == "reorder":  # beam search: as many rows as before, any of them repeated
                idx = (idx * batch)[:batch]
            else:  # contrastive search / assisted decoding: a subset
                idx = sorted(set(idx))
            for c in (cache, dyn):
                getattr(c, "reorder_cache" if kind == "reorder" else "batch_select_indices")(torch.tensor(idx))
            if ref is not None:
                ref.select(idx)
            batch = len(idx)
        elif kind == "repeat":
            if batch * arg > 4:
                record("cache operation sequences", "repeat skipped (batch)")
                continue
            for c in (cache, dyn):
                c.batch_repeat_interleave(arg)
            if ref is not None:
                ref.select([i for i in range(batch) for _ in range(arg)])
            batch *= arg
        _check_length(name, cache, dyn, ref)
        record("cache operation sequences", kind)
    record("cache operation sequences", f"sequence ({name})")


# no shrinking: each example runs a model, and a failing sequence is short enough to read as it is
@settings(max_examples=SEQUENCES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(_case)
@example((2, 4, [("crop", 0.99), ("prefill", 3)], 0))  # crop to 0 without sinks: TypeError (found here)
@pytest.mark.parametrize("name", list(PRESETS))
def test_random_operation_sequences_match_dynamic_cache_and_replay(model, name, case):
    _run(model, name, *case)


_BAD_EDITS = [
    ("crop", 3), ("crop", 1.5), ("crop", True), ("reorder_cache", [0, 5]), ("reorder_cache", [-4]),
    ("reorder_cache", [[0, 1]]), ("batch_select_indices", [2.0]), ("batch_select_indices", "0"),
    ("batch_select_indices", [True]), ("batch_select_indices", [7]), ("batch_repeat_interleave", 0),
    ("batch_repeat_interleave", -1), ("batch_repeat_interleave", 2.0),
]


@pytest.mark.parametrize("method, arg", _BAD_EDITS)
def test_bad_edits_are_one_line_refusals_that_change_nothing(model, method, arg):
    """Out-of-range rows, wrong types, a positive crop: one KvsqueezeError line (out-of-range rows were torch's
    IndexError from inside a layer), and the cache runs on exactly as if the edit had not been asked."""
    spec = PRESETS["kivi-2 sinks"]
    ids = torch.randint(2, VOCAB, (3, 30), generator=torch.Generator().manual_seed(1))
    cache, ref = QuantizedCache(model.config, spec), QuantizedCache(model.config, spec)
    for c in (cache, ref):
        _forward(model, c, ids[:, :29])
    x = torch.tensor(arg) if isinstance(arg, list) and method != "batch_select_indices" else arg
    with pytest.raises(KvsqueezeError) as err:
        getattr(cache, method)(x)
    assert str(err.value) and "\n" not in str(err.value)
    torch.testing.assert_close(_forward(model, cache, ids[:, 29:]), _forward(model, ref, ids[:, 29:]), **TIGHT)
    record("cache operation sequences", "bad edit refused")


def test_negative_rows_and_masks_select_as_in_dynamic_cache(model):
    ids = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    for sel in (torch.tensor([-1, 0]), torch.tensor([True, False, True])):
        cache, dyn = QuantizedCache(model.config, PRESETS["full"]), DynamicCache(config=model.config)
        for c in (cache, dyn):
            _forward(model, c, ids[:, :11])
            c.batch_select_indices(sel)
        rows = ids[sel]
        torch.testing.assert_close(_forward(model, cache, rows[:, 11:]), _forward(model, dyn, rows[:, 11:]), **TIGHT)
        record("cache operation sequences", "select with negative rows / mask")


def test_crop_after_a_sliding_layer_evicted_is_refused_before_any_layer_changes(tiny_mixed_sliding):
    """One KvsqueezeError line (it was a bare ValueError from the first sliding layer), checked before any layer is
    cropped (a full-attention layer before a sliding one would have been cropped already)."""
    model = tiny_mixed_sliding
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    cache = QuantizedCache(model.config, CacheSpec(block_tokens=8, name="full8"))
    _forward(model, cache, ids[:, :79])
    with pytest.raises(KvsqueezeError, match="sliding-window layers already evicted"):
        cache.crop(-5)
    assert [layer.kv.n_total for layer in cache.layers] == [79] * 4
    ref = DynamicCache(config=model.config)
    _forward(model, ref, ids[:, :79])
    torch.testing.assert_close(_forward(model, cache, ids[:, 79:]), _forward(model, ref, ids[:, 79:]), **TIGHT)
