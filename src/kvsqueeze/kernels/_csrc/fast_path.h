// The SIMD fast path of the decode kernel over the layouts the presets use.
#pragma once

namespace {

struct Item {
  int64_t seg, t0;
  int n;
  int nseg = 1;  // segments seg.. seg + nseg - 1 (nseg > 1: whole short segments, t0 = 0, n their tokens)
};

// ------------------------------------------------------------------------------------------------ SIMD fast path
// GCC vector extensions of the machine's native width (VW lanes: 16 with AVX-512, else 8: one AVX2 ymm; 16-lane
// types on AVX2 were split into xmm pieces spilled through the stack and made the decode step 3-4x slower) for
// head_dim 64/128/256 (the compiled ones, decode.h) and the layouts the presets use: fp32, and 2/4/8-bit integer
// codes whose packing units fill whole vectors.  Codes are unpacked in registers and consumed at once; nothing is
// written back to memory per token.
#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(4 * VW), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * VW), aligned(4)));

// Unaligned loads and stores as single instructions: GCC's generic tuning inlines a 32-byte memcpy as two 16-byte
// moves through the stack, and the AVX2 build's fp32 decode stalled on store forwarding at every row (4x slower).
inline vf loadf(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_loadu_ps(p));
#elif defined(__AVX__)
  return reinterpret_cast<vf>(_mm256_loadu_ps(p));
#else
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}
inline void storef(float* p, const vf& v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  _mm256_storeu_ps(p, reinterpret_cast<__m256>(v));
#else
  std::memcpy(p, &v, sizeof(v));
#endif
}

// The first n <= VW lanes of v to p: a whole vector is one store, where a variable-length copy compiles to a call
// to memcpy (or rep movsq: a sixth of the integer scores' step once)
inline void store_first(float* p, const vf& v, int n) {
  if (n == VW) {
    storef(p, v);
    return;
  }
  float part[VW];
  storef(part, v);
  std::memcpy(p, part, sizeof(float) * n);
}

#if defined(__AVX512F__)
// The lanes of a 16-float step at i that lie before end (every lane but in the last step)
inline __mmask16 lanes_before(int i, int end) {
  return i + 16 <= end ? 0xFFFF : static_cast<__mmask16>((1u << (end - i)) - 1);
}
#endif

// f(std::integral_constant<int, RB>) for a group of rb <= 4 query rows: the loops are compiled per row count
template <class F>
inline void with_rows(int rb, F&& f) {
  switch (rb) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// x in every lane: one vbroadcastss (vf{} + x compiled to a scalar add of +0 first, kept for signed zeros)
inline vf splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return reinterpret_cast<vf>(_mm256_set1_ps(x));
#else
  vf v;
  for (int l = 0; l < VW; ++l) v[l] = x;
  return v;
#endif
}

// Lane t of the result = the sum of the VW lanes of x[t]: log2(VW) levels of two-input lane permutations and adds
// (VW - 1 vectors' worth), instead of one horizontal sum per token, which dominated the score loop.  After level j
// each vector holds VW >> j partial sums of 2^j inputs side by side.
// V: float lanes, or the integer lanes of exact dot products (vi).
template <class V>
inline V pair_sums(const V& a, const V& b, const vi& lo, int shift) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, lo + shift);
}

