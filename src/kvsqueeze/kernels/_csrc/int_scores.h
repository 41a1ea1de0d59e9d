// Key scores by integer dot products (AVX-512 VNNI or AVX2 builds; other builds keep the float path).
//
// The float path converts every key code to float and spends one multiply-add per code and query row; at 2-4 bits
// that arithmetic, not the bytes read, bounded the decode step.  Here each query row is quantized once (per key
// group for per-channel keys, whose (scale, zero) fold into it first) and the packed codes are multiplied as bytes:
//   2/4-bit codes: the fields split from the packed bytes by a shift and a mask, the code bytes zero-extended to
//                  int16 (vpunpck*bw) x one 15-bit query part (vpdpwssd; AVX2: vpmaddwd; IntLayout::U16), one
//                  multiply per 32 (16) codes.  Layouts U16 does not cover (AVX-512: fields of more than 64
//                  channels) take unsigned code bytes x two int8 query parts (vpdpbusd; AVX2: vpmaddubsw + vpaddw),
//                  round(q / sq) and the remainder in 1/256ths, combined as hi * 256 + lo before the lanes are
//                  summed: one int8 part alone added ~20% to the 4-bit keys' own score error (measured against the
//                  reference), two add ~0.1%, one int16 part the same as two;
//   8-bit codes:   codes widened to int16 x int16 query (vpdpwssd; AVX2: vpmaddwd), so the query keeps 15 bits.
//   3-bit codes arrive as 4-bit ones (decode.h repacks a work item's rows: formats.h as_nibbles).
// Integer lane sums are exact; a block of VW tokens is reduced to VW scores at once (reduce_tokens) and scaled:
//   per-channel keys, group g:  s_t = sq_g * sum_c qi_c code_tc + sum_c q_c zero_gc       (qi = round(q a_g / sq_g))
//   per-token keys, one group:  s_t = sq * a_t * sum_c qi_c code_tc + c_t * sum_c q_c     (qi = round(q / sq))
// The only error added to the reference's is the query's rounding: |ds_t| <= sq / 2 * sum_c |code_tc| (two int8
// parts: sq = max|q a| / (127 * 256); int16: max|q| / 32767 or less), tested against the reference in tests/kernels.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSQ_INT_DOT 1
#define KVSQ_INT_DOT_NAME "avx512-vnni"
namespace {
typedef __m512i ivec;
constexpr int IB = 64;  // bytes per integer vector
inline ivec iload(const void* p) { return _mm512_loadu_si512(p); }
inline ivec izero() { return _mm512_setzero_si512(); }
// byte products summed into int32 lanes at once; parts_sum = hi * 256 + lo per int32 lane
inline ivec dot_u8s8(ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline ivec dot_s16(ivec acc, ivec a, ivec b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline ivec parts_sum(ivec hi, ivec lo) { return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo); }
template <int SHIFT>
inline ivec field_bytes(ivec x, uint8_t mask) {
  if constexpr (SHIFT) x = _mm512_srli_epi16(x, SHIFT);  // bits from the next byte land above the mask
  return _mm512_and_si512(x, _mm512_set1_epi8(static_cast<char>(mask)));
}
inline ivec widen_s16(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// code bytes zero-extended to int16: lo = bytes 0-7 of every 128-bit lane, hi = bytes 8-15 (vpunpck*bw work per lane)
inline void bytes_to_s16(ivec f, ivec& lo, ivec& hi) {
  lo = _mm512_unpacklo_epi8(f, _mm512_setzero_si512());
  hi = _mm512_unpackhi_epi8(f, _mm512_setzero_si512());
}

// out[j] = in[chan[j]] for DT floats by masked lane permutations (the field-major orders draw each output vector
// from per input vectors): a per-channel key group (32 tokens in the KIVI presets) gathered its scales and zero
// points one float at a time, 2 x DT scalar moves that were a fifth of a kivi-4 decode step.
template <int DT>
struct ChanGather {
  static constexpr int NV = DT / 16;
  __m512i idx[NV];
  __mmask16 m[NV][NV];
  ChanGather() = default;
  explicit ChanGather(const int* chan) {
    for (int j = 0; j < NV; ++j) {
      alignas(64) int32_t lanes[16];
      for (int s = 0; s < NV; ++s) m[j][s] = 0;
      for (int l = 0; l < 16; ++l) {
        lanes[l] = chan[16 * j + l] & 15;
        m[j][chan[16 * j + l] / 16] |= static_cast<__mmask16>(1u << l);
      }
      idx[j] = _mm512_load_si512(lanes);
    }
  }
  void apply(const float* in, float* out) const {
    __m512 v[NV];
    for (int s = 0; s < NV; ++s) v[s] = _mm512_loadu_ps(in + 16 * s);
    for (int j = 0; j < NV; ++j) {
      __m512 o = _mm512_setzero_ps();
      for (int s = 0; s < NV; ++s)
        if (m[j][s]) o = _mm512_mask_permutexvar_ps(o, m[j][s], idx[j], v[s]);
      _mm512_storeu_ps(out + 16 * j, o);
    }
  }
};
#define KVSQ_CHAN_GATHER 1
}  // namespace
#elif defined(__AVX2__)
#define KVSQ_INT_DOT 1
#define KVSQ_INT_DOT_NAME "avx2"
namespace {
typedef __m256i ivec;
constexpr int IB = 32;
inline ivec iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec izero() { return _mm256_setzero_si256(); }
// vpmaddubsw saturates pairs at int16: 2 x 15 x 128 fits, which is why 8-bit codes take the int16 path.  The
// pair sums of a row's fields and vectors stay int16 (IntLayout::PAIRS_FIT bounds them) and are widened once, by
// parts_sum: one vpmaddwd per query part where a widening per field and part cost two more instructions each.
inline ivec dot_u8s8(ivec acc, ivec u, ivec s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
inline ivec dot_s16(ivec acc, ivec a, ivec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline ivec parts_sum(ivec hi, ivec lo) {
  return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(256)), _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
}
// code bytes zero-extended to int16: lo = bytes 0-7 and 16-23, hi = bytes 8-15 and 24-31 (vpunpck*bw work per
// 128-bit lane)
inline void bytes_to_s16(ivec f, ivec& lo, ivec& hi) {
  lo = _mm256_unpacklo_epi8(f, _mm256_setzero_si256());
  hi = _mm256_unpackhi_epi8(f, _mm256_setzero_si256());
}
template <int SHIFT>
inline ivec field_bytes(ivec x, uint8_t mask) {
  if constexpr (SHIFT) x = _mm256_srli_epi16(x, SHIFT);
  return _mm256_and_si256(x, _mm256_set1_epi8(static_cast<char>(mask)));
}
inline ivec widen_s16(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// out[j] = in[chan[j]] for DT floats, as the AVX-512 ChanGather: each output vector is one lane permutation of each
// input vector its lanes come from (two for the 4-bit field-major order), blended; the scalar gather was a twentieth
// of a kivi-4 decode step on AVX2.
template <int DT>
struct ChanGather {
  static constexpr int NV = DT / 8;
  __m256i idx[NV];
  __m256 sel[NV][8];
  int src[NV][8], nsrc[NV];
  ChanGather() = default;
  explicit ChanGather(const int* chan) {
    for (int j = 0; j < NV; ++j) {
      alignas(32) int32_t lanes[8], m[8][8] = {};
      nsrc[j] = 0;
      for (int l = 0; l < 8; ++l) {
        const int c = chan[8 * j + l];
        lanes[l] = c & 7;
        int i = 0;
        while (i < nsrc[j] && src[j][i] != c / 8) ++i;
        if (i == nsrc[j]) src[j][nsrc[j]++] = c / 8;
        m[i][l] = -1;
      }
      idx[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
      for (int i = 0; i < nsrc[j]; ++i) sel[j][i] = _mm256_load_ps(reinterpret_cast<const float*>(m[i]));
    }
  }
  void apply(const float* in, float* out) const {
    for (int j = 0; j < NV; ++j) {
      __m256 o = _mm256_permutevar8x32_ps(_mm256_loadu_ps(in + 8 * src[j][0]), idx[j]);
      for (int i = 1; i < nsrc[j]; ++i)
        o = _mm256_blendv_ps(o, _mm256_permutevar8x32_ps(_mm256_loadu_ps(in + 8 * src[j][i]), idx[j]), sel[j][i]);
      _mm256_storeu_ps(out + 8 * j, o);
    }
  }
};
#define KVSQ_CHAN_GATHER 1
}  // namespace
#endif

#if defined(KVSQ_INT_DOT)
namespace {

#if defined(KVSQ_CHAN_GATHER)
// A thread's gather for the field-major order chan, rebuilt only when the order changes (built per work item, its
// set-up cost more than the gathers it served)
template <int DT>
const ChanGather<DT>& chan_gather(const int* chan) {
  struct Slot {
    bool ok = false;
    int key[DT];
    ChanGather<DT> g;
  };
  static thread_local Slot slot;
  if (!slot.ok || std::memcmp(slot.key, chan, sizeof(slot.key))) {
    slot.g = ChanGather<DT>(chan);
    std::memcpy(slot.key, chan, sizeof(slot.key));
    slot.ok = true;
  }
  return slot.g;
}
#endif

// The integer layout of one key format: code bytes per vector CB (s16: half a vector's bytes, widened), row bytes
// RBY, tokens per vector TPV (rows shorter than a vector share it) or vectors per token VPT.
template <int DT, int BITS>
struct IntLayout {
  static constexpr bool S16 = BITS == 8;
  static constexpr int per = S16 ? 1 : 8 / BITS;
  static constexpr int RBY = DT * BITS / 8;
  static constexpr int CB = S16 ? IB / 2 : IB;
  static constexpr int TPV = CB >= RBY ? CB / RBY : 1;
  static constexpr int VPT = RBY > CB ? RBY / CB : 1;
  static constexpr int START = TPV == 1 ? 0 : TPV == 2 ? 1 : TPV == 4 ? 2 : 3;
  static constexpr bool ok = (CB % RBY == 0 || RBY % CB == 0) && TPV <= VW && TPV <= 8;
  // AVX2's int16 pair sums of one row: VPT vectors x per fields x 2 codes x the largest code x 128 (|query part|)
  // (AVX-512 sums into int32 lanes)
  static constexpr bool PAIRS_FIT = S16 || IB == 64 || VPT * per * 2 * ((1 << BITS) - 1) * 128 <= 32767;
  static constexpr int U = DT / per;  // positions per field
  // 2/4-bit codes: the code bytes zero-extended to int16 against a 15-bit query (vpmaddwd / vpdpwssd), one query
  // part: per vector 2 unpacks shared by the rows and 2 multiplies per row, where the two int8 parts took 2
  // multiplies per row and an add and a shift per row and vector to combine them.  Same rounding bound.  The token
  // loop costs about the same either way; the gain is the per-group fold, which builds one part instead of two:
  // per-channel keys re-quantize the query for every 32-token group (the KIVI presets), which was a sixth of a
  // kivi-2 layer's step on AVX2; on AVX-512 32-token groups made kivi-4's layer 19% slower than 128-token ones with
  // two parts, and one part made it 8% faster (32k tokens, 1 thread, Zen 4).  AVX-512 builds a field's query
  // vectors by one 16-bit permutation of a 64-position window (U <= 64).
  static constexpr bool U16 = (BITS == 2 || BITS == 4) && (IB == 32 ? TPV <= 2 : U <= 64);
};

#if defined(__AVX512F__)
// The 16-bit lane permutations of an AVX-512 U16 query: entry [c][h][m] = (64 c + 16 (m / 8) + 8 h + m % 8) mod U,
// the position (within its field's run) of the code that int16 lane m of unpack half h of vector c holds.
template <int U, int VPT>
struct U16Index {
  alignas(64) int16_t idx[VPT][2][32];
  constexpr U16Index() : idx{} {
    for (int c = 0; c < VPT; ++c)
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < 32; ++m) idx[c][h][m] = static_cast<int16_t>((64 * c + 16 * (m / 8) + 8 * h + m % 8) % U);
  }
};
template <int U, int VPT>
inline constexpr U16Index<U, VPT> u16_index{};
#endif

// Query rows as integer vectors in the codes' byte order.  Queries come in the float path's field-major order
// (position k U + u holds channel u per + k, U = RBY units per row), so field k's bytes are one contiguous run:
// vector c, byte j of field k holds position k U + (c CB + j) mod U.  Quantized with vectorisable loops: a
// per-channel key group (32 tokens in the KIVI presets) re-quantizes every row.
template <int DT, int BITS, int RB>
struct IntQuery {
  using L = IntLayout<DT, BITS>;
  static constexpr int U = L::U;
  alignas(64) int8_t q8[RB][2][L::per][L::VPT][IB];  // [.][0]: round(q / sq), [.][1]: the remainder in 1/256ths
  alignas(64) int16_t q16[RB][DT];
  alignas(64) int16_t q4[L::U16 ? RB : 1][L::per][L::VPT][2][IB / 2];  // U16: field k, vector c, unpack half
  float sq[RB];

  static float round_even(float x) { return (x + 12582912.f) - 12582912.f; }  // |x| < 2^22

#if defined(__AVX512F__)
  // Row r's two int8 parts built in registers: X = round(256 q / sq') (|X| <= 127 * 256), hi = round(X / 256) and
  // lo = X - 256 hi in [-128, 127], the same bound as rounding q / sq' and then its remainder in 1/256ths.  The
  // bytes go to each vector as 16-byte pieces (field runs are multiples of 16 bytes); the scalar build below wrote
  // the parts to the stack 16 bytes at a time and read them back as 32-byte runs, a failed store-to-load forward
  // per run, and this re-quantization runs once per 32-token key group.
  void set_parts_avx512(int r, const float* q, float inv) {
    constexpr int NP = DT / 16;
    __m128i hi[NP], lo[NP];
    const __m512 s256 = _mm512_set1_ps(inv * 256.f);
    for (int p = 0; p < NP; ++p) {
      const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + 16 * p), s256));
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(128)), 8);
      hi[p] = _mm512_cvtepi32_epi8(h);
      lo[p] = _mm512_cvtepi32_epi8(_mm512_sub_epi32(x, _mm512_slli_epi32(h, 8)));
    }
    for (int k = 0; k < L::per; ++k)
      for (int c = 0; c < L::VPT; ++c) {
        // vector c of field k: position k U + (64 c + j) mod U at byte j, 16 bytes (one piece) at a time
        auto at = [&](int i) { return (k * U + (64 * c + 16 * i) % U) / 16; };
        auto join = [&](const __m128i* x) {
          const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(x[at(0)]), x[at(1)], 1);
          const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(x[at(2)]), x[at(3)], 1);
          return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        };
        _mm512_store_si512(q8[r][0][k][c], join(hi));
        _mm512_store_si512(q8[r][1][k][c], join(lo));
      }
  }
