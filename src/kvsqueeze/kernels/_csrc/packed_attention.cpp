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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int TILE = 32;
constexpr int PREFETCH_BYTES = 1024;  // tokens decoded at a time
constexpr int PAD_FLOATS = 16;  // after tile buffers: vector stores may run past a row (unpack_lut_avx2)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

enum Kind { FP = 0, INT_TOKEN = 1, INT_CHANNEL = 2, FP8 = 3, CODEBOOK = 4 };

struct Part {  // a [B, H, rows, X] tensor, last dim contiguous; strides in bytes
  const char* ptr = nullptr;
  const char* end = nullptr;  // one past the last byte of its storage: how far a wide load may read
  int64_t sb = 0, sh = 0, sr = 0;
  at::ScalarType dt = at::kFloat;
  const char* row(int64_t b, int64_t h, int64_t r) const { return ptr + b * sb + h * sh + r * sr; }
};

Part make_part(const at::Tensor& t) {
  Part p;
  if (!t.defined() || t.numel() == 0) return p;
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "packed parts must be [B,H,rows,X] with a contiguous last dim");
  const int64_t e = t.element_size();
  p.ptr = static_cast<const char*>(t.data_ptr());
  p.end = static_cast<const char*>(t.storage().data()) + t.storage().nbytes();
  p.sb = t.size(0) == 1 ? 0 : t.stride(0) * e;  // size-1 batch broadcasts (fp8 per-tensor fixed scales)
  p.sh = t.size(1) == 1 ? 0 : t.stride(1) * e;
  p.sr = t.stride(2) * e;
  p.dt = t.scalar_type();
  return p;
}

__attribute__((always_inline)) inline float ld(at::ScalarType dt, const char* p, int64_t i) {
  switch (dt) {
    case at::kFloat: return reinterpret_cast<const float*>(p)[i];
    case at::kHalf: return static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]);
    case at::kBFloat16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p)[i]);
    case at::kFloat8_e4m3fn: return static_cast<float>(reinterpret_cast<const c10::Float8_e4m3fn*>(p)[i]);
    default: TORCH_CHECK(false, "unsupported parameter dtype");
  }
  return 0.f;
}

struct Fmt {
  int kind = FP, bits = 8, group = 1, sym = 0, fp8 = 0, fixed = 0;
};
// CODEBOOK reuses the six ints: bits = high width, group = coordinates at the high width (first), sym = low
// width.  Its parts: x = packed codes (high run, then low run), scale = norm per token, zero = the format's
// table [1, 1, D + 2, W]: rows 0..D-1 the rotation R (y = x R), row D the high codebook, row D+1 the low one.
// Centred layouts (fp8 = G > 0): scale holds one row per G tokens, the group's mean in the rotated space (D
// values) then its G tokens' scales, and a row decodes to mean + scale * cb[code].
inline int cb_n_hi(const Fmt& f) { return f.group; }
inline int cb_group(const Fmt& f) { return f.fp8; }
inline int cb_bits_lo(const Fmt& f) { return f.sym; }
inline int run_per(int bits) { return bits == 3 ? 8 : 8 / bits; }  // codes per packing unit

struct Side {  // how one of keys/values of a segment is stored
  Fmt f;
  Part x, scale, zero;  // FP: x = values; INT/FP8: x = codes
};

struct Seg {
  Side k, v;
  int64_t pos = 0, n = 0;  // absolute position of the first token, token count
  bool is_new = false;
};

float LUT_E4M3[256], LUT_E5M2[256];

void init_luts() {
  static bool done = false;
  if (done) return;
  for (int i = 0; i < 256; ++i) {
    LUT_E4M3[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    LUT_E5M2[i] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(i), c10::Float8_e5m2::from_bits()));
  }
  done = true;
}

// Codes of one token row, unpacked as float but not yet scaled.  Packed widths come out "field-major": the k-th
// code of every packing unit first (position k*U + u holds channel u*per + k), which turns unpacking into
// constant shifts over contiguous bytes that the compiler vectorises; queries and outputs are permuted to match.
// DT is head_dim when known at compile time (64, 128), else 0 and Drt is used.
template <int BITS, int DT>
inline void unpack_fm(const uint8_t* __restrict src, float* __restrict dst, int Drt) {
  const int D = DT ? DT : Drt;
  if constexpr (BITS == 1 || BITS == 2 || BITS == 4) {
    constexpr int per = 8 / BITS;
    constexpr int mask = (1 << BITS) - 1;
    const int U = D / per;
    for (int k = 0; k < per; ++k) {
      float* o = dst + k * U;
#pragma omp simd
      for (int u = 0; u < U; ++u) o[u] = static_cast<float>((src[u] >> (k * BITS)) & mask);
    }
  } else if constexpr (BITS == 3) {
    const int U = D / 8;
    uint32_t w[64];
    for (int u = 0; u < U; ++u)
      w[u] = uint32_t(src[3 * u]) | (uint32_t(src[3 * u + 1]) << 8) | (uint32_t(src[3 * u + 2]) << 16);
    for (int k = 0; k < 8; ++k) {
      float* o = dst + k * U;
#pragma omp simd
      for (int u = 0; u < U; ++u) o[u] = static_cast<float>((w[u] >> (3 * k)) & 7u);
    }
  } else {
#pragma omp simd
    for (int j = 0; j < D; ++j) dst[j] = static_cast<float>(src[j]);
  }
}

template <int DT>
inline void unpack_rows(int bits, const Part& x, int64_t b, int64_t h, int64_t t0, int n, float* out, int D) {
  for (int t = 0; t < n; ++t) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(x.row(b, h, t0 + t));
    float* dst = out + t * D;
    switch (bits) {
      case 1: unpack_fm<1, DT>(src, dst, D); break;
      case 2: unpack_fm<2, DT>(src, dst, D); break;
      case 3: unpack_fm<3, DT>(src, dst, D); break;
      case 4: unpack_fm<4, DT>(src, dst, D); break;
      default: unpack_fm<8, DT>(src, dst, D); break;  // 5-8 bits: one code per byte
    }
  }
}

inline int codes_per_unit(const Fmt& f) {
  if (f.kind != INT_TOKEN && f.kind != INT_CHANNEL) return 1;
  return (f.bits == 1 || f.bits == 2 || f.bits == 4) ? 8 / f.bits : (f.bits == 3 ? 8 : 1);
}

struct Perm {  // field-major order of one format
  std::vector<int> chan;   // channel held at each position
  std::vector<int> group;  // per-token layouts: parameter group of each position
  std::vector<int> unit_group;  // per-token layouts: parameter group of each packing unit
};

Perm field_perm(const Fmt& f, int D) {
  const int per = codes_per_unit(f), U = D / per;
  Perm p;
  if (f.kind == CODEBOOK) {  // two runs (high width, then low width), each in its own field-major order
    p.chan.resize(D);
    p.group.assign(D, 0);
    p.unit_group.assign(D, 0);
    const int runs[2][2] = {{cb_n_hi(f), f.bits}, {D - cb_n_hi(f), cb_bits_lo(f)}};
    for (int r = 0, off = 0; r < 2; off += runs[r][0], ++r) {
      if (runs[r][0] == 0) continue;
      const int rp = run_per(runs[r][1]), RU = runs[r][0] / rp;
      for (int k = 0; k < rp; ++k)
        for (int u = 0; u < RU; ++u) p.chan[off + k * RU + u] = off + u * rp + k;
    }
    return p;
  }
  p.chan.resize(D);
  p.group.resize(D);
  for (int k = 0; k < per; ++k)
    for (int u = 0; u < U; ++u) {
      p.chan[k * U + u] = u * per + k;
      p.group[k * U + u] = f.kind == INT_TOKEN ? (u * per + k) / f.group : 0;
    }
  p.unit_group.resize(U);
  for (int u = 0; u < U; ++u) p.unit_group[u] = f.kind == INT_TOKEN ? u * per / f.group : 0;
  return p;
}

// n parameters of one stored row as float, the dtype switch hoisted out of the loop
inline void load_row(at::ScalarType dt, const char* p, int n, float* __restrict out) {
  switch (dt) {
    case at::kFloat: std::memcpy(out, p, sizeof(float) * n); return;
    case at::kHalf: {
      const c10::Half* x = reinterpret_cast<const c10::Half*>(p);
      int i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8)  // the scalar conversion was a visible part of the decode step
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
      for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
      return;
    }
    case at::kBFloat16: {
      const c10::BFloat16* x = reinterpret_cast<const c10::BFloat16*>(p);
      for (int i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
      return;
    }
    case at::kFloat8_e4m3fn: {
      const uint8_t* x = reinterpret_cast<const uint8_t*>(p);
      for (int i = 0; i < n; ++i) out[i] = LUT_E4M3[x[i]];
      return;
    }
    default: TORCH_CHECK(false, "unsupported parameter dtype");
  }
}

