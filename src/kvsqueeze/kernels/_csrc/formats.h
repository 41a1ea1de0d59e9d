// Storage formats as the kernel reads them: tensor views (Part), format descriptors (Fmt), segments, field-major
// channel orders, parameter loading, and dequantization of rows into float tiles (the generic path).
#pragma once

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
  int64_t r0 = 0;  // the row ptr points at (a scratch copy of rows [r0, ...): as_nibbles)
  at::ScalarType dt = at::kFloat;
  const char* row(int64_t b, int64_t h, int64_t r) const { return ptr + b * sb + h * sh + (r - r0) * sr; }
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
  int shift = 0;  // integer codes stored plus this (as_nibbles: 3-bit codes as 4-bit ones); never from Python
};
// A side's format from the six ints kernels/cpu.py writes for it (_fmt)
inline Fmt read_fmt(const int64_t* fm) {
  return Fmt{int(fm[0]), int(fm[1]), int(fm[2]), int(fm[3]), int(fm[4]), int(fm[5])};
}
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
  int64_t fmt = 0;         // index of its format in the plan's list (0: exact tokens, 1: the store's)
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

// 3-bit integer codes (8 per 3 bytes, code k of a unit at bit 3k) are read as 4-bit ones: a row repacked to one
// nibble per code (byte j: codes 2j and 2j + 1) goes through every 4-bit path (the generic one, the float and integer
// fast paths; before, 3-bit sides had only the generic path and decoded at half the speed of `full`), so the 3-bit
// field-major order is the 4-bit one (codes_per_unit).  16 codes at a time: the low 48 bits of x to 64.
inline uint64_t spread3(uint64_t x) {  // (every unit on the generic build; the vector builds use it for tails)
  x = (x & 0xFFFFFFull) | ((x & 0xFFFFFF000000ull) << 8);                       // 24-bit halves to 32
  x = (x & 0x00000FFF00000FFFull) | ((x & 0x00FFF00000FFF000ull) << 4);         // 12-bit quarters to 16
  x = (x & 0x003F003F003F003Full) | ((x & 0x0FC00FC00FC00FC0ull) << 2);         // 6-bit pairs to bytes
  return (x & 0x0707070707070707ull) | ((x & 0x3838383838383838ull) << 1);      // 3-bit codes to nibbles
}

// ``units`` 6-byte units of 3-bit codes (16 codes each, a contiguous run of rows) as 8-byte units of nibbles, ``bias``
// added to every nibble; never reads past the run (masked loads, a scalar tail).  Output byte j holds the 6-bit field
// at bit 6j (codes 2j and 2j + 1); with VBMI a byte permute and a multishift take it out directly.  Other vector
// builds give each 16-bit word w (bytes 2w, 2w + 1) the two source bytes holding its 12-bit field (at bit 12w: a
// dword permute, then a byte shuffle within 128-bit lanes), align the fields of even and odd words by one multiply,
// and split each into its two 6-bit fields with two shifts.  Either way the 6-bit field f (3-bit codes lo, hi) becomes
// the nibbles lo | hi << 4 as f + (f & 0x38).
inline void repack3_run(const uint8_t* __restrict src, uint8_t* __restrict dst, int64_t units, uint64_t bias) {
  int64_t u = 0;
#if defined(__AVX512BW__)
  {
    const __m512i vb = _mm512_set1_epi64(static_cast<long long>(bias)), hi3 = _mm512_set1_epi8(0x38);
#if defined(__AVX512VBMI__)
    const __m512i bperm = _mm512_set_epi8(47, 46, 47, 46, 45, 44, 43, 42, 41, 40, 41, 40, 39, 38, 37, 36, 35, 34, 35,
                                          34, 33, 32, 31, 30, 29, 28, 29, 28, 27, 26, 25, 24, 23, 22, 23, 22, 21, 20,
                                          19, 18, 17, 16, 17, 16, 15, 14, 13, 12, 11, 10, 11, 10, 9, 8, 7, 6, 5, 4, 5,
                                          4, 3, 2, 1, 0);  // 64-bit lane j: unit j
    const __m512i shifts = _mm512_set1_epi64(0x2A241E18120C0600ll);  // byte k of a lane: its bits [6k, 6k + 8)
    const __m512i six = _mm512_set1_epi8(0x3F);
    auto fields = [&](__m512i x) {
      return _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(bperm, x)), six);
    };
#else
    const __m512i perm = _mm512_setr_epi32(0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11);
    const __m512i shuf = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11));
    const __m512i align = _mm512_set1_epi32(0x00010010);  // even words x 16, odd x 1: fields at bits 4-15
    const __m512i lo6 = _mm512_set1_epi16(0x003F), hi6 = _mm512_set1_epi16(0x3F00);
    auto fields = [&](__m512i x) {
      const __m512i m = _mm512_mullo_epi16(_mm512_shuffle_epi8(_mm512_permutexvar_epi32(perm, x), shuf), align);
      return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(m, 4), lo6),
                             _mm512_and_si512(_mm512_srli_epi16(m, 2), hi6));
    };
