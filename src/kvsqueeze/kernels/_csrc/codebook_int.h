// Rotated codebook keys scored, and values weighted, by int16 dot products (the avx512-vbmi build: VBMI and VNNI; other
// builds keep the float levels of codebook_fast.h).  Keys first, values below.
//
// The float path turns each 16 coordinates' codes into float levels (a broadcast, a multishift, a lane permutation) and
// spends one multiply-add per 16 coordinates and query row: rot-3's keys at head_dim 64 took ~33 instructions a token,
// bound by Zen 4's two shuffle pipes.  Here a vector holds 16 coordinates of two tokens (one in each half) and their
// codes become int16 levels in three shuffles: vpermb gives every qword the 8 code bytes its four codes lie in,
// vpmultishiftqb brings each code to the low bits of its word, and vpermw reads the level table (repeated to 32
// entries, so the bits above a code select the same level; a vector holding both runs takes vpermt2w, its index bit 5
// set for the low run's lanes).  One vpdpwssd per vector and query row multiplies and adds pairs into int32 lanes, each
// token's in its own half: the first level of the token reduction costs nothing, and a block of VW tokens is reduced
// to VW scores in registers.  Scratch A/B at 8k, 1 thread (Zen 4): rot-3's layer 0.87-0.89x of one token per
// 32-coordinate vector (whose first level took two lane permutations and an add per two tokens and row, and whose
// partial sums went through memory).
// Rounding: levels to int16 at lsc = M / max|level| (the tables are fixed per layer: that error is systematic, at most
// max|level| / 2M per coordinate: ~1/1400 of a 3-bit codebook's own rms error at head_dim 256), each query row per work
// item at qsc = M / max|q'|, M = cb_int_max(DT): 16383 at head_dim 64, 11585 at 128, 8191 at 256.  An int32 lane sums
// DT / 8 products (two coordinates from each of DT / 16 vectors) of at most M^2 each, < 2^31; the sums are converted
// to float there, before the lanes of a token add up to its dot product.  s_t = scale_t * dot_t / (qsc lsc); against
// the float levels |ds_t| <= scale_t (sum_c |L_tc| / (2 qsc lsc) + sum_c |q'_c| max|level| / 2M), tested against the
// reference in tests/kernels.  A query row with a non-finite value, or a level table that is not finite, keeps the
// float path (the reference's non-finite result).
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
  int last_byte(int c) const { return (bit(c) + width(c) - 1) / 8; }
};

// Slots [slot, slot + m) of a pair layout's permutations (CbKeyPairRow, CbPairRow; perm: bytes counted from the
// vector's base, perm0: from byte 0) <- token tok's row bytes win.. of a run of codes ending in byte last (row t + 1's
// window at +32); a byte past last only puts bits above the codes (the tables repeat), so last stands in for it.
// False where a byte lies past the 32-byte window from base.
inline bool pair_window_bytes(int8_t* perm, int8_t* perm0, int slot, int m, int win, int last, int base, int tok) {
  for (int k = 0; k < m; ++k) {
    const int at = std::min(win + k, last);
    if (at - base > 31) return false;
    perm[slot + k] = static_cast<int8_t>(at - base + 32 * tok);
    perm0[slot + k] = static_cast<int8_t>(std::min(at, 31) + 32 * tok);  // (read only for rows of <= 32 bytes)
  }
  return true;
}