// (a, c) of n parameter pairs of one row, such that value = code * a + c for every integer layout (asymmetric:
// scale and zero; symmetric: codes centred on 2^(bits-1), or {-s, +s} at 1 bit); vectorisable
inline void affine_row(const Side& sd, const char* sr, const char* zr, int n, float* __restrict a,
                       float* __restrict c) {
  const Fmt& f = sd.f;
  load_row(sd.scale.dt, sr, n, a);
  if (!f.sym) {
    load_row(sd.zero.dt, zr, n, c);
  } else {
    const float m = f.bits == 1 ? -1.f : -static_cast<float>(1 << (f.bits - 1));
    for (int i = 0; i < n; ++i) c[i] = m * a[i];
    if (f.bits == 1)
      for (int i = 0; i < n; ++i) a[i] *= 2.f;
  }
}

// Per-token layouts: (a, c) of every group of tokens [t0, t0+n), NG floats per token, converted once per work
// item so the token loops only load floats.
inline void token_params(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int NG, float* A, float* C) {
  const int64_t row_bytes = NG * static_cast<int64_t>(c10::elementSize(sd.scale.dt));
  if (sd.scale.sr == row_bytes && (sd.f.sym || sd.zero.sr == row_bytes)) {  // rows contiguous: one pass
    affine_row(sd, sd.scale.row(b, h, t0), sd.f.sym ? nullptr : sd.zero.row(b, h, t0), n * NG, A, C);
    return;
  }
  for (int t = 0; t < n; ++t)
    affine_row(sd, sd.scale.row(b, h, t0 + t), sd.f.sym ? nullptr : sd.zero.row(b, h, t0 + t), NG, A + t * NG,
               C + t * NG);
}

// Per-channel layouts: (a, c) of token-group row ``grow``, gathered into the field-major order ``chan``.
inline void channel_params(const Side& sd, int64_t b, int64_t h, int64_t grow, const int* chan, int D, float* a,
                           float* c) {
  float an[512], cn[512];  // D <= 512 is checked at entry
  affine_row(sd, sd.scale.row(b, h, grow), sd.f.sym ? nullptr : sd.zero.row(b, h, grow), D, an, cn);
  for (int i = 0; i < D; ++i) {
    a[i] = an[chan[i]];
    c[i] = cn[chan[i]];
  }
}

// Dot product with 16 independent partial sums and a tree reduction: a plain float reduction loop is compiled
// (without -ffast-math) into a sequential chain of scalar adds, which dominated the decode step.
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

// Per-token groups in field-major order: field k of group g is the run k*U + [g*RUN, (g+1)*RUN).
template <int RUN>
inline void dequant_runs(float* __restrict o, const float* ag, const float* cg, int per, int NG, int U) {
  for (int k = 0; k < per; ++k)
    for (int g = 0; g < NG; ++g) {
      float* oo = o + k * U + g * RUN;
      const float a = ag[g], c = cg[g];
#pragma omp simd
      for (int j = 0; j < RUN; ++j) oo[j] = oo[j] * a + c;
    }
}

// n codes of one run through a level table, in the run's field-major order (see field_perm)
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

#if defined(__AVX2__)
// unpack_lut with the level table in registers: eight units' words side by side, each field through one vpermps
// (two and a blend for 16 levels) instead of a scalar table load per code, which was most of a rotated decode step.
// Fields are written eight units at a time in field order, so a run whose unit count is not a multiple of eight
// writes up to seven values past each field's end: into the next field (written after it), past the run into the
// next run or row (written after it too), or into the padding callers keep after their tile buffers (PAD_FLOATS).
// end: one past the last readable byte (Part::end); 3-bit words are read 32 bytes at a time where that many are.
template <int BITS>
inline void unpack_lut_avx2(const uint8_t* __restrict src, float* __restrict dst, int n, const float* __restrict lut,
                            const char* end) {
  constexpr int per = BITS == 3 ? 8 : 8 / BITS, mask = (1 << BITS) - 1;
  const int U = n / per;
  const __m256 lo = _mm256_loadu_ps(lut);
  const __m256 hi = BITS == 4 ? _mm256_loadu_ps(lut + 8) : lo;
  const int NC = (U + 7) / 8;
  __m256i words[64];  // the run's units, eight per vector (U <= 256: head_dim <= 512)
  for (int c = 0; c < NC; ++c) {
    const int u0 = 8 * c, nu = std::min(8, U - u0);
    const uint8_t* at = src + (BITS == 3 ? 3 * u0 : u0);
    if (BITS != 3 && nu == 8) {
      words[c] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
    } else if (BITS == 3 && reinterpret_cast<const char*>(at) + 28 <= end) {
      // units 0-3 from bytes 0-11 and units 4-7 from bytes 12-23, one 128-bit lane each: one byte shuffle makes
      // each unit's 3 bytes a 32-bit word (bytes past the run only feed lanes that are overwritten later)
      const __m256i raw = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(at + 12),
                                              reinterpret_cast<const __m128i*>(at));
      const __m256i spread = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                              0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
      words[c] = _mm256_shuffle_epi8(raw, spread);
    } else {  // built in registers: eight scalar stores read back as one vector stalled on store forwarding
      auto word = [&](int l) -> int32_t {
        if (l >= nu) return 0;
        const uint8_t* b = at + (BITS == 3 ? 3 * l : l);
        return BITS == 3 ? int32_t(b[0]) | (int32_t(b[1]) << 8) | (int32_t(b[2]) << 16) : b[0];
      };
      words[c] = _mm256_setr_epi32(word(0), word(1), word(2), word(3), word(4), word(5), word(6), word(7));
    }
  }
  for (int k = 0; k < per; ++k)  // field by field: a partial vector's extra lanes land where later stores go
    for (int c = 0; c < NC; ++c) {
      const __m256i idx = _mm256_and_si256(_mm256_srli_epi32(words[c], k * BITS), _mm256_set1_epi32(mask));
      __m256 v = _mm256_permutevar8x32_ps(lo, idx);
      if constexpr (BITS == 4)  // bit 3 of the code picks the upper half of the table
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
      _mm256_storeu_ps(dst + k * U + 8 * c, v);
    }
}
#endif

__attribute__((always_inline)) inline void unpack_run(int bits, const uint8_t* src, float* dst, int n,
                                                      const float* lut, const char* end) {
#if defined(__AVX2__)
  switch (bits) {
    case 1: unpack_lut_avx2<1>(src, dst, n, lut, end); break;
    case 2: unpack_lut_avx2<2>(src, dst, n, lut, end); break;
    case 3: unpack_lut_avx2<3>(src, dst, n, lut, end); break;
    default: unpack_lut_avx2<4>(src, dst, n, lut, end); break;
  }
#else
  (void)end;
  switch (bits) {
    case 1: unpack_lut<1>(src, dst, n, lut); break;
    case 2: unpack_lut<2>(src, dst, n, lut); break;
    case 3: unpack_lut<3>(src, dst, n, lut); break;
    default: unpack_lut<4>(src, dst, n, lut); break;
  }
#endif
}

inline const float* table_row(const Side& sd, int r) { return reinterpret_cast<const float*>(sd.zero.row(0, 0, r)); }

// Rotated codebook rows [t0, t0+n): (mean +) scale * cb[code] in the rotated space, field-major order (chan:
// the rotated coordinate at each position), into out[n][D].
inline void codebook_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int D, float* out,
                          const int* chan) {
  const Fmt& f = sd.f;
  const int nh = cb_n_hi(f), nl = D - nh, bl = cb_bits_lo(f), G = cb_group(f);
  const float* lut_hi = table_row(sd, D);
  const float* lut_lo = table_row(sd, D + 1);
  const int hi_bytes = nh * f.bits / 8;
  float mean[512];
  int64_t cur = -1, next = -1;
  const char* grow = nullptr;
  for (int t = 0; t < n; ++t) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(sd.x.row(b, h, t0 + t));
    float* o = out + t * D;
    if (nh) unpack_run(f.bits, src, o, nh, lut_hi, sd.x.end);
    if (nl) unpack_run(bl, src + hi_bytes, o + nh, nl, lut_lo, sd.x.end);
    if (G) {  // centred: the group's row holds its mean, then one scale per token
      const int64_t tok = t0 + t;
      if (tok >= next) {  // a new group (no division per token)
        cur = tok / G;
        next = (cur + 1) * G;
        grow = sd.scale.row(b, h, cur);
        for (int j = 0; j < D; ++j) mean[j] = ld(sd.scale.dt, grow, chan[j]);
      }
      const float scale = ld(sd.scale.dt, grow, D + (tok - cur * G));
#pragma omp simd
      for (int j = 0; j < D; ++j) o[j] = o[j] * scale + mean[j];
      continue;
    }
    const float norm = ld(sd.scale.dt, sd.scale.row(b, h, t0 + t), 0);
#pragma omp simd
    for (int j = 0; j < D; ++j) o[j] *= norm;
  }
}

