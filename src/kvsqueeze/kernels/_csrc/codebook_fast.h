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
//   end of the high run and the start of the low run picks between the two tables per lane.
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
  alignas(64) int32_t lo[NV][VW];  // mixed vector: 16 (AVX-512: table select bit) / -1 (AVX2: blend mask) on low-run lanes
  int off[NV], kind[NV];
  int bytes = 0, need = 0;  // row bytes; bytes a row's windows read from its start
#if defined(__AVX512F__)
  alignas(64) float thi[16], tlo[16];
#else
  alignas(32) float thi[16], tlo[16];  // entries 0-7 and (4-bit tables) 8-15
  bool four_hi = false, four_lo = false;
#endif

  // false when a vector's codes do not fit one 16-byte window (cannot happen for VW <= 16 and widths <= 4)
  bool init(const Side& sd) {
    const Fmt& f = sd.f;
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
      for (int l = 0; l < VW; ++l) {
        const int rel = first[l] - off[v];
        if (rel + width[l] > 16) return false;
        for (int j = 0; j < 4; ++j)  // bytes past the window read as 0 (they only feed bits above the code)
          shuf[v][4 * l + j] = static_cast<int8_t>(rel + j < 16 ? rel + j : -128);
      }
      // each 128-bit lane indexes its own copy of the window: the pattern of lanes 4..7 is the same bytes
      need = std::max(need, off[v] + 16);
    }
    const float* lh = table_row(sd, DT);
    const float* ll = table_row(sd, DT + 1);
    for (int e = 0; e < 16; ++e) {  // repeated: the index bits above a code select the same level
      thi[e] = lh[e & ((1 << bh) - 1)];
      tlo[e] = ll[e & ((1 << bl) - 1)];
    }
#if !defined(__AVX512F__)
    four_hi = bh == 4;
    four_lo = bl == 4;
#endif
    return true;
  }
};

// The tables as registers, and the levels of vector v of a row
template <int DT>
struct CbLevels {
  const CbRow<DT>& cr;
#if defined(__AVX512F__)
  __m512 thi, tlo;
  explicit CbLevels(const CbRow<DT>& c) : cr(c), thi(_mm512_load_ps(c.thi)), tlo(_mm512_load_ps(c.tlo)) {}
  __attribute__((always_inline)) inline vf operator()(const uint8_t* row, int v) const {
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + cr.off[v])));
    const __m512i idx = _mm512_srlv_epi32(_mm512_shuffle_epi8(raw, _mm512_load_si512(cr.shuf[v])),
                                          _mm512_load_si512(cr.shift[v]));
    __m512 out;
    if (cr.kind[v] == CB_HI) {
      out = _mm512_permutexvar_ps(idx, thi);
    } else if (cr.kind[v] == CB_LO) {
      out = _mm512_permutexvar_ps(idx, tlo);
    } else {  // index bit 4 picks the table: (idx & 15) | lo
      const __m512i sel = _mm512_ternarylogic_epi32(idx, _mm512_load_si512(cr.lo[v]), _mm512_set1_epi32(15), 0xEC);
      out = _mm512_permutex2var_ps(thi, sel, tlo);
    }
    return reinterpret_cast<vf>(out);
  }
#else
  __m256 ha, hb, la, lb;
  explicit CbLevels(const CbRow<DT>& c)
      : cr(c), ha(_mm256_load_ps(c.thi)), hb(_mm256_load_ps(c.thi + 8)), la(_mm256_load_ps(c.tlo)),
        lb(_mm256_load_ps(c.tlo + 8)) {}
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
      out = lookup(idx, ha, hb, cr.four_hi);
    } else if (cr.kind[v] == CB_LO) {
      out = lookup(idx, la, lb, cr.four_lo);
    } else {
      out = _mm256_blendv_ps(lookup(idx, ha, hb, cr.four_hi), lookup(idx, la, lb, cr.four_lo),
                             _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(cr.lo[v]))));
    }
    return reinterpret_cast<vf>(out);
  }
#endif
};

// A row's code bytes, or a zero-padded copy of them when its windows would read past the storage (Part::end)
template <int DT>
__attribute__((always_inline)) inline const uint8_t* cb_row(const Side& sd, const CbRow<DT>& cr, int64_t b, int64_t h,
                                                            int64_t t, uint8_t* pad) {
  const char* row = sd.x.row(b, h, t);
  __builtin_prefetch(row + PREFETCH_BYTES);
  if (__builtin_expect(row + cr.need > sd.x.end, 0)) {
    std::memcpy(pad, row, cr.bytes);
    return pad;
  }
  return reinterpret_cast<const uint8_t*>(row);
}

