// Portable helpers every build has: dot products, row accumulation, exp/max over float arrays, level tables.
#pragma once

namespace {

// Dot product with 16 independent partial sums and a tree reduction: a plain float reduction loop is compiled (no
// -ffast-math) to one dependent add per element.
template <int DT>
inline float dot(const float* __restrict a, const float* __restrict b, int Drt) {
  const int D = DT ? DT : Drt;
  float p[16] = {0.f};
  int j = 0;
  for (; j + 16 <= D; j += 16)
    for (int l = 0; l < 16; ++l) p[l] += a[j + l] * b[j + l];
  for (; j < D; ++j) p[j & 15] += a[j] * b[j];
  for (int l = 0; l < 8; ++l) p[l] += p[l + 8];
  for (int l = 0; l < 4; ++l) p[l] += p[l + 4];
  return (p[0] + p[2]) + (p[1] + p[3]);
}

// acc[0:D] += sum_t w[t] * x[t][0:D], accumulating in a local array the compiler keeps in registers.
template <int DT>
inline void axpy_rows(float* __restrict acc, const float* __restrict w, const float* __restrict x, int64_t xs,
                      int nt, int Drt) {
  if constexpr (DT > 0 && DT <= 128) {
    float a[DT];
    for (int j = 0; j < DT; ++j) a[j] = acc[j];
    for (int t = 0; t < nt; ++t) {
      const float p = w[t];
      const float* xr = x + t * xs;
      for (int j = 0; j < DT; ++j) a[j] += p * xr[j];
    }
    for (int j = 0; j < DT; ++j) acc[j] = a[j];
  } else {
    const int D = DT ? DT : Drt;
    for (int t = 0; t < nt; ++t) {
      const float p = w[t];
      const float* xr = x + t * xs;
#pragma omp simd
      for (int j = 0; j < D; ++j) acc[j] += p * xr[j];
    }
  }
}

template <int BITS>
inline void unpack_lut(const uint8_t* __restrict src, float* __restrict dst, int n, const float* __restrict lut) {
  if constexpr (BITS == 3) {
    const int U = n / 8;
    uint32_t w[64];
    for (int u = 0; u < U; ++u)
      w[u] = uint32_t(src[3 * u]) | (uint32_t(src[3 * u + 1]) << 8) | (uint32_t(src[3 * u + 2]) << 16);
    for (int k = 0; k < 8; ++k)
      for (int u = 0; u < U; ++u) dst[k * U + u] = lut[(w[u] >> (3 * k)) & 7u];
  } else {
    constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
    const int U = n / per;
    for (int k = 0; k < per; ++k)
      for (int u = 0; u < U; ++u) dst[k * U + u] = lut[(src[u] >> (k * BITS)) & mask];
  }
}
// p[i] = exp(x[i] - m) in place, returning the sum; vectorisable (std::exp is a scalar call and dominated the
// decode step).  exp(y ln2) with y split into round(y) + f, |f| <= 1/2, and a degree-7 Taylor series for 2^f.
inline float exp_sum(float* __restrict x, int n, float m) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int i = 0; i < n; ++i) {
    const float d = x[i] - m;
    const float y = std::max(d, -87.f) * 1.44269504088896341f;
    const float r = (y + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23 trick)
    const float f = (y - r) * 0.693147180559945309f;
    float p = 1.f + f * (1.f + f * (0.5f + f * (0.166666667f + f * (0.0416666667f + f * (0.00833333333f +
              f * (0.00138888889f + f * 0.000198412698f))))));
    const int32_t e = (static_cast<int32_t>(r) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, sizeof(scale));
    p = d < -87.f ? 0.f : p * scale;
    x[i] = p;
    total += p;
  }
  return total;
}

// max of x[0:n] with 16 independent lanes (a plain float max loop is not vectorised without -ffast-math)
inline float max_of(const float* x, int n) {
  float p[16];
  std::fill(p, p + 16, NEG_INF);
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) p[l] = p[l] > x[i + l] ? p[l] : x[i + l];
  for (; i < n; ++i) p[0] = p[0] > x[i] ? p[0] : x[i];
  for (int l = 1; l < 16; ++l) p[0] = p[0] > p[l] ? p[0] : p[l];
  return p[0];
}

// Whether a row of scores holds a NaN or +inf: the reference (and torch's softmax) then gives a NaN row, which the
// clamped exponentials below would otherwise hide (docs/robustness.md, "Overflow").
inline bool poisons_softmax(const float* x, int n) {
  int bad = 0;
  for (int i = 0; i < n; ++i) bad |= (x[i] != x[i]) | (x[i] == -NEG_INF);
  return bad != 0;
}

// exp_sum and max_of with AVX2 intrinsics (same formula and error bound): the plain loops compiled to scalar code

}  // namespace
