// The plan both entry points take: one struct, mirrored field for field by kernels/cpu.py's KernelPlan.
#pragma once

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
};

// The plan's fields under the names the entry points use
#define KVSQ_UNPACK_PLAN(p)                                                                             \
  const std::vector<at::Tensor>& parts = (p).parts;                                                     \
  const std::vector<int64_t>&seg_pos = (p).positions, &seg_n = (p).lengths, &seg_new = (p).is_new,      \
                           &seg_fmt = (p).format_index, &fmts = (p).formats;                            \
  const at::Tensor& mask = (p).mask;                                                                    \
  const int64_t kv_offset = (p).kv_offset, query_start = (p).query_start;                               \
  const double scaling = (p).scaling;