// Dequantized rows [t0, t0+n) of one side into out[n][D] in field-major order, or a direct pointer for fp32
// data.  Returns the pointer to use and sets row_stride (in floats).  tmp holds 4*D floats.
template <int DT>
const float* decode_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int Drt, float* out,
                         int64_t& row_stride, float* tmp, const Perm& pm) {
  const int D = DT ? DT : Drt;
  const Fmt& f = sd.f;
  row_stride = D;
  if (f.kind == FP) {
    if (sd.x.dt == at::kFloat) {
      row_stride = sd.x.sr / 4;
      return reinterpret_cast<const float*>(sd.x.row(b, h, t0));
    }
    for (int t = 0; t < n; ++t) {
      const char* r = sd.x.row(b, h, t0 + t);
      for (int j = 0; j < D; ++j) out[t * D + j] = ld(sd.x.dt, r, j);
    }
    return out;
  }
  if (f.kind == CODEBOOK) {
    codebook_rows(sd, b, h, t0, n, D, out, pm.chan.data());
    return out;
  }
  if (f.kind == FP8) {
    const float* lut = f.fp8 ? LUT_E5M2 : LUT_E4M3;
    for (int t = 0; t < n; ++t) {
      const uint8_t* c = reinterpret_cast<const uint8_t*>(sd.x.row(b, h, t0 + t));
      const float s = f.fixed ? ld(sd.scale.dt, sd.scale.row(b, h, 0), 0) : ld(sd.scale.dt, sd.scale.row(b, h, t0 + t), 0);
      for (int j = 0; j < D; ++j) out[t * D + j] = lut[c[j]] * s;
    }
    return out;
  }
  unpack_rows<DT>(f.bits, sd.x, b, h, t0, n, out, D);
  const int G = f.group;
  float* a = tmp;
  float* c = tmp + D;
  if (f.kind == INT_TOKEN) {
    const int NG = D / G, per = codes_per_unit(f), U = D / per;
    float* ag = tmp + 2 * D;
    float* cg = tmp + 3 * D;
    const int* gi = pm.group.data();
    const int run = G % per == 0 ? G / per : 0;  // positions k*U + [g*run, (g+1)*run) share group g
    for (int t = 0; t < n; ++t) {
      affine_row(sd, sd.scale.row(b, h, t0 + t), f.sym ? nullptr : sd.zero.row(b, h, t0 + t), NG, ag, cg);
      float* o = out + t * D;
      switch (run) {
        case 4: dequant_runs<4>(o, ag, cg, per, NG, U); break;
        case 8: dequant_runs<8>(o, ag, cg, per, NG, U); break;
        case 16: dequant_runs<16>(o, ag, cg, per, NG, U); break;
        case 32: dequant_runs<32>(o, ag, cg, per, NG, U); break;
        case 64: dequant_runs<64>(o, ag, cg, per, NG, U); break;
        case 128: dequant_runs<128>(o, ag, cg, per, NG, U); break;
        default:
          for (int i = 0; i < D; ++i) o[i] = o[i] * ag[gi[i]] + cg[gi[i]];
      }
    }
  } else {  // INT_CHANNEL: one (scale, zero) row per G tokens, gathered into field-major order
    int64_t cur = -1;
    for (int t = 0; t < n; ++t) {
      const int64_t grow = (t0 + t) / G;
      if (grow != cur) {
        cur = grow;
        channel_params(sd, b, h, grow, pm.chan.data(), D, a, c);
      }
      float* o = out + t * D;
#pragma omp simd
      for (int j = 0; j < D; ++j) o[j] = o[j] * a[j] + c[j];
    }
  }
  return out;
}

// p[i] = exp(x[i] - m) in place, returning the sum; vectorisable (std::exp is a scalar call and dominated the
// decode step).  exp(y ln2) with y split into round(y) + f, |f| <= 1/2, and a degree-7 Taylor series for 2^f:
// relative error < 2e-7.  Inputs below exp(-87) give exactly 0, so masked (-inf) scores contribute nothing.
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

// exp_sum and max_of with AVX2 intrinsics (same formula and error bound): the plain loops compiled to scalar code
// in run_tile and run_item (and GCC's 16-lane vector types to spills), where they were a third of a tile's time.
inline float exp_sum8(float* __restrict x, int n, float m) {
  int i = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.f), log2e = _mm256_set1_ps(1.44269504088896341f),
               ln2 = _mm256_set1_ps(0.693147180559945309f);
  const float cs[8] = {0.000198412698f, 0.00138888889f, 0.00833333333f, 0.0416666667f, 0.166666667f, 0.5f, 1.f, 1.f};
  __m256 tot = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), mv);
    const __m256 y = _mm256_mul_ps(_mm256_max_ps(d, lo), log2e);
    const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, r), ln2);
    __m256 p = _mm256_set1_ps(cs[0]);
    for (int c = 1; c < 8; ++c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(cs[c]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    p = _mm256_and_ps(p, _mm256_cmp_ps(d, lo, _CMP_GE_OQ));  // below exp(-87), masked (-inf) included: 0
    _mm256_storeu_ps(x + i, p);
    tot = _mm256_add_ps(tot, p);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, tot);
  for (int l = 0; l < 8; ++l) total += lanes[l];
#endif
  return i < n ? total + exp_sum(x + i, n - i, m) : total;
}

inline float max8(const float* x, int n) {
  int i = 0;
  float best = NEG_INF;
#if defined(__AVX2__)
  __m256 v = _mm256_set1_ps(NEG_INF);
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  for (int l = 0; l < 8; ++l) best = std::max(best, lanes[l]);
#endif
  return i < n ? std::max(best, max_of(x + i, n - i)) : best;
}

struct Item {
  int64_t seg, t0;
  int n;
};

// ------------------------------------------------------------------------------------------------ SIMD fast path
// GCC vector extensions of the machine's native width (VW lanes: 16 with AVX-512, else 8: one AVX2 ymm; 16-lane
// types on AVX2 were split into xmm pieces spilled through the stack and made the decode step 3-4x slower) for
// head_dim 64/128 and the layouts the presets use: fp32, and 2/4/8-bit integer codes whose packing units fill whole
// vectors.  Codes are unpacked in registers and consumed at once; nothing is written back to memory per token.
#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(4 * VW), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * VW), aligned(4)));

inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storef(float* p, const vf& v) { std::memcpy(p, &v, sizeof(v)); }

// Lane t of the result = the sum of the VW lanes of x[t]: log2(VW) levels of two-input lane permutations and adds
// (VW - 1 vectors' worth), instead of one horizontal sum per token, which dominated the score loop.  After level j
// each vector holds VW >> j partial sums of 2^j inputs side by side.
inline vf pair_sums(const vf& a, const vf& b, const vi& lo, int shift) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, lo + shift);
}

inline vf reduce_lanes(const vf* x) {
#if defined(__AVX512F__)
  const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  vf y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i) y[i] = pair_sums(x[2 * i], x[2 * i + 1], lo1, 8);
  for (int i = 0; i < 4; ++i) z[i] = pair_sums(y[2 * i], y[2 * i + 1], lo2, 4);
  for (int i = 0; i < 2; ++i) w[i] = pair_sums(z[2 * i], z[2 * i + 1], lo3, 2);
  return pair_sums(w[0], w[1], lo4, 1);
#else  // vperm2f128, then two in-lane shufps levels
  const vi lo1 = {0, 1, 2, 3, 8, 9, 10, 11};
  const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13};
  const vi lo3 = {0, 2, 4, 6, 8, 10, 12, 14};
  vf y[4], z[2];
  for (int i = 0; i < 4; ++i) y[i] = pair_sums(x[2 * i], x[2 * i + 1], lo1, 4);
  for (int i = 0; i < 2; ++i) z[i] = pair_sums(y[2 * i], y[2 * i + 1], lo2, 2);
  return pair_sums(z[0], z[1], lo3, 1);
