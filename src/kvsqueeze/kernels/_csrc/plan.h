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

// A run of segments flattened once and reused from step to step (kernels/cpu.py caches a layer's stored blocks
// between two flushes: converting 6 tensors per block from Python lists cost ~0.1 ms per layer at 32k tokens) goes
// in front of segment `at` of a step's own segments; the tensors are shared, not copied.
inline void insert_head(KernelPlan& self, const KernelPlan& head, int64_t at) {
  const size_t n = self.positions.size();
  TORCH_CHECK(at >= 0 && static_cast<size_t>(at) <= n && self.parts.size() == 6 * n &&
                  head.parts.size() == 6 * head.positions.size(), "insert_head: segment index out of range");
  auto put = [at](auto& dst, const auto& src, int64_t per) { dst.insert(dst.begin() + at * per, src.begin(), src.end()); };
  put(self.parts, head.parts, 6);
  put(self.positions, head.positions, 1);
  put(self.lengths, head.lengths, 1);
  put(self.is_new, head.is_new, 1);
  put(self.format_index, head.format_index, 1);
}

// The plan's fields under the names the entry points use
#define KVSQ_UNPACK_PLAN(p)                                                                             \
  const std::vector<at::Tensor>& parts = (p).parts;                                                     \
  const std::vector<int64_t>&seg_pos = (p).positions, &seg_n = (p).lengths, &seg_new = (p).is_new,      \
                           &seg_fmt = (p).format_index, &fmts = (p).formats;                            \
  const at::Tensor& mask = (p).mask;                                                                    \
  const int64_t kv_offset = (p).kv_offset, query_start = (p).query_start;                               \
  const double scaling = (p).scaling;