// Level LEVEL's two-input lane pattern, a compile-time constant: on AVX2 a run-time pattern turned each level
// into an emulated two-source permutation (AVX-512 has one instruction for it, AVX2 none).
template <int LEVEL>
constexpr vi level_pattern() {
#if defined(__AVX512F__)
  constexpr int P[4][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                            {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                            {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                            {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  return vi{P[LEVEL][0], P[LEVEL][1], P[LEVEL][2], P[LEVEL][3], P[LEVEL][4], P[LEVEL][5], P[LEVEL][6], P[LEVEL][7],
            P[LEVEL][8], P[LEVEL][9], P[LEVEL][10], P[LEVEL][11], P[LEVEL][12], P[LEVEL][13], P[LEVEL][14],
            P[LEVEL][15]};
#else  // (AVX2 reduces START 0 and 1 in reduce_tokens' own order, lane-crossing last)
  constexpr int P[3][8] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
  return vi{P[LEVEL][0], P[LEVEL][1], P[LEVEL][2], P[LEVEL][3], P[LEVEL][4], P[LEVEL][5], P[LEVEL][6], P[LEVEL][7]};
#endif
}

constexpr int LOG2_VW = VW == 16 ? 4 : 3;

// Lane t of the result = the sum of token t's lanes, from level START on (x: VW >> START vectors, overwritten).
// START > 0 serves integer dot products whose vectors hold 2^START tokens side by side (lanes [i VW / 2^START,
// (i + 1) VW / 2^START) of vector v belong to token v 2^START + i), i.e. the layout level START leaves.
// AVX2 (VW 8), START 0 and 1: in-lane unpacks take the first levels and one lane-crossing step the last, where the
// two-input level patterns above compiled to lane-crossing permutations at every level (vpermd, vperm2i128; on Zen 3
// a vpermd issues at a third of an unpack's rate): 8% of a kivi-4 layer's step at 8k.
template <int START, class V>
__attribute__((always_inline)) inline V reduce_tokens(V* x) {
  constexpr vi LO32{0, 8, 1, 9, 4, 12, 5, 13}, HI32{2, 10, 3, 11, 6, 14, 7, 15};  // vunpck{l,h}ps
  constexpr vi LO64{0, 1, 8, 9, 4, 5, 12, 13}, HI64{2, 3, 10, 11, 6, 7, 14, 15};  // vunpck{l,h}pd
  if constexpr (VW == 8 && START == 0) {
    // t_i: tokens 2i, 2i+1 as [2i: lanes 0+2, 2i+1: 0+2, 2i: 1+3, 2i+1: 1+3 | the same of lanes 4-7]
    V t[4];
    for (int i = 0; i < 4; ++i)
      t[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], LO32) + __builtin_shuffle(x[2 * i], x[2 * i + 1], HI32);
    // u_j: tokens 4j..4j+3, their lanes 0-3 summed in the low half, 4-7 in the high half
    const V u0 = __builtin_shuffle(t[0], t[1], LO64) + __builtin_shuffle(t[0], t[1], HI64);
    const V u1 = __builtin_shuffle(t[2], t[3], LO64) + __builtin_shuffle(t[2], t[3], HI64);
    return __builtin_shuffle(u0, u1, vi{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(u0, u1, vi{4, 5, 6, 7, 12, 13, 14, 15});
  } else if constexpr (VW == 8 && START == 1) {  // x[i]: token 2i in the low half, 2i+1 in the high half
    const V t0 = __builtin_shuffle(x[0], x[1], LO32) + __builtin_shuffle(x[0], x[1], HI32);
    const V t1 = __builtin_shuffle(x[2], x[3], LO32) + __builtin_shuffle(x[2], x[3], HI32);
    const V u = __builtin_shuffle(t0, t1, LO64) + __builtin_shuffle(t0, t1, HI64);  // tokens 0 2 4 6 | 1 3 5 7
    return __builtin_shuffle(u, vi{0, 4, 1, 5, 2, 6, 3, 7});
  } else if constexpr (START >= LOG2_VW) {
    return x[0];
  } else {
    constexpr vi lo = level_pattern<START>();
    constexpr int n = VW >> START;
    for (int i = 0; i < n / 2; ++i) x[i] = pair_sums(x[2 * i], x[2 * i + 1], lo, VW >> (START + 1));
    return reduce_tokens<START + 1, V>(x);
  }
}

// reduce_tokens<START> over the VW >> START vectors leaf(0), leaf(1), ... (each an array of RB rows' vectors, float or
// integer lanes), taking the levels as the leaves come, depth first: at most log2 of them per row are live, so the
// partial sums stay in registers where a buffer of all of them went through memory.  The same sums in the same order
// as reduce_tokens (AVX2, whose first levels take other patterns there, gathers the leaves and calls it).
template <int START, int COUNT, class Leaf>
__attribute__((always_inline)) inline auto token_tree(Leaf& leaf, int first) {
  if constexpr (COUNT == 1) {
    return leaf(first);
  } else {
    constexpr int LEVEL = START + __builtin_ctz(COUNT) - 1;  // the level that joins two halves of COUNT leaves
    const auto a = token_tree<START, COUNT / 2>(leaf, first);
    const auto b = token_tree<START, COUNT / 2>(leaf, first + COUNT / 2);
    auto out = a;
    for (size_t r = 0; r < out.size(); ++r) out[r] = pair_sums(a[r], b[r], level_pattern<LEVEL>(), VW >> (LEVEL + 1));
    return out;
  }
}

template <int START, class Leaf>
__attribute__((always_inline)) inline auto reduce_leaves(Leaf&& leaf) {
  constexpr int NV = VW >> START;
  if constexpr (VW == 16 && NV > 1) {
    return token_tree<START, NV>(leaf, 0);
  } else {
    using Rows = decltype(leaf(0));
    constexpr int RB = std::tuple_size_v<Rows>;
    typename Rows::value_type buf[RB][NV];
    for (int v = 0; v < NV; ++v) {
      const Rows x = leaf(v);
      for (int r = 0; r < RB; ++r) buf[r][v] = x[r];
    }
    Rows out;
    for (int r = 0; r < RB; ++r) out[r] = reduce_tokens<START>(buf[r]);
    return out;
  }
}

// The sum of one vector's lanes as a tree (log2(VW) dependent adds, not VW)
inline float sum_lanes(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 x = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float t = 0.f;
  for (int l = 0; l < VW; ++l) t += v[l];
  return t;
#endif
}

inline vf reduce_lanes(const vf* x) {
  vf y[VW];
  std::memcpy(y, x, sizeof(y));
  return reduce_tokens<0>(y);
}

// The end of a block of VW tokens (or of an item) whose scores are parked per row in buf[r][0 .. blk], each vector
// holding 2^LTU tokens side by side: the unfilled vectors are zeroed, each row reduced to a lane per token, times
// the tokens' scales (scale: from the block's first token, VW floats readable) and, where given, a factor per row,
// and the first cnt stored from s + r * s_stride + first (the float codebook score loop).
template <int LTU, int RB, int NB>
__attribute__((always_inline)) inline void store_block_scores(vf (&buf)[RB][NB], int blk, int first, int cnt,
                                                              const float* scale, const float* row_factor, float* s,
                                                              int64_t s_stride) {
  const vf sv = loadf(scale + first);
  for (int r = 0; r < RB; ++r) {
    for (int j = blk + 1; j < NB; ++j) buf[r][j] = vf{};
    store_first(s + r * s_stride + first, reduce_tokens<LTU>(buf[r]) * (row_factor ? sv * splat(row_factor[r]) : sv),
                cnt);
  }
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

// The k-th code of each widened byte left in place, as float: code * 2^(k BITS), one mask and no shift; sums of
// them times in_place_scale(k) (a power of two) are exactly the sums of the codes themselves.
template <int BITS>
inline vf field_in_place(const vi& bytes, int k) {
  if constexpr (BITS >= 8) return __builtin_convertvector(bytes, vf);
  else return __builtin_convertvector(bytes & (((1 << BITS) - 1) << (k * BITS)), vf);
}
template <int BITS>
inline float in_place_scale(int k) {
  if constexpr (BITS >= 8) return 1.f;
  else return 1.f / static_cast<float>(1 << (k * BITS));
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
      av[hb] = splat(ag[bg.g[hb]]);
      cv[hb] = splat(cg[bg.g[hb]]);
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
        store_first(s + r * s_stride + (t - l), reduce_lanes(buf[r]), l + 1);
      }
    }
  }
}

// acc (field-major) += sum_t p[r][t] * value_t for RB rows.  UNIFORM: every lane of a unit block lies in one
// parameter group (G / per >= VW), known at compile time so the token loop holds nothing else: with both loops in
// one body GCC kept one of the 12 accumulators (RB = 3, head_dim 64) on the stack, a store-to-load round trip per
// token on the loop's critical path.
template <int DT, int BITS, int RB, bool UNIFORM>
void fast_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                 float* acc, int64_t acc_stride, const int* gsel, const float* A, const float* C) {
  using L = Layout<DT, BITS>;
  vf a[RB][L::NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < L::NV; ++i) a[r][i] = loadf(acc + r * acc_stride + VW * i);
  const int NG = BITS == 32 ? 0 : DT / sd.f.group;
  const BlockGroups<DT, BITS> bg(BITS == 32 ? 0 : sd.f.group);
  // Codes of up to VW levels go through a lane permutation (vpermps ignores the index bits above log2(VW), so the
  // other fields of a byte need no mask): code -> float with no and/convert.  When every lane of a unit block is in
  // one group the permuted table is the dequantized levels a j + c themselves, built once per block and token,
  // which also saves the multiply-add per field.
  constexpr bool LUT = BITS < 8 && (1 << BITS) <= VW;
  vf iota;
  for (int l = 0; l < VW; ++l) iota[l] = static_cast<float>(l & ((1 << (BITS < 8 ? BITS : 1)) - 1));
  for (int t = 0; t < n; ++t) {
    float pr[RB];  // masked tokens have p = 0 exactly and add nothing: no test per token
    for (int r = 0; r < RB; ++r) pr[r] = p[r * p_stride + t];
    const char* row = sd.x.row(b, h, t0 + t);
    if constexpr (BITS != 32) __builtin_prefetch(row + PREFETCH_BYTES);
    if constexpr (BITS == 32) {
      const float* x = reinterpret_cast<const float*>(row);
      for (int i = 0; i < L::NV; ++i) {
        const vf v = loadf(x + VW * i);
        for (int r = 0; r < RB; ++r) a[r][i] += pr[r] * v;
      }
    } else if constexpr (LUT && UNIFORM) {  // the block's levels a j + c, permuted by the codes
      const uint8_t* x = reinterpret_cast<const uint8_t*>(row);
      for (int hb = 0; hb < L::UB; ++hb) {
        const vi bytes = widen(x + VW * hb);
        const vf levels = iota * splat(A[t * NG + bg.g[hb]]) + splat(C[t * NG + bg.g[hb]]);
        for (int k = 0; k < L::per; ++k) {
          const vf val = __builtin_shuffle(levels, k ? bytes >> (k * BITS) : bytes);
          for (int r = 0; r < RB; ++r) a[r][k * L::UB + hb] += pr[r] * val;
        }
      }
    } else {  // INT_TOKEN values
      vf av[L::UB], cv[L::UB];
      token_affine<DT, BITS>(sd.f.group, A + t * NG, C + t * NG, gsel, bg, av, cv);
      const uint8_t* x = reinterpret_cast<const uint8_t*>(row);
      for (int hb = 0; hb < L::UB; ++hb) {
        const vi bytes = widen(x + VW * hb);
        for (int k = 0; k < L::per; ++k) {
          vf val;
          if constexpr (LUT) val = __builtin_shuffle(iota, k ? bytes >> (k * BITS) : bytes) * av[hb] + cv[hb];
          else val = field<BITS>(bytes, k) * av[hb] + cv[hb];
          for (int r = 0; r < RB; ++r) a[r][k * L::UB + hb] += pr[r] * val;
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < L::NV; ++i) storef(acc + r * acc_stride + VW * i, a[r][i]);
}

// Whether RB rows of DT-wide accumulators overflow the vector registers (16 on AVX2, 32 on AVX-512, with room left
// for the codes, their conversion and the broadcast weights): at head_dim 64 and 3 query rows, AVX2 holds 24
// accumulators in 16 registers, and fast_values spent more of its time moving them to and from the stack than on
// its multiply-adds (perf: 35 cycles per token and KV head, half of them spill moves).
template <int DT, int BITS, int RB>
constexpr bool values_spill() {
  return RB * Layout<DT, BITS>::NV > (VW == 16 ? 24 : 8);
}

// fast_values for accumulators that do not fit the registers, and for 8-bit codes on AVX-512, with every unit block in
// one per-token group (G a multiple of VW units): one pass over the item's tokens per unit block and KC of its
// fields, RB x KC accumulators (8-bit codes, one field: NB blocks of a group per pass, RB x NB <= 8 accumulators
// on AVX2, 16 on AVX-512, so each row's weight is broadcast once per NB blocks; the int8 preset's step at 8k 24%
// faster on Zen 3).  8-bit codes on AVX-512 fit fast_values' registers, but its per-code affine (a code c ->
// a c + z, then one multiply-add per row) costs a fourth multiply-add per code at 3 rows, where w_rt folds the
// scale: the int8 preset's layer at 32k, 1 thread, 12-13% faster on Zen 4 (the step bound by multiply-adds).
// A token's scale is folded into its probability, w_rt = p_rt a_tg, so a code costs one multiply-add per row, and
// its zero term is one sum per row and group: acc += sum_t w_rt code_t + sum_t p_rt c_tg (the same arithmetic as the
// reference up to float rounding; the codes are re-read from L1 per pass, 8-32 bytes per token).
// ag[t] = A[t ng + g], cg[t] = C[t ng + g]: one group's per-token parameters as contiguous runs, with the common
// group counts as compile-time strides NG (vectorised with lane permutations; NG = 0: the run-time stride ng, loaded
// lane by lane).
template <int NG>
inline void group_runs_of(const float* __restrict A, const float* __restrict C, int ng, int g, int n,
                          float* __restrict ag, float* __restrict cg) {
  const int stride = NG ? NG : ng;
#pragma omp simd
  for (int t = 0; t < n; ++t) {
    ag[t] = A[t * stride + g];
    cg[t] = C[t * stride + g];
  }
}

inline void group_runs(const float* A, const float* C, int ng, int g, int n, float* ag, float* cg) {
  switch (ng) {
    case 1: return group_runs_of<1>(A, C, ng, g, n, ag, cg);
    case 2: return group_runs_of<2>(A, C, ng, g, n, ag, cg);
    case 4: return group_runs_of<4>(A, C, ng, g, n, ag, cg);
    default: return group_runs_of<0>(A, C, ng, g, n, ag, cg);
  }
}

// z[r] = sum_t p_rt cg_t for RB rows, the rows' vector chains side by side (one row's sum at a time was a dependent
// multiply-add per VW tokens: latency-bound, ~3 cycles a token)
template <int RB>
inline void group_sums(const float* p, int64_t p_stride, const float* cg, int n, float* z) {
  vf zs[RB];
  for (int r = 0; r < RB; ++r) zs[r] = vf{};
  int t = 0;
  for (; t + VW <= n; t += VW) {
    const vf c = loadf(cg + t);
    for (int r = 0; r < RB; ++r) zs[r] += loadf(p + r * p_stride + t) * c;
  }
  for (int r = 0; r < RB; ++r) {
    float zr = sum_lanes(zs[r]);
    for (int u = t; u < n; ++u) zr += p[r * p_stride + u] * cg[u];
    z[r] = zr;
  }
}

// One pass of blocked_values over n tokens: fields [0, per) in runs of KC, of NB consecutive unit blocks from row
// (the first token's row, stride sr), RB x KC x NB accumulators; acc: the first block's field 0 (field k of block j
// at acc + VW (k UB + j)), w: RB rows of n weights, cz: the rows' zero sums.
template <int BITS, int RB, int KC, int NB>
__attribute__((always_inline)) inline void blocked_pass(const char* row0, int64_t sr, int n, const float* w,
                                                        const float* cz, float* acc, int64_t acc_stride, int UB) {
  constexpr int per = BITS >= 8 ? 1 : 8 / BITS;
  for (int k0 = 0; k0 < per; k0 += KC) {
    vf a[RB][KC][NB];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < KC; ++k)
        for (int j = 0; j < NB; ++j) a[r][k][j] = vf{};
    const char* row = row0;
    for (int t = 0; t < n; ++t, row += sr) {
      vf code[KC][NB];  // fields in place (2-bit values: kivi-2-sink4's layer step 4% faster than shifting them)
      for (int j = 0; j < NB; ++j) {
        const vi bytes = widen(reinterpret_cast<const uint8_t*>(row) + VW * j);
        for (int k = 0; k < KC; ++k) code[k][j] = field_in_place<BITS>(bytes, k0 + k);
      }
      for (int r = 0; r < RB; ++r) {
        const vf wr = splat(w[r * n + t]);
        for (int k = 0; k < KC; ++k)
          for (int j = 0; j < NB; ++j) a[r][k][j] += wr * code[k][j];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < KC; ++k)
        for (int j = 0; j < NB; ++j) {
          float* dst = acc + r * acc_stride + VW * ((k0 + k) * UB + j);
          storef(dst, loadf(dst) + a[r][k][j] * in_place_scale<BITS>(k0 + k) + cz[r]);
        }
  }
}

template <int DT, int BITS, int RB>
void blocked_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                    float* acc, int64_t acc_stride, const float* A, const float* C, float* wt) {
  using L = Layout<DT, BITS>;
  constexpr int KC = std::min(L::per, std::max(1, 8 / RB));
  constexpr int NB = L::per == 1 ? std::min(L::UB, std::max(1, (VW == 16 ? 16 : 8) / RB)) : 1;
  const int NG = DT / sd.f.group;
  const BlockGroups<DT, BITS> bg(sd.f.group);
  const char* row0 = sd.x.row(b, h, t0);
  const int64_t sr = sd.x.sr;
  float cz[RB];
  int gcur = -1;
  for (int hb = 0; hb < L::UB; ++hb) {
    if (bg.g[hb] != gcur) {  // this group's weights w[r][t] and zero sums
      gcur = bg.g[hb];
      // the group's (a, c) gathered once into contiguous runs: the rows' loops below read them as vectors (strided
      // per row, the lane-by-lane gathers were a quarter of this function at 3 rows)
      float* ag = wt + RB * n;
      float* cg = ag + n;
      group_runs(A, C, NG, gcur, n, ag, cg);
      group_sums<RB>(p, p_stride, cg, n, cz);
      for (int r = 0; r < RB; ++r) {
        const float* pr = p + r * p_stride;
        float* w = wt + r * n;
#pragma omp simd
        for (int t = 0; t < n; ++t) w[t] = pr[t] * ag[t];
      }
    }
    // 8-bit codes (one field): NB unit blocks of one group per pass share the rows' weight broadcasts
    if (NB > 1 && hb + NB <= L::UB && bg.g[hb + NB - 1] == gcur) {
      blocked_pass<BITS, RB, KC, NB>(row0 + VW * hb, sr, n, wt, cz, acc + VW * hb, acc_stride, L::UB);
      hb += NB - 1;
    } else {
      blocked_pass<BITS, RB, KC, 1>(row0 + VW * hb, sr, n, wt, cz, acc + VW * hb, acc_stride, L::UB);
    }
  }
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
  float* W;  // blocked_values' weights (4 rows) and one group's (a, c): 6 x the item's tokens
};

template <int DT, int BITS, int KIND>
void scores_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* q, int64_t R, float* s,
                 int64_t s_stride, const int* gsel, TokenParams tp) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rb = std::min<int64_t>(4, R - r0);
    const float* qr = q + r0 * DT;
    float* sr = s + r0 * s_stride;
    with_rows(static_cast<int>(rb), [&](auto rows) {
      fast_scores<DT, BITS, KIND, decltype(rows)::value>(sd, b, h, t0, n, qr, sr, s_stride, gsel, tp.A, tp.C);
    });
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

template <int DT, int BITS, int RB, bool UNIFORM>
void values_block(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                  float* acc, int64_t acc_stride, const int* gsel, TokenParams tp) {
  if constexpr (BITS != 32 && (values_spill<DT, BITS, RB>() || (VW == 16 && BITS == 8))) {
    if (sd.f.group % (VW * Layout<DT, BITS>::per) == 0)
      return blocked_values<DT, BITS, RB>(sd, b, h, t0, n, p, p_stride, acc, acc_stride, tp.A, tp.C, tp.W);
  }
  fast_values<DT, BITS, RB, UNIFORM>(sd, b, h, t0, n, p, p_stride, acc, acc_stride, gsel, tp.A, tp.C);
}

template <int DT, int BITS, bool UNIFORM>
void values_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                 int64_t R, float* acc, int64_t acc_stride, const int* gsel, TokenParams tp) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rb = std::min<int64_t>(4, R - r0);
    const float* pr = p + r0 * p_stride;
    float* ar = acc + r0 * acc_stride;
    with_rows(static_cast<int>(rb), [&](auto rows) {
      values_block<DT, BITS, decltype(rows)::value, UNIFORM>(sd, b, h, t0, n, pr, p_stride, ar, acc_stride, gsel, tp);
    });
  }
}

// 2/4-bit codes: the uniform-groups variant where the side's groups allow it
template <int DT, int BITS>
void values_rows_lut(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                     int64_t R, float* acc, int64_t acc_stride, const int* gsel, TokenParams tp) {
  if (sd.f.group / Layout<DT, BITS>::per >= VW)
    values_rows<DT, BITS, true>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp);
  else
    values_rows<DT, BITS, false>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp);
}

template <int DT>
bool try_fast_values(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, const float* p, int64_t p_stride,
                     int64_t R, float* acc, int64_t acc_stride, const int* gsel, TokenParams tp) {
  const int bits = fast_bits<DT>(sd, false);
  if (bits && bits != 32) token_params(sd, b, h, t0, n, DT / sd.f.group, tp.A, tp.C);
  switch (bits) {
    case 32: values_rows<DT, 32, false>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    case 2: values_rows_lut<DT, 2>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    case 4: values_rows_lut<DT, 4>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    case 8: values_rows<DT, 8, false>(sd, b, h, t0, n, p, p_stride, R, acc, acc_stride, gsel, tp); return true;
    default: return false;
  }
}

// An attention mask [B|1, 1, Lq, kv_len] as both entry points read it: boolean (hide where false) or float (a bias

}  // namespace