#endif
}

// VW consecutive code bytes widened to int32 lanes (one vpmovzxbd; a plain widening loop compiled to byte loads
// and lane inserts through the stack at 8 lanes)
inline vi widen(const uint8_t* __restrict src) {
  vi x;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  std::memcpy(&x, &w, sizeof(x));
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  std::memcpy(&x, &w, sizeof(x));
#else
  for (int l = 0; l < VW; ++l) x[l] = src[l];
#endif
  return x;
}

template <int BITS>
inline vf field(const vi& bytes, int k) {  // k-th code of each widened byte, as float
  vi x = bytes;
  if constexpr (BITS < 8) {
    if (k) x = x >> (k * BITS);
    if ((k + 1) * BITS < 8) x = x & ((1 << BITS) - 1);  // the top field of a byte needs no mask
  }
  return __builtin_convertvector(x, vf);
}

// BITS == 32: float32 rows.  Row vector index k*UB + h holds field k of units [VW h, VW h + VW): the field-major
// order (field_perm) does not depend on VW, so queries and accumulators are the same arrays at either width.
template <int DT, int BITS>
struct Layout {
  static constexpr int per = BITS >= 8 ? 1 : 8 / BITS;
  static constexpr int U = DT / per;
  static constexpr int UB = U / VW;
  static constexpr int NV = DT / VW;
};

// Per-token group parameters (ag, cg: this token's NG <= 16 groups, padded to 16 floats) spread over the unit
// blocks: lane l of block h belongs to group gsel[VW h + l] = (VW h + l) * per / G; bg[h]: block h's group when
// every block lies in one group (G / per >= VW), computed once per call (a division per token and block cost more
// than the rest of the token's work on AMD's integer divider).
template <int DT, int BITS>
struct BlockGroups {
  int g[Layout<DT, BITS>::UB];
  explicit BlockGroups(int group) {
    for (int hb = 0; hb < Layout<DT, BITS>::UB; ++hb) g[hb] = group ? hb * VW * Layout<DT, BITS>::per / group : 0;
  }
};

template <int DT, int BITS>
__attribute__((always_inline)) inline void token_affine(int group, const float* ag, const float* cg, const int* gsel,
                                                        const BlockGroups<DT, BITS>& bg, vf* av, vf* cv) {
  using L = Layout<DT, BITS>;
  if (group / L::per >= VW) {  // every block lies in one group: broadcasts, no permutation
    for (int hb = 0; hb < L::UB; ++hb) {
      av[hb] = vf{} + ag[bg.g[hb]];
      cv[hb] = vf{} + cg[bg.g[hb]];
    }
    return;
  }
  if (DT / group <= VW) {  // every group index fits one vector: one lane permutation (vpermps) per block
    const vf agv = loadf(ag), cgv = loadf(cg);
    for (int hb = 0; hb < L::UB; ++hb) {
      vi idx;
      std::memcpy(&idx, gsel + hb * VW, sizeof(idx));
      av[hb] = __builtin_shuffle(agv, idx);
      cv[hb] = __builtin_shuffle(cgv, idx);
    }
    return;
  }
  for (int hb = 0; hb < L::UB; ++hb)  // more groups than lanes (AVX2, small groups): gathered lane by lane
    for (int l = 0; l < VW; ++l) {
      av[hb][l] = ag[gsel[hb * VW + l]];
      cv[hb][l] = cg[gsel[hb * VW + l]];
    }
}

// Scores of RB query rows (q in field-major order, already scaled) against tokens [t0, t0+n) of a segment.
// A, C: per-token layouts' (a, c) from token_params.  Each token's RB partial-sum vectors are parked in buf and
// reduced VW tokens at a time.
template <int DT, int BITS, int KIND, int RB>
void fast_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* q, float* s, int64_t s_stride,
                 const int* gsel, const float* A, const float* C) {
  using L = Layout<DT, BITS>;
  vf qv[RB][L::NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < L::NV; ++i) qv[r][i] = loadf(q + r * DT + VW * i);
  vf cst[RB];  // per-channel keys: q . zero of the current group
  vf qa[RB][L::NV];
  vf buf[RB][VW];
  const int NG = KIND == INT_TOKEN ? DT / sd.f.group : 0;
  const BlockGroups<DT, BITS> bg(KIND == INT_TOKEN ? sd.f.group : 0);
  int chan[DT];  // field-major order (see field_perm): position k*U + u holds channel u*per + k
  for (int k = 0; k < L::per; ++k)
    for (int u = 0; u < L::U; ++u) chan[k * L::U + u] = u * L::per + k;
  int64_t next = -1;  // first token of the next per-channel group
  for (int t = 0; t < n; ++t) {
    vf acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = vf{};
    const char* row = sd.x.row(b, h, t0 + t);
    if constexpr (BITS != 32) __builtin_prefetch(row + PREFETCH_BYTES);
    if constexpr (BITS == 32) {
      const float* x = reinterpret_cast<const float*>(row);
      for (int i = 0; i < L::NV; ++i) {
        const vf kv = loadf(x + VW * i);
        for (int r = 0; r < RB; ++r) acc[r] += qv[r][i] * kv;
      }
    } else if constexpr (KIND == INT_CHANNEL) {
      if (t0 + t >= next) {  // fold this token group's (scale, zero) into the query (no division per token)
        const int64_t grow = (t0 + t) / sd.f.group;
        next = (grow + 1) * sd.f.group;
        float a[DT], c[DT];
        channel_params(sd, b, h, grow, chan, DT, a, c);
        for (int r = 0; r < RB; ++r) {
          vf z = vf{};
          for (int i = 0; i < L::NV; ++i) {
            qa[r][i] = qv[r][i] * loadf(a + VW * i);
            z += qv[r][i] * loadf(c + VW * i);
          }
          cst[r] = z;
        }
      }
      const uint8_t* x = reinterpret_cast<const uint8_t*>(row);
      for (int hb = 0; hb < L::UB; ++hb) {
        const vi bytes = widen(x + VW * hb);
        for (int k = 0; k < L::per; ++k) {
          const vf raw = field<BITS>(bytes, k);
          for (int r = 0; r < RB; ++r) acc[r] += qa[r][k * L::UB + hb] * raw;
        }
      }
      for (int r = 0; r < RB; ++r) acc[r] += cst[r];
    } else {  // INT_TOKEN
      vf av[L::UB], cv[L::UB];
      token_affine<DT, BITS>(sd.f.group, A + t * NG, C + t * NG, gsel, bg, av, cv);
      const uint8_t* x = reinterpret_cast<const uint8_t*>(row);
      for (int hb = 0; hb < L::UB; ++hb) {
        const vi bytes = widen(x + VW * hb);
        for (int k = 0; k < L::per; ++k) {
          const vf val = field<BITS>(bytes, k) * av[hb] + cv[hb];
          for (int r = 0; r < RB; ++r) acc[r] += qv[r][k * L::UB + hb] * val;
        }
      }
    }
    const int l = t & (VW - 1);
    for (int r = 0; r < RB; ++r) buf[r][l] = acc[r];
    if (l == VW - 1 || t == n - 1) {
      for (int r = 0; r < RB; ++r) {
        for (int j = l + 1; j < VW; ++j) buf[r][j] = vf{};
        float red[VW];
        storef(red, reduce_lanes(buf[r]));
        std::memcpy(s + r * s_stride + (t - l), red, sizeof(float) * (l + 1));
      }
    }
  }
}

