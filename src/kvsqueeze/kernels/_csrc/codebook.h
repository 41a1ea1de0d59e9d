// Rotated codebook rows (docs/rotated.md) and the generic dequantization of any side into a float tile.
#pragma once

namespace {

inline const float* table_row(const Side& sd, int r) { return reinterpret_cast<const float*>(sd.zero.row(0, 0, r)); }

// A rotated format's lane layout (Row: CbRow, CbKeyPairRow or CbPairRow, built by Row::init), kept per thread for the
// last four formats by their widths and split (building one cost as much as a dozen tokens per work item); null where
// init refuses the format
template <class Row>
const Row* format_lanes(const Fmt& f) {
  struct Slot {
    int bh = -1, nh = -1, bl = -1;
    bool ok = false;
    Row row;
  };
  static thread_local Slot slots[4];
  static thread_local int next = 0;
  for (Slot& sl : slots)
    if (sl.bh == f.bits && sl.nh == cb_n_hi(f) && sl.bl == cb_bits_lo(f)) return sl.ok ? &sl.row : nullptr;
  Slot& sl = slots[next];
  next = (next + 1) % 4;
  sl.bh = f.bits;
  sl.nh = cb_n_hi(f);
  sl.bl = cb_bits_lo(f);
  sl.row = Row();
  sl.ok = sl.row.init(f);
  return sl.ok ? &sl.row : nullptr;
}

// Rotated codebook rows [t0, t0+n): (mean +) scale * cb[code] in the rotated space, field-major order (chan:
// the rotated coordinate at each position), into out[n][D].
inline void codebook_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int D, float* out,
                          const int* chan) {
  const Fmt& f = sd.f;
  const int nh = cb_n_hi(f), nl = D - nh, bl = cb_bits_lo(f), G = cb_group(f);
  const float* lut_hi = table_row(sd, D);
  const float* lut_lo = table_row(sd, D + 1);
  const int hi_bytes = nh * f.bits / 8;
  float mean[512];
  int64_t cur = -1, next = -1;
  const char* grow = nullptr;
  for (int t = 0; t < n; ++t) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(sd.x.row(b, h, t0 + t));
    float* o = out + t * D;
    if (nh) unpack_run(f.bits, src, o, nh, lut_hi, sd.x.end);
    if (nl) unpack_run(bl, src + hi_bytes, o + nh, nl, lut_lo, sd.x.end);
    if (G) {  // centred: the group's row holds its mean, then one scale per token
      const int64_t tok = t0 + t;
      if (tok >= next) {  // a new group (no division per token)
        cur = tok / G;
        next = (cur + 1) * G;
        grow = sd.scale.row(b, h, cur);
        for (int j = 0; j < D; ++j) mean[j] = ld(sd.scale.dt, grow, chan[j]);
      }
      const float scale = ld(sd.scale.dt, grow, D + (tok - cur * G));
#pragma omp simd
      for (int j = 0; j < D; ++j) o[j] = o[j] * scale + mean[j];
      continue;
    }
    const float norm = ld(sd.scale.dt, sd.scale.row(b, h, t0 + t), 0);
#pragma omp simd
    for (int j = 0; j < D; ++j) o[j] *= norm;
  }
}

// Dequantized rows [t0, t0+n) of one side into out[n][D] in field-major order, or a direct pointer for fp32
// data.  Returns the pointer to use and sets row_stride (in floats).  tmp holds 4*D floats.
template <int DT>
const float* decode_rows(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int Drt, float* out,
                         int64_t& row_stride, float* tmp, const Perm& pm) {
  const int D = DT ? DT : Drt;
  const Fmt& f = sd.f;
  row_stride = D;
  if (f.kind == FP) {
    if (sd.x.dt == at::kFloat) {
      row_stride = sd.x.sr / 4;
      return reinterpret_cast<const float*>(sd.x.row(b, h, t0));
    }
    for (int t = 0; t < n; ++t) {
      const char* r = sd.x.row(b, h, t0 + t);
      for (int j = 0; j < D; ++j) out[t * D + j] = ld(sd.x.dt, r, j);
    }
    return out;
  }
  if (f.kind == CODEBOOK) {
    codebook_rows(sd, b, h, t0, n, D, out, pm.chan.data());
    return out;
  }
  if (f.kind == FP8) {
    const float* lut = f.fp8 ? LUT_E5M2 : LUT_E4M3;
    for (int t = 0; t < n; ++t) {
      const uint8_t* c = reinterpret_cast<const uint8_t*>(sd.x.row(b, h, t0 + t));
      const float s = f.fixed ? ld(sd.scale.dt, sd.scale.row(b, h, 0), 0) : ld(sd.scale.dt, sd.scale.row(b, h, t0 + t), 0);
      for (int j = 0; j < D; ++j) out[t * D + j] = lut[c[j]] * s;
    }
    return out;
  }
  unpack_rows<DT>(f.bits, sd.x, b, h, t0, n, out, D);
  const int G = f.group;
  float* a = tmp;
  float* c = tmp + D;
  if (f.kind == INT_TOKEN) {
    const int NG = D / G, per = codes_per_unit(f), U = D / per;
    float* ag = tmp + 2 * D;
    float* cg = tmp + 3 * D;
    const int* gi = pm.group.data();
    const int run = G % per == 0 ? G / per : 0;  // positions k*U + [g*run, (g+1)*run) share group g
    for (int t = 0; t < n; ++t) {
      affine_row(sd, sd.scale.row(b, h, t0 + t), f.sym ? nullptr : sd.zero.row(b, h, t0 + t), NG, ag, cg);
      float* o = out + t * D;
      switch (run) {
        case 4: dequant_runs<4>(o, ag, cg, per, NG, U); break;
        case 8: dequant_runs<8>(o, ag, cg, per, NG, U); break;
        case 16: dequant_runs<16>(o, ag, cg, per, NG, U); break;
        case 32: dequant_runs<32>(o, ag, cg, per, NG, U); break;
        case 64: dequant_runs<64>(o, ag, cg, per, NG, U); break;
        case 128: dequant_runs<128>(o, ag, cg, per, NG, U); break;
        default:
          for (int i = 0; i < D; ++i) o[i] = o[i] * ag[gi[i]] + cg[gi[i]];
      }
    }
  } else {  // INT_CHANNEL: one (scale, zero) row per G tokens, gathered into field-major order
    int64_t cur = -1;
    for (int t = 0; t < n; ++t) {
      const int64_t grow = (t0 + t) / G;
      if (grow != cur) {
        cur = grow;
        channel_params(sd, b, h, grow, pm.chan.data(), D, a, c);
      }
      float* o = out + t * D;
#pragma omp simd
      for (int j = 0; j < D; ++j) o[j] = o[j] * a[j] + c[j];
    }
  }
  return out;
}

}  // namespace
