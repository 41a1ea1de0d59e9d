"""Which C++ kernel paths a CPU is offered, from its /proc/cpuinfo flags (no build needed)."""

from __future__ import annotations

import pytest

from kvsqueeze.errors import KvsqueezeError
from kvsqueeze.kernels import cpu

_V4 = "avx avx2 fma f16c bmi1 bmi2 movbe avx512f avx512bw avx512vl avx512dq avx512cd"


@pytest.mark.parametrize("flags, paths", [
    (f"{_V4} avx512_vnni avx512vbmi", ["avx512-vbmi", "avx512-vnni", "avx2", "generic"]),  # Ice Lake, Zen 4
    (f"{_V4} avx512_vnni", ["avx512-vnni", "avx2", "generic"]),  # Cascade Lake: VNNI without VBMI
    (f"{_V4} avx512vbmi", ["avx2", "generic"]),  # AVX-512 without VNNI
    ("avx avx2 fma f16c bmi1 bmi2 movbe", ["avx2", "generic"]),
    ("sse4_2", ["generic"]),
])
def test_the_kernel_paths_follow_the_cpus_features(flags, paths, monkeypatch):
    """A path is offered only where the CPU has every feature its build targets (a build for one CPU must not run
    on another), best first; KVSQUEEZE_CPU_ISA cannot force one the CPU lacks."""
    if not cpu._X86:
        pytest.skip("x86 instruction-set paths")
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: flags)
    cpu._runnable.cache_clear()
    monkeypatch.setattr(cpu, "_forced", None)
    monkeypatch.setenv("KVSQUEEZE_CPU_ISA", "auto")
    try:
        assert cpu.runnable_isas() == paths
        assert cpu.selected_isa() == paths[0]
        for missing in (i for i in cpu.ISAS if i not in paths):
            monkeypatch.setenv("KVSQUEEZE_CPU_ISA", missing)
            with pytest.raises(KvsqueezeError, match="needs CPU features"):
                cpu.selected_isa()
    finally:
        cpu._runnable.cache_clear()
