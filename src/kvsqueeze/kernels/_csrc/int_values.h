// Weighted values by int16 dot products (AVX-512 VNNI builds; other builds keep the float path of fast_path.h).
//
// fast_values spends one float multiply-add per code and query row (three at SmolLM2's 3 query heads per KV head):
// at 2 and 4 bits those, not the bytes read, bound the values' part of a decode step (27% of kivi-4's layer).
// Here each query row's weights w_rtg = p_rt a_tg (probability times the token's scale in group g) are rounded once
// per item to int16, wq = round(w / sw_rg) with sw_rg = max_t |w_rtg| / 32767, and two tokens are multiplied at once:
// lane l of a vector holds the codes of tokens t and t + 1 as two int16 and the weight vector (wq_t, wq_t+1), so one
// vpdpwssd adds 32 products to int32 lanes where a float multiply-add adds 16.  The sums are centred on the codes'
// middle, mid = 2^(bits-1), by subtracting mid sum_t wq_t (exact, in int32), and mid comes back through the float
// sum of the weights: acc += sw sum_t wq_t (c_t - mid) + mid sum_t w_t + sum_t p_t c_tg (zero points).  Lane sums are
// exact; the error added to the reference's is the weights' rounding, |d acc| <= sw_rg / 2 * sum_t |c_t - mid| per
// channel, half of what uncentred sums gave (tests/kernels bound it).
// Served: 2/4-bit per-token codes (3-bit ones repacked to 4-bit, formats.h as_nibbles) whose vectors (16 packing
// units) each lie in one group (G / per a multiple of 16: kivi-4's and int4's values) or in two halves of 8 lanes
// (G / per = 8: kivi-2's groups of 32 at 2 bits), with finite scales and zero points (an inf / NaN one goes to the
// float path, which gives the reference's result).
#pragma once

#if defined(KVSQ_INT_DOT) && defined(__AVX512F__)
#define KVSQ_INT_VALUES 1
namespace {

constexpr int INT_VALUES_RUN = 256;  // tokens per pass: 256 x 240 x 32767 < 2^31 (int_values_pass)
constexpr int INT_VALUES_MAX_GROUPS = 16;    // per-token groups per row (fast_bits: DT / G <= 16)

// Rows' int16 weights wq[(r NG + g) n2 + t] (n2: n rounded up to even, the pad token's weight 0), their scales
// sw[r NG + g], sums qsum[r NG + g] and zero sums cz[r NG + g] (with the centre's mid sum_t w_t).  (A row whose
// probabilities are NaN is dropped by the merge whatever its partial holds: run_item marks it.)  wf: RB x n floats.
// The RB rows go side by side through each pass, every sum in a chain of its own: one row at a time, the zero sum's
// two dependent multiply-adds per 16 tokens bound the loop by their latency (10% of a kivi-4 layer at 8k).
template <int RB>
void int_value_weights(const float* p, int64_t p_stride, const float* A, const float* C, int NG, int n, float mid,
                       float* ag, float* cg, float* wf, int16_t* wq, int n2, float* sw, int32_t* qsum, float* cz) {
  for (int g = 0; g < NG; ++g) {
    group_runs(A, C, NG, g, n, ag, cg);
    // one pass: the weights (kept), their largest magnitude, their sum and the zero sum
    __m512 mx[RB], ws[RB], zs[RB];
    for (int r = 0; r < RB; ++r) mx[r] = ws[r] = zs[r] = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
      const __mmask16 m = lanes_before(t, n);
      const __m512 a = _mm512_maskz_loadu_ps(m, ag + t), c = _mm512_maskz_loadu_ps(m, cg + t);
      for (int r = 0; r < RB; ++r) {
        const __m512 pv = _mm512_maskz_loadu_ps(m, p + r * p_stride + t);
        const __m512 w = _mm512_mul_ps(pv, a);
        _mm512_mask_storeu_ps(wf + r * n + t, m, w);
        mx[r] = _mm512_max_ps(mx[r], _mm512_abs_ps(w));
        ws[r] = _mm512_add_ps(ws[r], w);
        zs[r] = _mm512_fmadd_ps(pv, c, zs[r]);
      }
    }
    __m512 inv[RB];
    for (int r = 0; r < RB; ++r) {
      const float wmax = _mm512_reduce_max_ps(mx[r]);
      inv[r] = _mm512_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
      sw[r * NG + g] = wmax / 32767.f;
      cz[r * NG + g] = mid * _mm512_reduce_add_ps(ws[r]) + _mm512_reduce_add_ps(zs[r]);
    }
    __m512i qs[RB];
    for (int r = 0; r < RB; ++r) qs[r] = _mm512_setzero_si512();
    for (int t = 0; t < n; t += 16) {
      const __mmask16 m = lanes_before(t, n);
      for (int r = 0; r < RB; ++r) {
        const __m512i wi = _mm512_maskz_cvtps_epi32(m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wf + r * n + t), inv[r]));
        _mm256_mask_storeu_epi16(wq + (r * NG + g) * n2 + t, m, _mm512_cvtsepi32_epi16(wi));
        qs[r] = _mm512_add_epi32(qs[r], wi);
      }
    }
    for (int r = 0; r < RB; ++r) {
      if (n2 > n) wq[(r * NG + g) * n2 + n] = 0;
      qsum[r * NG + g] = _mm512_reduce_add_epi32(qs[r]);
    }
  }
}