// dot_t = q' . cb[codes_t] for RB query rows (natural order), s = dot_t * scale_t; VW tokens reduced at a time.
template <int DT, int RB>
void cb_scores(const Side& sd, const CbRow<DT>& cr, int64_t b, int64_t h, int64_t t0, int n, const float* q, float* s,
               int64_t s_stride, const float* scale) {
  constexpr int NV = DT / VW;
  const CbLevels<DT> lv(cr);
  alignas(64) uint8_t pad[DT / 2 + 64] = {};
  vf buf[RB][VW];
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = cb_row(sd, cr, b, h, t0 + t, pad);
    vf acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = vf{};
    for (int v = 0; v < NV; ++v) {
      const vf x = lv(row, v);
      for (int r = 0; r < RB; ++r) acc[r] += loadf(q + r * DT + v * VW) * x;
    }
    const int l = t & (VW - 1);
    for (int r = 0; r < RB; ++r) buf[r][l] = acc[r];
    if (l == VW - 1 || t == n - 1) {
      const vf sv = loadf(scale + t - l);  // (scale has VW floats of padding)
      for (int r = 0; r < RB; ++r) {
        for (int j = l + 1; j < VW; ++j) buf[r][j] = vf{};
        float red[VW];
        storef(red, reduce_lanes(buf[r]) * sv);
        std::memcpy(s + r * s_stride + (t - l), red, sizeof(float) * (l + 1));
      }
    }
  }
}

// acc (RB rows, natural order) += sum_t (p_t scale_t) cb[codes_t]
template <int DT, int RB>
void cb_values(const Side& sd, const CbRow<DT>& cr, int64_t b, int64_t h, int64_t t0, int n, const float* p,
               int64_t p_stride, const float* scale, float* acc) {
  constexpr int NV = DT / VW;
  const CbLevels<DT> lv(cr);
  alignas(64) uint8_t pad[DT / 2 + 64] = {};
  vf a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = loadf(acc + r * DT + v * VW);
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = cb_row(sd, cr, b, h, t0 + t, pad);
    vf pr[RB];  // masked tokens have p = 0 exactly and add nothing: no test per token
    for (int r = 0; r < RB; ++r) pr[r] = splat(p[r * p_stride + t] * scale[t]);
    for (int v = 0; v < NV; ++v) {
      const vf x = lv(row, v);
      for (int r = 0; r < RB; ++r) a[r][v] += pr[r] * x;
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) storef(acc + r * DT + v * VW, a[r][v]);
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

// Hook for run_item: scores of R query rows (qs: field-major order chan, already scaled) against a CODEBOOK side.
// qn: R * DT floats of scratch, sc: n + VW floats.
template <int DT>
bool try_cb_scores(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* qs, int64_t R, float* s,
                   int64_t s_stride, const int* chan, float* qn, float* sc) {
  if (sd.f.kind != CODEBOOK || DT % VW) return false;
  CbRow<DT> cr;
  if (!cr.init(sd)) return false;
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < DT; ++j) qn[r * DT + chan[j]] = qs[r * DT + j];
  std::fill(sc + n, sc + n + VW, 0.f);
  cb_scales(sd, b, h, t0, n, DT, sc);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    const float* qr = qn + r0 * DT;
    float* sr = s + r0 * s_stride;
    switch (rb) {
      case 1: cb_scores<DT, 1>(sd, cr, b, h, t0, n, qr, sr, s_stride, sc); break;
      case 2: cb_scores<DT, 2>(sd, cr, b, h, t0, n, qr, sr, s_stride, sc); break;
      case 3: cb_scores<DT, 3>(sd, cr, b, h, t0, n, qr, sr, s_stride, sc); break;
      default: cb_scores<DT, 4>(sd, cr, b, h, t0, n, qr, sr, s_stride, sc); break;
    }
  }
  float mean[DT];
  cb_groups(sd, b, h, t0, n, DT, mean, [&](int lo, int hi) {  // centred: + q' . mean_g over the group's tokens
    for (int64_t r = 0; r < R; ++r) {
      const float qm = dot<DT>(qn + r * DT, mean, DT);
      float* sr = s + r * s_stride;
      for (int t = lo; t < hi; ++t) sr[t] += qm;
    }
  });
  return true;
}

// Hook for run_item: acc (field-major order chan, stride acc_stride) += sum_t p_t value_t in the rotated space.
// an: R * DT floats of scratch, sc: n + VW floats.
template <int DT>
bool try_cb_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                   int64_t R, float* acc, int64_t acc_stride, const int* chan, float* an, float* sc) {
  if (sd.f.kind != CODEBOOK || DT % VW) return false;
  CbRow<DT> cr;
  if (!cr.init(sd)) return false;
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
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, R - r0));
    const float* pr = p + r0 * p_stride;
    float* ar = an + r0 * DT;
    switch (rb) {
      case 1: cb_values<DT, 1>(sd, cr, b, h, t0, n, pr, p_stride, sc, ar); break;
      case 2: cb_values<DT, 2>(sd, cr, b, h, t0, n, pr, p_stride, sc, ar); break;
      case 3: cb_values<DT, 3>(sd, cr, b, h, t0, n, pr, p_stride, sc, ar); break;
      default: cb_values<DT, 4>(sd, cr, b, h, t0, n, pr, p_stride, sc, ar); break;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < DT; ++j) acc[r * acc_stride + j] += an[r * DT + chan[j]];
  return true;
}

#else  // builds without AVX2 keep the tiled path

template <int DT>
bool try_cb_scores(const Side&, int64_t, int64_t, int64_t, int, const float*, int64_t, float*, int64_t, const int*,
                   float*, float*) {
  return false;
}
template <int DT>
bool try_cb_values(const Side&, int64_t, int64_t, int64_t, int, const float*, int64_t, int64_t, float*, int64_t,
                   const int*, float*, float*) {
  return false;
}

#endif

}  // namespace