// acc (field-major) += sum_t p[r][t] * value_t for RB rows.
template <int DT, int BITS, int RB>
void fast_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                 float* acc, int64_t acc_stride, const int* gsel, const float* A, const float* C) {
  using L = Layout<DT, BITS>;
  vf a[RB][L::NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < L::NV; ++i) a[r][i] = loadf(acc + r * acc_stride + VW * i);
  const int NG = BITS == 32 ? 0 : DT / sd.f.group;
  const BlockGroups<DT, BITS> bg(BITS == 32 ? 0 : sd.f.group);
  for (int t = 0; t < n; ++t) {
    float pr[RB];
    bool any = false;
    for (int r = 0; r < RB; ++r) {
      pr[r] = p[r * p_stride + t];
      any |= pr[r] != 0.f;
    }
    if (!any) continue;
    const char* row = sd.x.row(b, h, t0 + t);
    if constexpr (BITS != 32) __builtin_prefetch(row + PREFETCH_BYTES);
    if constexpr (BITS == 32) {
      const float* x = reinterpret_cast<const float*>(row);
      for (int i = 0; i < L::NV; ++i) {
        const vf v = loadf(x + VW * i);
        for (int r = 0; r < RB; ++r) a[r][i] += pr[r] * v;
      }
    } else {  // INT_TOKEN values
      vf av[L::UB], cv[L::UB];
      token_affine<DT, BITS>(sd.f.group, A + t * NG, C + t * NG, gsel, bg, av, cv);
      const uint8_t* x = reinterpret_cast<const uint8_t*>(row);
      for (int hb = 0; hb < L::UB; ++hb) {
        const vi bytes = widen(x + VW * hb);
        for (int k = 0; k < L::per; ++k) {
          const vf val = field<BITS>(bytes, k) * av[hb] + cv[hb];
          for (int r = 0; r < RB; ++r) a[r][k * L::UB + hb] += pr[r] * val;
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < L::NV; ++i) storef(acc + r * acc_stride + VW * i, a[r][i]);
}

// Which fast variant serves a side: its BITS (32 = fp32), or 0 when only the generic path can.
template <int DT>
int fast_bits(const Side& sd, bool is_key) {
  const Fmt& f = sd.f;
  if (f.kind == FP) return sd.x.dt == at::kFloat ? 32 : 0;
  if (f.kind == FP8 || f.kind == CODEBOOK) return 0;
  if (f.bits != 2 && f.bits != 4 && f.bits != 8) return 0;
  const int per = f.bits == 8 ? 1 : 8 / f.bits;
  if ((DT / per) % VW) return 0;
  if (f.kind == INT_TOKEN && (DT / f.group > 16 || f.group % per)) return 0;
  if (f.kind == INT_CHANNEL && !is_key) return 0;
  return f.bits;
}

// Scratch for per-token parameters: (a, c) of every group of every token of a work item, padded for 16-wide reads.
struct TokenParams {
  float* A;
  float* C;
};

template <int DT, int BITS, int KIND>
void scores_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* q, int64_t R, float* s,
                 int64_t s_stride, const int* gsel, TokenParams tp) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rb = std::min<int64_t>(4, R - r0);
    const float* qr = q + r0 * DT;
    float* sr = s + r0 * s_stride;
    switch (rb) {
      case 1: fast_scores<DT, BITS, KIND, 1>(sd, b, h, t0, n, qr, sr, s_stride, gsel, tp.A, tp.C); break;
      case 2: fast_scores<DT, BITS, KIND, 2>(sd, b, h, t0, n, qr, sr, s_stride, gsel, tp.A, tp.C); break;
      case 3: fast_scores<DT, BITS, KIND, 3>(sd, b, h, t0, n, qr, sr, s_stride, gsel, tp.A, tp.C); break;
      default: fast_scores<DT, BITS, KIND, 4>(sd, b, h, t0, n, qr, sr, s_stride, gsel, tp.A, tp.C); break;
    }
  }
}

template <int DT>
bool try_fast_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* q, int64_t R, float* s,
                     int64_t s_stride, const int* gsel, TokenParams tp) {
  const int bits = fast_bits<DT>(sd, true);
  const bool ch = sd.f.kind == INT_CHANNEL;
  if (bits && bits != 32 && !ch) token_params(sd, b, h, t0, n, DT / sd.f.group, tp.A, tp.C);
  switch (bits) {
    case 32: scores_rows<DT, 32, FP>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp); return true;
    case 2: ch ? scores_rows<DT, 2, INT_CHANNEL>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp)
               : scores_rows<DT, 2, INT_TOKEN>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp); return true;
    case 4: ch ? scores_rows<DT, 4, INT_CHANNEL>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp)
               : scores_rows<DT, 4, INT_TOKEN>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp); return true;
    case 8: ch ? scores_rows<DT, 8, INT_CHANNEL>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp)
               : scores_rows<DT, 8, INT_TOKEN>(sd, b, h, t0, n, q, R, s, s_stride, gsel, tp); return true;
    default: return false;
  }
}

template <int DT, int BITS>
void values_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                 int64_t R, float* acc, int64_t acc_stride, const int* gsel, TokenParams tp) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rb = std::min<int64_t>(4, R - r0);
    const float* pr = p + r0 * p_stride;
    float* ar = acc + r0 * acc_stride;
    switch (rb) {
      case 1: fast_values<DT, BITS, 1>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, gsel, tp.A, tp.C); break;
      case 2: fast_values<DT, BITS, 2>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, gsel, tp.A, tp.C); break;
      case 3: fast_values<DT, BITS, 3>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, gsel, tp.A, tp.C); break;
      default: fast_values<DT, BITS, 4>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, gsel, tp.A, tp.C); break;
    }
  }
}

template <int DT>
bool try_fast_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                     int64_t R, float* acc, int64_t acc_stride, const int* gsel, TokenParams tp) {
  const int bits = fast_bits<DT>(sd, false);
  if (bits && bits != 32) token_params(sd, b, h, t0, n, DT / sd.f.group, tp.A, tp.C);
  switch (bits) {
    case 32: values_rows<DT, 32>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    case 2: values_rows<DT, 2>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    case 4: values_rows<DT, 4>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    case 8: values_rows<DT, 8>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    default: return false;
  }
}

// An attention mask [B|1, 1, Lq, kv_len] as both entry points read it: boolean (hide where false) or float (a bias
// added to the scores; other dtypes converted once, into `held`).  has == false: no mask.
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

struct Ctx {
  int64_t B, Hq, Lq;
  int D;
  int64_t Hkv, rep, R, NI, W, chunk;
  const float* qp;
  const float* qrot;  // queries rotated by the keys' codebook rotation (q R), or null
  const std::vector<Seg>* segs;
  const std::vector<Item>* items;
  const std::vector<int64_t>* seg_fmt;
  const std::vector<Perm>*kperm, *vperm;
  float* part;
  MaskView mask;
  int64_t kv_offset, query_start;
  float scaling;
};

struct Scratch {
  std::vector<float> kbuf, vbuf, tmp, qs, qa, qc, s, accp, pa, pc;
  Scratch(int D, int64_t R, int64_t chunk)
      : kbuf(TILE * D + PAD_FLOATS), vbuf(TILE * D + PAD_FLOATS), tmp(4 * D), qs(R * D), qa(R * D), qc(R), s(R * chunk), accp(D),
        pa(chunk * 16 + 16), pc(chunk * 16 + 16) {}
};

