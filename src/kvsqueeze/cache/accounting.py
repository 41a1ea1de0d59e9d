"""Byte totals shared by the cache's own record and the records kept for peers' caches."""

from __future__ import annotations


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
