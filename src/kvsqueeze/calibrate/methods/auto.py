"""auto: per-layer, per-side formats chosen at an average bit budget from measured sensitivities
(:mod:`kvsqueeze.calibrate.auto` says what is measured and why it predicts perplexity)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...artifact import Side
from ..auto import choose, plan_layers
from .base import Job, Method, check_exact, clean_name, option
from .skvq import SINKS_HELP, WINDOW_HELP


@dataclass(frozen=True)
class AutoSettings:
    method: ClassVar[str] = "auto"
    bits: float = option(3.0, "average bits per quantized element, every scale, zero-point and centre counted "
                         "(default 3.0)", type=float)
    refine: bool = option(True, "no end-to-end re-measuring of the chosen assignment", flag="--no-refine",
                          negate=True)
    window: int = option(128, WINDOW_HELP, type=int)
    sinks: int = option(4, SINKS_HELP, type=int)

    def __post_init__(self) -> None:
        check_exact(self.window, self.sinks)
        if not 1.0 < self.bits <= 16.0:
            raise ValueError(f"--bits must be in (1, 16], got {self.bits}")
        if self.window % 128:
            raise ValueError(f"--method auto needs a window that is a multiple of 128 (the rotated keys' token "
                             f"group), got {self.window}")

    def name(self, model_name: str) -> str:
        return clean_name([model_name, "auto", f"b{self.bits:g}", f"w{self.window}", f"s{self.sinks}"])


def run(job: Job, s: AutoSettings) -> list[dict[str, Side]]:
    plan, record = choose(job.model, job.activations(), job.data.ids, s.bits, s.window, s.sinks,
                          progress=job.progress, refine=s.refine)
    return plan_layers(plan, record)


METHOD = Method("auto", "per-layer, per-side formats (KIVI integers, rotated codebooks, int8) chosen at the average "
                "bit budget --bits from measured sensitivities on the calibration slice", AutoSettings, run=run)