// One (batch, kv head, chunk) work item: partial max, sum and weighted values of every query row.
template <int DT>
void run_item(const Ctx& cx, int64_t w, Scratch& sc) {
  const int D = DT ? DT : cx.D;
  const int64_t R = cx.R, W = cx.W, Lq = cx.Lq, chunk = cx.chunk;
  const int64_t bh = w / cx.NI, b = bh / cx.Hkv, h = bh % cx.Hkv;
  const Item& it = (*cx.items)[w % cx.NI];
  const Seg& sg = (*cx.segs)[it.seg];
  const int n = it.n;
  const Perm& kpm = (*cx.kperm)[(*cx.seg_fmt)[it.seg]];
  const Perm& vpm = (*cx.vperm)[(*cx.seg_fmt)[it.seg]];
  float* pw = cx.part + w * R * W;
  float* qs = sc.qs.data();
  float* s = sc.s.data();
  const TokenParams tp{sc.pa.data(), sc.pc.data()};
  // queries of this kv head, pre-scaled, in the keys' field-major order
  for (int64_t r = 0; r < R; ++r) {
    const float* qsrc = sg.k.f.kind == CODEBOOK ? cx.qrot : cx.qp;
    const float* src = qsrc + ((b * cx.Hq + h * cx.rep + r / Lq) * Lq + r % Lq) * D;
    for (int j = 0; j < D; ++j) qs[r * D + j] = src[kpm.chan[j]] * cx.scaling;
  }
  // scores
  const bool fast_k = DT > 0 && try_fast_scores<DT>(sg.k, b, h, it.t0, n, qs, R, s, chunk, kpm.unit_group.data(), tp);
  if (fast_k) {
  } else if (sg.k.f.kind == INT_CHANNEL) {
    // s = (q * a_g) . codes + q . c_g: codes are never scaled, the group's parameters go into the query
    const Fmt& f = sg.k.f;
    float* a = sc.tmp.data();
    float* c = a + D;
    float* qa = sc.qa.data();
    int64_t cur = -1;
    for (int t0 = 0; t0 < n; t0 += TILE) {
      const int nt = std::min(TILE, n - t0);
      unpack_rows<DT>(f.bits, sg.k.x, b, h, it.t0 + t0, nt, sc.kbuf.data(), D);
      for (int t = 0; t < nt; ++t) {
        const int64_t grow = (it.t0 + t0 + t) / f.group;
        if (grow != cur) {
          cur = grow;
          channel_params(sg.k, b, h, grow, kpm.chan.data(), D, a, c);
          for (int64_t r = 0; r < R; ++r) {
            float cs = 0.f;
#pragma omp simd reduction(+ : cs)
            for (int i = 0; i < D; ++i) {
              qa[r * D + i] = qs[r * D + i] * a[i];
              cs += qs[r * D + i] * c[i];
            }
            sc.qc[r] = cs;
          }
        }
        const float* kr = sc.kbuf.data() + t * D;
        for (int64_t r = 0; r < R; ++r) s[r * chunk + t0 + t] = dot<DT>(qa + r * D, kr, D) + sc.qc[r];
      }
    }
  } else {
    for (int t0 = 0; t0 < n; t0 += TILE) {
      const int nt = std::min(TILE, n - t0);
      int64_t ks;
      const float* kp = decode_rows<DT>(sg.k, b, h, it.t0 + t0, nt, D, sc.kbuf.data(), ks, sc.tmp.data(), kpm);
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qs + r * D;
        float* sr = s + r * chunk + t0;
        for (int t = 0; t < nt; ++t) sr[t] = dot<DT>(qr, kp + t * ks, D);
      }
    }
  }
  // mask, softmax within the chunk
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * chunk;
    const int64_t lq = r % Lq;
    if (cx.mask.has) {
      mask_row(cx.mask, b, lq, sg.pos + it.t0 - cx.kv_offset, n, sr);
    } else if (sg.is_new && Lq > 1) {
      const int64_t qpos = cx.query_start + lq;
      for (int t = 0; t < n; ++t)
        if (sg.pos + it.t0 + t > qpos) sr[t] = NEG_INF;
    }
    const float m = max8(sr, n);
    const float safe = std::isinf(m) && m < 0 ? 0.f : m;
    const float l = exp_sum8(sr, n, safe);
    float* pr = pw + r * W;
    pr[0] = m;
    pr[1] = l;
    std::fill(pr + 2, pr + W, 0.f);
  }
  // weighted values
  const bool fast_v = DT > 0 && try_fast_values<DT>(sg.v, b, h, it.t0, n, s, chunk, R, pw + 2, W, vpm.unit_group.data(), tp);
  for (int t0 = 0; t0 < (fast_v ? 0 : n); t0 += TILE) {
    const int nt = std::min(TILE, n - t0);
    int64_t vs;
    const float* vp = decode_rows<DT>(sg.v, b, h, it.t0 + t0, nt, D, sc.vbuf.data(), vs, sc.tmp.data(), vpm);
    for (int64_t r = 0; r < R; ++r) axpy_rows<DT>(pw + r * W + 2, s + r * chunk + t0, vp, vs, nt, D);
  }
  // back to natural channel order
  for (int64_t r = 0; r < R; ++r) {
    float* acc = pw + r * W + 2;
    std::copy(acc, acc + D, sc.accp.data());
    for (int j = 0; j < D; ++j) acc[vpm.chan[j]] = sc.accp[j];
  }
}

}  // namespace

// q: float32 [B, Hq, Lq, D] contiguous.  Per segment: 6 tensors (k.x, k.scale, k.zero, v.x, v.scale, v.zero;
// empty where absent), its absolute start, token count, is-new flag and format index (into fmts: 6 ints each,
// keys then values).  mask: empty, bool or float [B|1, 1, Lq, kv_len].  Returns float32 [B, Hq, Lq, D].
// The segment lists both entry points take, unpacked: one Seg per segment, each format's field orders (formats no
// segment uses get identity orders, never read) and, per format, a rotated-codebook side whose table (rotation +
// levels) was checked here once.
struct Segments {
  std::vector<Seg> segs;
  std::vector<Perm> kperm, vperm;
  std::vector<const Side*> kcb, vcb;
  int64_t Hkv = 0;
};

Segments read_segments(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& seg_pos,
                       const std::vector<int64_t>& seg_n, const std::vector<int64_t>& seg_new,
                       const std::vector<int64_t>& seg_fmt, const std::vector<int64_t>& fmts, int D) {
  const size_t S = seg_pos.size(), NF = fmts.size() / 12;
  TORCH_CHECK(parts.size() == 6 * S && seg_n.size() == S && seg_new.size() == S && seg_fmt.size() == S,
              "bad segment lists");
  Segments g;
  g.segs.resize(S);
  g.kperm.resize(NF);
  g.vperm.resize(NF);
  g.kcb.assign(NF, nullptr);
  g.vcb.assign(NF, nullptr);
  for (size_t i = 0; i < S; ++i) {
    TORCH_CHECK(seg_fmt[i] >= 0 && static_cast<size_t>(seg_fmt[i]) < NF, "bad segment format index");
    Seg& s = g.segs[i];
    Side* sides[2] = {&s.k, &s.v};
    for (int w = 0; w < 2; ++w) {
      const int64_t* fm = fmts.data() + 12 * seg_fmt[i] + 6 * w;
      sides[w]->f = Fmt{int(fm[0]), int(fm[1]), int(fm[2]), int(fm[3]), int(fm[4]), int(fm[5])};
      sides[w]->x = make_part(parts[6 * i + 3 * w]);
      sides[w]->scale = make_part(parts[6 * i + 3 * w + 1]);
      sides[w]->zero = make_part(parts[6 * i + 3 * w + 2]);
      if (sides[w]->f.kind != CODEBOOK) continue;
      const at::Tensor& tab = parts[6 * i + 3 * w + 2];
      const Fmt& f = sides[w]->f;
      TORCH_CHECK(tab.dim() == 4 && tab.scalar_type() == at::kFloat && tab.size(2) == D + 2 &&
                  tab.size(3) >= std::max(D, 16) && tab.size(0) == 1 && tab.size(1) == 1,
                  "codebook table must be float32 [1, 1, D + 2, max(D, 16)]");
      TORCH_CHECK(f.bits >= 1 && f.bits <= 4 && cb_bits_lo(f) >= 1 && cb_bits_lo(f) <= 4 && cb_n_hi(f) % 8 == 0 &&
                  (D - cb_n_hi(f)) % 8 == 0 && cb_group(f) >= 0, "bad codebook format");
      (w == 0 ? g.kcb : g.vcb)[seg_fmt[i]] = sides[w];
    }
    s.pos = seg_pos[i];
    s.n = seg_n[i];
    s.is_new = seg_new[i] != 0;
    g.Hkv = parts[6 * i].size(1);
    g.kperm[seg_fmt[i]] = field_perm(s.k.f, D);
    g.vperm[seg_fmt[i]] = field_perm(s.v.f, D);
  }
  for (size_t f = 0; f < NF; ++f)
    if (g.kperm[f].chan.empty()) g.kperm[f] = g.vperm[f] = field_perm(Fmt{}, D);
  return g;
}

// the codebook side of any format (a plan stores one format: every stored segment shares its table)
const Side* any_side(const std::vector<const Side*>& per_format) {
  const Side* out = nullptr;
  for (const Side* sd : per_format)
    if (sd) out = sd;
  return out;
}

