// Rotated codebook keys scored by int16 dot products (the avx512-vbmi build: VBMI and VNNI; other builds keep the float
// levels of codebook_fast.h).
//
// The float path turns each 16 coordinates' codes into float levels (a broadcast, a multishift, a lane permutation) and
// spends one multiply-add per 16 coordinates and query row: rot-3's keys at head_dim 64 took ~33 instructions a token,
// bound by Zen 4's two shuffle pipes.  Here each 32 coordinates' codes become int16 levels in three shuffles: vpermb
// gives every qword the 8 code bytes its four codes lie in, vpmultishiftqb brings each code to the low bits of its
// word, and vpermw reads the level table (repeated to 32 entries, so the bits above a code select the same level; a
// vector holding both runs takes vpermt2w, its index bit 5 set for the low run's lanes).  One vpdpwssd per 32
// coordinates and query row multiplies and adds pairs into int32 lanes; a block of VW tokens is reduced to VW scores at
// once, as cb_scores does.
// Rounding: levels to int16 at lsc = M / max|level| (the tables are fixed per layer: that error is systematic, at most
// max|level| / 2M per coordinate: ~1/1400 of a 3-bit codebook's own rms error at head_dim 256), each query row per work
// item at qsc = M / max|q'|, M = cb_int_max(DT): 16383 at head_dim 64, 11585 at 128, 8191 at 256.  An int32 lane sums
// DT / 16 products and the first pairwise level of the token reduction two lanes, DT / 8 products of at most M^2 each,
// < 2^31; the sums are converted to float there, before the lanes of a token add up to its dot product. s_t = scale_t *
// dot_t / (qsc lsc); against the float levels |ds_t| <= scale_t (sum_c |L_tc| / (2 qsc lsc) + sum_c |q'_c| max|level| /
// 2M), tested against the reference in tests/kernels.  A query row with a non-finite value, or a level table that is
// not finite, keeps the float path (the reference's non-finite result).
#pragma once

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVSQ_CB_INT 1
namespace {

// The largest int16 magnitude of levels and query values at head_dim DT: (DT / 8) M^2 < 2^31 (see above)
constexpr float cb_int_max(int DT) { return DT <= 64 ? 16383.f : DT <= 128 ? 11585.f : 8191.f; }

// Where each word of a row's 32-coordinate vectors finds its code, for one format at head_dim DT.  Word k of vector w
// is rotated coordinate 32 w + k (natural order); qword j holds words 4j..4j+3, whose codes lie in one run (runs
// start at multiples of 8 coordinates) and in the 8 bytes from win_j.
template <int DT>
struct CbIntRow {
  static constexpr int NW = DT / 32;
  alignas(64) int8_t perm[NW][64];  // vpermb: byte m of qword j <- byte win_j - base + m of the loaded window
  alignas(64) int8_t ms[NW][64];    // vpmultishiftqb: both bytes of word i of qword j <- bits from its code's offset
  alignas(64) int16_t sel[NW][32];  // 32 for the low run's words (vpermt2w's second table), else 0
  int base[NW];                     // vector w's window: row bytes [base, base + 64), masked at the row's end
  int run[NW];                      // 0: all words high-run, 1: all low-run (one vpermw, no select), 2: mixed
  __mmask64 load[NW];
  bool init(const Fmt& f) {
    const int nh = cb_n_hi(f), bh = f.bits, bl = cb_bits_lo(f);
    if (nh % 8 || bh < 1 || bh > 5 || (nh < DT && (bl < 1 || bl > 5))) return false;
    const int hb = nh * bh / 8, bytes = hb + (DT - nh) * bl / 8;
    for (int w = 0; w < NW; ++w) {
      int bit[32], lo_words = 0;
      for (int k = 0; k < 32; ++k) {
        const int c = 32 * w + k;
        bit[k] = c < nh ? c * bh : 8 * hb + (c - nh) * bl;
        sel[w][k] = c < nh ? 0 : 32;
        lo_words += c >= nh;
      }
      run[w] = lo_words == 0 ? 0 : lo_words == 32 ? 1 : 2;
      base[w] = bit[0] / 8;  // codes ascend with coordinates: word 0's is the lowest
      for (int j = 0; j < 8; ++j) {
        const int win = bit[4 * j] / 8;
        for (int m = 0; m < 8; ++m) {
          const int src = win - base[w] + m;
          if (src > 63) return false;
          perm[w][8 * j + m] = static_cast<int8_t>(src);
        }
        for (int i = 0; i < 4; ++i) {
          const int off = bit[4 * j + i] - 8 * win, width = 32 * w + 4 * j + i < nh ? bh : bl;
          if (off + width > 64) return false;
          ms[w][8 * j + 2 * i] = ms[w][8 * j + 2 * i + 1] = static_cast<int8_t>(off);
        }
      }
      const int avail = bytes - base[w];  // only the row's own bytes are read (the last row may end the storage)
      load[w] = avail >= 64 ? ~__mmask64{0} : (__mmask64{1} << avail) - 1;
    }
    return true;
  }
};

// The two level tables as int16 (each repeated to 32 entries) and their common scale; ok false for a table that is
// not finite or all zero
struct CbIntTables {
  alignas(64) int16_t hi[32], lo[32];
  float lsc = 0.f;
  bool ok = false;
  CbIntTables(const Side& sd, int D) {
    // a format with one run (nh 0 or D) uses one table for both: the other row is not read
    const int nh = cb_n_hi(sd.f), bh = nh > 0 ? sd.f.bits : cb_bits_lo(sd.f), bl = nh < D ? cb_bits_lo(sd.f) : bh;
    const float* lh = table_row(sd, nh > 0 ? D : D + 1);
    const float* ll = nh < D ? table_row(sd, D + 1) : lh;
    float m = 0.f, sum = 0.f;  // (std::max drops a NaN; the sum keeps it)
    for (int e = 0; e < (1 << bh); ++e) m = std::max(m, std::fabs(lh[e])), sum += std::fabs(lh[e]);
    for (int e = 0; e < (1 << bl); ++e) m = std::max(m, std::fabs(ll[e])), sum += std::fabs(ll[e]);
    if (!(m > 0.f) || !std::isfinite(sum)) return;
    lsc = cb_int_max(D) / m;
    for (int e = 0; e < 32; ++e) {
      hi[e] = static_cast<int16_t>(std::nearbyint(lh[e & ((1 << bh) - 1)] * lsc));
      lo[e] = static_cast<int16_t>(std::nearbyint(ll[e & ((1 << bl) - 1)] * lsc));
    }
    ok = true;
  }
};

// Query rows rounded to int16 (natural order) and the factor 1 / (qsc lsc) that turns a row's integer dot products
// back into q' . levels; false when a row holds a non-finite value (or is too small to scale)
template <int DT>
bool cb_int_query(const float* qn, int64_t R, float lsc, int16_t* q16, float* unit) {
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qn + r * DT;
    __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int c = 0; c < DT; c += 16) {
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(q + c));
      mx = _mm512_max_ps(mx, a);
      sum = _mm512_add_ps(sum, a);
    }
    const float m = _mm512_reduce_max_ps(mx), s = _mm512_reduce_add_ps(sum);
    if (!std::isfinite(s)) return false;  // a NaN or inf anywhere in the row (max may drop a NaN; the sum keeps it)
    int16_t* out = q16 + r * DT;
    if (s == 0.f) {
      std::fill(out, out + DT, int16_t{0});
      unit[r] = 0.f;
      continue;
    }
    const float qsc = cb_int_max(DT) / m;
    if (!std::isfinite(qsc)) return false;
    const __m512 f = _mm512_set1_ps(qsc);
    for (int c = 0; c < DT; c += 16)  // |q qsc| <= M < 32767: the saturating narrow never saturates
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c), f))));
    unit[r] = 1.f / (qsc * lsc);
  }
  return true;
}