#endif
    auto spread = [&](__m512i x) {
      const __m512i f = fields(x);
      return _mm512_add_epi64(_mm512_add_epi8(f, _mm512_and_si512(f, hi3)), vb);
    };
    for (; u + 11 <= units; u += 8)  // a full 64-byte load stays within the run (masked accesses cost more)
      _mm512_storeu_si512(dst + 8 * u, spread(_mm512_loadu_si512(src + 6 * u)));
    for (; u < units; u += 8) {
      const int64_t m = std::min<int64_t>(8, units - u);
      const __m512i z = spread(_mm512_maskz_loadu_epi8((1ull << (6 * m)) - 1, src + 6 * u));
      _mm512_mask_storeu_epi64(dst + 8 * u, static_cast<__mmask8>((1u << m) - 1), z);
    }
    return;
  }
#elif defined(__AVX2__)
  {
    const __m256i perm = _mm256_setr_epi32(0, 1, 2, 2, 3, 4, 5, 5);
    const __m256i shuf = _mm256_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11,
                                          0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11);
    const __m256i align = _mm256_set1_epi32(0x00010010);  // even words x 16, odd x 1: fields at bits 4-15
    const __m256i lo6 = _mm256_set1_epi16(0x003F), hi6 = _mm256_set1_epi16(0x3F00), hi3 = _mm256_set1_epi8(0x38);
    const __m256i load6 = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);  // 24 bytes: 4 units
    const __m256i vb = _mm256_set1_epi64x(static_cast<long long>(bias));
    auto spread = [&](__m256i x) {
      const __m256i m = _mm256_mullo_epi16(_mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(x, perm), shuf), align);
      const __m256i f = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(m, 4), lo6),
                                        _mm256_and_si256(_mm256_srli_epi16(m, 2), hi6));
      return _mm256_add_epi64(_mm256_add_epi8(f, _mm256_and_si256(f, hi3)), vb);
    };
    for (; u + 6 <= units; u += 4)  // a full 32-byte load stays within the run
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * u),
                          spread(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 6 * u))));
    for (; u + 4 <= units; u += 4)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * u),
                          spread(_mm256_maskload_epi32(reinterpret_cast<const int*>(src + 6 * u), load6)));
  }
#endif
  for (; u < units; ++u) {  // (a 6-byte memcpy into one word went through the stack and stalled its reload)
    uint32_t lo;
    uint16_t hi;
    std::memcpy(&lo, src + 6 * u, 4);
    std::memcpy(&hi, src + 6 * u + 4, 2);
    const uint64_t y = spread3(uint64_t(lo) | (uint64_t(hi) << 32)) + bias;
    std::memcpy(dst + 8 * u, &y, 8);
  }
}

// One row of D 3-bit codes as D / 2 bytes of nibbles, ``bias`` added to every nibble (no carry: codes <= 7, bias
// 0 or 4).  Reads exactly the row's 3 D / 8 bytes.
inline void repack3_row(const uint8_t* __restrict src, uint8_t* __restrict dst, int D, uint64_t bias) {
  const int n16 = D / 16;
  repack3_run(src, dst, n16, bias);
  if (D % 16) {  // a last unit of 8 codes
    const uint8_t* p = src + 6 * n16;
    const uint32_t x = uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16);
    const uint32_t y = static_cast<uint32_t>(spread3(x) + bias);
    std::memcpy(dst + 8 * n16, &y, 4);
  }
}