#endif

  void set(const float* qe) {
    constexpr float QMAX8 = 127.f;
    // int32 lane sums must not overflow: DT codes of 255 times the largest int16 query value
    constexpr float QMAX16 = std::min(32767.f, float((2147483647LL / (255LL * DT))));
    for (int r = 0; r < RB; ++r) {
      const float* q = qe + r * DT;
      float m = 0.f;
#pragma omp simd reduction(max : m)
      for (int c = 0; c < DT; ++c) m = std::max(m, std::fabs(q[c]));
      constexpr bool W16 = L::S16 || L::U16;
      const float qmax = W16 ? QMAX16 : QMAX8;
      sq[r] = m / qmax / (W16 ? 1.f : 256.f);  // int8 parts: the dot products come out in 1/256ths
      const float inv = m > 0.f ? qmax / m : 0.f;
      if constexpr (L::U16) {
#if defined(__AVX2__) && !defined(__AVX512F__)
        // byte j of field k's vector c is position k U + 32 c + j (two tokens per vector, U = 16: position k U + j
        // in each 128-bit lane); the halves as bytes_to_s16 orders them: packs of positions (p..p+7, p'..p'+7) give
        // quads (p, p', p+4, p'+4), put in order by one vpermq (p' = p + 16, or p itself for two tokens)
        const __m256 sc = _mm256_set1_ps(inv);
        constexpr int LANE1 = L::TPV == 2 ? 0 : 16;
        auto half = [&](const float* x) {
          const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), sc));
          const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + LANE1), sc));
          return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        };
        for (int k = 0; k < L::per; ++k)
          for (int c = 0; c < L::VPT; ++c) {
            const float* run = q + k * U + 32 * c;
            _mm256_store_si256(reinterpret_cast<__m256i*>(q4[r][k][c][0]), half(run));
            _mm256_store_si256(reinterpret_cast<__m256i*>(q4[r][k][c][1]), half(run + 8));
          }