at::Tensor attend(const at::Tensor& q, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& seg_pos,
                  const std::vector<int64_t>& seg_n, const std::vector<int64_t>& seg_new,
                  const std::vector<int64_t>& seg_fmt, const std::vector<int64_t>& fmts, const at::Tensor& mask,
                  int64_t kv_offset, int64_t query_start, double scaling, int64_t chunk) {
  init_luts();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  const int D = static_cast<int>(q.size(3));
  const size_t S = seg_pos.size();
  TORCH_CHECK(D <= 512, "head_dim up to 512 is supported");
  const Segments g = read_segments(parts, seg_pos, seg_n, seg_new, seg_fmt, fmts, D);
  const std::vector<Seg>& segs = g.segs;
  const int64_t Hkv = g.Hkv;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  const int64_t rep = Hq / Hkv, R = rep * Lq;

  std::vector<Item> items;
  for (size_t i = 0; i < S; ++i)
    for (int64_t t0 = 0; t0 < segs[i].n; t0 += chunk)
      items.push_back({int64_t(i), t0, int(std::min<int64_t>(chunk, segs[i].n - t0))});
  const int64_t NI = static_cast<int64_t>(items.size());
  auto out = at::zeros({B, Hq, Lq, D}, q.options());
  if (NI == 0) return out;

  // partials: [B*Hkv, NI, R, D + 2] (m, l, acc)
  const int64_t W = D + 2;
  std::vector<float> part(static_cast<size_t>(B * Hkv * NI * R * W));
  const float* qp = q.data_ptr<float>();
  at::Tensor mask_held;
  const MaskView mk = read_mask(mask, mask_held);

  // field-major orders per format (index 0: fp segments, 1: the store); rotated codebook layouts: their table,
  // checked once by read_segments; queries rotated once for the keys
  const std::vector<Perm>& kperm = g.kperm;
  const std::vector<Perm>& vperm = g.vperm;
  const Side* kcb = any_side(g.kcb);
  const Side* vcb = any_side(g.vcb);
  std::vector<float> qrot;
  if (kcb) {  // q' = q R, one D x D product per query row
    qrot.assign(static_cast<size_t>(B * Hq * Lq * D), 0.f);
    for (int64_t r = 0; r < B * Hq * Lq; ++r)
      for (int i = 0; i < D; ++i) {
        const float qi = qp[r * D + i];
        const float* Ri = table_row(*kcb, i);
        float* o = qrot.data() + r * D;
#pragma omp simd
        for (int j = 0; j < D; ++j) o[j] += qi * Ri[j];
      }
  }

  Ctx cx{B, Hq, Lq, D, Hkv, rep, R, NI, W, chunk, qp, qrot.data(), &segs, &items, &seg_fmt, &kperm, &vperm, part.data(), mk,
         kv_offset, query_start, static_cast<float>(scaling)};
  at::parallel_for(0, B * Hkv * NI, 1, [&](int64_t lo, int64_t hi) {
    Scratch sc(D, R, chunk);
    for (int64_t w = lo; w < hi; ++w) {
      if (D == 64) run_item<64>(cx, w, sc);
      else if (D == 128) run_item<128>(cx, w, sc);
      else run_item<0>(cx, w, sc);
    }
  });

  // exact log-sum-exp merge of the chunk partials
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv * R, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t bh = x / R, r = x % R, b = bh / Hkv, h = bh % Hkv;
      float M = NEG_INF;
      for (int64_t i = 0; i < NI; ++i) M = std::max(M, part[((bh * NI + i) * R + r) * W]);
      float* o = op + ((b * Hq + h * rep + r / Lq) * Lq + r % Lq) * D;
      if (std::isinf(M) && M < 0) continue;  // fully masked row -> zeros
      float L = 0.f;
      float orot[512];  // rotated codebook values: their partials are merged in the rotated space
      if (vcb) std::fill(orot, orot + D, 0.f);
      for (int64_t i = 0; i < NI; ++i) {
        const float* pr = part.data() + ((bh * NI + i) * R + r) * W;
        if (pr[1] == 0.f) continue;
        const float c = std::exp(pr[0] - M);
        L += c * pr[1];
        float* dst = segs[items[i].seg].v.f.kind == CODEBOOK ? orot : o;
        for (int j = 0; j < D; ++j) dst[j] += c * pr[2 + j];
      }
      if (vcb)  // o += o' R^T, once per output row
        for (int j = 0; j < D; ++j) {
          const float* Rj = table_row(*vcb, j);
          float acc = 0.f;
          for (int i = 0; i < D; ++i) acc += orot[i] * Rj[i];
          o[j] += acc;
        }
      const float inv = 1.f / std::max(L, 1e-30f);
      for (int j = 0; j < D; ++j) o[j] *= inv;
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------- multi-query steps (prefill)
// attend_multi serves steps with many new tokens (a prompt fed in chunks on top of a packed history).  The decode
// path above scores every query row against codes unpacked token by token: its cost grows with queries x tokens
// x head_dim in scalar-ish code, while a prefill step has enough query rows to amortise a dequantized tile.  Work
// items are (batch, kv head, tile of QT queries); an item's rows are its GQA group's heads x its queries, and it
// walks the segments in token order in tiles of KT tokens: each tile is dequantized once into a small float32
// scratch (decode_rows, so every format the decode path reads works here too), scored with one GEMM (Q K^T),
// folded into an exact online softmax (running max, sum, weighted values per row) and accumulated with a second
// GEMM (P V) through ATen (BLAS).  Dequantizing once per tile costs head_dim work per token against rows x
// head_dim for the GEMMs, so with 64 queries x the group's heads per item the GEMMs dominate (perf, 1024 queries
// over 3072 kivi-2 tokens, SmolLM2 heads, 1 thread: ~75% of the kernel's time in sgemm), and the kernel runs at
// about the speed of torch's SDPA over the same tokens held exact (0.9-1.0x in one process; the block-by-block
// reference: 2x).  Tiles whose keys are all masked for the item's queries (causal future, padding, sliding-window
// eviction) are skipped before they are dequantized, so a causal chunk's own tokens cost about half a square.
// Segment formats differ (exact tokens vs stored codes: a permuted field-major order, or the rotated space of a
// codebook), so queries are prepared and values accumulated once per format and combined at the end.

namespace {

struct MultiCtx {
  int64_t B, Hq, Lq, Hkv, rep, QT, KT, NT, NF;
  int D;
  const float* qp;
  const std::vector<Seg>* segs;
  const std::vector<int64_t>* seg_fmt;
  const std::vector<Perm>*kperm, *vperm;
  const std::vector<const Side*>*kcb, *vcb;  // per format: a side holding its codebook table, or null
  MaskView mask;
  int64_t kv_offset, query_start;
  float scaling;
  float* out;
};

struct MultiScratch {
  std::vector<float> q, acc, s, m, l, kbuf, vbuf, tmp, rot;
  MultiScratch(const MultiCtx& cx)
      : q(cx.NF * cx.rep * cx.QT * cx.D), acc(cx.NF * cx.rep * cx.QT * cx.D), s(cx.rep * cx.QT * cx.KT),
        m(cx.rep * cx.QT), l(cx.rep * cx.QT), kbuf(cx.KT * cx.D + PAD_FLOATS), vbuf(cx.KT * cx.D + PAD_FLOATS), tmp(4 * cx.D), rot(cx.D) {}
};

enum TileState { VISIBLE = 0, HIDDEN = 1, MIXED = 2 };

// Whether the keys [t0, t0+nt) of a segment are visible to every query of the tile, to none, or to some.
TileState tile_state(const MultiCtx& cx, int64_t b, int64_t q0, int64_t nq, const Seg& sg, int64_t t0, int nt) {
  if (cx.mask.has) {
    const MaskView& mk = cx.mask;
    const int64_t c0 = sg.pos + t0 - cx.kv_offset;
    const int64_t lo = std::max<int64_t>(c0, 0), hi = std::min<int64_t>(c0 + nt, mk.mcols);
    bool vis = false, hidden = lo > c0 || hi < c0 + nt, bias = false;
    const int64_t bb = mk.mB == 1 ? 0 : b;
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t base = bb * mk.ms0 + (q0 + j) * mk.ms2;
      if (mk.bp) {
        for (int64_t c = lo; c < hi; ++c) {
          const bool x = mk.bp[base + c * mk.ms3];
          vis |= x;
          hidden |= !x;
        }
      } else {
        for (int64_t c = lo; c < hi; ++c) {
          const float x = mk.fp[base + c * mk.ms3];
          const bool h = std::isinf(x) && x < 0;
          vis |= !h;
          hidden |= h;
          bias |= !h && x != 0.f;
        }
      }
    }
    return !vis ? HIDDEN : (hidden || bias ? MIXED : VISIBLE);
  }
  if (sg.is_new && cx.Lq > 1) {  // causal among the new tokens
    if (sg.pos + t0 > cx.query_start + q0 + nq - 1) return HIDDEN;
    if (sg.pos + t0 + nt - 1 <= cx.query_start + q0) return VISIBLE;
    return MIXED;
  }
  return VISIBLE;
}

// Mask (or bias) scores s[rep*nq][KT] of a MIXED tile, exactly as the decode path does per element.
void apply_tile_mask(const MultiCtx& cx, int64_t b, int64_t q0, int64_t nq, const Seg& sg, int64_t t0, int nt,
                     float* s) {
  const int64_t R = cx.rep * nq;
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * cx.KT;
    const int64_t lq = q0 + r % nq;
    if (cx.mask.has) {
      mask_row(cx.mask, b, lq, sg.pos + t0 - cx.kv_offset, nt, sr);
    } else {
      const int64_t qpos = cx.query_start + lq;
      for (int t = 0; t < nt; ++t)
        if (sg.pos + t0 + t > qpos) sr[t] = NEG_INF;
    }
  }
}

}  // namespace