// s[r][t] = scale_t * (q'_r . cb[codes_t]) for RB query rows over n tokens from row0 (stride sr), via int16 levels.
// TU = 4 tokens are summed pairwise in registers (levels 0-1 of reduce_tokens; level 0 in int32, then float), the
// rest VW tokens at once.
template <int DT, int RB>
void cb_int_scores(const CbIntRow<DT>& cr, const CbIntTables& tb, const char* row0, int64_t sr, int n,
                   const int16_t* q16, const float* unit, float* s, int64_t s_stride, const float* scale) {
  constexpr int NW = DT / 32, TU = 4, NB = VW / TU;
  const __m512i thi = _mm512_load_si512(tb.hi), tlo = _mm512_load_si512(tb.lo), low5 = _mm512_set1_epi16(31);
  __m512i qv[RB][NW];
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < NW; ++w) qv[r][w] = _mm512_loadu_si512(q16 + r * DT + 32 * w);
  auto levels = [&](const uint8_t* row, int w) __attribute__((always_inline)) {
    const __m512i raw = _mm512_maskz_loadu_epi8(cr.load[w], row + cr.base[w]);
    const __m512i placed = _mm512_permutexvar_epi8(_mm512_load_si512(cr.perm[w]), raw);
    const __m512i codes = _mm512_multishift_epi64_epi8(_mm512_load_si512(cr.ms[w]), placed);
    // the bits of the next codes above a code only repeat the table; a vector of one run needs no select (the
    // tests of its run are scalar work beside the vector pipes this loop fills)
    if (cr.run[w] == 0) return _mm512_permutexvar_epi16(codes, thi);
    if (cr.run[w] == 1) return _mm512_permutexvar_epi16(codes, tlo);
    const __m512i idx = _mm512_ternarylogic_epi32(codes, low5, _mm512_load_si512(cr.sel[w]), 0xEA);  // (c & 31) | sel
    return _mm512_permutex2var_epi16(thi, idx, tlo);
  };
  constexpr vi l0 = level_pattern<0>(), l1 = level_pattern<1>();
  vf buf[RB][NB];
  for (int t = 0; t < n; t += TU) {
    __m512i acc[TU][RB];
#pragma GCC unroll 4
    for (int u = 0; u < TU; ++u) {
      for (int r = 0; r < RB; ++r) acc[u][r] = _mm512_setzero_si512();
      if (t + u >= n) continue;  // past the item: zero
      const uint8_t* row = reinterpret_cast<const uint8_t*>(row0 + (t + u) * sr);
      __builtin_prefetch(row + PREFETCH_BYTES);
#pragma GCC unroll 8
      for (int w = 0; w < NW; ++w) {
        const __m512i lv = levels(row, w);
        for (int r = 0; r < RB; ++r) acc[u][r] = _mm512_dpwssd_epi32(acc[u][r], lv, qv[r][w]);
      }
    }
    const int blk = (t / TU) & (NB - 1);
    auto level0 = [&](int u, int r) __attribute__((always_inline)) {  // exact in int32, then to float32
      return __builtin_convertvector(
          pair_sums(reinterpret_cast<vi>(acc[u][r]), reinterpret_cast<vi>(acc[u + 1][r]), l0, VW / 2), vf);
    };
    for (int r = 0; r < RB; ++r) buf[r][blk] = pair_sums(level0(0, r), level0(2, r), l1, VW / 4);
    if (blk == NB - 1 || t + TU >= n)  // (scale has VW floats of padding)
      store_block_scores<2>(buf, blk, t - blk * TU, std::min(VW, n - (t - blk * TU)), scale, unit, s, s_stride);
  }
}

// Hook for try_cb_scores: scores of R query rows (qn: rotated, scaled, natural order) against a CODEBOOK side's
// tokens [t0, t0+n) without the centred mean term, scale: the tokens' scales (n + VW floats).  False (nothing
// written) where the layout, the tables or the query keep the float path.
template <int DT>
bool try_cb_int_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qn, int64_t R, float* s,
                       int64_t s_stride, const float* scale) {
  if (DT % 32 || R > 64) return false;
  const CbIntRow<DT>* cr = format_lanes<CbIntRow<DT>>(sd.f);
  if (!cr) return false;
  const CbIntTables tb(sd, DT);
  if (!tb.ok) return false;
  alignas(64) int16_t q16[64 * DT];
  float unit[64];
  if (!cb_int_query<DT>(qn, R, tb.lsc, q16, unit)) return false;
  const char* row0 = sd.x.row(b, h, t0);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    with_rows(rb, [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      cb_int_scores<DT, RB>(*cr, tb, row0, sd.x.sr, n, q16 + r0 * DT, unit + r0, s + r0 * s_stride, s_stride, scale);
    });
  }
  return true;
}

}  // namespace
#endif
