// Rotated codebook sides (kind CODEBOOK) in the decode kernel without a float tile: AVX2 / AVX-512 builds.
//
// The generic path unpacked 32 rows of levels into L1 and read them back for a dot product or an axpy per token and
// query row, which cost 3x the packed integer formats' step.  Here a token's codes are turned into levels in
// registers and consumed at once, VW coordinates a vector:
//   lane l of vector v holds rotated coordinate v VW + l (natural order: a packing unit's codes are consecutive
//   coordinates, so one vector's codes lie in at most 11 consecutive bytes, high run then low run).  A 16-byte
//   window of the row is broadcast to every 128-bit lane, one byte shuffle puts the bytes of each lane's code at
//   the bottom of its 32-bit lane, one variable shift brings the code to bit 0, and one lane permutation of the
//   level table (in a register) gives the level: vpermps reads only the low 4 (AVX2: 3) index bits, so a table
//   with fewer levels is repeated to fill it and the bits above a code need no mask.  The one vector that holds the
//   end of the high run and the start of the low run picks between the two tables per lane.  On AVX2 every layout
//   is split (runs are multiples of 8 coordinates, CbRow::split): a vector is all high-run or all low-run lanes, its
//   8 codes lie in 4 bytes, placed by one broadcast and one shift, and the loops know each vector's table.  On
//   AVX-512 a high run of an odd number of 8-coordinate units leaves one mixed vector (CbRow::mixed): the loops
//   know which one it is, so no vector's kind is tested per token (rot-3 at head_dim 64, one layer at 8k in a warm
//   loop: 12% faster).  With VBMI (the avx512-vbmi build) one vpmultishiftqb over the 8 bytes that hold a vector's
//   codes replaces the byte shuffle and the shift (rot-3 at 8k, one layer, Zen 4: 16% faster, bit-identical).
// Scores: s_t = scale_t (q' . cb[codes_t]) + q' . mean_g: VW tokens' dot products are reduced at once
// (reduce_lanes), then scaled; the mean term is one dot product per group.  Values: acc += (p_t scale_t) cb[codes_t],
// plus (sum_t p_t) mean_g per group for centred values.  Queries and accumulators are in natural order here; the
// hooks convert from / to the field-major order (Perm) run_item uses.
#pragma once