// MKL (torch's BLAS on x86) opened its own thread team inside each work item's GEMMs: with 2 intra-op threads the
// kernel spent half its time spinning in libgomp and ran 3-4x slower than on 1.  Work items therefore pin their
// BLAS calls to their own thread; weak, so builds whose BLAS is not MKL simply skip it.  (MKL's C entry point, which
// its header names mkl_set_num_threads_local; the lower-case symbol is the Fortran one, taking a pointer.)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace {

struct SerialBlas {
  int prev = 0;
  SerialBlas() {
    if (MKL_Set_Num_Threads_Local) prev = MKL_Set_Num_Threads_Local(1);
  }
  ~SerialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(prev);
  }
};

at::Tensor mat(float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(p, {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// One (batch, kv head, query tile) work item, written straight into the output.
template <int DT>
void run_tile(const MultiCtx& cx, int64_t w, MultiScratch& sc) {
  const int D = DT ? DT : cx.D;
  const int64_t bh = w / cx.NT, b = bh / cx.Hkv, h = bh % cx.Hkv;
  const int64_t q0 = (w % cx.NT) * cx.QT, nq = std::min(cx.QT, cx.Lq - q0), R = cx.rep * nq;
  const int64_t KT = cx.KT;
  // queries of the tile, pre-scaled, once per format: in its key order (field-major), rotated for a codebook
  for (int64_t f = 0; f < cx.NF; ++f) {
    const Side* cb = (*cx.kcb)[f];
    const int* chan = (*cx.kperm)[f].chan.data();
    for (int64_t r = 0; r < R; ++r) {
      const float* src = cx.qp + ((b * cx.Hq + h * cx.rep + r / nq) * cx.Lq + q0 + r % nq) * D;
      if (cb) {  // q' = q R
        std::fill(sc.rot.begin(), sc.rot.end(), 0.f);
        for (int i = 0; i < D; ++i) {
          const float qi = src[i];
          const float* Ri = table_row(*cb, i);
#pragma omp simd
          for (int j = 0; j < D; ++j) sc.rot[j] += qi * Ri[j];
        }
        src = sc.rot.data();
      }
      float* dst = sc.q.data() + (f * R + r) * D;
      for (int j = 0; j < D; ++j) dst[j] = src[chan[j]] * cx.scaling;
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + cx.NF * R * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + R, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + R, 0.f);
  at::Tensor S = mat(sc.s.data(), R, KT, KT);
  for (size_t si = 0; si < cx.segs->size(); ++si) {
    const Seg& sg = (*cx.segs)[si];
    const int64_t f = (*cx.seg_fmt)[si];
    const Perm& kpm = (*cx.kperm)[f];
    const Perm& vpm = (*cx.vperm)[f];
    at::Tensor Q = mat(sc.q.data() + f * R * D, R, D, D);
    at::Tensor A = mat(sc.acc.data() + f * R * D, R, D, D);
    for (int64_t t0 = 0; t0 < sg.n; t0 += KT) {
      const int nt = static_cast<int>(std::min(KT, sg.n - t0));
      const TileState st = tile_state(cx, b, q0, nq, sg, t0, nt);
      if (st == HIDDEN) continue;
      int64_t ks, vs;
      const float* kp = decode_rows<DT>(sg.k, b, h, t0, nt, D, sc.kbuf.data(), ks, sc.tmp.data(), kpm);
      at::Tensor Sv = S.narrow(1, 0, nt);
      at::mm_out(Sv, Q, mat(const_cast<float*>(kp), nt, D, ks).t());
      if (st == MIXED) apply_tile_mask(cx, b, q0, nq, sg, t0, nt, sc.s.data());
      for (int64_t r = 0; r < R; ++r) {  // online softmax: rescale what the row holds when its max grows
        float* sr = sc.s.data() + r * KT;
        const float mx = std::max(sc.m[r], max8(sr, nt));
        const float safe = std::isinf(mx) && mx < 0 ? 0.f : mx;
        const float sum = exp_sum8(sr, nt, safe);
        if (mx > sc.m[r]) {
          const float corr = std::isinf(sc.m[r]) ? 0.f : std::exp(sc.m[r] - mx);
          if (corr != 1.f) {
            sc.l[r] *= corr;
            for (int64_t g = 0; g < cx.NF; ++g) {
              float* ar = sc.acc.data() + (g * R + r) * D;
#pragma omp simd
              for (int j = 0; j < D; ++j) ar[j] *= corr;
            }
          }
          sc.m[r] = mx;
        }
        sc.l[r] += sum;
      }
      const float* vp = decode_rows<DT>(sg.v, b, h, t0, nt, D, sc.vbuf.data(), vs, sc.tmp.data(), vpm);
      A.addmm_(Sv, mat(const_cast<float*>(vp), nt, D, vs));
    }
  }
  // combine the formats' accumulators in natural channel order (rotating codebook values back: o = o' R^T)
  for (int64_t r = 0; r < R; ++r) {
    float* o = cx.out + ((b * cx.Hq + h * cx.rep + r / nq) * cx.Lq + q0 + r % nq) * D;
    if (sc.l[r] == 0.f) continue;  // fully masked row: zeros
    for (int64_t f = 0; f < cx.NF; ++f) {
      const float* ar = sc.acc.data() + (f * R + r) * D;
      const int* chan = (*cx.vperm)[f].chan.data();
      const Side* cb = (*cx.vcb)[f];
      float* nat = cb ? sc.rot.data() : o;
      if (cb) std::fill(sc.rot.begin(), sc.rot.end(), 0.f);
      for (int j = 0; j < D; ++j) nat[chan[j]] += ar[j];
      if (cb)
        for (int j = 0; j < D; ++j) {
          const float* Rj = table_row(*cb, j);
          float acc = 0.f;
          for (int i = 0; i < D; ++i) acc += sc.rot[i] * Rj[i];
          o[j] += acc;
        }
    }
    const float inv = 1.f / sc.l[r];
#pragma omp simd
    for (int j = 0; j < D; ++j) o[j] *= inv;
  }
}

}  // namespace

// Same arguments as attend, plus the query tile QT and key tile KT of the work items.  Returns float32 [B, Hq, Lq, D].
at::Tensor attend_multi(const at::Tensor& q, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& seg_pos,
                        const std::vector<int64_t>& seg_n, const std::vector<int64_t>& seg_new,
                        const std::vector<int64_t>& seg_fmt, const std::vector<int64_t>& fmts, const at::Tensor& mask,
                        int64_t kv_offset, int64_t query_start, double scaling, int64_t q_tile, int64_t k_tile) {
  init_luts();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32");
  TORCH_CHECK(q_tile > 0 && k_tile > 0, "tiles must be positive");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  const int D = static_cast<int>(q.size(3));
  const size_t S = seg_pos.size(), NF = fmts.size() / 12;
  TORCH_CHECK(D <= 512, "head_dim up to 512 is supported");
  const Segments g = read_segments(parts, seg_pos, seg_n, seg_new, seg_fmt, fmts, D);
  const int64_t Hkv = g.Hkv;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  auto out = at::zeros({B, Hq, Lq, D}, q.options());
  if (S == 0 || Lq == 0) return out;
  at::Tensor mask_held;
  const MaskView mk = read_mask(mask, mask_held);
  const int64_t QT = std::min(q_tile, Lq), NT = (Lq + QT - 1) / QT;
  MultiCtx cx{B, Hq, Lq, Hkv, Hq / Hkv, QT, k_tile, NT, static_cast<int64_t>(NF), D, q.data_ptr<float>(), &g.segs,
              &seg_fmt, &g.kperm, &g.vperm, &g.kcb, &g.vcb, mk, kv_offset, query_start, static_cast<float>(scaling), out.data_ptr<float>()};
  at::parallel_for(0, B * Hkv * NT, 1, [&](int64_t lo, int64_t hi) {
    SerialBlas serial;
    MultiScratch sc(cx);
    for (int64_t w = lo; w < hi; ++w) {
      if (D == 64) run_tile<64>(cx, w, sc);
      else if (D == 128) run_tile<128>(cx, w, sc);
      else run_tile<0>(cx, w, sc);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "decode attention over packed KV blocks");
  m.def("attend_multi", &attend_multi, "multi-query (prefill) attention over packed KV blocks");
}