// Where each word of a pair of rows' 16-coordinate vectors finds its code, for one format at head_dim DT.  A vector
// holds two tokens side by side: words 0-15 are token t's coordinates 16 v .. 16 v + 15, words 16-31 token t + 1's, so
// one vpdpwssd against the query's 16 coordinates (in both halves) leaves each token's partial sums in its own half,
// the layout the first level of the token reduction produced when a vector held one token's 32 coordinates (the
// same integer sums of the same products: the scores are bit-identical).  Qword j holds words 4j..4j+3 of one token
// (one run: runs start at multiples of 8 coordinates), whose codes lie in the 8 bytes from win_j of its row.
// The register a vector's bytes are permuted from holds both rows' windows: row t's bytes from base in 0-31 and row
// t + 1's in 32-63 (two loads and an insert), or, where the rows lie close enough, one load from row t's base that
// reaches row t + 1 (its bytes sr later): PairWindows picks per call.
template <int DT>
struct CbKeyPairRow {
  static constexpr int NV = DT / 16;
  static constexpr __mmask64 SECOND = __mmask64{0xFFFFFFFF} << 32;  // the upper half's bytes: token t + 1's
  // vpermb: byte m of qword j <- byte win_j - base + m of its token's window, token t + 1's + 32; perm: base = the
  // vector's first byte, perm0: base 0 (one window for every vector, rows of at most 32 bytes)
  alignas(64) int8_t perm[NV][64], perm0[NV][64];
  alignas(64) int8_t ms[NV][64];    // vpmultishiftqb: both bytes of word i of qword j <- bits from its code's offset
  alignas(64) int16_t sel[NV][32];  // 32 for the low run's words (vpermt2w's second table), else 0
  int base[NV];                     // vector v's first byte in a row
  int span[NV];                     // bytes from base that hold its codes
  int run[NV];                      // 0: all words high-run, 1: all low-run (one vpermw, no select), 2: mixed
  int bytes = 0;
  bool init(const Fmt& f) {
    const CbRuns rn(f, DT);
    if (!rn.ok) return false;
    bytes = rn.bytes;
    for (int v = 0; v < NV; ++v) {
      int lo_words = 0;
      for (int k = 0; k < 16; ++k) {
        const int c = 16 * v + k;
        sel[v][k] = sel[v][16 + k] = c < rn.nh ? 0 : 32;
        lo_words += c >= rn.nh;
      }
      run[v] = lo_words == 0 ? 0 : lo_words == 16 ? 1 : 2;
      base[v] = rn.bit(16 * v) / 8;  // codes ascend with coordinates: word 0's is the lowest
      span[v] = 0;
      for (int j = 0; j < 4; ++j) {
        const int c0 = 16 * v + 4 * j, win = rn.bit(c0) / 8, last = rn.last_byte(c0 + 3);  // the four codes' bytes
        span[v] = std::max(span[v], last - base[v] + 1);
        for (int tok = 0; tok < 2; ++tok)  // qword j of each half: 8 bytes of its token's row
          if (!pair_window_bytes(perm[v], perm0[v], 32 * tok + 8 * j, 8, win, last, base[v], tok)) return false;
        for (int i = 0; i < 4; ++i) {
          const int off = rn.bit(c0 + i) - 8 * win;
          if (off + rn.width(c0 + i) > 64) return false;
          for (int tok = 0; tok < 2; ++tok)
            ms[v][32 * tok + 8 * j + 2 * i] = ms[v][32 * tok + 8 * j + 2 * i + 1] = static_cast<int8_t>(off);
        }
      }
    }
    return true;
  }
};

