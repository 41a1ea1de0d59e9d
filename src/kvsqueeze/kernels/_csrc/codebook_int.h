// Rotated codebook keys scored, and values weighted, by int16 dot products (the avx512-vbmi build: VBMI and VNNI; other
// builds keep the float levels of codebook_fast.h).  Keys first, values below.
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

// A rotated format's two runs as the int16 paths read them at head_dim D: coordinate c's code starts at bit(c) of a
// row and is width(c) bits wide; ok false where they refuse the layout (a high run that does not end at a multiple of
// 8 coordinates, or a width outside 1-5 bits)
struct CbRuns {
  int nh, bh, bl, hb, bytes;
  bool ok;
  CbRuns(const Fmt& f, int D)
      : nh(cb_n_hi(f)), bh(f.bits), bl(cb_bits_lo(f)), hb(nh * bh / 8), bytes(hb + (D - nh) * bl / 8),
        ok(nh % 8 == 0 && bh >= 1 && bh <= 5 && (nh >= D || (bl >= 1 && bl <= 5))) {}
  int bit(int c) const { return c < nh ? c * bh : 8 * hb + (c - nh) * bl; }
  int width(int c) const { return c < nh ? bh : bl; }
};

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
    const CbRuns rn(f, DT);
    if (!rn.ok) return false;
    for (int w = 0; w < NW; ++w) {
      int bit[32], lo_words = 0;
      for (int k = 0; k < 32; ++k) {
        const int c = 32 * w + k;
        bit[k] = rn.bit(c);
        sel[w][k] = c < rn.nh ? 0 : 32;
        lo_words += c >= rn.nh;
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
          const int off = bit[4 * j + i] - 8 * win;
          if (off + rn.width(32 * w + 4 * j + i) > 64) return false;
          ms[w][8 * j + 2 * i] = ms[w][8 * j + 2 * i + 1] = static_cast<int8_t>(off);
        }
      }
      const int avail = rn.bytes - base[w];  // only the row's own bytes are read (the last row may end the storage)
      load[w] = avail >= 64 ? ~__mmask64{0} : (__mmask64{1} << avail) - 1;
    }
    return true;
  }
};