#elif defined(__AVX512F__)
        // the row as int16 in field-major order, 16 positions per piece, kept in registers; then each field's
        // vectors from its window of positions (w0: the first 32, w1: the next 32) by one 16-bit permutation per
        // unpack half (U16Index: int16 lane m of a half holds byte 16 (m / 8) + 8 h + m % 8 of the vector, i.e.
        // position k U + (64 c + that byte) mod U)
        constexpr int NP = DT / 16;
        __m256i piece[NP];
        const __m512 sc = _mm512_set1_ps(inv);
        for (int p = 0; p < NP; ++p)
          piece[p] = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + 16 * p), sc)));
        auto pair = [&](int p) {  // pieces p and p + 1 as one vector (a window of 16 positions: p alone)
          const __m512i lo = _mm512_castsi256_si512(piece[p]);
          if constexpr (U >= 32) return _mm512_inserti64x4(lo, piece[p + 1], 1);
          else return lo;
        };
        for (int k = 0; k < L::per; ++k) {
          const int p0 = k * U / 16;
          const __m512i w0 = pair(p0), w1 = U == 64 ? pair(p0 + 2) : w0;
          for (int c = 0; c < L::VPT; ++c)
            for (int h = 0; h < 2; ++h)
              _mm512_store_si512(q4[r][k][c][h], _mm512_permutex2var_epi16(
                                                     w0, _mm512_load_si512(u16_index<U, L::VPT>.idx[c][h]), w1));
        }