namespace {

#if defined(__AVX2__)

enum { CB_HI = 0, CB_LO = 1, CB_MIXED = 2 };

// Where each lane of a row's vectors finds its code, and the level tables, for one format at head_dim DT.
template <int DT>
struct CbRow {
  static constexpr int NV = DT / VW;
  alignas(64) int8_t shuf[NV][4 * VW];  // byte shuffle per vector (the same 16-byte pattern in each 128-bit lane)
  alignas(64) int32_t shift[NV][VW];
  alignas(64) int32_t lo[NV][VW];  // mixed vector, low-run lanes: 16 (AVX-512: table select bit), -1 (AVX2: blend)
#if defined(__AVX512VBMI__)
  // VBMI: vector v's codes lie in the 8 bytes from off[v] (widths <= 4, runs start at multiples of 8 coordinates);
  // byte 4 (l % 2) of qword l / 2 takes the 8 bits from bit ms[v][...] of that window (vpmultishiftqb)
  alignas(64) int8_t ms[NV][64];
#endif
  int off[NV], kind[NV];
  int bytes = 0, need = 0;  // row bytes; bytes a row's windows read from its start
  // split: vectors [0, nhv) all high-run lanes, the rest all low-run (no mixed vector: always on AVX2, whose
  // vectors are 8 coordinates and split_bits' high runs multiples of 8), and a low run of at most 8 levels; the
  // token loops then know each vector's kind (cb_level's split modes, cb_values_split).  mixed: the same with
  // vector nhv holding the end of the high run and the start of the low run (AVX-512's 16-coordinate vectors at
  // head_dim 64 for rot-3's 2.875-bit keys: 56 + 8 coordinates); its kind is known too.
  int nhv = 0;
  bool split = false, mixed = false;
  // false when a vector's codes do not fit one 16-byte window (cannot happen for VW <= 16 and widths <= 4)
  bool init(const Fmt& f) {
    const int nh = cb_n_hi(f), bh = f.bits, bl = cb_bits_lo(f);
    const int hb = nh * bh / 8;
    bytes = hb + (DT - nh) * bl / 8;
    for (int v = 0; v < NV; ++v) {
      int first[VW], width[VW];
      bool any_hi = false, any_lo = false;
      for (int l = 0; l < VW; ++l) {
        const int c = v * VW + l;
        const bool hi = c < nh;
        const int bits = hi ? bh : bl, i = hi ? c : c - nh, base = hi ? 0 : hb;
        if (bits == 3) {  // 8 codes per 3 bytes, code k of a unit at bit 3k
          first[l] = base + 3 * (i / 8);
          shift[v][l] = 3 * (i % 8);
          width[l] = 3;
        } else {  // 8 / bits codes per byte, code k at bit k bits
          first[l] = base + i * bits / 8;
          shift[v][l] = i * bits % 8;
          width[l] = 1;
        }
        lo[v][l] = hi ? 0 : (VW == 16 ? 16 : -1);
        any_hi |= hi;
        any_lo |= !hi;
      }
      kind[v] = any_hi && any_lo ? CB_MIXED : any_hi ? CB_HI : CB_LO;
      off[v] = *std::min_element(first, first + VW);
#if defined(__AVX512VBMI__)
      for (int l = 0; l < VW; ++l) {
        const int bit = 8 * (first[l] - off[v]) + shift[v][l];
        if (bit + (v * VW + l < nh ? bh : bl) > 64) return false;
        for (int j = 0; j < 4; ++j) ms[v][4 * l + j] = static_cast<int8_t>(bit);
      }
#endif
      for (int l = 0; l < VW; ++l) {
        const int rel = first[l] - off[v];
        if (rel + width[l] > 16) return false;
        for (int j = 0; j < 4; ++j)  // bytes past the window read as 0 (they only feed bits above the code)
          shuf[v][4 * l + j] = static_cast<int8_t>(rel + j < 16 ? rel + j : -128);
      }
      // each 128-bit lane indexes its own copy of the window: the pattern of lanes 4..7 is the same bytes
      need = std::max(need, off[v] + 16);
    }
    nhv = 0;
    while (nhv < NV && kind[nhv] == CB_HI) ++nhv;
    split = nhv == NV || bl <= 3;
    for (int v = nhv; v < NV; ++v) split = split && kind[v] == CB_LO;
    mixed = !split && nhv < NV && bl <= 3 && kind[nhv] == CB_MIXED;
    for (int v = nhv + 1; v < NV; ++v) mixed = mixed && kind[v] == CB_LO;
    return true;
  }
};

// The level tables in registers (repeated to 16 entries: the index bits above a code select the same level; AVX2:
// entries 0-7 and 8-15), and the levels of vector v of a row
struct CbTables {
  alignas(64) float hi[16], lo[16];
  int bits_hi, bits_lo;
  bool four_hi, four_lo;
  template <int DT>
  CbTables(const Side& sd, std::integral_constant<int, DT>) {
    const int bh = sd.f.bits, bl = cb_bits_lo(sd.f);
    const float* lh = table_row(sd, DT);
    const float* ll = table_row(sd, DT + 1);
    for (int e = 0; e < 16; ++e) {
      hi[e] = lh[e & ((1 << bh) - 1)];
      lo[e] = ll[e & ((1 << bl) - 1)];
    }
    bits_hi = bh;
    bits_lo = bl;
    four_hi = bh == 4;
    four_lo = bl == 4;
  }
};

template <int DT>
struct CbLevels {
  const CbRow<DT>& cr;
#if defined(__AVX512F__)
  __m512 thi, tlo;
  CbLevels(const CbRow<DT>& c, const CbTables& tb) : cr(c), thi(_mm512_load_ps(tb.hi)), tlo(_mm512_load_ps(tb.lo)) {}
  // vector v's codes, each at the bottom of its 32-bit lane (the bits above it unmasked)
  __attribute__((always_inline)) inline __m512i codes(const uint8_t* row, int v) const {
#if defined(__AVX512VBMI__)
    uint64_t w;
    std::memcpy(&w, row + cr.off[v], sizeof(w));
    return _mm512_multishift_epi64_epi8(_mm512_load_si512(cr.ms[v]), _mm512_set1_epi64(static_cast<int64_t>(w)));
#else
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + cr.off[v])));
    return _mm512_srlv_epi32(_mm512_shuffle_epi8(raw, _mm512_load_si512(cr.shuf[v])), _mm512_load_si512(cr.shift[v]));
