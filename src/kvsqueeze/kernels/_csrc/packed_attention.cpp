// Decode attention directly over kvsqueeze's packed block storage (CPU).
//
// One call per layer: the context (sinks, history blocks, window, new tokens) is split into chunks of at most
// CHUNK tokens; each (batch, kv head, chunk) work item computes its partial softmax (max, sum, weighted values)
// in parallel (flash-decoding), then the partials are merged exactly with log-sum-exp.  Codes are unpacked one
// small tile of tokens at a time into an L1-sized float buffer, so nothing of size context x head_dim exists.
// Per-channel keys use the algebra s = (q * scale_g) . codes + q . zero_g, so their codes are never scaled.
// Rotated codebook layouts (kind CODEBOOK, docs/rotated.md) are read in the rotated space: queries are rotated
// once (q R), a token's score is norm * sum_i q'_i cb[code_i] (a 2-16 entry table), values accumulate in the
// rotated space and the merged output is rotated back once (o = o' R^T).
//
// Files: formats.h (tensor views, formats, parameters, generic dequantization), plan.h (the KernelPlan both entry
// points take, and the StoredRun it may reuse), simd_generic.h / simd_avx2.h (helpers per instruction set),
// codebook.h (rotated codebooks), fast_path.h (vectorised float path), codebook_int.h (rotated codebook keys by
// int16 dot products: AVX-512 VBMI), codebook_fast.h (rotated codebook sides in registers), int_scores.h (integer
// key scores: AVX-512 VNNI or AVX2), int_values.h (integer weighted values: AVX-512 VNNI), mask.h, decode.h (the
// decode entry point), multi.h (the multi-query entry point), paged.h (both over a paged pool's sequences), encode.h
// (quantize-and-pack of appended tokens, the torch codec's parts bit for bit); this file: includes and bindings.
// Each instruction-set path is its own build (kernels/cpu.py), so the same sources compile with or without each
// feature.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)  // other CPUs build the generic path: every intrinsic below sits
#include <immintrin.h>                        // under an instruction-set macro they never define
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "formats.h"
#include "plan.h"
#include "simd_generic.h"
#include "simd_avx2.h"
#include "codebook.h"
#include "fast_path.h"
#include "codebook_int.h"
#include "codebook_fast.h"
#include "int_scores.h"
#include "int_values.h"
#include "mask.h"
#include "decode.h"
#include "multi.h"
#include "paged.h"
#include "encode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<KernelPlan>(m, "KernelPlan", pybind11::module_local())  // each instruction-set build has its own
      .def(pybind11::init<>())
      .def_readwrite("parts", &KernelPlan::parts)
      .def_readwrite("positions", &KernelPlan::positions)
      .def_readwrite("lengths", &KernelPlan::lengths)
      .def_readwrite("is_new", &KernelPlan::is_new)
      .def_readwrite("format_index", &KernelPlan::format_index)
      .def_readwrite("formats", &KernelPlan::formats)
      .def_readwrite("mask", &KernelPlan::mask)
      .def_readwrite("kv_offset", &KernelPlan::kv_offset)
      .def_readwrite("query_start", &KernelPlan::query_start)
      .def_readwrite("scaling", &KernelPlan::scaling)
      .def_readwrite("head", &KernelPlan::head)
      .def_readwrite("head_at", &KernelPlan::head_at);
  pybind11::class_<StoredRun, std::shared_ptr<StoredRun>>(m, "StoredRun", pybind11::module_local());
  m.def("read_run", &read_run, "read a plan's segments once into a StoredRun that later plans put in front");
  m.def("attend_paged", &attend_paged, "attention of every sequence of a paged pool (vLLM's KV blocks), in place");
  m.def("attend", &attend, "decode attention over packed KV blocks", pybind11::arg("q"), pybind11::arg("plan"),
        pybind11::arg("chunk"), pybind11::arg("by_heads") = false);
  m.def("attend_multi", &attend_multi, "multi-query (prefill) attention over packed KV blocks");
  m.def("encode_int", &encode_int, "quantize and pack tokens as the torch integer codecs do, bit for bit");
}