#endif
      } else if constexpr (L::S16) {
#pragma omp simd
        for (int c = 0; c < DT; ++c) q16[r][c] = static_cast<int16_t>(round_even(q[c] * inv));
#if defined(__AVX512F__)
      } else if constexpr (IB == 64 && U % 16 == 0) {
        set_parts_avx512(r, q, inv);
#endif
      } else {
        alignas(64) int32_t h32[DT], l32[DT];
        alignas(64) int8_t hi[DT], lo[DT];
#pragma omp simd
        for (int c = 0; c < DT; ++c) {  // integer clamps and narrowing: float min/max kept this loop scalar
          const float x = q[c] * inv, h = round_even(x);
          h32[c] = static_cast<int32_t>(h);
          const int32_t l = static_cast<int32_t>(round_even((x - h) * 256.f));  // |x - h| <= 1/2: only +-128 clamps
          l32[c] = l > 127 ? 127 : (l < -127 ? -127 : l);
        }
#pragma omp simd
        for (int c = 0; c < DT; ++c) {
          hi[c] = static_cast<int8_t>(h32[c]);
          lo[c] = static_cast<int8_t>(l32[c]);
        }
        for (int k = 0; k < L::per; ++k)
          for (int c = 0; c < L::VPT; ++c)
            for (int i = 0; i < L::TPV; ++i) {  // rows shorter than a vector: the run repeated per token
              const int n = std::min(IB, U);
              std::memcpy(&q8[r][0][k][c][i * n], hi + k * U + c * IB, n);
              std::memcpy(&q8[r][1][k][c][i * n], lo + k * U + c * IB, n);
            }
      }
    }
  }
};

