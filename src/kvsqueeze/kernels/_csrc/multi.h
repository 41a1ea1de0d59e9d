// The multi-query entry point (prefill): query tiles over dequantized key/value tiles with BLAS GEMMs.
#pragma once

// ------------------------------------------------------------------------------------- multi-query steps (prefill)
// attend_multi serves steps with many new tokens (a prompt fed in chunks on top of a packed history).  The decode
// path above scores every query row against codes unpacked token by token: its cost grows with queries x tokens
// x head_dim in scalar-ish code, while a prefill step has enough query rows to amortise a dequantized tile.  Work
// items are (batch, kv head, tile of QT queries); an item's rows are its GQA group's heads x its queries, and it
// walks the segments in token order in tiles of KT tokens: each tile is dequantized once into a small float32
// scratch (decode_rows, so every format the decode path reads works here too), scored with one GEMM (Q K^T),
// folded into an exact online softmax (running max, sum, weighted values per row) and accumulated with a second
// GEMM (P V) through ATen (BLAS).  Dequantizing once per tile costs head_dim work per token against rows x
// head_dim for the GEMMs, so with 64 queries x the group's heads per item the GEMMs dominate (perf, 1024 queries
// over 3072 kivi-2 tokens, SmolLM2 heads, 1 thread: ~75% of the kernel's time in sgemm), and the kernel runs at
// about the speed of torch's SDPA over the same tokens held exact (0.9-1.0x in one process; the block-by-block
// reference: 2x).  Tiles whose keys are all masked for the item's queries (causal future, padding, sliding-window
// eviction) are skipped before they are dequantized, so a causal chunk's own tokens cost about half a square.
// Segment formats differ (exact tokens vs stored codes: a permuted field-major order, or the rotated space of a
// codebook), so queries are prepared and values accumulated once per format and combined at the end.

namespace {

struct MultiCtx {
  int64_t B, Hq, Lq, Hkv, rep, QT, KT, NT, NF;
  int D;
  const float* qp;
  const std::vector<Seg>* segs;
  const std::vector<Perm>*kperm, *vperm;
  const std::vector<const Side*>*kcb, *vcb;  // per format: a side holding its codebook table, or null
  MaskView mask;
  int64_t kv_offset, query_start;
  float scaling;
  float* out;
};

struct MultiScratch {
  std::vector<float> q, acc, s, m, l, kbuf, vbuf, tmp, rot;
  MultiScratch(const MultiCtx& cx)
      : q(cx.NF * cx.rep * cx.QT * cx.D), acc(cx.NF * cx.rep * cx.QT * cx.D), s(cx.rep * cx.QT * cx.KT),
        m(cx.rep * cx.QT), l(cx.rep * cx.QT), kbuf(cx.KT * cx.D + PAD_FLOATS), vbuf(cx.KT * cx.D + PAD_FLOATS), tmp(4 * cx.D), rot(cx.D) {}
};

enum TileState { VISIBLE = 0, HIDDEN = 1, MIXED = 2 };

// Whether the keys [t0, t0+nt) of a segment are visible to every query of the tile, to none, or to some.
TileState tile_state(const MultiCtx& cx, int64_t b, int64_t q0, int64_t nq, const Seg& sg, int64_t t0, int nt) {
  if (cx.mask.has) {
    const MaskView& mk = cx.mask;
    const int64_t c0 = sg.pos + t0 - cx.kv_offset;
    const int64_t lo = std::max<int64_t>(c0, 0), hi = std::min<int64_t>(c0 + nt, mk.mcols);
    bool vis = false, hidden = lo > c0 || hi < c0 + nt, bias = false;
    const int64_t bb = mk.mB == 1 ? 0 : b;
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t base = bb * mk.ms0 + (q0 + j) * mk.ms2;
      if (mk.bp) {
        for (int64_t c = lo; c < hi; ++c) {
          const bool x = mk.bp[base + c * mk.ms3];
          vis |= x;
          hidden |= !x;
        }
      } else {
        for (int64_t c = lo; c < hi; ++c) {
          const float x = mk.fp[base + c * mk.ms3];
          const bool h = std::isinf(x) && x < 0;
          vis |= !h;
          hidden |= h;
          bias |= !h && x != 0.f;
        }
      }
    }
    return !vis ? HIDDEN : (hidden || bias ? MIXED : VISIBLE);
  }
  if (sg.is_new && cx.Lq > 1) {  // causal among the new tokens
    if (sg.pos + t0 > cx.query_start + q0 + nq - 1) return HIDDEN;
    if (sg.pos + t0 + nt - 1 <= cx.query_start + q0) return VISIBLE;
    return MIXED;
  }
  return VISIBLE;
}