// Tokens [tb, te) (tb even) of unit blocks [hb0, hb0 + NBP) of every field, RB rows: acc (field-major, vector
// k UB + hb) += sw sum_t wq_t code_t + cz.  HALVES: lanes 0-7 of block hb are in group grp[hb], lanes 8-15 in
// grp[hb] + 1.  Field k is masked in place, code 2^(k BITS) (no shift; undone by the final scale): int32 lanes then
// take up to 240 x 32767 per token, so a pass covers at most INT_VALUES_RUN tokens.
template <int DT, int BITS, int RB, int NBP, bool HALVES>
void int_values_pass(const char* row0, int64_t sr, int n, int tb, int te, int hb0, const int* grp, const int16_t* wq,
                     int n2, int NG, const float* sw, const int32_t* qsum, const float* cz, float* acc,
                     int64_t acc_stride) {
  using L = Layout<DT, BITS>;
  constexpr int per = L::per, UB = L::UB;
  constexpr __mmask16 HI = 0xFF00;
  // field k of both tokens in place: code 2^(k BITS) in each int16
  auto field_mask = [](int k) { return (((1 << BITS) - 1) << (k * BITS)) * 0x10001; };
  __m512i ai[RB][per][NBP];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < per; ++k)
      for (int j = 0; j < NBP; ++j) ai[r][k][j] = _mm512_setzero_si512();
  // a group's weights of tokens t, t + 1 as one int32: wq is stored token-contiguous, t even
  auto pair = [&](int r, int g, int t) __attribute__((always_inline)) {
    int32_t v;
    std::memcpy(&v, wq + (r * NG + g) * n2 + t, sizeof(v));
    return _mm512_set1_epi32(v);
  };
  const char* row = row0 + tb * sr;
  for (int t = tb; t < te; t += 2, row += 2 * sr) {
    const char* row1 = t + 1 < n ? row + sr : row;  // the pad token (weight 0) re-reads token t's codes
    __builtin_prefetch(row + PREFETCH_BYTES);
    __m512i w[RB][NBP];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NBP; ++j) {
        const int g = grp[hb0 + j];
        w[r][j] = HALVES ? _mm512_mask_blend_epi32(HI, pair(r, g, t), pair(r, g + 1, t)) : pair(r, g, t);
      }
    for (int j = 0; j < NBP; ++j) {
      const int off = VW * (hb0 + j);
      const __m512i x0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + off)));
      const __m512i x1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row1 + off)));
      const __m512i both = _mm512_or_si512(x0, _mm512_slli_epi32(x1, 16));  // token t low, t + 1 high half
      for (int k = 0; k < per; ++k) {
        const __m512i code = _mm512_and_si512(both, _mm512_set1_epi32(field_mask(k)));
        for (int r = 0; r < RB; ++r) ai[r][k][j] = _mm512_dpwssd_epi32(ai[r][k][j], code, w[r][j]);
      }
    }
  }
  // centred: sum_t wq_t (c_t - mid) = sum_t wq_t c_t - mid sum_t wq_t, exact in int32 (qsum: these tokens' sums)
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NBP; ++j) {
      const int g = grp[hb0 + j];
      __m512 s = _mm512_set1_ps(sw[r * NG + g]), z = _mm512_set1_ps(tb ? 0.f : cz[r * NG + g]);
      __m512i qs = _mm512_set1_epi32(qsum[r * NG + g]);
      if (HALVES) {
        s = _mm512_mask_blend_ps(HI, s, _mm512_set1_ps(sw[r * NG + g + 1]));
        z = _mm512_mask_blend_ps(HI, z, _mm512_set1_ps(tb ? 0.f : cz[r * NG + g + 1]));
        qs = _mm512_mask_blend_epi32(HI, qs, _mm512_set1_epi32(qsum[r * NG + g + 1]));
      }
      for (int k = 0; k < per; ++k) {
        float* dst = acc + r * acc_stride + VW * (k * UB + hb0 + j);
        const __m512i centred = _mm512_sub_epi32(ai[r][k][j], _mm512_slli_epi32(qs, BITS - 1 + k * BITS));
        const __m512 sk = _mm512_mul_ps(s, _mm512_set1_ps(1.f / static_cast<float>(1 << (k * BITS))));
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), sk, z),
                                            _mm512_loadu_ps(dst)));
      }
    }
}