// The two level tables as int16 (each repeated to 32 entries, the largest magnitude M) and their common scale; ok
// false for a table that is not finite or all zero
struct CbIntTables {
  alignas(64) int16_t hi[32], lo[32];
  float lsc = 0.f;
  bool ok = false;
  CbIntTables(const Side& sd, int D, float M) {
    // a format with one run (nh 0 or D) uses one table for both: the other row is not read
    const int nh = cb_n_hi(sd.f), bh = nh > 0 ? sd.f.bits : cb_bits_lo(sd.f), bl = nh < D ? cb_bits_lo(sd.f) : bh;
    const float* lh = table_row(sd, nh > 0 ? D : D + 1);
    const float* ll = nh < D ? table_row(sd, D + 1) : lh;
    float m = 0.f, sum = 0.f;  // (std::max drops a NaN; the sum keeps it)
    for (int e = 0; e < (1 << bh); ++e) m = std::max(m, std::fabs(lh[e])), sum += std::fabs(lh[e]);
    for (int e = 0; e < (1 << bl); ++e) m = std::max(m, std::fabs(ll[e])), sum += std::fabs(ll[e]);
    if (!(m > 0.f) || !std::isfinite(sum)) return;
    lsc = M / m;
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
  const CbIntTables tb(sd, DT, cb_int_max(DT));
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

// ------------------------------------------------------------------------------------------------------- values
// Rotated codebook values weighted by int16 dot products (the same build).  The float path (codebook_fast.h
// cb_values_pass) turns each 16 coordinates' codes into float levels (a broadcast, a multishift, a lane permutation)
// and spends one multiply-add per 16 coordinates, token and query row: rot-3's values were ~40% of its kernel time
// at 8k (one layer, 1 thread, Zen 4).  Here two tokens go together: int32 lane l of vector v is coordinate 16 v + l,
// its two words tokens t and t + 1.  Both rows' 32-byte windows are loaded into one register, vpermb gives each qword
// the 3 code bytes of its two coordinates from each row, vpmultishiftqb brings each code to the low bits of its word,
// vpermt2w reads the two int16 level tables (index bit 5 set for the low run's words), and one vpdpwssd per vector
// and query row adds both tokens' products, weighted by the int32 (wq_t, wq_t+1).  Scratch A/B at 8k, 1 thread: 5%
// off rot-3's layer.
// Rounding: levels to int16 at lsc = 4095 / max|level| (systematic: at most max|level| / 8190 per coordinate), each
// query row's weights w_t = p_t scale_t per work item to wq_t = round(w_t / sw), sw = max_t |w_t| / 32767, as
// int_values.h does.  An int32 lane adds at most CB_VALUE_RUN tokens' products (each < 32767 x 4095: 16 of them
// < 2^31) before it is converted and added to the float sums.  Against the float levels |d acc_c| <= max|level| /
// 8190 sum_t |w_t| + sw / 2 sum_t |L_tc|, tested against the reference in tests/kernels.  A non-finite weight or
// level table keeps the float path (the reference's non-finite result).
constexpr float CB_VALUE_LEVEL_MAX = 4095.f;
constexpr int CB_VALUE_RUN = 16;  // tokens per int32 run: 16 x 32767 x 4095 < 2^31

// Where each word of a row's 16-coordinate vectors finds its code, two tokens at a time, for one format at head_dim
// DT (runs start at multiples of 8 coordinates, so a qword's two coordinates are of one run and their codes lie in
// the 3 bytes from win_j of each row).
template <int DT>
struct CbPairRow {
  static constexpr int NV = DT / 16;
  alignas(64) int8_t perm[NV][64];  // vpermb: bytes 0-2 of qword j <- row t's window bytes win_j.., 3-5 <- row t+1's
  alignas(64) int8_t ms[NV][64];    // vpmultishiftqb: both bytes of each word <- the bits from its code's offset
  alignas(64) int16_t sel[NV][32];  // 32 for the low run's words (vpermt2w's second table), else 0
  int base[NV];                     // vector v's window: row bytes [base, base + 32), masked at the row's end
  __mmask32 load[NV];
  bool one = false;  // rows of at most 32 bytes: every vector reads the window from byte 0, loaded once per 2 tokens
  bool init(const Fmt& f) {
    const CbRuns rn(f, DT);
    if (!rn.ok) return false;
    one = rn.bytes <= 32;
    for (int v = 0; v < NV; ++v) {
      int bit[16];
      for (int l = 0; l < 16; ++l) {
        const int c = 16 * v + l;
        bit[l] = rn.bit(c);
        sel[v][2 * l] = sel[v][2 * l + 1] = c < rn.nh ? 0 : 32;
      }
      base[v] = one ? 0 : bit[0] / 8;  // codes ascend with coordinates: lane 0's is the lowest
      for (int j = 0; j < 8; ++j) {
        const int win = bit[2 * j] / 8;
        const int last = (bit[2 * j + 1] + rn.width(16 * v + 2 * j + 1) - 1) / 8;  // the last byte of the two codes
        for (int m = 0; m < 3; ++m) {
          int src = win - base[v] + m;
          if (src > 31) {
            if (win + m <= last) return false;
            src = 31;  // a byte past the codes: its bits only repeat the table
          }
          perm[v][8 * j + m] = static_cast<int8_t>(src);
          perm[v][8 * j + 3 + m] = static_cast<int8_t>(src + 32);
        }
        perm[v][8 * j + 6] = perm[v][8 * j + 7] = 0;  // (unread)
        for (int i = 0; i < 2; ++i) {
          const int off = bit[2 * j + i] - 8 * win;
          if (off + rn.width(16 * v + 2 * j + i) > 24) return false;
          ms[v][8 * j + 4 * i] = ms[v][8 * j + 4 * i + 1] = static_cast<int8_t>(off);  // word 2i: token t
          ms[v][8 * j + 4 * i + 2] = ms[v][8 * j + 4 * i + 3] = static_cast<int8_t>(off + 24);  // 2i + 1: t + 1
        }
      }
      const int avail = rn.bytes - base[v];  // only the row's own bytes are read (the last row may end the storage)
      load[v] = avail >= 32 ? ~__mmask32{0} : (__mmask32{1} << avail) - 1;
    }
    return true;
  }
};

// acc (RB rows of DT floats, natural order) += sw_r sum_t wq_rt L_t (sw_r: the row's factor back to floats) over
// vectors [v0, v0 + VP) of n tokens from row0 (stride sr); wq: RB rows of n2 weights (n2 even, the pad token's weight
// 0).  ONE: CbPairRow::one.
template <int DT, int RB, int VP, bool ONE>
void cb_int_values_pass(const CbPairRow<DT>& cr, const CbIntTables& tb, const char* row0, int64_t sr, int n,
                        const int16_t* wq, int n2, const float* sw, float* acc, int v0) {
  const __m512i thi = _mm512_load_si512(tb.hi), tlo = _mm512_load_si512(tb.lo), low5 = _mm512_set1_epi16(31);
  __m512i ai[RB][VP];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < VP; ++i) ai[r][i] = _mm512_setzero_si512();
  auto flush = [&]() __attribute__((always_inline)) {
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < VP; ++i) {
        float* d = acc + r * DT + 16 * (v0 + i);
        _mm512_storeu_ps(d, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][i]), _mm512_set1_ps(sw[r]), _mm512_loadu_ps(d)));
        ai[r][i] = _mm512_setzero_si512();
      }
  };
  auto window = [&](const char* a, const char* b, int v) __attribute__((always_inline)) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(cr.load[v], a + cr.base[v])),
                              _mm256_maskz_loadu_epi8(cr.load[v], b + cr.base[v]), 1);
  };
  for (int t = 0; t < n; t += 2) {
    const char* ra = row0 + t * sr;
    const char* rb = t + 1 < n ? ra + sr : ra;  // the pad token (weight 0) re-reads token t's codes
    __builtin_prefetch(ra + PREFETCH_BYTES);
    __m512i w[RB];
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, wq + r * n2 + t, sizeof(pair));
      w[r] = _mm512_set1_epi32(pair);
    }
    __m512i raw = ONE ? window(ra, rb, 0) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < VP; ++i) {
      const int v = v0 + i;
      if (!ONE) raw = window(ra, rb, v);
      const __m512i placed = _mm512_permutexvar_epi8(_mm512_load_si512(cr.perm[v]), raw);
      const __m512i codes = _mm512_multishift_epi64_epi8(_mm512_load_si512(cr.ms[v]), placed);
      // every vector through both tables, (c & 31) | sel: a test of its run per vector cost more (branches, and
      // moves of the sums between registers at their joins)
      const __m512i lv = _mm512_permutex2var_epi16(
          thi, _mm512_ternarylogic_epi32(codes, low5, _mm512_load_si512(cr.sel[v]), 0xEA), tlo);
      for (int r = 0; r < RB; ++r) ai[r][i] = _mm512_dpwssd_epi32(ai[r][i], lv, w[r]);
    }
    if ((t + 2) % CB_VALUE_RUN == 0) flush();
  }
  if (n2 % CB_VALUE_RUN) flush();  // (the loop's last pair ends at n2)
}

