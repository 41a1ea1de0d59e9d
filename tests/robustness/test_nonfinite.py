"""Overflow, NaN and zero-range K/V through every codec and attention kernel (docs/robustness.md, "Overflow").

The rule (quant/nonfinite.py): in a quantized group NaN is quantized as 0, +-inf take the group's end codes (its
range is over the finite values), finite values however large give finite parameters and decoded values, and a
zero-range group decodes to exactly its constant.  Full-precision tokens (sinks, window) keep what the model
produced.  Then the reference, the C++ kernel and Triton (interpreted on CPU) must agree on attention.
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():  # before Triton is first imported (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import importlib.util
import unittest.mock

import pytest
import torch

from kvsqueeze.cache.factory import make_codec
from kvsqueeze.cache.layer import LayerKV
from kvsqueeze.kernels import cpu, reference
from kvsqueeze.spec import QuantSpec, preset

from ._counts import record

KIND = "non-finite K/V"
# the Triton interpreter computes the deliberate inf - inf and 0 x inf in numpy, which warns about them
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
INF = float("inf")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _int_specs() -> list[QuantSpec]:
    out = []
    for bits in range(1, 9):
        out += [QuantSpec(fmt="int", bits=bits, axis="token", group=16),
                QuantSpec(fmt="int", bits=bits, axis="channel", group=16),
                QuantSpec(fmt="int", bits=bits, axis="token", group=16, symmetric=True)]
    for pd in ("bf16", "fp32", "fp8-e4m3"):
        out += [QuantSpec(fmt="int", bits=4, axis="token", group=32, param_dtype=pd),
                QuantSpec(fmt="int", bits=2, axis="channel", group=16, param_dtype=pd),
                QuantSpec(fmt="int", bits=3, axis="token", group=16, symmetric=True, param_dtype=pd)]
    return out


KIVI = [preset(p) for p in ("kivi-2", "kivi-4")]
RANGE_SPECS = _int_specs() + [s.key for s in KIVI] + [s.value for s in KIVI] + [
    QuantSpec(fmt="fp8-e4m3", fp8_scale="token"), QuantSpec(fmt="fp8-e5m2", fp8_scale="token"),
    QuantSpec(fmt="fp8-e4m3", fp8_scale="head"), QuantSpec(fmt="ternary", axis="token", group=16)]
ROT3 = preset("rot-3")
VECTOR_SPECS = [QuantSpec(fmt="rot", bits=2.5), QuantSpec(fmt="rot-qjl", bits=2),
                QuantSpec(fmt="rot", bits=2.75, axis="channel", group=16),
                dataclasses.replace(ROT3.key, group=16), ROT3.value]  # rot-3's sides (keys centred over 16 tokens)
T, D = 32, 64


def _label(s: QuantSpec) -> str:
    return f"{s.fmt}{s.bits}{s.axis[0]}{s.group or ''}{'s' if s.symmetric else ''}-{s.param_dtype}-{s.fp8_scale}"


def _groups(codec, spec: QuantSpec, t: int, d: int) -> torch.Tensor:
    """[T, D] group id of each element: the elements that share one range (vector codecs: one token)."""
    tt, dd = torch.meshgrid(torch.arange(t), torch.arange(d), indexing="ij")
    if spec.fmt in ("int", "ternary"):
        g = codec.group
        return tt * d + dd // g if spec.axis == "token" else (tt // g) * d + dd + 10**6
    if spec.fmt.startswith("fp8"):
        return tt if spec.fp8_scale == "token" else torch.zeros_like(tt)
    return tt


def _roundtrip(codec, x: torch.Tensor) -> tuple[dict, torch.Tensor]:
    shared: dict = {}  # a fresh store each time: fp8 per-head scales are fixed by the first encode
    parts = codec.encode(x, 0, shared)
    return parts, codec.decode(parts, 0, shared)


def _finite_parts(parts: dict) -> bool:
    return all(torch.isfinite(p.float()).all() for p in parts.values() if p.is_floating_point())


def _replace_infs(x: torch.Tensor, gid: torch.Tensor, vector: bool, sign_only: bool = False) -> torch.Tensor:
    """x with +-inf replaced by its group's finite max / min (vector codecs: +- the token's finite absmax; 1-bit
    symmetric codes, whose scale is the mean |x| over finite values: +- that mean, which keeps it)."""
    xf = x.float().clone()[0, 0]
    fin = torch.isfinite(xf)
    for g in gid[~fin].unique():
        m = (gid == g)
        vals = xf[m & fin]
        hi, lo = (vals.max(), vals.min()) if len(vals) else (torch.tensor(0.), torch.tensor(0.))
        if vector:
            hi = lo = torch.maximum(hi, -lo)
            lo = -lo
        if sign_only:
            hi = vals.abs().mean() if len(vals) else torch.tensor(0.)
            lo = -hi
        xf[m & (xf == INF)] = hi
        xf[m & (xf == -INF)] = lo
    return xf[None, None].to(x.dtype)


def _base(dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 1, T, D, generator=g) * 2 + 0.3).to(dtype)


def _check_codec(spec: QuantSpec, dtype: torch.dtype) -> None:
    vector = spec.fmt.startswith("rot")
    codec = make_codec(spec, D, dtype)
    gid = _groups(codec, spec, T, D)
    big = min(1e30, float(torch.finfo(dtype).max))

    # NaN: quantized as 0 (decodes as a 0 in its place would)
    x = _base(dtype)
    x[0, 0, 3, 5] = x[0, 0, 20, 40] = float("nan")
    parts, y = _roundtrip(codec, x)
    assert _finite_parts(parts) and torch.isfinite(y).all()
    assert torch.equal(y, _roundtrip(codec, torch.nan_to_num(x, nan=0.0))[1])
    record(KIND, "codec NaN")

    # +-inf: the group's end codes; the finite values decode as if the infs were the group's finite max / min
    x = _base(dtype, 1)
    x[0, 0, 3, 5], x[0, 0, 9, 17], x[0, 0, 20, 40] = INF, -INF, INF
    parts, y = _roundtrip(codec, x)
    assert _finite_parts(parts) and torch.isfinite(y).all()
    one_bit = spec.fmt == "int" and spec.symmetric and spec.bits == 1
    rep = _roundtrip(codec, _replace_infs(x, gid, vector, one_bit))[1]
    infs = ~torch.isfinite(x.float())
    if vector:
        assert torch.equal(y, rep)
    elif one_bit:  # the mean moves by float rounding only
        torch.testing.assert_close(y, rep, rtol=1e-2, atol=0)
    else:
        assert torch.equal(y[~infs], rep[~infs])
        pos, neg = x.float() == INF, x.float() == -INF
        assert (y[pos] >= rep[pos]).all() and (y[neg] <= rep[neg]).all()
    record(KIND, "codec inf")

    # huge finite values (1e30, or the input dtype's max): finite everything, saturating at the group's ends
    x = _base(dtype, 2)
    x[0, 0, 3, 5], x[0, 0, 9, 17] = big, -big
    parts, y = _roundtrip(codec, x)
    assert _finite_parts(parts) and torch.isfinite(y).all()
    for (t, d), sign in (((3, 5), 1), ((9, 17), -1)):
        if vector:
            assert y[0, 0, t, d] * sign > 0
        else:
            members = y[0, 0][gid == gid[t, d]]
            assert y[0, 0, t, d] == (members.max() if sign > 0 else members.min())
    record(KIND, "codec huge")

    # zero range: a constant group decodes to exactly its constant (vector codecs: an all-zero token/group to 0)
    for c in ((0.0,) if vector else (0.0, 1.5, -2.25, 0.375)):
        x = _base(dtype, 3)
        sel = gid == gid[5, 0] if not (vector and spec.axis == "channel") else (torch.arange(T) // 16 == 0)[:, None]
        x[0, 0][sel.expand(T, D)] = c
        parts, y = _roundtrip(codec, x)
        assert torch.equal(y[0, 0][sel.expand(T, D)], x.float()[0, 0][sel.expand(T, D)]), c
        record(KIND, "codec zero-range")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("spec", RANGE_SPECS + VECTOR_SPECS, ids=_label)
def test_codec_rule(spec, dtype):
    _check_codec(spec, dtype)


def _calibrated_specs() -> list[QuantSpec]:
    from kvsqueeze.quant.extras import GroupExtras, PreRopeExtras, TransformExtras

    g = torch.Generator().manual_seed(5)
    perm = torch.stack([torch.randperm(D, generator=g)])
    skvq = QuantSpec(fmt="int", bits=3, axis="token", group=16, param_dtype="fp8-e4m3",
                     extras=GroupExtras(perm, torch.full((1, D // 16), 0.9)))
    lo = -torch.rand(1, D, generator=g) * 3 - 1
    prerope = QuantSpec(fmt="int", bits=2, axis="token", group=D,
                        extras=PreRopeExtras(lo, -lo, 1.0 / 10000 ** (torch.arange(0, D, 2) / D), outliers=2))
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g))
    transform = QuantSpec(fmt="int", bits=4, axis="token", group=32, extras=TransformExtras(q[None], q.T[None]))
    return [skvq, prerope, transform]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_calibrated_codecs(dtype):
    """SKVQ groups (permuted, per-group clip, fp8 parameters), pre-RoPE keys with outliers and an invertible
    transform: no inf/NaN out of NaN, +-inf or +-1e30 in; NaN decodes as 0 would; an all-zero token decodes to 0
    (the pre-RoPE grid is static, so only its NaN/inf rule applies)."""
    for spec in _calibrated_specs():
        codec = make_codec(spec, D, dtype)
        for val in (float("nan"), INF, -INF, 1e30, -1e30):
            x = _base(dtype, 4)
            x[0, 0, 3, 5] = x[0, 0, 11, 30] = val
            x[0, 0, 7] = 0.0
            parts, y = _roundtrip(codec, x)
            assert _finite_parts(parts) and torch.isfinite(y).all(), (type(codec).__name__, val)
            if val != val:
                assert torch.equal(y, _roundtrip(codec, torch.nan_to_num(x, nan=0.0))[1])
            if spec.extras.__class__.__name__ != "PreRopeExtras":
                assert (y[0, 0, 7] == 0).all()
            record(KIND, "codec calibrated")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("pdtype", ["fp32", "fp16", "bf16"])
def test_triton_packer_follows_the_rule(pdtype):
    """The Triton quantize-and-pack (interpreted on CPU) gives the torch codecs' parts bit for bit on non-finite,
    huge and zero-range input (it computes its group ranges separately, so it must follow the rule itself)."""
    from kvsqueeze.cache.codecs import IntChannelCodec, IntTokenCodec
    from kvsqueeze.kernels import triton_pack

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and the interpreter is off")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for axis, bits, sym in (("token", 4, False), ("token", 3, True), ("channel", 2, False), ("channel", 8, True)):
        spec = QuantSpec(fmt="int", bits=bits, axis=axis, group=8, symmetric=sym, param_dtype=pdtype)
        codec = (IntChannelCodec if axis == "channel" else IntTokenCodec)(spec, 16)
        x = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(bits))
        x[0, 0, 1, 2], x[0, 0, 4, 9], x[0, 1, 3, 3], x[0, 1, 9, 12] = INF, -INF, float("nan"), 1e30
        x[0, 1, 0:8, 0] = INF  # a per-channel group with no finite value
        x[0, 0, 12, 8:] = 1.5  # zero-range token group
        x[0, 0, 8:, 5] = -2.25  # zero-range channel group
        got, ref = triton_pack.encode(codec.fmt, x.to(dev)), codec.encode(x)
        assert got is not None and set(got) == set(ref)
        for name in ref:
            assert torch.equal(got[name].cpu(), ref[name]), (axis, bits, sym, name)
        record(KIND, "Triton packer")


# ------------------------------------------------------------------------------------------------ attention
def _kernels():
    out = {"reference": reference.attend}
    if cpu.load_extension() is not None:
        out["cpu"] = cpu.attend
    if HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        from kvsqueeze.kernels import triton_decode

        out["triton"] = triton_decode.attend
        out["triton-dense"] = _dense_prefill(triton_decode.attend)
    return out


def _dense_prefill(attend):
    """``attend`` with prefill steps on the dense route (kernels/triton_prefill.py: unpacked once, then SDPA)."""
    def run(*args):
        with unittest.mock.patch.dict(os.environ, {"KVSQUEEZE_TRITON_PREFILL_DENSE": "1"}):
            return attend(*args)
    return run


@pytest.fixture
def kernels(monkeypatch):
    ks = _kernels()
    if "triton" in ks:  # tiny chunks: the interpreter is slow
        from kvsqueeze.kernels import triton_decode

        monkeypatch.setattr(triton_decode, "CHUNK", 32)
        monkeypatch.setattr(triton_decode, "BLOCK_T", 32)
    return ks


def _layer(spec: str, where: list[int], val: float, dtype: torch.dtype, n: int = 80, d: int = 32,
           new_tokens: int = 1) -> LayerKV:
    g = torch.Generator().manual_seed(7)
    layer = LayerKV(preset(spec))
    k, v = torch.randn(1, 1, n, d, generator=g), torch.randn(1, 1, n, d, generator=g)
    for i, t in enumerate(where):
        k[0, 0, t, 3 + i] = val
        v[0, 0, t, 5 + i] = -val
    layer.stage(k.to(dtype), v.to(dtype))
    layer.commit()
    new = torch.randn(1, 1, new_tokens, d, generator=g).to(dtype)
    layer.stage(new, new)
    return layer


def _compare(kernels: dict, layer: LayerKV, dtype, outcome: str, lq: int = 1) -> dict:
    q = torch.randn(1, 2, lq, layer.shape[-1], generator=torch.Generator().manual_seed(3)).to(dtype)
    outs = {name: fn(q, layer.plan(), None, 0.17).float() for name, fn in kernels.items()}
    ref = outs["reference"]
    for name, out in outs.items():
        assert torch.equal(torch.isfinite(out), torch.isfinite(ref)), name
        fin = torch.isfinite(ref)
        scale = ref[fin].abs().max().item() if fin.any() else 0.0
        torch.testing.assert_close(out[fin], ref[fin], rtol=2e-2, atol=2e-3 * (1 + scale))
        record(KIND, f"attention {outcome} ({name})")
    return outs


SPECS = ["k4t32-v4t32-w16", "k2c16-v2t16-w16-s4", "k8t32-v3c16-w16", "k3r-v2.5r-w16", "fp8-e4m3"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("val", [INF, float("nan"), 1e30], ids=["inf", "nan", "1e30"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", [32, 64], ids=["d32", "d64"])  # 64: the C++ kernel's fast paths (integer keys/values)
def test_quantized_nonfinite_attention_agrees(kernels, spec, val, dtype, d):
    """Non-finite and huge values in quantized tokens: finite attention, the same in every kernel."""
    layer = _layer(spec, [6, 10, 33], val, dtype, d=d)
    outs = _compare(kernels, layer, dtype, "quantized")
    assert torch.isfinite(outs["reference"]).all()


@pytest.mark.parametrize("val", [INF, float("nan")], ids=["inf", "nan"])
def test_sink_nonfinite_follows_torch(kernels, val):
    """A non-finite sink token is kept as the model produced it: torch's arithmetic, in every kernel alike."""
    layer = _layer("k2c16-v2t16-w16-s4", [1], val, torch.float32)
    outs = _compare(kernels, layer, torch.float32, "sink")
    assert not torch.isfinite(outs["reference"]).all()