// Mask (or bias) scores s[rep*nq][KT] of a MIXED tile, exactly as the decode path does per element.
void apply_tile_mask(const MultiCtx& cx, int64_t b, int64_t q0, int64_t nq, const Seg& sg, int64_t t0, int nt,
                     float* s) {
  const int64_t R = cx.rep * nq;
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * cx.KT;
    const int64_t lq = q0 + r % nq;
    if (cx.mask.has) {
      mask_row(cx.mask, b, lq, sg.pos + t0 - cx.kv_offset, nt, sr);
    } else {
      const int64_t qpos = cx.query_start + lq;
      for (int t = 0; t < nt; ++t)
        if (sg.pos + t0 + t > qpos) sr[t] = NEG_INF;
    }
  }
}

}  // namespace

// MKL (torch's BLAS on x86) opened its own thread team inside each work item's GEMMs: with 2 intra-op threads the
// kernel spent half its time spinning in libgomp and ran 3-4x slower than on 1.  Work items therefore pin their
// BLAS calls to their own thread; weak, so builds whose BLAS is not MKL simply skip it.  (MKL's C entry point, which
// its header names mkl_set_num_threads_local; the lower-case symbol is the Fortran one, taking a pointer.)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace {

struct SerialBlas {
  int prev = 0;
  SerialBlas() {
    if (MKL_Set_Num_Threads_Local) prev = MKL_Set_Num_Threads_Local(1);
  }
  ~SerialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(prev);
  }
};

