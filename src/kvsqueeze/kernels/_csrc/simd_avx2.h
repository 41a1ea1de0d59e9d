// AVX2 helpers (compiled only where the build targets AVX2): level tables in registers, exp/max eight lanes at a time.
#pragma once

namespace {

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
inline float exp_sum8(float* __restrict x, int n, float m) {
  int i = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.f), log2e = _mm256_set1_ps(1.44269504088896341f),
               ln2 = _mm256_set1_ps(0.693147180559945309f);
  const float cs[8] = {0.000198412698f, 0.00138888889f, 0.00833333333f, 0.0416666667f, 0.166666667f, 0.5f, 1.f, 1.f};
  __m256 tot = _mm256_setzero_ps();
#if defined(__AVX512F__)
  {  // the same lane arithmetic sixteen at a time: three query rows' exponentials were a tenth of a kivi-4 step
    const __m512 mv16 = _mm512_set1_ps(m), lo16 = _mm512_set1_ps(-87.f), log2e16 = _mm512_set1_ps(1.44269504088896341f),
                 ln2_16 = _mm512_set1_ps(0.693147180559945309f);
    for (; i + 16 <= n; i += 16) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), mv16);
      const __m512 y = _mm512_mul_ps(_mm512_max_ps(d, lo16), log2e16);
      const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, r), ln2_16);
      __m512 p = _mm512_set1_ps(cs[0]);
      for (int c = 1; c < 8; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(cs[c]));
      const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(127)), 23);
      p = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
      p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, lo16, _CMP_GE_OQ), p);  // below exp(-87), -inf included: 0
      _mm512_storeu_ps(x + i, p);
      // summed in the eight-lane loop's order, so the sum is bit-identical to it: a 2-bit cache's codes flip on
      // last-bit differences, and the chunked-prefill test (tests/kernels) moved by 0.5 logits on a reordering
      tot = _mm256_add_ps(tot, _mm512_castps512_ps256(p));
      tot = _mm256_add_ps(tot, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
    }
  }
#endif
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
#if defined(__AVX512F__)
  __m512 v16 = _mm512_set1_ps(NEG_INF);
  for (; i + 16 <= n; i += 16) v16 = _mm512_max_ps(v16, _mm512_loadu_ps(x + i));
  v = _mm256_max_ps(_mm512_castps512_ps256(v16), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v16), 1)));
#endif
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  for (int l = 0; l < 8; ++l) best = std::max(best, lanes[l]);
#endif
  return i < n ? std::max(best, max_of(x + i, n - i)) : best;
}

}  // namespace