#endif
  }
  __attribute__((always_inline)) inline vf operator()(const uint8_t* row, int v) const {
    if (cr.kind[v] == CB_HI) return pure<true, false>(row, v);
    if (cr.kind[v] == CB_LO) return pure<false, false>(row, v);
    return mixed(row, v);
  }
  // vector v when all its lanes are of one run (HI: the high run), known to the caller: no kind test
  template <bool HI, bool FOUR>
  __attribute__((always_inline)) inline vf pure(const uint8_t* row, int v) const {
    return reinterpret_cast<vf>(_mm512_permutexvar_ps(codes(row, v), HI ? thi : tlo));
  }
  // vector v when it is the mixed one, known to the caller: index bit 4 picks the table, (idx & 15) | lo
  __attribute__((always_inline)) inline vf mixed(const uint8_t* row, int v) const {
    const __m512i sel =
        _mm512_ternarylogic_epi32(codes(row, v), _mm512_load_si512(cr.lo[v]), _mm512_set1_epi32(15), 0xEC);
    return reinterpret_cast<vf>(_mm512_permutex2var_ps(thi, sel, tlo));
  }
#else
  __m256 ha, hb, la, lb;
  __m256i shi, slo;  // split layouts: lane l's code at bit l * bits of its vector's first 4 bytes
  bool four_hi, four_lo;
  CbLevels(const CbRow<DT>& c, const CbTables& tb)
      : cr(c), ha(_mm256_load_ps(tb.hi)), hb(_mm256_load_ps(tb.hi + 8)), la(_mm256_load_ps(tb.lo)),
        lb(_mm256_load_ps(tb.lo + 8)),
        shi(_mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(tb.bits_hi))),
        slo(_mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(tb.bits_lo))),
        four_hi(tb.four_hi), four_lo(tb.four_lo) {}
  static __attribute__((always_inline)) inline __m256 lookup(__m256i idx, __m256 a, __m256 b, bool four) {
    __m256 v = _mm256_permutevar8x32_ps(a, idx);
    if (four)  // bit 3 of the code picks the upper half of a 16-level table
      v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(b, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    return v;
  }
  __attribute__((always_inline)) inline vf operator()(const uint8_t* row, int v) const {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + cr.off[v])));
    const __m256i idx = _mm256_srlv_epi32(
        _mm256_shuffle_epi8(raw, _mm256_load_si256(reinterpret_cast<const __m256i*>(cr.shuf[v]))),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(cr.shift[v])));
    __m256 out;
    if (cr.kind[v] == CB_HI) {
      out = lookup(idx, ha, hb, four_hi);
    } else if (cr.kind[v] == CB_LO) {
      out = lookup(idx, la, lb, four_lo);
    } else {
      out = _mm256_blendv_ps(lookup(idx, ha, hb, four_hi), lookup(idx, la, lb, four_lo),
                             _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(cr.lo[v]))));
    }
    return reinterpret_cast<vf>(out);
  }
  // vector v when all its lanes are of one run (HI: the high run; FOUR: its table has 16 levels), known to the
  // caller: the kind and width tests of operator() cost ~5 instructions per vector and token.  Such a vector's 8
  // codes are 8 x bits <= 32 bits from byte off[v], lane 0's at bit 0 (runs start at multiples of 8 coordinates):
  // one 4-byte broadcast and one shift place them, where operator()'s byte shuffle serves any 16-byte window.
  template <bool HI, bool FOUR>
  __attribute__((always_inline)) inline vf pure(const uint8_t* row, int v) const {
    uint32_t w;
    std::memcpy(&w, row + cr.off[v], sizeof(w));  // (the row's windows may read 16 bytes: CbRow::need)
    const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), HI ? shi : slo);
    return reinterpret_cast<vf>(HI ? lookup(idx, ha, hb, FOUR) : lookup(idx, la, lb, FOUR));
  }
  // (AVX2 layouts are always split: no mixed vector)
  __attribute__((always_inline)) inline vf mixed(const uint8_t* row, int v) const { return (*this)(row, v); }
#endif
};

// The lane layout of a format, built once per thread and format; null where init refuses it
template <int DT>
const CbRow<DT>* cb_lanes(const Fmt& f) {
  return format_lanes<CbRow<DT>>(f);
}