// Scores of RB query rows (qs: field-major order, scaled; qn: the same rows in natural order) against tokens
// [t0, t0+n) of an integer key side.
// Per-channel keys need t0 and the group aligned to VW tokens (a block of VW tokens shares one group).
template <int DT, int BITS, int KIND, int RB>
void int_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qs, const float* qn, float* s,
                int64_t s_stride, const float* A, const float* C, const int* chan, const ValueAhead& ahead) {
  using L = IntLayout<DT, BITS>;
  static_assert(L::PAIRS_FIT, "int16 pair sums would overflow");
  constexpr uint8_t MASK = BITS >= 8 ? 0xFF : (1 << BITS) - 1;
  IntQuery<DT, BITS, RB> iq;
  float cst[RB] = {0.f}, qsum[RB] = {0.f};
  alignas(64) static const uint8_t zeros[IB * 8] = {0};
  if constexpr (KIND == INT_TOKEN) {
    iq.set(qs);
    for (int r = 0; r < RB; ++r) {
      float z = 0.f;
#pragma omp simd reduction(+ : z)
      for (int c = 0; c < DT; ++c) z += qs[r * DT + c];
      qsum[r] = z;
    }
  }
  const bool contiguous = sd.x.sr == L::RBY;
  // the item's first row and the row stride, read once: sd's fields are re-read after every store (they might
  // alias), and the three multiplies of row() per token were a sixth of the token loop
  const uint8_t* const row0 = reinterpret_cast<const uint8_t*>(sd.x.row(b, h, t0));
  const int64_t sr = sd.x.sr;
#if defined(KVSQ_CHAN_GATHER)
  const ChanGather<DT>& gather = chan_gather<DT>(chan);
#endif
  // per-channel keys: one run of blocks per key group, the group's fold before it (a fold test in every block kept
  // the block loop's registers across the fold's code)
  for (int tb = 0; tb < n;) {
    int tend = n;
    if constexpr (KIND == INT_CHANNEL) {  // fold the group's (scale, zero) into the query and quantize it
      const int64_t grow = (t0 + tb) / sd.f.group;
      tend = static_cast<int>(std::min<int64_t>(n, (grow + 1) * sd.f.group - t0));
      // the scales in the query's field-major order; the zero points' term q . c needs no order (qn: natural)
      float an[DT], cn[DT], a[DT], qe[RB * DT];
      channel_row(sd, b, h, grow, DT, an, cn);
#if defined(KVSQ_CHAN_GATHER)
      gather.apply(an, a);
#else
      for (int i = 0; i < DT; ++i) a[i] = an[chan[i]];
#endif
      for (int r = 0; r < RB; ++r) {  // (an omp simd sum compiled to VW dependent scalar adds per row)
        vf z = vf{};
        for (int i = 0; i < DT / VW; ++i) {
          const vf qv = loadf(qs + r * DT + VW * i);
          storef(qe + r * DT + VW * i, qv * loadf(a + VW * i));
          z += loadf(qn + r * DT + VW * i) * loadf(cn + VW * i);
        }
        cst[r] = sum_lanes(z);
      }
      iq.set(qe);
    }
    for (; tb < tend; tb += VW) {
      const int nb = std::min(VW, n - tb);
      ahead.block(tb);
      // exact int32 lane sums of vector v (L::TPV tokens), reduced as integers and converted once per VW tokens
      auto leaf = [&](int v) __attribute__((always_inline)) {
        const int tok = tb + v * L::TPV;  // first token of this vector
        ivec acc[RB], low[RB];
        for (int r = 0; r < RB; ++r) acc[r] = low[r] = izero();
        alignas(64) uint8_t gathered[IB];
        const uint8_t* base;
        if (L::TPV == 1) {
          base = tok < n ? row0 + tok * sr : zeros;
        } else if (contiguous && tok + L::TPV <= n) {
          base = row0 + tok * sr;
        } else {  // rows apart in memory, or past the end: gathered (missing rows as zeros, their sums unused)
          for (int i = 0; i < L::TPV; ++i)
            std::memcpy(gathered + i * L::RBY, tok + i < n ? row0 + (tok + i) * sr : zeros, L::RBY);
          base = gathered;
        }
        __builtin_prefetch(reinterpret_cast<const char*>(base) + PREFETCH_BYTES);
        ahead.token(tok);
        for (int c = 0; c < L::VPT; ++c) {
          if constexpr (L::S16) {
            const ivec x = widen_s16(base + c * L::CB);
            for (int r = 0; r < RB; ++r) acc[r] = dot_s16(acc[r], x, iload(iq.q16[r] + c * L::CB));
          } else if constexpr (L::U16) {
            const ivec x = iload(base + c * IB);
            [&]<int... K>(std::integer_sequence<int, K...>) {
              (([&] {
                 ivec lo, hi;
                 bytes_to_s16(field_bytes<K * BITS>(x, MASK), lo, hi);
                 for (int r = 0; r < RB; ++r)
                   acc[r] = dot_s16(dot_s16(acc[r], lo, iload(iq.q4[r][K][c][0])), hi, iload(iq.q4[r][K][c][1]));
               }()), ...);
            }(std::make_integer_sequence<int, L::per>{});
          } else {
            const ivec x = iload(base + c * IB);
            [&]<int... K>(std::integer_sequence<int, K...>) {
              (([&] {
                 const ivec f = field_bytes<K * BITS>(x, MASK);
                 for (int r = 0; r < RB; ++r) {
                   acc[r] = dot_u8s8(acc[r], f, iload(iq.q8[r][0][K][c]));
                   low[r] = dot_u8s8(low[r], f, iload(iq.q8[r][1][K][c]));
                 }
               }()), ...);
            }(std::make_integer_sequence<int, L::per>{});
          }
        }
        std::array<vi, RB> out;
        for (int r = 0; r < RB; ++r) {
          const ivec x = L::S16 || L::U16 ? acc[r] : parts_sum(acc[r], low[r]);
          std::memcpy(&out[r], &x, sizeof(x));
        }
        return out;
      };
      const std::array<vi, RB> sums = reduce_leaves<L::START>(leaf);
      for (int r = 0; r < RB; ++r) {
        const vf dots = __builtin_convertvector(sums[r], vf);
        const vf sv = KIND == INT_CHANNEL ? dots * iq.sq[r] + cst[r]
                                          : dots * iq.sq[r] * loadf(A + tb) + loadf(C + tb) * qsum[r];
        store_first(s + r * s_stride + tb, sv, nb);
      }
    }
  }
}