// Vectors per pass: RB x VP int32 sums, RB weights, two tables and a few temporaries in AVX-512's 32 registers
template <int DT, int RB>
constexpr int cb_int_value_vectors() {
  return std::max(1, std::min(DT / 16, (25 - RB) / RB));
}

// RB query rows' weights p (p_t scale_t, n per row, stride p_stride) rounded to int16 (wq: RB rows of n2) and their
// scales sw; the caller has checked that they are finite
template <int RB>
void cb_int_value_weights(const float* p, int64_t p_stride, int n, int16_t* wq, int n2, float* sw) {
  for (int r = 0; r < RB; ++r) {
    const float* pr = p + r * p_stride;
    __m512 mx = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16)
      mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes_before(t, n), pr + t)));
    const float wmax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
    int16_t* q = wq + r * n2;
    for (int t = 0; t < n; t += 16) {  // |w inv| <= 32767: the saturating narrow never saturates
      const __mmask16 m = lanes_before(t, n);
      _mm256_mask_storeu_epi16(q + t, m, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(
                                             _mm512_maskz_loadu_ps(m, pr + t), inv))));
    }
    if (n2 > n) q[n] = 0;
    sw[r] = wmax / 32767.f;
  }
}

template <int DT, int RB, bool ONE>
void cb_int_values(const CbPairRow<DT>& cr, const CbIntTables& tb, const char* row0, int64_t sr, int n,
                   const float* p, int64_t p_stride, int16_t* wq, float* acc) {
  const int n2 = n + (n & 1);
  float sw[RB];
  cb_int_value_weights<RB>(p, p_stride, n, wq, n2, sw);
  for (int r = 0; r < RB; ++r) sw[r] /= tb.lsc;  // one factor per row: weights' and levels' scales
  // the fewest passes over the tokens, of balanced sizes
  constexpr int VP = cb_int_value_vectors<DT, RB>(), NV = DT / 16;
  const int passes = (NV + VP - 1) / VP;
  for (int k = 0, v = 0; k < passes; ++k) {
    const int size = NV / passes + (k < NV % passes);
    [&]<int... S>(std::integer_sequence<int, S...>) {
      ((size == S + 1 ? cb_int_values_pass<DT, RB, S + 1, ONE>(cr, tb, row0, sr, n, wq, n2, sw, acc, v) : void()),
       ...);
    }(std::make_integer_sequence<int, VP>{});
    v += size;
  }
}

