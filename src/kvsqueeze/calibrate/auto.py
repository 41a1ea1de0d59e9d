"""A per-layer, per-side choice of cache formats at an average bit budget (``kvsqueeze calibrate --method auto``).

What is measured, on the calibration slice only:

1. Sensitivity.  One backward pass per calibration sequence gives ``G``, the gradient of the sequence's NLL with
   respect to every layer's attention output (the input of ``o_proj``).  For each layer, side and candidate
   format, the layer's attention output is recomputed at evenly spaced query positions with only that side of
   that layer quantized as the cache would store it (window, sinks and flush granularity included, the window
   protocol's view), and the cost is ``0.5 * sum(G^2 * dO^2)``: the second-order change of the NLL under a
   diagonal empirical-Fisher approximation (the first-order term averages out over quantization noise).  The
   NLL change is the log-perplexity change, so these costs predict perplexity directly, and they add up over
   layers and sides to first order.
2. Assignment.  A multiple-choice knapsack (dynamic programming over exact costs in eighths of a bit, or
   sixteenths where a head_dim needs them: :func:`cost_unit`) picks one format per
   layer and side minimising the summed cost with the average bits, every scale, zero-point and centre counted
   (:func:`kvsqueeze.quant.bits_per_element`), at most the budget.  The average is over the elements the cache
   will hold quantized at the calibration length (:func:`held_tokens`): a sliding layer keeps only the blocks its
   window still sees, so a hybrid model's global layers weigh more (Gemma-3-270M, 2048 tokens: 4 to 1), and the
   real cache then holds the budget rather than exceeding it (equal weights gave 4.080 b for a 4.0 b budget).
3. Refinement.  The chosen assignment is re-measured end to end: the KL divergence of the model's next-token
   distribution (all layers quantized at once, window protocol) from the full-precision model's on the same
   slice, and the same with keys only and values only quantized.  Where the measured key/value shares disagree
   with the predicted ones, the key (or value) costs are rescaled by the ratio and the knapsack solved again;
   the assignment with the smaller measured KL is kept.

Candidates are formats the cache and the C++/Triton kernels serve per layer: KIVI-style integers (1-4 bits,
per-channel keys in 32-token groups, per-token values in 32-channel groups, fp16 parameters), rotated codebooks
(keys centred per 128 tokens) at quarter-bit widths 1.5-4, and int8 per-token groups of 64.  A mixed assignment
is uniform within each layer, so every layer's kernel call is a uniform one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..artifact import Side
from ..cache.emulate import fake_quantize_cache
from ..quant import bits_per_element
from ..spec import CacheSpec, QuantSpec
from .clip import attention_out, layer_scope, query_positions
from .collect import Activations

UNIT = 8  # costs in eighths of a bit, or finer where a head_dim needs it (cost_unit)
BLOCK_TOKENS = CacheSpec.block_tokens  # the cache's storage blocks (sliding layers evict whole ones)
ROT_WIDTHS = (1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 3.75, 4.0)


def candidates(side: str, head_dim: int) -> list[QuantSpec]:
    """The formats tried for one side of a layer."""
    out = []
    for b in (1, 2, 3, 4):
        out.append(QuantSpec(fmt="int", bits=b, axis="channel", group=32) if side == "key" else
                   QuantSpec(fmt="int", bits=b, axis="token", group=32))
    for w in ROT_WIDTHS:
        out.append(QuantSpec(fmt="rot", bits=w, axis="channel", group=128) if side == "key" else
                   QuantSpec(fmt="rot", bits=w))
    out.append(QuantSpec(fmt="int", bits=8, axis="token", group=64))
    return [q for q in out if _serves(q, head_dim)]


def _serves(q: QuantSpec, head_dim: int) -> bool:
    try:
        q.check_head_dim(head_dim)
    except ValueError:
        return False
    return True


def cost_unit(quants: list[QuantSpec], head_dim: int) -> int:
    """The knapsack's unit, in fractions of a bit: eighths, or the power of two that counts every candidate's bits
    exactly (head_dim 256: a rotated side's fp16 norm is 1/16 bit per element, which eighths rounded away, and the
    real cache held 4.008 bits for a 4.0 budget)."""
    unit = UNIT
    while unit < 1024 and any(abs(bits_per_element(q, head_dim) * unit - round(bits_per_element(q, head_dim) * unit))
                              > 1e-9 for q in quants):
        unit *= 2
    return unit


def cost_units(q: QuantSpec, head_dim: int, unit: int = UNIT) -> int:
    """Bits per element in units of 1 / ``unit`` bit (exact when ``unit`` comes from :func:`cost_unit`)."""
    return round(bits_per_element(q, head_dim) * unit)


# ------------------------------------------------------------------------------------------------ gradients
def output_gradients(model: Any, ids: torch.Tensor, progress: bool = True) -> dict[int, torch.Tensor]:
    """Per attention layer: the gradient of each sequence's summed NLL with respect to the attention output
    (``o_proj``'s input), [N, L, Hq * D] float32."""
    from tqdm.auto import tqdm

    attn = {m.layer_idx: m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")}
    if not attn:
        raise ValueError("--method auto needs attention modules with an o_proj (the output projection)")
    grads: dict[int, list[torch.Tensor]] = {i: [] for i in attn}
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, m in attn.items():
        def pre(mod, args, i=i):
            x = args[0]
            x.retain_grad()
            seen[i] = x
        hooks.append(m.o_proj.register_forward_pre_hook(pre))
    emb = model.get_input_embeddings()
    try:
        for row in tqdm(range(ids.shape[0]), desc="auto: output gradients", disable=not progress):
            x = ids[row:row + 1]
            with torch.enable_grad():
                e = emb(x).detach().requires_grad_(True)  # the graph starts here (the weights stay frozen)
                logits = model(inputs_embeds=e, use_cache=False).logits[0, :-1].float()
                loss = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
                loss.backward()
            for i in attn:
                grads[i].append(seen[i].grad.detach().float()[0])
            seen.clear()
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.stack(g) for i, g in grads.items()}


# ------------------------------------------------------------------------------------------------ sensitivity
def layer_costs(la: Any, grad: torch.Tensor, side: str, quants: list[QuantSpec], window: int, sinks: int,
                max_queries: int = 256) -> list[float]:
    """0.5 * sum(G^2 dO^2) of one layer for each format of ``side`` (the other side exact)."""
    n, hq, length, d = la.q.shape
    hkv = la.k.shape[1]
    sinks, scope = layer_scope(la, sinks)
    start = window + sinks if window + sinks < length // 2 else 16
    qpos = query_positions(length, max_queries, start=start)
    ref = attention_out(la.q, la.k, la.v, qpos, la.scaling, **scope)  # [N, Hkv, rep*P, D]
    g = grad.view(n, length, hq, d)[:, qpos].permute(0, 2, 1, 3).reshape(n, hkv, -1, d)
    g2 = g ** 2
    out = []
    for q in quants:
        spec = CacheSpec(**{side: q}, window=window, sinks=sinks)
        k_hat, v_hat = fake_quantize_cache(la.k, la.v, spec)
        o = attention_out(la.q, la.k, la.v, qpos, la.scaling, k_hat if side == "key" else None,
                          v_hat if side == "value" else None, window, sinks, flush=spec.flush_tokens, **scope)
        out.append(0.5 * float((g2 * (o - ref) ** 2).sum()) * (length - start) / max(1, len(qpos)))
    return out


# ------------------------------------------------------------------------------------------------ knapsack
def held_tokens(la: Any, length: int, window: int, sinks: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Tokens one layer's cache holds quantized after ``length`` tokens, as the cache stores them: all but the
    full-precision window and sinks; a sliding layer (no sinks) drops whole blocks of ``block_tokens`` that no query
    sees any more (``BlockStore.evict_before``).  Flush granularity (32 or 128 tokens) is left out: it moves a
    layer's count by less than one token group."""
    sliding = getattr(la, "sliding_window", None)
    stored = max(0, length - window - layer_scope(la, sinks)[0])  # (a sliding layer keeps no sinks)
    if sliding is None:
        return stored
    first_seen = max(0, length - sliding + 1)  # the next query sees positions >= this
    return stored - min(first_seen // block_tokens, stored // block_tokens) * block_tokens


def budget_weights(held: list[int], limit: int = 1024) -> list[int]:
    """Integer knapsack weights proportional to each group's held tokens: divided by their common divisor, or
    rounded to at most ``limit`` where that leaves them larger (the knapsack's table grows with their sum; the
    rounding then moves a weight by at most 1 in ``limit``); equal weights when nothing is held."""
    if not any(held):
        return [1] * len(held)
    g = math.gcd(*held)
    w = [h // g for h in held]
    if max(w) > limit:
        top = max(held)
        w = [max(1, round(h * limit / top)) if h else 0 for h in held]
    return w


def knapsack(costs: list[list[float]], units: list[list[int]], budget: int) -> list[int]:
    """Multiple-choice knapsack: one option per group minimising the summed cost with summed units <= budget
    (dynamic programming over exact totals).  ValueError if even the cheapest options exceed the budget."""
    inf = float("inf")
    best = torch.full((budget + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    choice = []
    for c, u in zip(costs, units):
        new = torch.full_like(best, inf)
        arg = torch.full((budget + 1,), -1, dtype=torch.long)
        for j, (cj, uj) in enumerate(zip(c, u)):
            if uj > budget:
                continue
            cand = torch.full_like(best, inf)
            cand[uj:] = best[:budget + 1 - uj] + cj
            better = cand < new
            new = torch.where(better, cand, new)
            arg = torch.where(better, torch.full_like(arg, j), arg)
        best = new
        choice.append(arg)
    if not math.isfinite(float(best.min())):
        raise ValueError("the bit budget is below the cheapest format of every layer")
    total = int(best.argmin())
    picks = []
    for g in range(len(costs) - 1, -1, -1):
        j = int(choice[g][total])
        picks.append(j)
        total -= units[g][j]
    return picks[::-1]


# ------------------------------------------------------------------------------------------------ end to end
QUERY_CHUNK = 256  # queries per attention_out call of a full sequence


def causal_attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, k_hat: torch.Tensor,
                         v_hat: torch.Tensor, spec: CacheSpec, softcap: float | None = None,
                         visible: int | None = None) -> torch.Tensor:
    """attention_out at every position of q [B, Hq, T, D] as the cache of ``spec`` would serve it (``visible``: a
    sliding layer's window), [B, Hkv, rep, T, D]: QUERY_CHUNK queries at a time against the keys up to the chunk's
    last only (later keys are masked out anyway), so the work and the temporaries are a fraction of one [T, T] pass
    and the result is the same."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    outs = []
    for a in range(0, t, QUERY_CHUNK):
        e = min(t, a + QUERY_CHUNK)
        o = attention_out(q[:, :, a:e], k[:, :, :e], v[:, :, :e], torch.arange(a, e), scaling, k_hat[:, :, :e],
                          v_hat[:, :, :e], spec.window, spec.sinks, q_selected=True, flush=spec.flush_tokens,
                          visible=visible, softcap=softcap)
        outs.append(o.view(b, hkv, hq // hkv, e - a, d))
    return torch.cat(outs, dim=3)


class WindowKL:
    """Mean KL(full || quantized) of the next-token distributions over ``ids`` [N, L], every layer quantized with
    its spec (None = exact) as the window protocol's queries see the cache; ``kl(layer_specs)``.  The
    full-precision model's log-probabilities are computed once and kept (up to ``keep_bytes``), so each further
    assignment measured costs one quantized forward per sequence."""

    def __init__(self, model: Any, ids: torch.Tensor, keep_bytes: int = 2 << 30):
        self.model, self.ids = model, ids
        self.keep = ids.numel() * model.config.get_text_config().vocab_size * 4 <= keep_bytes
        self.refs: dict[int, torch.Tensor] = {}

    def _reference(self, row: int) -> torch.Tensor:
        if row in self.refs:
            return self.refs[row]
        ref = torch.log_softmax(self.model(self.ids[row:row + 1], use_cache=False).logits[0].float(), -1)
        if self.keep:
            self.refs[row] = ref
        return ref

    @torch.no_grad()
    def kl(self, layer_specs: list[CacheSpec | None]) -> float:
        from ..adapter import attention_override, sdpa_attention_forward

        def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
            spec = layer_specs[module.layer_idx]
            if spec is None:
                return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kw)
            sc = query.shape[-1] ** -0.5 if scaling is None else scaling
            visible = kw.get("sliding_window") or getattr(module, "sliding_window", None)
            if visible is not None and spec.sinks:  # a sliding layer keeps no sinks (as layer_scope says)
                spec = dataclasses.replace(spec, sinks=0)
            k_hat, v_hat = fake_quantize_cache(key.float(), value.float(), spec)
            o = causal_attention_out(query, key, value, sc, k_hat, v_hat, spec, kw.get("softcap"),
                                     visible)  # [B, Hkv, rep, T, D]
            b, hq, t, d = query.shape
            return o.reshape(b, hq, t, d).transpose(1, 2).to(query.dtype).contiguous(), None

        total, count = 0.0, 0
        for row in range(self.ids.shape[0]):
            ref = self._reference(row)
            with attention_override(self.model, attend):
                got = torch.log_softmax(self.model(self.ids[row:row + 1], use_cache=False).logits[0].float(), -1)
            total += float((ref.exp() * (ref - got)).sum())
            count += ref.shape[0]
        return total / count


def window_kl(model: Any, ids: torch.Tensor, layer_specs: list[CacheSpec | None]) -> float:
    """WindowKL(model, ids).kl(layer_specs): one assignment measured."""
    return WindowKL(model, ids).kl(layer_specs)


@dataclasses.dataclass
class Plan:
    """One assignment: the chosen (key, value) format per layer and what was measured of it."""

    formats: list[tuple[QuantSpec, QuantSpec]]
    predicted: float
    bits: float
    kl: float | None = None
    kl_keys: float | None = None
    kl_values: float | None = None
    predicted_keys: float = 0.0


def choose(model: Any, acts: Activations, ids: torch.Tensor, bits: float, window: int, sinks: int,
           progress: bool = True, refine: bool = True) -> tuple[Plan, dict[str, Any]]:
    """The assignment at ``bits`` and a record of the measurements (see the module docstring)."""
    from tqdm.auto import tqdm

    grads = output_gradients(model, ids, progress)
    d = acts.head_dim
    layers = [i for i, la in enumerate(acts.layers) if la is not None]
    cands = {s: candidates(s, d) for s in ("key", "value")}
    unit = cost_unit(cands["key"] + cands["value"], d)
    units = {s: [cost_units(q, d, unit) for q in cands[s]] for s in cands}
    table: dict[tuple[int, str], list[float]] = {}
    bar = tqdm(total=2 * len(layers), desc="auto: sensitivity (layer x side x format)", disable=not progress)
    for i in layers:
        for s in ("key", "value"):
            table[i, s] = layer_costs(acts.layers[i], grads[i], s, cands[s], window, sinks)
            bar.update(1)
    bar.close()
    groups = [(i, s) for i in layers for s in ("key", "value")]
    # the budget holds on average over the elements the cache will hold quantized at this length
    held = [held_tokens(acts.layers[i], ids.shape[1], window, sinks) for i, _ in groups]
    weight = budget_weights(held)
    budget = math.floor(bits * unit + 1e-9) * sum(weight)

    def solve(scale: dict[str, float]) -> Plan:
        picks = knapsack([[c * scale[s] for c in table[i, s]] for i, s in groups],
                         [[u * w for u in units[s]] for (_, s), w in zip(groups, weight)], budget)
        chosen = {g: cands[g[1]][j] for g, j in zip(groups, picks)}
        pred = sum(table[g][j] for g, j in zip(groups, picks))
        pred_keys = sum(table[g][j] for g, j in zip(groups, picks) if g[1] == "key")
        avg = sum(units[g[1]][j] * w for g, j, w in zip(groups, picks, weight)) / unit / sum(weight)
        return Plan([(chosen[i, "key"], chosen[i, "value"]) if i in layers else (QuantSpec(fmt="none"),) * 2
                     for i in range(len(acts.layers))], pred, avg, predicted_keys=pred_keys)

    probe = WindowKL(model, ids)

    def measure(plan: Plan) -> None:
        def specs(which: str) -> list[CacheSpec | None]:
            out: list[CacheSpec | None] = []
            for k, v in plan.formats:
                if not k.quantized:
                    out.append(None)
                    continue
                out.append(CacheSpec(key=k if which != "value" else QuantSpec(fmt="none"),
                                     value=v if which != "key" else QuantSpec(fmt="none"), window=window,
                                     sinks=sinks))
            return out
        plan.kl = probe.kl(specs("both"))
        plan.kl_keys = probe.kl(specs("key"))
        plan.kl_values = probe.kl(specs("value"))

    plan = solve({"key": 1.0, "value": 1.0})
    record: dict[str, Any] = {"measure": "0.5*sum(G^2 dO^2), G = dNLL/d(attention output), window protocol",
                              "budget_weights": {f"{i}.{s}": w for (i, s), w in zip(groups, weight)},
                              "candidates": {s: [q.label() for q in cands[s]] for s in cands},
                              "costs": {f"{i}.{s}": table[i, s] for i, s in groups}}
    if not refine:
        return plan, record
    with tqdm(total=2, desc="auto: re-measuring end to end", disable=not progress) as bar:
        measure(plan)
        bar.update(1)
        pk = plan.predicted_keys
        pv = plan.predicted - pk
        # rescale one side's costs by how far its measured share departs from the predicted one
        ratio = (plan.kl_keys / max(pk, 1e-12)) / max(plan.kl_values / max(pv, 1e-12), 1e-12) \
            if pk > 0 and pv > 0 else 1.0
        record["first"] = _plan_record(plan)
        record["key_value_ratio"] = ratio
        if abs(math.log(max(ratio, 1e-12))) > math.log(1.25):
            second = solve({"key": ratio, "value": 1.0})
            if [(k.label(), v.label()) for k, v in second.formats] != [(k.label(), v.label())
                                                                      for k, v in plan.formats]:
                measure(second)
                record["second"] = _plan_record(second)
                if second.kl < plan.kl:
                    plan = second
        bar.update(1)
    return plan, record


def _plan_record(plan: Plan) -> dict[str, Any]:
    return {"bits": plan.bits, "predicted": plan.predicted, "predicted_keys": plan.predicted_keys, "kl": plan.kl, "kl_keys": plan.kl_keys,
            "kl_values": plan.kl_values, "formats": [[k.label(), v.label()] for k, v in plan.formats]}


def plan_layers(plan: Plan, record: dict[str, Any]) -> list[dict[str, Side]]:
    """Artifact layers of an assignment: plain sides (no tensors), the measurements on the first layer."""
    out = []
    for i, (k, v) in enumerate(plan.formats):
        info = {"auto": {"bits": plan.bits, "kl": plan.kl}} if i else {"auto": record}
        out.append({"key": Side("plain" if k.quantized else "none", k, {}, info),
                    "value": Side("plain" if v.quantized else "none", v, {}, {})})
    return out