// Whether the integer path serves this key side for a work item starting at token t0 (of its segment).
template <int DT>
int int_bits(const Side& sd, int64_t t0) {
  const Fmt& f = sd.f;
  if (DT == 0 || (f.kind != INT_TOKEN && f.kind != INT_CHANNEL)) return 0;
  if (f.bits != 2 && f.bits != 4 && f.bits != 8) return 0;
  const int rby = DT * f.bits / 8, cb = f.bits == 8 ? IB / 2 : IB;
  if (!(cb % rby == 0 || rby % cb == 0) || (cb > rby && cb / rby > std::min(VW, 8))) return 0;
  if (f.kind == INT_TOKEN && f.group != DT) return 0;  // several groups per row: the float path
  if (f.kind == INT_CHANNEL && (f.group % VW || t0 % VW)) return 0;
  return f.bits;
}

template <int DT, int BITS, int KIND>
void int_scores_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qs, const float* qn,
                     int64_t R, float* s, int64_t s_stride, const float* A, const float* C, const int* chan,
                     const ValueAhead& ahead) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rb = std::min<int64_t>(4, R - r0);
    const float* qr = qs + r0 * DT;
    const float* qnr = qn + r0 * DT;
    float* sr = s + r0 * s_stride;
    with_rows(static_cast<int>(rb), [&](auto rows) {
      int_scores<DT, BITS, KIND, decltype(rows)::value>(sd, b, h, t0, n, qr, qnr, sr, s_stride, A, C, chan, ahead);
    });
  }
}

