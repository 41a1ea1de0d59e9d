"""What each calibrated method needs of a model, checked in one place before any activation is collected.

Facts come from :func:`kvsqueeze.layout.attention_facts` (config + module names/shapes).  The rules:

* SKVQ (reordered per-token groups) and every value transform work after RoPE or never meet it: they need
  nothing but a layout the cache serves.
* Pre-RoPE keys (``kvquant``, ``hybrid``) need RoPE tables that do not change with the sequence length
  (``dynamic`` and ``longrope`` re-derive the table as the sequence grows, so a key stored before RoPE could not
  be re-rotated as the model rotated it).  Partial rotary and per-layer-type tables are fine.
* Key transforms meant to be folded into W_k before RoPE (``invertible --transform learned-folded|smooth``) need no
  norm between W_k and RoPE; with a per-head q/k norm (Qwen3, Gemma-3) a *diagonal* transform shared by all heads
  folds into the norm weights instead, so ``smooth`` calibrates shared scales there and ``learned-folded`` (which
  rotates inside RoPE pairs) is refused in favour of ``learned-online`` (applied by the cache after RoPE).
* Sliding-window layers are calibrated on what their window lets a query see, without sinks (the cache keeps none
  in a sliding layer).
"""

from __future__ import annotations

from typing import Any

from ..errors import KvsqueezeError
from ..layout import AttentionFacts

FOLDED_KEY_TRANSFORMS = ("learned-folded", "smooth")


class ModelRequirementError(KvsqueezeError):
    """A calibrated method asked of a model that lacks what the method needs (the message says what and why)."""


def needs(method: str, transform: str | None = None) -> list[str]:
    """What ``method`` (and the invertible method's ``transform``) needs of a model, in words."""
    out = ["a KV layout the cache serves (full or sliding attention; MHA, GQA or MQA)"]
    if method in ("kvquant", "hybrid"):
        out.append("RoPE tables that do not depend on the sequence length (pre-RoPE keys)")
    if method == "invertible" and transform in FOLDED_KEY_TRANSFORMS:
        out.append("no norm between W_k and RoPE, or a per-head one with a diagonal key transform (the fold)")
    return out


def _refusal(facts: AttentionFacts, method: str, transform: str | None) -> tuple[str, str] | None:
    """(short reason, full one-line reason) why ``method`` cannot calibrate this model, or None."""
    name = facts.model_type
    if method in ("kvquant", "hybrid"):
        if not facts.has_rope:
            return ("no RoPE: nothing to store keys before",
                    f"--method {method} stores keys before RoPE, but this {name} model has no rotary position "
                    "embeddings; use --method skvq or invertible")
        if facts.length_dependent_rope:
            types = ", ".join(sorted({r[0] for r in facts.rope if r is not None}))
            return (f"{types} RoPE changes with the sequence length",
                    f"--method {method} stores keys before RoPE, but this {name} model's RoPE ({types}) changes its "
                    "table with the sequence length, so stored keys cannot be re-rotated as the model rotated "
                    "them; use --method skvq or invertible")
    if method == "invertible" and transform in FOLDED_KEY_TRANSFORMS and facts.qk_norm != "none":
        if facts.qk_norm == "other":
            return ("a k norm the fold cannot absorb sits between W_k and RoPE",
                    f"--transform {transform} folds key transforms into W_k, but this {name} model normalises keys "
                    "between W_k and RoPE with a norm the fold cannot absorb; use --transform learned-online "
                    "(applied by the cache after RoPE)")
        if transform == "learned-folded":
            return ("rotations inside RoPE pairs cannot fold into the per-head k_norm; use smooth or learned-online",
                    "--transform learned-folded learns rotations inside RoPE pairs, which cannot be folded into "
                    f"this {name} model's per-head k_norm (only a diagonal transform shared by all heads can); use "
                    "--transform smooth (folded into the norm) or learned-online (applied by the cache)")
    return None


def refusal(facts: AttentionFacts, method: str, transform: str | None = None) -> str | None:
    """The one-line reason ``method`` cannot calibrate this model, or None when it can."""
    r = _refusal(facts, method, transform)
    return None if r is None else r[1]


def check(facts: AttentionFacts, method: str, transform: str | None = None) -> None:
    """Raise :class:`ModelRequirementError` (one line, exit 2 on the command line) if the method cannot run."""
    reason = refusal(facts, method, transform)
    if reason is not None:
        raise ModelRequirementError(reason)


def notes(facts: AttentionFacts, method: str, transform: str | None = None) -> list[str]:
    """How a method that works adapts to this model (for the family table)."""
    out = []
    if facts.sliding_layers:
        out.append("sliding layers: window-only objective")
    if method in ("kvquant", "hybrid"):
        if facts.rope_tables > 1:
            out.append(f"{facts.rope_tables} RoPE tables")
        if facts.partial_rotary:
            out.append("partial rotary")
    if method == "invertible" and transform in FOLDED_KEY_TRANSFORMS:
        if facts.qk_norm == "per-head":
            out.append("shared key scales folded into q/k norms")
        if facts.partial_rotary:
            out.append("pairs of the partial rotary layout")
        if facts.projections == "other":
            out.append("export cannot fold into these projections")
    if facts.attn_softcap is not None:
        out.append("soft-capped objective")
    return out


def verdict(facts: AttentionFacts, method: str, transform: str | None = None) -> str:
    """"works" (with notes) or "refused (<short reason>)" - one cell of the family x method table."""
    r = _refusal(facts, method, transform)
    if r is not None:
        return f"refused ({r[0]})"
    n = notes(facts, method, transform)
    return "works" + (f" ({'; '.join(n)})" if n else "")


def check_model(model: Any, method: str, transform: str | None = None) -> AttentionFacts:
    """Read ``model``'s facts and check the method against them; returns the facts for the caller to use."""
    from ..layout import attention_facts

    facts = attention_facts(model)
    check(facts, method, transform)
    return facts