// Hook for try_cb_values: acc (R rows of DT floats, natural order) += sum_t p_t cb[codes_t] over a CODEBOOK side's
// tokens [t0, t0 + n) (p: probabilities times the tokens' scales, stride p_stride); wq: 4 x (n + 2) int16 of
// scratch.  False (nothing written) where the layout, the tables or the weights keep the float path.
template <int DT>
bool try_cb_int_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                       int64_t R, float* acc, int16_t* wq) {
  if (DT % 16 || n <= 0) return false;
  const CbPairRow<DT>* cr = format_lanes<CbPairRow<DT>>(sd.f);
  if (!cr) return false;
  const CbIntTables tb(sd, DT, CB_VALUE_LEVEL_MAX);
  if (!tb.ok) return false;
  __m512 bad = _mm512_setzero_ps();  // 0 x w is NaN only where w is not finite
  for (int64_t r = 0; r < R; ++r)
    for (int t = 0; t < n; t += 16)
      bad = _mm512_add_ps(bad, _mm512_mul_ps(_mm512_setzero_ps(),
                                             _mm512_maskz_loadu_ps(lanes_before(t, n), p + r * p_stride + t)));
  if (!std::isfinite(_mm512_reduce_add_ps(bad))) return false;
  const char* row0 = sd.x.row(b, h, t0);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    with_rows(rb, [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      const float* pr = p + r0 * p_stride;
      if (cr->one) cb_int_values<DT, RB, true>(*cr, tb, row0, sd.x.sr, n, pr, p_stride, wq, acc + r0 * DT);
      else cb_int_values<DT, RB, false>(*cr, tb, row0, sd.x.sr, n, pr, p_stride, wq, acc + r0 * DT);
    });
  }
  return true;
}

}  // namespace
#endif