// The code rows of an item (first row, stride and the storage's end, read once: the side's fields are re-read after
// every store, and row()'s three multiplies per token were a measurable share of the token loops).  operator():
// row t's code bytes, or a zero-padded copy of them when its windows would read past the storage (Part::end).
template <int DT>
struct CbRows {
  const CbRow<DT>& cr;
  const char* row0;
  int64_t sr;
  const char* end;
  CbRows(const Side& sd, const CbRow<DT>& c, int64_t b, int64_t h, int64_t t0)
      : cr(c), row0(sd.x.row(b, h, t0)), sr(sd.x.sr), end(sd.x.end) {}
  __attribute__((always_inline)) inline const uint8_t* operator()(int t, uint8_t* pad) const {
    const char* row = row0 + t * sr;
    __builtin_prefetch(row + PREFETCH_BYTES);
    if (__builtin_expect(row + cr.need > end, 0)) {
      std::memcpy(pad, row, cr.bytes);
      return pad;
    }
    return reinterpret_cast<const uint8_t*>(row);
  }
  // Tokens [0, safe(n)) whose windows stay inside the storage: read with direct() (no test, no copy)
  int safe(int n) const {
    if (row0 + (n - 1) * sr + cr.need <= end) return n;
    if (row0 + cr.need > end) return 0;
    const int64_t k = (end - cr.need - row0) / sr + 1;  // rows 0..k-1 end inside
    return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, k)));
  }
  __attribute__((always_inline)) inline const uint8_t* direct(int t) const {
    const char* row = row0 + t * sr;
    __builtin_prefetch(row + PREFETCH_BYTES);
    return reinterpret_cast<const uint8_t*>(row);
  }
};

// Levels of vector v: MODE CB_ANY tests the vector's kind (any layout); CB_SPLIT / CB_SPLIT4 know the layout is
// split (CbRow::split) and the high run's table has 8 / 16 levels; CB_SPLITM / CB_SPLITM4 the same with vector nhv
// the mixed one (CbRow::mixed): the kind test per vector and token was ~5 instructions of AVX-512's rot-3 keys.
enum { CB_ANY = 0, CB_SPLIT = 1, CB_SPLIT4 = 2, CB_SPLITM = 3, CB_SPLITM4 = 4 };
template <int MODE, int DT>
__attribute__((always_inline)) inline vf cb_level(const CbLevels<DT>& lv, const uint8_t* row, int v, int nhv) {
  constexpr bool FOUR = MODE == CB_SPLIT4 || MODE == CB_SPLITM4;
  if constexpr (MODE == CB_ANY) return lv(row, v);
  else if (v < nhv) return lv.template pure<true, FOUR>(row, v);
  else if ((MODE == CB_SPLITM || MODE == CB_SPLITM4) && v == nhv) return lv.mixed(row, v);
  else return lv.template pure<false, false>(row, v);
}

// dot_t = q' . cb[codes_t] for RB query rows (natural order), s = dot_t * scale_t.  AVX-512: TU = 4 tokens at a
// time are summed pairwise in registers (levels 0-1 of reduce_tokens) and the rest VW tokens at once (parking every
// token's vector on the stack and reducing from level 0 cost a third of the loop); AVX2 (16 registers) parks each.
template <int DT, int RB, int MODE>
void cb_scores(const Side& sd, const CbRow<DT>& cr, const CbTables& tb, int64_t b, int64_t h, int64_t t0, int n,
               const float* q, float* s, int64_t s_stride, const float* scale) {
  const int nhv = cr.nhv;
  constexpr int NV = DT / VW, LTU = VW == 16 ? 2 : 0, TU = 1 << LTU, NB = VW / TU;
  const CbLevels<DT> lv(cr, tb);
  const CbRows<DT> rows(sd, cr, b, h, t0);
  alignas(64) uint8_t pad[DT / 2 + 64] = {};
  vf buf[RB][NB];
  for (int t = 0; t < n; t += TU) {
    vf acc[TU][RB];
#pragma GCC unroll 4
    for (int u = 0; u < TU; ++u) {
      for (int r = 0; r < RB; ++r) acc[u][r] = vf{};
      if (TU > 1 && t + u >= n) continue;  // past the item: zero
      const uint8_t* row = rows(t + u, pad);
      vf odd[RB];  // AVX2: a second chain per row (eight dependent multiply-adds per token were latency-bound)
      for (int r = 0; r < RB; ++r) odd[r] = vf{};
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const vf x = cb_level<MODE>(lv, row, v, nhv);
        for (int r = 0; r < RB; ++r) {
          if (VW == 8 && (v & 1)) odd[r] += loadf(q + r * DT + v * VW) * x;
          else acc[u][r] += loadf(q + r * DT + v * VW) * x;
        }
      }
      if constexpr (VW == 8)
        for (int r = 0; r < RB; ++r) acc[u][r] += odd[r];
    }
    const int blk = (t / TU) & (NB - 1);
    for (int r = 0; r < RB; ++r) {
      vf x[TU];
      for (int u = 0; u < TU; ++u) x[u] = acc[u][r];
      if constexpr (LTU == 2) {
        constexpr vi l0 = level_pattern<0>(), l1 = level_pattern<1>();
        buf[r][blk] = pair_sums(pair_sums(x[0], x[1], l0, VW / 2), pair_sums(x[2], x[3], l0, VW / 2), l1, VW / 4);
      } else if constexpr (LTU == 1) {
        constexpr vi l0 = level_pattern<0>();
        buf[r][blk] = pair_sums(x[0], x[1], l0, VW / 2);
      } else {
        buf[r][blk] = x[0];
      }
    }
    if (blk == NB - 1 || t + TU >= n)  // (scale has VW floats of padding)
      store_block_scores<LTU>(buf, blk, t - blk * TU, std::min(VW, n - (t - blk * TU)), scale, nullptr, s, s_stride);
  }
}