@pytest.mark.parametrize("lq", [1, 4, 20], ids=["decode", "decode-4", "multi-query"])
@pytest.mark.parametrize("val", [INF, float("nan")], ids=["inf", "nan"])
def test_window_nonfinite_follows_torch(kernels, val, lq):
    """The same for a window token, for 1 and 4 queries (the C++ decode path) and 20 (its multi-query path): a NaN
    or +inf score makes the row NaN in every kernel, as in the reference (the C++ kernel's clamped exponentials
    used to drop them)."""
    layer = _layer("k4t32-v4t32-w16", [75], val, torch.float32, new_tokens=lq)
    outs = _compare(kernels, layer, torch.float32, f"window, {lq} queries", lq=lq)
    assert not torch.isfinite(outs["reference"]).all()


# ------------------------------------------------------------------------------------------------ end to end
def test_bf16_model_with_nonfinite_cache_agrees_across_backends():
    """A tiny bf16 Llama decoding over a QuantizedCache whose stored K/V hold inf, -inf, NaN and +-1e30 (crafted
    and handed to ``update``, as a model whose projections overflow would): finite logits, equal in every backend."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsqueeze.adapter import QuantizedCache, attention_paths, cache_kwargs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    kv = []
    for _ in range(cfg.num_hidden_layers):
        k, v = torch.randn(1, 1, 64, 32, generator=g), torch.randn(1, 1, 64, 32, generator=g)
        for t, val in ((5, INF), (9, -INF), (12, float("nan")), (20, 1e30), (27, -1e30)):
            k[0, 0, t, t % 32] = val
            v[0, 0, t, (t + 7) % 32] = val
        kv.append((k.to(torch.bfloat16), v.to(torch.bfloat16)))
    backends = ["torch"] + [b for b in ("cpu", "triton") if b in _kernels()]
    logits = {}
    for backend in backends:
        cache = QuantizedCache(cfg, "k4c16-v4t16-w16-s2", backend=backend)
        for lay, (k, v) in zip(cache.layers, kv):  # what each layer's update + attention would have stored
            lay.kv.stage(k, v)
            lay.kv.commit()
            lay.is_initialized = True
        out = []
        with torch.no_grad():
            for tok in (3, 17, 42):
                out.append(model(torch.tensor([[tok]]), **cache_kwargs(model, cache)).logits.float())
        assert cache.get_seq_length() == 67
        logits[backend] = torch.cat(out)
        assert torch.isfinite(logits[backend]).all(), backend
        assert sum(attention_paths(cache).values()) > 0
        record(KIND, f"bf16 model ({backend})")
    for backend, got in logits.items():
        torch.testing.assert_close(got, logits["torch"], atol=5e-2, rtol=5e-2, msg=lambda m, b=backend: f"{b}: {m}")
