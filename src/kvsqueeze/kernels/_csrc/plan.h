// The plan both entry points take: one struct, mirrored field for field by kernels/cpu.py's KernelPlan.
#pragma once

// A layer's run of stored blocks read once into tensor views (decode.h read_run) and reused from step to step:
// kernels/cpu.py keeps one per layer until a block fills.  Reading 6 tensors per block at every step touched ~200
// tensor headers per layer that the model's weights had evicted from the caches (~1 ms of a SmolLM2 decode step at
// 8k tokens).  The tensors are held, so the views stay valid while the run lives.
struct StoredRun {
  std::vector<at::Tensor> parts;  // 6 per segment, as in KernelPlan
  std::vector<Seg> segs;          // their views, formats and positions
  std::vector<int64_t> formats;   // the format list they were read with (a plan using the run must have the same)
  int64_t Hkv = 0;
};

struct KernelPlan {
  std::vector<at::Tensor> parts;  // 6 per segment: keys (x, scale, zero), values (x, scale, zero); empty where absent
  std::vector<int64_t> positions;     // per segment: absolute position of its first token
  std::vector<int64_t> lengths;       // per segment: token count
  std::vector<int64_t> is_new;        // per segment: 1 for the step's own (causal among themselves) tokens
  std::vector<int64_t> format_index;  // per segment: which 12 ints of formats describe it
  std::vector<int64_t> formats;       // 6 ints per side, keys then values (see Fmt)
  at::Tensor mask;                    // empty, bool or float [B|1, 1, Lq, kv_len]
  int64_t kv_offset = 0;              // absolute position of mask column 0
  int64_t query_start = 0;            // absolute position of the first query
  double scaling = 1.0;
  std::shared_ptr<StoredRun> head;  // stored segments that go before segment head_at, or null
  int64_t head_at = 0;
};

// The plan's fields under the names the entry points use
#define KVSQ_UNPACK_PLAN(p)                                                                             \
  const at::Tensor& mask = (p).mask;                                                                    \
  const int64_t kv_offset = (p).kv_offset, query_start = (p).query_start;                               \
  const double scaling = (p).scaling;
