// Attention masks as both entry points read them.
#pragma once

namespace {

struct MaskView {
  bool has = false;
  int64_t mB = 0, mcols = 0, ms0 = 0, ms2 = 0, ms3 = 0;
  const bool* bp = nullptr;
  const float* fp = nullptr;
};

MaskView read_mask(const at::Tensor& mask, at::Tensor& held) {
  MaskView m;
  if (!mask.defined() || mask.numel() == 0) return m;
  const bool is_bool = mask.scalar_type() == at::kBool;
  held = is_bool ? mask : mask.to(at::kFloat);
  m.has = true;
  m.mB = held.size(0);
  m.mcols = held.size(3);
  m.ms0 = held.stride(0);
  m.ms2 = held.stride(2);
  m.ms3 = held.stride(3);
  if (is_bool) m.bp = held.data_ptr<bool>();
  else m.fp = held.data_ptr<float>();
  return m;
}

// One query row's scores over n keys from mask column col0 on: a boolean mask hides (-inf), a float mask adds its
// bias, columns outside the mask are hidden.  Shared by the decode path and the multi-query path.
inline void mask_row(const MaskView& mk, int64_t b, int64_t lq, int64_t col0, int n, float* sr) {
  const int64_t bb = mk.mB == 1 ? 0 : b;
  for (int t = 0; t < n; ++t) {
    const int64_t col = col0 + t;
    if (col < 0 || col >= mk.mcols) {
      sr[t] = NEG_INF;
    } else if (mk.bp) {
      if (!mk.bp[bb * mk.ms0 + lq * mk.ms2 + col * mk.ms3]) sr[t] = NEG_INF;
    } else {
      sr[t] += mk.fp[bb * mk.ms0 + lq * mk.ms2 + col * mk.ms3];
    }
  }
}

}  // namespace