// Codes of one token row, unpacked as float but not yet scaled.  Packed widths come out "field-major": the k-th
// code of every packing unit first (position k*U + u holds channel u*per + k), which turns unpacking into
// constant shifts over contiguous bytes that the compiler vectorises; queries and outputs are permuted to match.
// DT is head_dim when known at compile time (64, 128, 256), else 0 and Drt is used.
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
  } else if constexpr (BITS == 3) {  // through the 4-bit order (codes_per_unit)
    uint8_t nib[256];  // D <= 512
    repack3_row(src, nib, D, 0);
    unpack_fm<4, DT>(nib, dst, D);
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

// codes per packing unit in the order rows are read (3-bit rows as 4-bit ones: repack3_row)
inline int codes_per_unit(const Fmt& f) {
  if (f.kind != INT_TOKEN && f.kind != INT_CHANNEL) return 1;
  return (f.bits == 1 || f.bits == 2 || f.bits == 4) ? 8 / f.bits : (f.bits == 3 ? 2 : 1);
}

// Rows [t0, t0 + n) of a 3-bit integer side repacked into buf (n * D / 2 bytes) as 4-bit codes: the side every
// 4-bit path reads in its place.  Symmetric codes are stored plus 4: centred on 4, they are then symmetric 4-bit
// codes (centre 8) with the same scale.  Asymmetric ones are shifted the same way where ``centre`` asks (values:
// the integer value path centres its sums on the 4-bit middle, int_values.h, and unshifted 3-bit codes tripled its
// rounding error), their zero points less 4 scales (affine_row); keys keep them as they are (the integer scores'
// rounding error grows with the codes).
inline Side as_nibbles(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int D, uint8_t* buf,
                       const uint8_t* buf_end, bool centre) {
  const int64_t rb = D / 2;
  const int shift = centre || sd.f.sym ? 4 : 0;
  const uint64_t bias = shift ? 0x4444444444444444ull : 0;
  const uint8_t* first = reinterpret_cast<const uint8_t*>(sd.x.row(b, h, t0));
  if (sd.x.sr == 3 * D / 8) {  // rows back to back (a block's codes): one run (D is 64, 128 or 256 here)
    repack3_run(first, buf, int64_t(n) * D / 16, bias);
  } else {
    for (int t = 0; t < n; ++t) repack3_run(first + t * sd.x.sr, buf + t * rb, D / 16, bias);
  }
  Side out = sd;
  out.f.bits = 4;
  out.f.shift = sd.f.sym ? 0 : shift;
  out.x.ptr = reinterpret_cast<const char*>(buf);
  out.x.end = reinterpret_cast<const char*>(buf_end);
  out.x.sb = out.x.sh = 0;
  out.x.sr = rb;
  out.x.r0 = t0;
  return out;
}

inline bool is_int3(const Side& sd) { return (sd.f.kind == INT_TOKEN || sd.f.kind == INT_CHANNEL) && sd.f.bits == 3; }

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

// Ask for rows [r0, r0 + n) of a part ahead of use, a cache line at a time (rows as stored; never past the storage).
inline void prefetch_rows(const Part& x, int64_t b, int64_t h, int64_t r0, int64_t n) {
  if (!x.ptr || n <= 0) return;
  const char* lo = x.row(b, h, r0);
  const char* hi = std::min(x.row(b, h, r0 + n), x.end);
  if (x.sr <= 256) {  // rows near each other: the whole range
    for (const char* p = lo; p < hi; p += 64) __builtin_prefetch(p);
  } else {
    for (int64_t r = 0; r < n; ++r) __builtin_prefetch(x.row(b, h, r0 + r));
  }
}

// A work item's value rows (codes, and per-token scales and zero points), requested while its key scores run, ahead
// of the key being scored: with K/V coming from memory (a model's weights evict them between layers) the values
// pass waited on them, the up-front prefetch_rows of the whole item notwithstanding (Zen 3, one layer at 8k read
// from memory: 4-6% of the kivi-4 / kivi-2 / int8 step; a burst of line prefetches per block of tokens instead
// gained nothing, and the rotated codebook scores got slower with it).  Never faults: prefetches are hints.
struct ValueAhead {
  const char* codes = nullptr;  // row t + CODES of the codes, at each scored token t
  const char* scale = nullptr;  // rows t + PARAMS of the per-token parameters, once per block of tokens
  const char* zero = nullptr;
  int64_t csr = 0, psr = 0;
  static constexpr int CODES = 32, PARAMS = 64;
  ValueAhead(const Side& v, int64_t b, int64_t h, int64_t t0) {
    if (v.f.kind == FP) return;
    codes = v.x.row(b, h, t0);
    csr = v.x.sr;
    if (v.f.kind == INT_TOKEN) {
      scale = v.scale.row(b, h, t0);
      zero = v.zero.ptr ? v.zero.row(b, h, t0) : nullptr;
      psr = v.scale.sr;
    }
  }
  void token(int64_t t) const {
    if (codes) __builtin_prefetch(codes + (t + CODES) * csr);
  }
  void block(int64_t t) const {
    if (scale) __builtin_prefetch(scale + (t + PARAMS) * psr);
    if (zero) __builtin_prefetch(zero + (t + PARAMS) * psr);
  }
};

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
    if (f.shift)
      for (int i = 0; i < n; ++i) c[i] -= static_cast<float>(f.shift) * a[i];
  } else {  // (a shifted symmetric side's centre is its read width's: as_nibbles)
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

// Per-channel layouts: (a, c) of token-group row ``grow`` in natural channel order.
inline void channel_row(const Side& sd, int64_t b, int64_t h, int64_t grow, int D, float* a, float* c) {
  affine_row(sd, sd.scale.row(b, h, grow), sd.f.sym ? nullptr : sd.zero.row(b, h, grow), D, a, c);
}

// The same, gathered one float at a time into the field-major order ``chan`` (out[i] = in[chan[i]]).
inline void channel_params(const Side& sd, int64_t b, int64_t h, int64_t grow, const int* chan, int D, float* a,
                           float* c) {
  float an[512], cn[512];  // D <= 512 is checked at entry
  channel_row(sd, b, h, grow, D, an, cn);
  for (int i = 0; i < D; ++i) {
    a[i] = an[chan[i]];
    c[i] = cn[chan[i]];
  }
}

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

}  // namespace
