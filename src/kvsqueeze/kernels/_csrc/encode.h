// Quantize-and-pack of appended tokens: the torch integer codecs' encode (quant/integer.py quantize_groups,
// quant/packing.py pack_bits), bit for bit, in one call.
//
// A decode step stores one token per layer and side wherever tokens are stored one at a time (int8, whose window
// is 0; per-token layouts once their window is full; per-channel keys store 32 at a time).  The torch codec spends
// ~85 small tensor operations on it - 0.2-0.3 ms per side and layer, a sixth of an int8 decode step at 8k tokens
// over 30 layers - where the arithmetic is a few hundred instructions.  Same rules, operation by operation (the
// Triton pack, kernels/triton_pack.py, follows them too): NaN is 0; min / max over the finite values clamped to
// +-LIMIT ((0, 0) when none); asymmetric groups take zero = clip min rounded down and scale = (clip max - zero) /
// (2^bits - 1) (in float64, then float32) rounded up in the parameter dtype; symmetric ones scale = clip absmax /
// qmax rounded up (the constant itself for a zero range); codes round half to even from the stored parameters.  No
// product is fused into a multiply-add (the build allows contraction elsewhere): the one a * b - c here goes
// through memory.
#pragma once

namespace {

constexpr float ENCODE_LIMIT = 1125899906842624.f;  // 2^50: quant/nonfinite.py LIMIT

// t rounded to the parameter dtype (0 float32, 1 float16, 2 bfloat16), nearest then stepped one unit up (or down)
// where that missed t, after clamping to the dtype's finite range: quant/params.py to_param
template <int PK>
inline float to_param_dtype(float t, bool up) {
  constexpr float lim = PK == 0 ? std::numeric_limits<float>::max() : PK == 1 ? 65504.f : 3.38953139e38f;
  t = std::min(std::max(t, -lim), lim);
  if constexpr (PK == 0) {
    return t;
  } else {
    using P = std::conditional_t<PK == 1, c10::Half, c10::BFloat16>;
    P r(t);
    const float rf = static_cast<float>(r);
    if (up ? !(rf < t) : !(rf > t)) return rf;
    // the neighbouring value, on the sign-magnitude bits (params.py _step_up): down = up of the negation
    uint16_t b = r.x;
    if (!up) b ^= 0x8000;
    const bool neg = b & 0x8000;
    b = neg ? ((b & 0x7FFF) == 0 ? 1 : b - 1) : b + 1;
    if (!up) b ^= 0x8000;
    return static_cast<float>(P(b, P::from_bits()));
  }
}

inline float stored_product(float a, float b) {  // a * b rounded to float32 on its own (never fused into an add)
  volatile float p = a * b;
  return p;
}

// The parameters of one group from its finite min and max (scale, zero as float32 values of the parameter dtype)
template <int PK>
inline void group_params(float mn, float mx, int bits, bool sym, float clip, float floor, float& scale,
                         float& zero) {
  if (mn > mx) mn = mx = 0.f;  // no finite value
  if (sym) {
    const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
    const float amax = stored_product(std::max(-mn, mx), clip);
    const float raw = mn == mx ? amax : static_cast<float>(static_cast<double>(amax) / qmax);
    scale = to_param_dtype<PK>(std::max(raw, floor), true);
    zero = 0.f;
    return;
  }
  zero = to_param_dtype<PK>(stored_product(mn, clip), false);
  const float top = stored_product(mx, clip) - zero;
  const float raw = static_cast<float>(static_cast<double>(top) / static_cast<double>((1 << bits) - 1));
  scale = to_param_dtype<PK>(std::max(raw, floor), true);
}

inline float finite_or_zero(float x) { return x != x ? 0.f : x; }

// The code of value x (NaN already 0) from stored parameters
inline uint8_t group_code(float x, int bits, bool sym, float scale, float zero) {
  if (sym) {
    const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
    const float q = std::min(std::max(std::nearbyint(x / scale), -qmax), qmax);
    return static_cast<uint8_t>(static_cast<int>(q) + (1 << (bits - 1)));
  }
  const float q = std::min(std::max(std::nearbyint((x - zero) / scale), 0.f), static_cast<float>((1 << bits) - 1));
  return static_cast<uint8_t>(q);
}

// min / max accumulation over finite values clamped to +-LIMIT (quant/nonfinite.py finite_minmax)
inline void finite_extent(float x, float& mn, float& mx) {
  if (std::fabs(x) <= std::numeric_limits<float>::max()) {
    const float c = std::min(std::max(x, -ENCODE_LIMIT), ENCODE_LIMIT);
    mn = std::min(mn, c);
    mx = std::max(mx, c);
  }
}

// D codes of one token packed as pack_bits packs them: 8 / bits per byte from the lowest bits, 3-bit codes as
// 24-bit little-endian words of 8, one byte each from 5 bits on
inline void pack_row(const uint8_t* codes, int D, int bits, uint8_t* out) {
  if (bits >= 5) {
    std::memcpy(out, codes, D);
  } else if (bits == 3) {
    for (int u = 0; u < D / 8; ++u) {
      uint32_t w = 0;
      for (int k = 0; k < 8; ++k) w |= uint32_t(codes[8 * u + k]) << (3 * k);
      out[3 * u] = w & 0xFF;
      out[3 * u + 1] = (w >> 8) & 0xFF;
      out[3 * u + 2] = (w >> 16) & 0xFF;
    }
  } else {
    const int per = 8 / bits;
    for (int j = 0; j < D / per; ++j) {
      uint8_t byte = 0;
      for (int k = 0; k < per; ++k) byte |= codes[per * j + k] << (k * bits);
      out[j] = byte;
    }
  }
}

template <int PK, class S>
void encode_rows(const float* x, int64_t B, int64_t H, int64_t T, int D, int bits, int group, bool channel, bool sym,
                 float clip, float floor, uint8_t* codes, S* scale, S* zero) {
  const int nbytes = bits >= 5 ? D : D * bits / 8;
  const int64_t units = channel ? B * H * (T / group) : B * H * T;  // a group of tokens, or a token
  at::parallel_for(0, units, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> xs(static_cast<size_t>(channel ? group * D : D));
    std::vector<uint8_t> q(static_cast<size_t>(channel ? group * D : D));
    std::vector<float> sc(D), zc(D);
    for (int64_t u = lo; u < hi; ++u) {
      const int rows = channel ? group : 1;
      const int64_t row0 = channel ? u * group : u;  // first token row of B * H * T
      for (int64_t i = 0; i < int64_t(rows) * D; ++i) xs[i] = finite_or_zero(x[row0 * D + i]);
      const int ng = channel ? D : D / group;  // parameter slots of this unit
      for (int g = 0; g < ng; ++g) {
        float mn = ENCODE_LIMIT, mx = -ENCODE_LIMIT;
        if (channel) {
          for (int r = 0; r < rows; ++r) finite_extent(xs[r * D + g], mn, mx);
        } else {
          for (int c = 0; c < group; ++c) finite_extent(xs[g * group + c], mn, mx);
        }
        group_params<PK>(mn, mx, bits, sym, clip, floor, sc[g], zc[g]);
        const int64_t p = u * ng + g;
        scale[p] = static_cast<S>(sc[g]);
        if (zero) zero[p] = static_cast<S>(zc[g]);
      }
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < D; ++c) {
          const int g = channel ? c : c / group;
          q[r * D + c] = group_code(xs[r * D + c], bits, sym, sc[g], zc[g]);
        }
      for (int r = 0; r < rows; ++r) pack_row(q.data() + r * D, D, bits, codes + (row0 + r) * nbytes);
    }
  });
}

