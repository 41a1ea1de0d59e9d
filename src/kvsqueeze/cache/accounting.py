"""Byte totals shared by the cache's own record and the records kept for peers' caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ByteTotals:
    """Totals and bits per element shared by every record of KV bytes (ours and peers')."""

    codes: int
    params: int
    full_precision: int
    elements: int
    quantized_elements: int

    @property
    def total(self) -> int:
        return self.codes + self.params + self.full_precision

    @property
    def bits_per_element(self) -> float:
        return 8 * self.total / self.elements if self.elements else float("nan")

    @property
    def quantized_bits_per_element(self) -> float:
        """Bits per element of the quantized part only (codes + scales/zeros over quantized elements)."""
        return 8 * (self.codes + self.params) / self.quantized_elements if self.quantized_elements else float("nan")


@dataclass(frozen=True)
class KVFootprint(ByteTotals):
    """Bytes held by any cache (ours or a peer's), by kind; elements are K+V elements of the stored tokens."""

    codes: int
    params: int
    full_precision: int
    elements: int
    quantized_elements: int
    tokens: int  # tokens stored per sequence (the cache's sequence length)
    batch: int

    @property
    def bytes_per_token(self) -> float:
        """All layers' K and V bytes per stored token of one sequence."""
        return self.total / (self.tokens * self.batch) if self.tokens else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"codes": self.codes, "params": self.params, "full_precision": self.full_precision,
                "total": self.total, "elements": self.elements, "quantized_elements": self.quantized_elements,
                "tokens": self.tokens, "batch": self.batch, "bits_per_element": _num(self.bits_per_element),
                "quantized_bits_per_element": _num(self.quantized_bits_per_element),
                "bytes_per_token": _num(self.bytes_per_token)}


def _num(x: float) -> float | None:
    return None if x != x else round(x, 6)  # JSON has no NaN