// How one call loads a pair layout's windows (Row: CbKeyPairRow or CbPairRow; Row::SECOND marks the permutation bytes
// that read row t + 1, from its window at byte 32) for rows sr bytes apart.  one (rows of at most 32 bytes): one
// window per pair serves every vector; stride (row t + 1's codes within 64 bytes of the window's start): one load
// reaching row t + 1, whose indices move from +32 to +sr; else two loads and an insert.
template <class Row>
struct PairWindows {
  static constexpr int NV = Row::NV;
  __m512i perm[NV];
  __mmask64 full[NV], pad[NV];  // stride: the bytes of rows t and t + 1 / of row t alone (the last, odd token)
  __mmask32 half[NV];           // else: a row's own bytes from base
  int base[NV];
  bool one = false, stride = false;
  PairWindows(const Row& cr, int64_t sr) {
    int reach = 0;
    for (int v = 0; v < NV; ++v) reach = std::max(reach, cr.span[v]);
    one = cr.bytes <= 32;
    stride = sr > 0 && (one ? sr + cr.bytes : sr + reach) <= 64;
    const __m512i up = _mm512_set1_epi8(static_cast<char>(stride ? sr - 32 : 0));
    for (int v = 0; v < NV; ++v) {
      const int b0 = one ? 0 : cr.base[v], own = cr.bytes - b0;
      base[v] = b0;
      const __m512i p = _mm512_load_si512(one ? cr.perm0[v] : cr.perm[v]);
      perm[v] = _mm512_mask_add_epi8(p, Row::SECOND, p, up);
      const int64_t both = std::min<int64_t>(64, sr + own);
      full[v] = both >= 64 ? ~__mmask64{0} : (__mmask64{1} << both) - 1;
      pad[v] = own >= 64 ? ~__mmask64{0} : (__mmask64{1} << own) - 1;
      half[v] = own >= 32 ? ~__mmask32{0} : (__mmask32{1} << own) - 1;
    }
  }
  // vector v's bytes of rows a and a + sr (two false: the last, odd token, a alone; its partner reads as a or 0)
  template <bool STRIDE>
  __attribute__((always_inline)) __m512i load(const char* a, bool two, int64_t sr, int v) const {
    if constexpr (STRIDE) return _mm512_maskz_loadu_epi8(two ? full[v] : pad[v], a + base[v]);
    const char* b = two ? a + sr : a;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(half[v], a + base[v])),
                              _mm256_maskz_loadu_epi8(half[v], b + base[v]), 1);
  }
  // f.template operator()<ONE, STRIDE>() for this call's way of loading
  template <class F>
  void dispatch(F&& f) const {
    if (one) stride ? f.template operator()<true, true>() : f.template operator()<true, false>();
    else stride ? f.template operator()<false, true>() : f.template operator()<false, false>();
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

// s[r][t] = scale_t * (q'_r . cb[codes_t]) for RB query rows over n tokens from row0 (stride sr), via int16 levels,
// two tokens per vector; each pair's int32 halves are level 0 of reduce_tokens, levels 1-3 follow in float in its
// order, VW tokens at a time in registers.  ONE, STRIDE: PairWindows.
template <int DT, int RB, bool ONE, bool STRIDE>
void cb_int_scores(const CbKeyPairRow<DT>& cr, const PairWindows<CbKeyPairRow<DT>>& pw, const CbIntTables& tb,
                   const char* row0, int64_t sr, int n, const int16_t* q16, const float* unit, float* s,
                   int64_t s_stride, const float* scale) {
  constexpr int NV = DT / 16;
  const __m512i thi = _mm512_load_si512(tb.hi), tlo = _mm512_load_si512(tb.lo), low5 = _mm512_set1_epi16(31);
  __m512i qv[RB][NV];  // the query's 16 coordinates of vector v in both halves
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v)
      qv[r][v] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + r * DT + 16 * v)));
  auto levels = [&](__m512i raw, int v) __attribute__((always_inline)) {
    const __m512i placed = _mm512_permutexvar_epi8(pw.perm[v], raw);
    const __m512i codes = _mm512_multishift_epi64_epi8(_mm512_load_si512(cr.ms[v]), placed);
    // the bits of the next codes above a code only repeat the table; a vector of one run needs no select (the
    // tests of its run are scalar work beside the vector pipes this loop fills)
    if (cr.run[v] == 0) return _mm512_permutexvar_epi16(codes, thi);
    if (cr.run[v] == 1) return _mm512_permutexvar_epi16(codes, tlo);
    const __m512i idx = _mm512_ternarylogic_epi32(codes, low5, _mm512_load_si512(cr.sel[v]), 0xEA);  // (c & 31) | sel
    return _mm512_permutex2var_epi16(thi, idx, tlo);
  };
  // the pair of tokens ta, ta + 1 as float partial sums, each token's in its half (two false: ta + 1 past the item)
  auto pair = [&](int ta, bool two) __attribute__((always_inline)) {
    __m512i acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_si512();
    const char* row = row0 + ta * sr;
    __builtin_prefetch(row + PREFETCH_BYTES);
    __m512i raw = ONE ? pw.template load<STRIDE>(row, two, sr, 0) : _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      if (!ONE) raw = pw.template load<STRIDE>(row, two, sr, v);
      const __m512i lv = levels(raw, v);
      for (int r = 0; r < RB; ++r) acc[r] = _mm512_dpwssd_epi32(acc[r], lv, qv[r][v]);
    }
    std::array<vf, RB> out;
    for (int r = 0; r < RB; ++r) out[r] = __builtin_convertvector(reinterpret_cast<vi>(acc[r]), vf);  // exact ints
    return out;
  };
  // VW tokens from t (FULL: all of them in the item, else cnt; pairs past it are zeros), reduced in registers from
  // level 1 on and stored times their scales
  auto block = [&]<bool FULL>(int t, int cnt) __attribute__((always_inline)) {
    const std::array<vf, RB> dots = reduce_leaves<1>([&](int i) __attribute__((always_inline)) {
      const int ta = t + 2 * i;
      if (!FULL && ta >= t + cnt) return std::array<vf, RB>{};
      return pair(ta, FULL || ta + 1 < t + cnt);
    });
    const vf sv = loadf(scale + t);  // (scale has VW floats of padding)
    for (int r = 0; r < RB; ++r) store_first(s + r * s_stride + t, dots[r] * (sv * splat(unit[r])), FULL ? VW : cnt);
  };
  int t = 0;
  for (; t + VW <= n; t += VW) block.template operator()<true>(t, VW);
  if (t < n) block.template operator()<false>(t, n - t);
}