// x [B, H, T, D] (float32, float16 or bfloat16) -> [codes, scale(, zero)] as the torch codec stores them: codes
// [B, H, T, packed bytes]; per-token groups of `group` channels: parameters [B, H, T, D / group]; per-channel groups
// of `group` tokens: [B, H, T / group, D].
std::vector<at::Tensor> encode_int(const at::Tensor& x_in, int64_t bits, int64_t group, bool per_channel,
                                   bool symmetric, double clip, double floor, at::ScalarType pdt) {
  TORCH_CHECK(x_in.dim() == 4, "x must be [B, H, T, D]");
  TORCH_CHECK(bits >= 1 && bits <= 8 && !(symmetric && bits == 1), "bits must be 1-8 (2-8 symmetric)");
  TORCH_CHECK(pdt == at::kFloat || pdt == at::kHalf || pdt == at::kBFloat16, "parameters in fp32, fp16 or bf16");
  const int64_t B = x_in.size(0), H = x_in.size(1), T = x_in.size(2);
  const int D = static_cast<int>(x_in.size(3));
  const int per = bits >= 5 ? 1 : (bits == 3 ? 8 : 8 / bits);
  TORCH_CHECK(D % per == 0, "head_dim must hold whole packing units");
  TORCH_CHECK(group >= 1 && (per_channel ? T % group == 0 : D % group == 0),
              "group must divide the tokens (per channel) or head_dim (per token)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int nbytes = bits >= 5 ? D : D * static_cast<int>(bits) / 8;
  at::Tensor codes = at::empty({B, H, T, nbytes}, x.options().dtype(at::kByte));
  const std::vector<int64_t> pshape =
      per_channel ? std::vector<int64_t>{B, H, T / group, D} : std::vector<int64_t>{B, H, T, D / group};
  at::Tensor scale = at::empty(pshape, x.options().dtype(pdt));
  at::Tensor zero = symmetric ? at::Tensor() : at::empty(pshape, x.options().dtype(pdt));
  const float c = static_cast<float>(clip), fl = static_cast<float>(floor);
  const int b = static_cast<int>(bits), g = static_cast<int>(group);
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  if (pdt == at::kFloat) {
    encode_rows<0>(xp, B, H, T, D, b, g, per_channel, symmetric, c, fl, cp, scale.data_ptr<float>(),
                   symmetric ? nullptr : zero.data_ptr<float>());
  } else if (pdt == at::kHalf) {
    encode_rows<1>(xp, B, H, T, D, b, g, per_channel, symmetric, c, fl, cp, scale.data_ptr<at::Half>(),
                   symmetric ? nullptr : zero.data_ptr<at::Half>());
  } else {
    encode_rows<2>(xp, B, H, T, D, b, g, per_channel, symmetric, c, fl, cp, scale.data_ptr<at::BFloat16>(),
                   symmetric ? nullptr : zero.data_ptr<at::BFloat16>());
  }
  if (symmetric) return {codes, scale};
  return {codes, scale, zero};
}

}  // namespace