// acc (RB rows, natural order) += sum_t p_t cb[codes_t] (p: probabilities times the tokens' scales)
template <int DT, int RB>
void cb_values(const Side& sd, const CbRow<DT>& cr, const CbTables& tb, int64_t b, int64_t h, int64_t t0, int n,
               const float* p, int64_t p_stride, float* acc) {
  constexpr int NV = DT / VW;
  const CbLevels<DT> lv(cr, tb);
  const CbRows<DT> rows(sd, cr, b, h, t0);
  alignas(64) uint8_t pad[DT / 2 + 64] = {};
  vf a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = loadf(acc + r * DT + v * VW);
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = rows(t, pad);
    vf pr[RB];  // masked tokens have p = 0 exactly and add nothing: no test per token
    for (int r = 0; r < RB; ++r) pr[r] = splat(p[r * p_stride + t]);
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const vf x = lv(row, v);
      for (int r = 0; r < RB; ++r) a[r][v] += pr[r] * x;
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) storef(acc + r * DT + v * VW, a[r][v]);
}

// cb_values for a split layout (CbRow::split): passes over the tokens, each for VP vectors of one run, so the RB x VP
// accumulators stay in registers (RB = 3 rows at head_dim 64 need 24 on AVX2's 16: cb_values spent as many moves
// to and from the stack as lookups) and each vector's kind and table are known in the loop (MIX: the mixed vector
// of a CbRow::mixed layout, a pass of its own).
template <int DT, int RB, int VP, bool HI, bool FOUR, bool MIX = false>
void cb_values_pass(const CbLevels<DT>& lv, const CbRows<DT>& rows, uint8_t* pad, int n, const float* p,
                    int64_t p_stride, float* acc, int v0) {
  vf a[RB][VP];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < VP; ++i) a[r][i] = vf{};
  auto token = [&](int t, const uint8_t* row) __attribute__((always_inline)) {
    vf pr[RB];
    for (int r = 0; r < RB; ++r) pr[r] = splat(p[r * p_stride + t]);
    for (int i = 0; i < VP; ++i) {
      const vf x = MIX ? lv.mixed(row, v0 + i) : lv.template pure<HI, FOUR>(row, v0 + i);
      for (int r = 0; r < RB; ++r) a[r][i] += pr[r] * x;
    }
  };
  const int ns = rows.safe(n);
  for (int t = 0; t < ns; ++t) token(t, rows.direct(t));
  for (int t = ns; t < n; ++t) token(t, rows(t, pad));
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < VP; ++i) {
      float* dst = acc + r * DT + (v0 + i) * VW;
      storef(dst, loadf(dst) + a[r][i]);
    }
}

// Vectors per pass: RB x VP accumulators, RB broadcast weights, the level and up to two tables in the registers
// (AVX2 at 3 rows: 2, measured 3-5% faster than the 3 that fit, with any split of a row's runs)
template <int DT, int RB>
constexpr int cb_pass_vectors() {
  constexpr int regs = VW == 16 ? 32 : 16, vp = VW == 8 && RB == 3 ? 2 : (regs - RB - 4) / RB;
  return std::max(1, std::min(DT / VW, vp));
}