template <int DT, int BITS, int RB>
void int_values_block(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                      float* acc, int64_t acc_stride, TokenParams tp, int16_t* wq) {
  using L = Layout<DT, BITS>;
  constexpr int per = L::per, UB = L::UB;
  const int G = sd.f.group, NG = DT / G, span = G / per;  // span: packing units (lanes) per group
  const bool halves = span == VW / 2;
  const int n2 = n + (n & 1);
  float sw[RB * INT_VALUES_MAX_GROUPS], cz[RB * INT_VALUES_MAX_GROUPS];
  int32_t qsum[RB * INT_VALUES_MAX_GROUPS];
  int_value_weights<RB>(p, p_stride, tp.A, tp.C, NG, n, 1 << (BITS - 1), tp.W, tp.W + n, tp.W + 2 * n, wq, n2,
                        sw, qsum, cz);
  int grp[UB];
  for (int hb = 0; hb < UB; ++hb) grp[hb] = hb * VW / span;  // (halves: the block's first group)
  const char* row0 = sd.x.row(b, h, t0);
  // blocks per pass: RB x per x NBP int32 accumulators and RB x NBP weight vectors in AVX-512's 32 registers
  constexpr int NBP = std::max(1, std::min(UB, 16 / (RB * per)));
  for (int tb = 0; tb < n; tb += INT_VALUES_RUN) {
    const int te = std::min(n, tb + INT_VALUES_RUN);
    for (int i = 0; i < (n > INT_VALUES_RUN ? RB * NG : 0); ++i) {  // an item of several runs: each run's sums
      __m512i qs = _mm512_setzero_si512();
      for (int t = tb; t < te; t += 16) {
        const __mmask16 m = lanes_before(t, te);
        qs = _mm512_add_epi32(qs, _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, wq + i * n2 + t)));
      }
      qsum[i] = _mm512_reduce_add_epi32(qs);
    }
    for (int hb0 = 0; hb0 < UB; hb0 += NBP) {
      if (halves)
        int_values_pass<DT, BITS, RB, NBP, true>(row0, sd.x.sr, n, tb, te, hb0, grp, wq, n2, NG, sw, qsum, cz, acc,
                                                 acc_stride);
      else
        int_values_pass<DT, BITS, RB, NBP, false>(row0, sd.x.sr, n, tb, te, hb0, grp, wq, n2, NG, sw, qsum, cz, acc,
                                                  acc_stride);
    }
  }
}

// Whether the integer path serves a value side (the layouts above); the Python mirror is
// kernels/cpu.py integer_value_format.
template <int DT>
int int_values_bits(const Side& sd) {
  const int bits = fast_bits<DT>(sd, false);
  if ((bits != 2 && bits != 4) || sd.f.kind != INT_TOKEN) return 0;
  const int span = sd.f.group / (8 / bits);  // packing units per group
  return span % VW == 0 || span == VW / 2 ? bits : 0;
}

template <int DT>
bool try_int_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                    int64_t R, float* acc, int64_t acc_stride, TokenParams tp, int16_t* wq) {
  const int bits = int_values_bits<DT>(sd);
  if (!bits) return false;
  const int NG = DT / sd.f.group;
  token_params(sd, b, h, t0, n, NG, tp.A, tp.C);
  // an inf / NaN scale or zero point: the float path, whose products give the reference's non-finite result
  // (0 x (a + c) is NaN only where one of them is not finite)
  __m512 bad = _mm512_setzero_ps();
  for (int i = 0; i < n * NG; i += 16) {
    const __mmask16 m = lanes_before(i, n * NG);
    bad = _mm512_add_ps(bad, _mm512_mul_ps(_mm512_setzero_ps(), _mm512_add_ps(_mm512_maskz_loadu_ps(m, tp.A + i),
                                                                             _mm512_maskz_loadu_ps(m, tp.C + i))));
  }
  if (!std::isfinite(_mm512_reduce_add_ps(bad))) return false;
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rb = std::min<int64_t>(4, R - r0);
    with_rows(static_cast<int>(rb), [&](auto rows) {
      constexpr int RB = decltype(rows)::value;
      const float* pr = p + r0 * p_stride;
      float* ar = acc + r0 * acc_stride;
      if (bits == 2) int_values_block<DT, 2, RB>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, tp, wq);
      else int_values_block<DT, 4, RB>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, tp, wq);
    });
  }
  return true;
}

}  // namespace
#endif