// Hook for try_cb_scores: scores of R query rows (qn: rotated, scaled, natural order) against a CODEBOOK side's
// tokens [t0, t0+n) without the centred mean term, scale: the tokens' scales (n + VW floats).  False (nothing
// written) where the layout, the tables or the query keep the float path.
template <int DT>
bool try_cb_int_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qn, int64_t R, float* s,
                       int64_t s_stride, const float* scale) {
  if (DT % 32 || R > 64) return false;
  const CbKeyPairRow<DT>* cr = format_lanes<CbKeyPairRow<DT>>(sd.f);
  if (!cr) return false;
  const CbIntTables tb(sd, DT, cb_int_max(DT));
  if (!tb.ok) return false;
  alignas(64) int16_t q16[64 * DT];
  float unit[64];
  if (!cb_int_query<DT>(qn, R, tb.lsc, q16, unit)) return false;
  const char* row0 = sd.x.row(b, h, t0);
  const int64_t sr = sd.x.sr;
  const PairWindows<CbKeyPairRow<DT>> pw(*cr, sr);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    with_rows(rb, [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      pw.dispatch([&]<bool ONE, bool STRIDE>() {
        cb_int_scores<DT, RB, ONE, STRIDE>(*cr, pw, tb, row0, sr, n, q16 + r0 * DT, unit + r0, s + r0 * s_stride,
                                           s_stride, scale);
      });
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
  static constexpr __mmask64 SECOND = 0x3838383838383838;  // bytes 3-5 of every qword: token t + 1's
  // vpermb: bytes 0-2 of qword j <- row t's window bytes win_j - base.., 3-5 <- row t + 1's (+32); perm: base = the
  // vector's first byte, perm0: base 0 (one window for every vector, rows of at most 32 bytes)
  alignas(64) int8_t perm[NV][64], perm0[NV][64];
  alignas(64) int8_t ms[NV][64];    // vpmultishiftqb: both bytes of each word <- the bits from its code's offset
  alignas(64) int16_t sel[NV][32];  // 32 for the low run's words (vpermt2w's second table), else 0
  int base[NV];                     // vector v's first byte in a row
  int span[NV];                     // bytes from base that hold its codes
  int bytes = 0;
  bool init(const Fmt& f) {
    const CbRuns rn(f, DT);
    if (!rn.ok) return false;
    bytes = rn.bytes;
    for (int v = 0; v < NV; ++v) {
      for (int l = 0; l < 16; ++l) sel[v][2 * l] = sel[v][2 * l + 1] = 16 * v + l < rn.nh ? 0 : 32;
      base[v] = rn.bit(16 * v) / 8;  // codes ascend with coordinates: lane 0's is the lowest
      span[v] = 0;
      for (int j = 0; j < 8; ++j) {
        const int c0 = 16 * v + 2 * j, win = rn.bit(c0) / 8, last = rn.last_byte(c0 + 1);  // the two codes' bytes
        span[v] = std::max(span[v], last - base[v] + 1);
        for (int tok = 0; tok < 2; ++tok)  // bytes 0-2 of qword j: row t's, 3-5: row t + 1's
          if (!pair_window_bytes(perm[v], perm0[v], 8 * j + 3 * tok, 3, win, last, base[v], tok)) return false;
        perm[v][8 * j + 6] = perm[v][8 * j + 7] = perm0[v][8 * j + 6] = perm0[v][8 * j + 7] = 0;  // (unread)
        for (int i = 0; i < 2; ++i) {
          const int off = rn.bit(c0 + i) - 8 * win;
          if (off + rn.width(c0 + i) > 24) return false;
          ms[v][8 * j + 4 * i] = ms[v][8 * j + 4 * i + 1] = static_cast<int8_t>(off);  // word 2i: token t
          ms[v][8 * j + 4 * i + 2] = ms[v][8 * j + 4 * i + 3] = static_cast<int8_t>(off + 24);  // 2i + 1: t + 1
        }
      }
    }
    return true;
  }
};

// acc (RB rows of DT floats, natural order) += sw_r sum_t wq_rt L_t (sw_r: the row's factor back to floats) over
// vectors [v0, v0 + VP) of n tokens from row0 (stride sr); wq: RB rows of n2 weights (n2 even, the pad token's weight
// 0).  ONE, STRIDE: PairWindows.
template <int DT, int RB, int VP, bool ONE, bool STRIDE>
void cb_int_values_pass(const CbPairRow<DT>& cr, const PairWindows<CbPairRow<DT>>& pw, const CbIntTables& tb,
                        const char* row0, int64_t sr, int n, const int16_t* wq, int n2, const float* sw, float* acc,
                        int v0) {
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
  for (int t = 0; t < n; t += 2) {
    const char* ra = row0 + t * sr;
    const bool two = t + 1 < n;  // else the pad token (weight 0) reads token t's codes or zeros
    __builtin_prefetch(ra + PREFETCH_BYTES);
    __m512i w[RB];
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, wq + r * n2 + t, sizeof(pair));
      w[r] = _mm512_set1_epi32(pair);
    }
    __m512i raw = ONE ? pw.template load<STRIDE>(ra, two, sr, 0) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < VP; ++i) {
      const int v = v0 + i;
      if (!ONE) raw = pw.template load<STRIDE>(ra, two, sr, v);
      const __m512i placed = _mm512_permutexvar_epi8(pw.perm[v], raw);
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

template <int DT, int RB, bool ONE, bool STRIDE>
void cb_int_values(const CbPairRow<DT>& cr, const PairWindows<CbPairRow<DT>>& pw, const CbIntTables& tb,
                   const char* row0, int64_t sr, int n, const float* p, int64_t p_stride, int16_t* wq, float* acc) {
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
      ((size == S + 1 ? cb_int_values_pass<DT, RB, S + 1, ONE, STRIDE>(cr, pw, tb, row0, sr, n, wq, n2, sw, acc, v)
                      : void()),
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
  const int64_t sr = sd.x.sr;
  const PairWindows<CbPairRow<DT>> pw(*cr, sr);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    with_rows(rb, [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      pw.dispatch([&]<bool ONE, bool STRIDE>() {
        cb_int_values<DT, RB, ONE, STRIDE>(*cr, pw, tb, row0, sr, n, p + r0 * p_stride, p_stride, wq, acc + r0 * DT);
      });
    });
  }
  return true;
}

}  // namespace
#endif