template <int DT, int RB, bool HI, bool FOUR>
void cb_values_run(const CbLevels<DT>& lv, const CbRows<DT>& rows, uint8_t* pad, int n, const float* p,
                   int64_t p_stride, float* acc, int v0, int v1) {
  // the fewest passes, of balanced sizes (a run of 7 at VP 4: 4 + 3, not 4 + 1 + 1 + 1)
  constexpr int VP = cb_pass_vectors<DT, RB>();
  const int len = v1 - v0, passes = (len + VP - 1) / VP;
  for (int k = 0, v = v0; k < passes; ++k) {
    const int size = len / passes + (k < len % passes);
    [&]<int... S>(std::integer_sequence<int, S...>) {
      ((size == S + 1 ? cb_values_pass<DT, RB, S + 1, HI, FOUR>(lv, rows, pad, n, p, p_stride, acc, v) : void()),
       ...);
    }(std::make_integer_sequence<int, VP>{});
    v += size;
  }
}

template <int DT, int RB>
void cb_values_split(const Side& sd, const CbRow<DT>& cr, const CbTables& tb, int64_t b, int64_t h, int64_t t0,
                     int n, const float* p, int64_t p_stride, float* acc) {
  const CbLevels<DT> lv(cr, tb);
  const CbRows<DT> rows(sd, cr, b, h, t0);
  alignas(64) uint8_t pad[DT / 2 + 64] = {};
  if (tb.four_hi) cb_values_run<DT, RB, true, true>(lv, rows, pad, n, p, p_stride, acc, 0, cr.nhv);
  else cb_values_run<DT, RB, true, false>(lv, rows, pad, n, p, p_stride, acc, 0, cr.nhv);
  if (cr.mixed) cb_values_pass<DT, RB, 1, false, false, true>(lv, rows, pad, n, p, p_stride, acc, cr.nhv);
  cb_values_run<DT, RB, false, false>(lv, rows, pad, n, p, p_stride, acc, cr.nhv + cr.mixed, DT / VW);
}

// Per-token scales of tokens [t0, t0+n) into out (centred: from each group's row, after its mean)
inline void cb_scales(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int D, float* out) {
  const int G = cb_group(sd.f);
  const int64_t es = static_cast<int64_t>(c10::elementSize(sd.scale.dt));
  if (!G) {
    if (sd.scale.sr == es) {
      load_row(sd.scale.dt, sd.scale.row(b, h, t0), n, out);
    } else {
      for (int t = 0; t < n; ++t) out[t] = ld(sd.scale.dt, sd.scale.row(b, h, t0 + t), 0);
    }
    return;
  }
  for (int64_t tok = t0; tok < t0 + n;) {
    const int64_t g = tok / G, end = std::min<int64_t>((g + 1) * G, t0 + n);
    load_row(sd.scale.dt, sd.scale.row(b, h, g) + (D + (tok - g * G)) * es, static_cast<int>(end - tok),
             out + (tok - t0));
    tok = end;
  }
}

// Centred layouts: each(mean, lo, hi) for every group covering the item's tokens [lo, hi), its mean (natural
// order) loaded into mean[D]
template <typename F>
void cb_groups(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int D, float* mean, F&& each) {
  const int G = cb_group(sd.f);
  if (!G) return;
  for (int64_t tok = t0; tok < t0 + n;) {
    const int64_t g = tok / G, end = std::min<int64_t>((g + 1) * G, t0 + n);
    load_row(sd.scale.dt, sd.scale.row(b, h, g), D, mean);
    each(static_cast<int>(tok - t0), static_cast<int>(end - t0));
    tok = end;
  }
}

// Centred layouts: s[r][t] += q'_r . mean_g over each group's tokens
template <int DT>
void cb_mean_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qn, int64_t R, float* s,
                    int64_t s_stride) {
  float mean[DT];
  cb_groups(sd, b, h, t0, n, DT, mean, [&](int lo, int hi) {
    for (int64_t r = 0; r < R; ++r) {
      const float qm = dot<DT>(qn + r * DT, mean, DT);
      float* sr = s + r * s_stride;
      for (int t = lo; t < hi; ++t) sr[t] += qm;
    }
  });
}