at::Tensor mat(float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(p, {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// One (batch, kv head, query tile) work item, written straight into the output.
template <int DT>
void run_tile(const MultiCtx& cx, int64_t w, MultiScratch& sc) {
  const int D = DT ? DT : cx.D;
  const int64_t bh = w / cx.NT, b = bh / cx.Hkv, h = bh % cx.Hkv;
  const int64_t q0 = (w % cx.NT) * cx.QT, nq = std::min(cx.QT, cx.Lq - q0), R = cx.rep * nq;
  const int64_t KT = cx.KT;
  // queries of the tile, pre-scaled, once per format: in its key order (field-major), rotated for a codebook
  for (int64_t f = 0; f < cx.NF; ++f) {
    const Side* cb = (*cx.kcb)[f];
    const int* chan = (*cx.kperm)[f].chan.data();
    for (int64_t r = 0; r < R; ++r) {
      const float* src = cx.qp + ((b * cx.Hq + h * cx.rep + r / nq) * cx.Lq + q0 + r % nq) * D;
      if (cb) {  // q' = q R
        std::fill(sc.rot.begin(), sc.rot.end(), 0.f);
        for (int i = 0; i < D; ++i) {
          const float qi = src[i];
          const float* Ri = table_row(*cb, i);
#pragma omp simd
          for (int j = 0; j < D; ++j) sc.rot[j] += qi * Ri[j];
        }
        src = sc.rot.data();
      }
      float* dst = sc.q.data() + (f * R + r) * D;
      for (int j = 0; j < D; ++j) dst[j] = src[chan[j]] * cx.scaling;
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + cx.NF * R * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + R, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + R, 0.f);
  at::Tensor S = mat(sc.s.data(), R, KT, KT);
  for (size_t si = 0; si < cx.segs->size(); ++si) {
    const Seg& sg = (*cx.segs)[si];
    const int64_t f = sg.fmt;
    const Perm& kpm = (*cx.kperm)[f];
    const Perm& vpm = (*cx.vperm)[f];
    at::Tensor Q = mat(sc.q.data() + f * R * D, R, D, D);
    at::Tensor A = mat(sc.acc.data() + f * R * D, R, D, D);
    for (int64_t t0 = 0; t0 < sg.n; t0 += KT) {
      const int nt = static_cast<int>(std::min(KT, sg.n - t0));
      const TileState st = tile_state(cx, b, q0, nq, sg, t0, nt);
      if (st == HIDDEN) continue;
      int64_t ks, vs;
      const float* kp = decode_rows<DT>(sg.k, b, h, t0, nt, D, sc.kbuf.data(), ks, sc.tmp.data(), kpm);
      at::Tensor Sv = S.narrow(1, 0, nt);
      at::mm_out(Sv, Q, mat(const_cast<float*>(kp), nt, D, ks).t());
      if (st == MIXED) apply_tile_mask(cx, b, q0, nq, sg, t0, nt, sc.s.data());
      for (int64_t r = 0; r < R; ++r) {  // online softmax: rescale what the row holds when its max grows
        float* sr = sc.s.data() + r * KT;
        const bool bad = poisons_softmax(sr, nt);  // before exp_sum8 overwrites the scores
        const float mx = std::max(sc.m[r], max8(sr, nt));
        const float safe = std::isinf(mx) && mx < 0 ? 0.f : mx;
        const float sum = exp_sum8(sr, nt, safe);
        if (mx > sc.m[r]) {
          const float corr = std::isinf(sc.m[r]) ? 0.f : std::exp(sc.m[r] - mx);
          if (corr != 1.f) {
            sc.l[r] *= corr;
            for (int64_t g = 0; g < cx.NF; ++g) {
              float* ar = sc.acc.data() + (g * R + r) * D;
#pragma omp simd
              for (int j = 0; j < D; ++j) ar[j] *= corr;
            }
          }
          sc.m[r] = mx;
        }
        sc.l[r] += sum;
        if (bad) sc.l[r] = std::numeric_limits<float>::quiet_NaN();  // a NaN row, as in the reference
      }
      const float* vp = decode_rows<DT>(sg.v, b, h, t0, nt, D, sc.vbuf.data(), vs, sc.tmp.data(), vpm);
      A.addmm_(Sv, mat(const_cast<float*>(vp), nt, D, vs));
    }
  }
  // combine the formats' accumulators in natural channel order (rotating codebook values back: o = o' R^T)
  for (int64_t r = 0; r < R; ++r) {
    float* o = cx.out + ((b * cx.Hq + h * cx.rep + r / nq) * cx.Lq + q0 + r % nq) * D;
    if (sc.l[r] == 0.f) continue;  // fully masked row: zeros
    for (int64_t f = 0; f < cx.NF; ++f) {
      const float* ar = sc.acc.data() + (f * R + r) * D;
      const int* chan = (*cx.vperm)[f].chan.data();
      const Side* cb = (*cx.vcb)[f];
      float* nat = cb ? sc.rot.data() : o;
      if (cb) std::fill(sc.rot.begin(), sc.rot.end(), 0.f);
      for (int j = 0; j < D; ++j) nat[chan[j]] += ar[j];
      if (cb)
        for (int j = 0; j < D; ++j) {
          const float* Rj = table_row(*cb, j);
          float acc = 0.f;
          for (int i = 0; i < D; ++i) acc += sc.rot[i] * Rj[i];
          o[j] += acc;
        }
    }
    const float inv = 1.f / sc.l[r];
#pragma omp simd
    for (int j = 0; j < D; ++j) o[j] *= inv;
  }
}

}  // namespace

// The plan as attend takes it, plus the query tile QT and key tile KT of the work items.  Returns float32 [B, Hq, Lq, D].
at::Tensor attend_multi(const at::Tensor& q, const KernelPlan& plan, int64_t q_tile, int64_t k_tile) {
  KVSQ_UNPACK_PLAN(plan)
  init_luts();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32");
  TORCH_CHECK(q_tile > 0 && k_tile > 0, "tiles must be positive");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  const int D = static_cast<int>(q.size(3));
  TORCH_CHECK(D <= 512, "head_dim up to 512 is supported");
  const Segments g = read_segments(plan, D);
  const size_t S = g.segs.size(), NF = plan.formats.size() / 12;
  const int64_t Hkv = g.Hkv;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  auto out = at::zeros({B, Hq, Lq, D}, q.options());
  if (S == 0 || Lq == 0) return out;
  at::Tensor mask_held;
  const MaskView mk = read_mask(mask, mask_held);
  const int64_t QT = std::min(q_tile, Lq), NT = (Lq + QT - 1) / QT;
  MultiCtx cx{B, Hq, Lq, Hkv, Hq / Hkv, QT, k_tile, NT, static_cast<int64_t>(NF), D, q.data_ptr<float>(), &g.segs,
              &g.kperm, &g.vperm, &g.kcb, &g.vcb, mk, kv_offset, query_start, static_cast<float>(scaling), out.data_ptr<float>()};
  at::parallel_for(0, B * Hkv * NT, 1, [&](int64_t lo, int64_t hi) {
    SerialBlas serial;
    MultiScratch sc(cx);
    for (int64_t w = lo; w < hi; ++w) {
      if (D == 64) run_tile<64>(cx, w, sc);
      else if (D == 128) run_tile<128>(cx, w, sc);
      else run_tile<0>(cx, w, sc);
    }
  });
  return out;
}