template <int DT>
bool try_int_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qs, const float* qn,
                    int64_t R, float* s, int64_t s_stride, float* A, float* C, const int* chan,
                    const ValueAhead& ahead) {
  if constexpr (DT == 0) {
    return false;
  } else {
    const int bits = int_bits<DT>(sd, t0);
    if (!bits) return false;
    const bool ch = sd.f.kind == INT_CHANNEL;
    if (!ch) token_params(sd, b, h, t0, n, 1, A, C);
    switch (bits) {
      case 2: ch ? int_scores_rows<DT, 2, INT_CHANNEL>(sd, b, h, t0, n, qs, qn, R, s, s_stride, A, C, chan, ahead)
                 : int_scores_rows<DT, 2, INT_TOKEN>(sd, b, h, t0, n, qs, qn, R, s, s_stride, A, C, chan, ahead); return true;
      case 4: ch ? int_scores_rows<DT, 4, INT_CHANNEL>(sd, b, h, t0, n, qs, qn, R, s, s_stride, A, C, chan, ahead)
                 : int_scores_rows<DT, 4, INT_TOKEN>(sd, b, h, t0, n, qs, qn, R, s, s_stride, A, C, chan, ahead); return true;
      default: ch ? int_scores_rows<DT, 8, INT_CHANNEL>(sd, b, h, t0, n, qs, qn, R, s, s_stride, A, C, chan, ahead)
                  : int_scores_rows<DT, 8, INT_TOKEN>(sd, b, h, t0, n, qs, qn, R, s, s_stride, A, C, chan, ahead); return true;
    }
  }
}

}  // namespace
#endif