// Hook for run_item: scores of R query rows (qn: rotated, scaled, natural order) against a CODEBOOK side.
// sc: n + VW floats of scratch.
template <int DT>
bool try_cb_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qn, int64_t R, float* s,
                   int64_t s_stride, float* sc) {
  if (sd.f.kind != CODEBOOK || DT % VW) return false;
  std::fill(sc + n, sc + n + VW, 0.f);
  cb_scales(sd, b, h, t0, n, DT, sc);
#if defined(KVSQ_CB_INT)
  if (try_cb_int_scores<DT>(sd, b, h, t0, n, qn, R, s, s_stride, sc)) {
    cb_mean_scores<DT>(sd, b, h, t0, n, qn, R, s, s_stride);
    return true;
  }
#endif
  const CbRow<DT>* cr = cb_lanes<DT>(sd.f);
  if (!cr) return false;
  const CbTables tb(sd, std::integral_constant<int, DT>{});
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    const float* qr = qn + r0 * DT;
    float* sr = s + r0 * s_stride;
    with_rows(rb, [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      if (cr->mixed && tb.four_hi) cb_scores<DT, RB, CB_SPLITM4>(sd, *cr, tb, b, h, t0, n, qr, sr, s_stride, sc);
      else if (cr->mixed) cb_scores<DT, RB, CB_SPLITM>(sd, *cr, tb, b, h, t0, n, qr, sr, s_stride, sc);
      else if (!cr->split) cb_scores<DT, RB, CB_ANY>(sd, *cr, tb, b, h, t0, n, qr, sr, s_stride, sc);
      else if (tb.four_hi) cb_scores<DT, RB, CB_SPLIT4>(sd, *cr, tb, b, h, t0, n, qr, sr, s_stride, sc);
      else cb_scores<DT, RB, CB_SPLIT>(sd, *cr, tb, b, h, t0, n, qr, sr, s_stride, sc);
    });
  }
  cb_mean_scores<DT>(sd, b, h, t0, n, qn, R, s, s_stride);
  return true;
}

// Hook for run_item: acc (natural order, stride acc_stride) += sum_t p_t value_t in the rotated space.
// an: R * DT floats of scratch, sc: n + VW floats.
// p is multiplied by the tokens' scales in place.
template <int DT>
bool try_cb_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, float* p, int64_t p_stride,
                   int64_t R, float* acc, int64_t acc_stride, float* an, float* sc, int16_t* wq) {
  if (sd.f.kind != CODEBOOK || DT % VW) return false;
  const CbRow<DT>* cr = cb_lanes<DT>(sd.f);
  if (!cr) return false;
  const CbTables tb(sd, std::integral_constant<int, DT>{});
  std::fill(an, an + R * DT, 0.f);
  cb_scales(sd, b, h, t0, n, DT, sc);
  float mean[DT];
  cb_groups(sd, b, h, t0, n, DT, mean, [&](int lo, int hi) {  // centred values: + (sum of the group's p) mean_g
    for (int64_t r = 0; r < R; ++r) {
      float ps = 0.f;
      for (int t = lo; t < hi; ++t) ps += p[r * p_stride + t];
      float* ar = an + r * DT;
#pragma omp simd
      for (int j = 0; j < DT; ++j) ar[j] += ps * mean[j];
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    float* pr = p + r * p_stride;
#pragma omp simd
    for (int t = 0; t < n; ++t) pr[t] *= sc[t];
  }
#if defined(KVSQ_CB_INT)
  const bool done = try_cb_int_values<DT>(sd, b, h, t0, n, p, p_stride, R, an, wq);
#else
  const bool done = false;
  (void)wq;
#endif
  for (int64_t r0 = 0; r0 < (done ? 0 : R); r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    const float* pr = p + r0 * p_stride;
    float* ar = an + r0 * DT;
    with_rows(rb, [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      if (cr->split || cr->mixed) cb_values_split<DT, RB>(sd, *cr, tb, b, h, t0, n, pr, p_stride, ar);
      else cb_values<DT, RB>(sd, *cr, tb, b, h, t0, n, pr, p_stride, ar);
    });
  }
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < DT; ++j) acc[r * acc_stride + j] += an[r * DT + j];
  return true;
}

#else  // builds without AVX2 keep the tiled path

template <int DT>
bool try_cb_scores(const Side&, int64_t, int64_t, int64_t, int, const float*, int64_t, float*, int64_t, float*) {
  return false;
}
template <int DT>
bool try_cb_values(const Side&, int64_t, int64_t, int64_t, int, float*, int64_t, int64_t, float*, int64_t, float*,
                   float*, int16_t*) {
  return false;
}

#endif

}  // namespace
