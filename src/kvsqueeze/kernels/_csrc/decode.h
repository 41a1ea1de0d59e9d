// The decode entry point: flash-decoding over chunks of the packed context.
#pragma once

namespace {

struct Ctx {
  int64_t B, Hq, Lq;
  int D;
  int64_t Hkv, rep, R, NI, W, chunk;
  const float* qprep;  // [B * Hkv, NF, R, D]: a head's query rows per format, scaled, in its keys' field-major order
  const float* qnat;   // [B * Hkv, NF, R, D]: the same rows in natural order (rotated codebook keys: q R)
  int64_t NF;
  const std::vector<Seg>* segs;
  const std::vector<Item>* items;
  const std::vector<Perm>*kperm, *vperm;
  float* part;
  MaskView mask;
  int64_t kv_offset, query_start;
  float scaling;
};

struct Scratch {
  std::vector<float> kbuf, vbuf, tmp, qa, qc, s, accp, pa, pc, wt;
  std::vector<int16_t> wq;  // int_values.h: 4 rows' int16 weights per group (codebook_int.h: per row)
  std::vector<uint8_t> nib;  // a 3-bit side's rows of one segment as 4-bit codes (as_nibbles), padded for wide loads
  Scratch(int D, int64_t R, int64_t chunk)
      : kbuf(TILE * D + PAD_FLOATS), vbuf(TILE * D + PAD_FLOATS), tmp(4 * D), qa(R * D), qc(R), s(R * chunk), accp(D),
        pa(chunk * 16 + 16), pc(chunk * 16 + 16), wt(6 * chunk + 16), nib(chunk * D / 2 + 64) {
#if defined(KVSQ_INT_VALUES)
    wq.resize(4 * INT_VALUES_MAX_GROUPS * (chunk + 2));
#endif
  }
  Side nibbles(const Side& sd, int64_t b, int64_t h, int64_t t0, int n, int D, bool centre) {
    return as_nibbles(sd, b, h, t0, n, D, nib.data(), nib.data() + nib.size(), centre);
  }
};

// Scores s[r * chunk + t] of the R query rows against tokens [t0, t0 + n) of one segment.
template <int DT>
void segment_scores(const Ctx& cx, const Seg& sg, int64_t b, int64_t h, int64_t t0, int n, const float* qs,
                    const float* qn, float* s, Scratch& sc, const TokenParams& tp) {
  const int D = DT ? DT : cx.D;
  const int64_t R = cx.R, chunk = cx.chunk;
  const Perm& kpm = (*cx.kperm)[sg.fmt];
  // Packed items are short streams (kivi-4: 8 KiB of key codes, 8 KiB of values, 4 KiB of parameters per 256 tokens)
  // that the hardware prefetcher barely ramps up on: from DRAM the kernel ran at a third of its speed on data in
  // cache.  The segment's rows (codes and per-token / per-group parameters) are requested up front, keys first.
  if (sg.k.f.kind != FP) {
    prefetch_rows(sg.k.x, b, h, t0, n);
    const int64_t kr0 = sg.k.f.kind == INT_CHANNEL ? t0 / std::max(sg.k.f.group, 1) : t0;
    const int64_t krn = sg.k.f.kind == INT_CHANNEL ? n / std::max(sg.k.f.group, 1) + 1 : n;
    prefetch_rows(sg.k.scale, b, h, kr0, krn);
    prefetch_rows(sg.k.zero, b, h, kr0, krn);
    prefetch_rows(sg.v.x, b, h, t0, n);
    if (sg.v.f.kind == INT_TOKEN) {
      prefetch_rows(sg.v.scale, b, h, t0, n);
      prefetch_rows(sg.v.zero, b, h, t0, n);
    }
  }
  const ValueAhead ahead(sg.v, b, h, t0);
  // 3-bit codes through the 4-bit paths (as_nibbles)
  const Side key = DT > 0 && is_int3(sg.k) ? sc.nibbles(sg.k, b, h, t0, n, D, false) : sg.k;
  // scores: integer dot products where the build and the key format allow, else the float fast path, else generic
  bool fast_k = false;
#if defined(KVSQ_INT_DOT)
  fast_k = try_int_scores<DT>(key, b, h, t0, n, qs, qn, R, s, chunk, tp.A, tp.C, kpm.chan.data(), ahead);
#endif
  if (!fast_k) fast_k = DT > 0 && try_fast_scores<DT>(key, b, h, t0, n, qs, R, s, chunk, kpm.unit_group.data(), tp);
  if (!fast_k && DT > 0)  // rotated codebook keys: levels in registers (codebook_fast.h)
    fast_k = try_cb_scores<DT>(key, b, h, t0, n, qn, R, s, chunk, tp.A);
  if (fast_k) {
  } else if (key.f.kind == INT_CHANNEL) {
    // s = (q * a_g) . codes + q . c_g: codes are never scaled, the group's parameters go into the query
    const Fmt& f = key.f;
    float* a = sc.tmp.data();
    float* c = a + D;
    float* qa = sc.qa.data();
    int64_t cur = -1;
    for (int u0 = 0; u0 < n; u0 += TILE) {
      const int nt = std::min(TILE, n - u0);
      unpack_rows<DT>(f.bits, key.x, b, h, t0 + u0, nt, sc.kbuf.data(), D);
      for (int t = 0; t < nt; ++t) {
        const int64_t grow = (t0 + u0 + t) / f.group;
        if (grow != cur) {
          cur = grow;
          channel_params(key, b, h, grow, kpm.chan.data(), D, a, c);
          for (int64_t r = 0; r < R; ++r) {
            float cs = 0.f;
#pragma omp simd reduction(+ : cs)
            for (int i = 0; i < D; ++i) {
              qa[r * D + i] = qs[r * D + i] * a[i];
              cs += qs[r * D + i] * c[i];
            }
            sc.qc[r] = cs;
          }
        }
        const float* kr = sc.kbuf.data() + t * D;
        for (int64_t r = 0; r < R; ++r) s[r * chunk + u0 + t] = dot<DT>(qa + r * D, kr, D) + sc.qc[r];
      }
    }
  } else {
    for (int u0 = 0; u0 < n; u0 += TILE) {
      const int nt = std::min(TILE, n - u0);
      int64_t ks;
      const float* kp = decode_rows<DT>(key, b, h, t0 + u0, nt, D, sc.kbuf.data(), ks, sc.tmp.data(), kpm);
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qs + r * D;
        float* sr = s + r * chunk + u0;
        for (int t = 0; t < nt; ++t) sr[t] = dot<DT>(qr, kp + t * ks, D);
      }
    }
  }
}

// Weighted values of one segment's tokens [t0, t0 + n) (probabilities p[r * chunk + t]) added to the partials
// acc (R rows of stride W); false where the tiled path served them (field-major order).
template <int DT>
bool segment_values(const Ctx& cx, const Seg& sg, int64_t b, int64_t h, int64_t t0, int n, float* p, float* acc,
                    Scratch& sc, const TokenParams& tp) {
  const int D = DT ? DT : cx.D;
  const int64_t R = cx.R, W = cx.W, chunk = cx.chunk;
  const Perm& vpm = (*cx.vperm)[sg.fmt];
  // 3-bit codes through the 4-bit paths, centred on the 4-bit middle (as_nibbles)
  const Side val = DT > 0 && is_int3(sg.v) ? sc.nibbles(sg.v, b, h, t0, n, D, true) : sg.v;
  bool fast_v = false;
#if defined(KVSQ_INT_VALUES)
  fast_v = DT > 0 && try_int_values<DT>(val, b, h, t0, n, p, chunk, R, acc, W, tp, sc.wq.data());
#endif
  fast_v = fast_v ||
           (DT > 0 && (try_fast_values<DT>(val, b, h, t0, n, p, chunk, R, acc, W, vpm.unit_group.data(), tp) ||
                       try_cb_values<DT>(val, b, h, t0, n, p, chunk, R, acc, W, sc.qa.data(), tp.A, sc.wq.data())));
  for (int u0 = 0; u0 < (fast_v ? 0 : n); u0 += TILE) {
    const int nt = std::min(TILE, n - u0);
    int64_t vs;
    const float* vp = decode_rows<DT>(val, b, h, t0 + u0, nt, D, sc.vbuf.data(), vs, sc.tmp.data(), vpm);
    for (int64_t r = 0; r < R; ++r) axpy_rows<DT>(acc + r * W, p + r * chunk + u0, vp, vs, nt, D);
  }
  return fast_v;
}

// One (batch, kv head, chunk) work item: partial max, sum and weighted values of every query row.  An item is a
// chunk of one segment, or a run of short segments (a paged pool's 32-token pages: Item::nseg) that share a format
// and newness and follow each other in position, scored and weighted segment by segment under one softmax.
template <int DT>
void run_item(const Ctx& cx, int64_t w, Scratch& sc) {
  const int D = DT ? DT : cx.D;
  const int64_t R = cx.R, W = cx.W, Lq = cx.Lq, chunk = cx.chunk;
  const int64_t bh = w / cx.NI, b = bh / cx.Hkv, h = bh % cx.Hkv;
  const Item& it = (*cx.items)[w % cx.NI];
  const Seg& sg = (*cx.segs)[it.seg];  // the first (positions run on from it: the mask and causal tests use it)
  const int n = it.n;
  const Perm& vpm = (*cx.vperm)[sg.fmt];
  float* pw = cx.part + w * R * W;
  const float* qs = cx.qprep + (bh * cx.NF + sg.fmt) * R * D;
  const float* qn = cx.qnat + (bh * cx.NF + sg.fmt) * R * D;
  float* s = sc.s.data();
  const TokenParams tp{sc.pa.data(), sc.pc.data(), sc.wt.data()};
  for (int k = 0, off = 0; k < it.nseg; ++k) {
    const Seg& sk = (*cx.segs)[it.seg + k];
    const int nk = it.nseg == 1 ? n : static_cast<int>(sk.n);
    segment_scores<DT>(cx, sk, b, h, k ? 0 : it.t0, nk, qs, qn, s + off, sc, tp);
    off += nk;
  }
  // mask, softmax within the chunk
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * chunk;
    const int64_t lq = r % Lq;
    if (cx.mask.has) {
      mask_row(cx.mask, b, lq, sg.pos + it.t0 - cx.kv_offset, n, sr);
    } else if (sg.is_new && Lq > 1) {
      const int64_t qpos = cx.query_start + lq;
      for (int t = 0; t < n; ++t)
        if (sg.pos + it.t0 + t > qpos) sr[t] = NEG_INF;
    }
    const bool bad = poisons_softmax(sr, n);  // the merge turns max +inf with sum NaN into a NaN row
    const float m = max8(sr, n);
    const float safe = std::isinf(m) && m < 0 ? 0.f : m;
    const float l = exp_sum8(sr, n, safe);  // (overwrites the scores with their exponentials)
    float* pr = pw + r * W;
    pr[0] = bad ? -NEG_INF : m;
    pr[1] = bad ? std::numeric_limits<float>::quiet_NaN() : l;
    std::fill(pr + 2, pr + W, 0.f);
  }
  // weighted values (every segment of an item has the same format: the same path)
  bool fast_v = true;
  for (int k = 0, off = 0; k < it.nseg; ++k) {
    const Seg& sk = (*cx.segs)[it.seg + k];
    const int nk = it.nseg == 1 ? n : static_cast<int>(sk.n);
    fast_v = segment_values<DT>(cx, sk, b, h, k ? 0 : it.t0, nk, s + off, pw + 2, sc, tp) && fast_v;
    off += nk;
  }
  // Partials stay in the values' field-major order (the merge puts each format's sum back in natural order once per
  // row, not once per item); rotated codebook values are merged in the rotated space in natural order, which the
  // fast path gives and the tiled one is put back into here.
  for (int64_t r = 0; r < (sg.v.f.kind == CODEBOOK && !fast_v ? R : 0); ++r) {
    float* acc = pw + r * W + 2;
    std::copy(acc, acc + D, sc.accp.data());
    for (int j = 0; j < D; ++j) acc[vpm.chan[j]] = sc.accp[j];
  }
}

}  // namespace


// One segment from its 6 parts (keys x/scale/zero, values x/scale/zero) and format index into fmts (12 ints per
// format); a rotated-codebook side's table (rotation + levels) is checked here.
Seg read_segment(const at::Tensor* parts, int64_t pos, int64_t n, bool is_new, int64_t fmt,
                 const std::vector<int64_t>& fmts, int D) {
  TORCH_CHECK(fmt >= 0 && static_cast<size_t>(fmt) < fmts.size() / 12, "bad segment format index");
  Seg s;
  Side* sides[2] = {&s.k, &s.v};
  for (int w = 0; w < 2; ++w) {
    const int64_t* fm = fmts.data() + 12 * fmt + 6 * w;
    sides[w]->f = read_fmt(fm);
    sides[w]->x = make_part(parts[3 * w]);
    sides[w]->scale = make_part(parts[3 * w + 1]);
    sides[w]->zero = make_part(parts[3 * w + 2]);
    if (sides[w]->f.kind != CODEBOOK) continue;
    const at::Tensor& tab = parts[3 * w + 2];
    const Fmt& f = sides[w]->f;
    TORCH_CHECK(tab.dim() == 4 && tab.scalar_type() == at::kFloat && tab.size(2) == D + 2 &&
                tab.size(3) >= std::max(D, 16) && tab.size(0) == 1 && tab.size(1) == 1,
                "codebook table must be float32 [1, 1, D + 2, max(D, 16)]");
    TORCH_CHECK(f.bits >= 1 && f.bits <= 4 && cb_bits_lo(f) >= 1 && cb_bits_lo(f) <= 4 && cb_n_hi(f) % 8 == 0 &&
                (D - cb_n_hi(f)) % 8 == 0 && cb_group(f) >= 0, "bad codebook format");
  }
  s.pos = pos;
  s.n = n;
  s.fmt = fmt;
  s.is_new = is_new;
  return s;
}

// The plan's own segments (6 parts each) with the stored run it holds read once before (read_run), in order.
std::vector<Seg> plan_segments(const KernelPlan& p, int D, int64_t& Hkv) {
  const size_t S = p.positions.size();
  TORCH_CHECK(p.parts.size() == 6 * S && p.lengths.size() == S && p.is_new.size() == S &&
              p.format_index.size() == S, "bad segment lists");
  const StoredRun* run = p.head.get();
  TORCH_CHECK(!run || (p.head_at >= 0 && static_cast<size_t>(p.head_at) <= S), "stored run index out of range");
  TORCH_CHECK(!run || run->formats == p.formats, "a stored run was read with other formats than the plan's");
  std::vector<Seg> segs;
  segs.reserve(S + (run ? run->segs.size() : 0));
  for (size_t i = 0; i <= S; ++i) {
    if (run && static_cast<size_t>(p.head_at) == i) {
      segs.insert(segs.end(), run->segs.begin(), run->segs.end());
      Hkv = run->Hkv;
    }
    if (i == S) break;
    segs.push_back(read_segment(p.parts.data() + 6 * i, p.positions[i], p.lengths[i], p.is_new[i] != 0,
                                p.format_index[i], p.formats, D));
    Hkv = p.parts[6 * i].size(1);
  }
  return segs;
}

// A plan's segments read once, to be put in front of segment head_at of later plans (kernels/cpu.py).
std::shared_ptr<StoredRun> read_run(const KernelPlan& p, int64_t D) {
  TORCH_CHECK(!p.head, "a stored run cannot hold another");
  TORCH_CHECK(D > 0 && D <= 512, "head_dim up to 512 is supported");
  auto run = std::make_shared<StoredRun>();
  run->segs = plan_segments(p, static_cast<int>(D), run->Hkv);
  run->parts = p.parts;
  run->formats = p.formats;
  return run;
}

// What both entry points read: every segment in order, each format's field orders (formats no segment uses get
// identity orders, never read) and, per format, a rotated-codebook side holding its table.
struct Segments {
  std::vector<Seg> segs;
  std::vector<Perm> kperm, vperm;
  std::vector<const Side*> kcb, vcb;
  int64_t Hkv = 0;
};

Segments read_segments(const KernelPlan& p, int D) {
  const size_t NF = p.formats.size() / 12;
  Segments g;
  g.segs = plan_segments(p, D, g.Hkv);
  g.kperm.resize(NF);
  g.vperm.resize(NF);
  g.kcb.assign(NF, nullptr);
  g.vcb.assign(NF, nullptr);
  for (const Seg& s : g.segs) {
    if (s.k.f.kind == CODEBOOK) g.kcb[s.fmt] = &s.k;
    if (s.v.f.kind == CODEBOOK) g.vcb[s.fmt] = &s.v;
    if (g.kperm[s.fmt].chan.empty()) {  // once per format, not per segment (130 segments at 32k)
      g.kperm[s.fmt] = field_perm(s.k.f, D);
      g.vperm[s.fmt] = field_perm(s.v.f, D);
    }
  }
  for (size_t f = 0; f < NF; ++f)
    if (g.kperm[f].chan.empty()) g.kperm[f] = g.vperm[f] = field_perm(Fmt{}, D);
  return g;
}

// the codebook side of any format (a plan stores one format: every stored segment shares its table)
const Side* any_side(const std::vector<const Side*>& per_format) {
  const Side* out = nullptr;
  for (const Side* sd : per_format)
    if (sd) out = sd;
  return out;
}

at::Tensor attend(const at::Tensor& q, const KernelPlan& plan, int64_t chunk, bool by_heads = false) {
  KVSQ_UNPACK_PLAN(plan)
  init_luts();
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  const int D = static_cast<int>(q.size(3));
  TORCH_CHECK(D <= 512, "head_dim up to 512 is supported");
  const Segments g = read_segments(plan, D);
  const size_t S = g.segs.size();
  const std::vector<Seg>& segs = g.segs;
  const int64_t Hkv = g.Hkv;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  const int64_t rep = Hq / Hkv, R = rep * Lq;

  // Items of up to chunk tokens: chunks of a segment, or a run of short segments that follow each other in
  // position with one format and newness (a paged pool's 32-token pages: an item per page spent more on its set-up,
  // softmax and partials than on its tokens; kivi-4 over 8 x 2048 tokens, 2 threads: 0.72 ms against 0.42 for the
  // same tokens in 256-token blocks)
  std::vector<Item> items;
  for (size_t i = 0; i < S;) {
    size_t j = i + 1;
    int64_t tot = segs[i].n;
    while (tot < chunk && j < S && segs[j].fmt == segs[i].fmt && segs[j].is_new == segs[i].is_new &&
           segs[j].pos == segs[j - 1].pos + segs[j - 1].n && tot + segs[j].n <= chunk)
      tot += segs[j++].n;
    if (j > i + 1) {
      items.push_back({int64_t(i), 0, int(tot), int(j - i)});
    } else {
      for (int64_t t0 = 0; t0 < segs[i].n; t0 += chunk)
        items.push_back({int64_t(i), t0, int(std::min<int64_t>(chunk, segs[i].n - t0))});
    }
    i = j;
  }
  const int64_t NI = static_cast<int64_t>(items.size());
  auto out = at::zeros({B, Hq, Lq, D}, q.options());
  if (NI == 0) return out;

  // partials: [B*Hkv, NI, R, D + 2] (m, l, acc)
  const int64_t W = D + 2;
  std::vector<float> part(static_cast<size_t>(B * Hkv * NI * R * W));
  const float* qp = q.data_ptr<float>();
  at::Tensor mask_held;
  const MaskView mk = read_mask(mask, mask_held);

  // field-major orders per format (index 0: fp segments, 1: the store); rotated codebook layouts: their table,
  // checked once by read_segments; queries rotated once for the keys
  const std::vector<Perm>& kperm = g.kperm;
  const std::vector<Perm>& vperm = g.vperm;
  const Side* kcb = any_side(g.kcb);
  std::vector<float> qrot;
  if (kcb) {  // q' = q R, one D x D product per query row
    qrot.assign(static_cast<size_t>(B * Hq * Lq * D), 0.f);
    for (int64_t r = 0; r < B * Hq * Lq; ++r)
      for (int i = 0; i < D; ++i) {
        const float qi = qp[r * D + i];
        const float* Ri = table_row(*kcb, i);
        float* o = qrot.data() + r * D;
#pragma omp simd
        for (int j = 0; j < D; ++j) o[j] += qi * Ri[j];
      }
  }

  // every item of a head reads the same query rows: prepared once per (batch, kv head, format), not per item
  const int64_t NF = static_cast<int64_t>(kperm.size());
  std::vector<float> qprep(static_cast<size_t>(B * Hkv * NF * R * D));
  std::vector<float> qnat(qprep.size());
  for (int64_t bh = 0; bh < B * Hkv; ++bh)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = (((bh / Hkv) * Hq + (bh % Hkv) * rep + r / Lq) * Lq + r % Lq) * D;
      for (int64_t f = 0; f < NF; ++f) {
        const float* src = (g.kcb[f] ? qrot.data() : qp) + row;
        float* dst = qprep.data() + ((bh * NF + f) * R + r) * D;
        float* nat = qnat.data() + ((bh * NF + f) * R + r) * D;
        for (int j = 0; j < D; ++j) {
          dst[j] = src[kperm[f].chan[j]] * static_cast<float>(scaling);
          nat[j] = src[j] * static_cast<float>(scaling);
        }
      }
    }

  Ctx cx{B, Hq, Lq, D, Hkv, rep, R, NI, W, chunk, qprep.data(), qnat.data(), NF, &segs, &items, &kperm, &vperm,
         part.data(), mk, kv_offset, query_start, static_cast<float>(scaling)};
  // Items are walked chunk by chunk, every (batch, KV head) of a chunk before the next chunk (item w = bh NI + i
  // runs at x = i B Hkv + bh): a block stores its heads side by side, so a thread reads each part as one run of
  // memory, where (batch, head) order (by_heads: KVSQUEEZE_CPU_ORDER=heads, kept to measure the difference) jumped
  // from block to block, 8 KiB at a time at kivi-4, which the hardware prefetchers barely ramp up on.  Same
  // partials, same merge: the outputs are identical.
  const int64_t BH = B * Hkv;
  at::parallel_for(0, BH * NI, 1, [&](int64_t lo, int64_t hi) {
    Scratch sc(D, R, chunk);
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t w = by_heads ? x : (x % BH) * NI + x / BH;
      if (D == 64) run_item<64>(cx, w, sc);
      else if (D == 128) run_item<128>(cx, w, sc);
      else if (D == 256) run_item<256>(cx, w, sc);  // Gemma-3's head_dim
      else run_item<0>(cx, w, sc);
    }
  });

  // exact log-sum-exp merge of the chunk partials, summed per format (in its order) and put in natural order once
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv * R, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> sums(static_cast<size_t>(NF * D));
    std::vector<char> used(NF);
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t bh = x / R, r = x % R, b = bh / Hkv, h = bh % Hkv;
      float M = NEG_INF;
      for (int64_t i = 0; i < NI; ++i) M = std::max(M, part[((bh * NI + i) * R + r) * W]);
      float* o = op + ((b * Hq + h * rep + r / Lq) * Lq + r % Lq) * D;
      if (std::isinf(M) && M < 0) continue;  // fully masked row -> zeros
      float L = 0.f;
      std::fill(sums.begin(), sums.end(), 0.f);
      std::fill(used.begin(), used.end(), 0);
      for (int64_t i = 0; i < NI; ++i) {
        const float* pr = part.data() + ((bh * NI + i) * R + r) * W;
        if (pr[1] == 0.f) continue;
        const float c = std::exp(pr[0] - M);
        L += c * pr[1];
        const int64_t f = segs[items[i].seg].fmt;
        used[f] = 1;
        float* dst = sums.data() + f * D;
        for (int j = 0; j < D; ++j) dst[j] += c * pr[2 + j];
      }
      for (int64_t f = 0; f < NF; ++f) {
        if (!used[f]) continue;
        const float* sf = sums.data() + f * D;
        if (g.vcb[f]) {  // rotated codebook values: o += o' R^T
          for (int j = 0; j < D; ++j) {
            const float* Rj = table_row(*g.vcb[f], j);
            float acc = 0.f;
            for (int i = 0; i < D; ++i) acc += sf[i] * Rj[i];
            o[j] += acc;
          }
        } else {
          const int* chan = vperm[f].chan.data();
          for (int j = 0; j < D; ++j) o[chan[j]] += sf[j];
        }
      }
      const float inv = 1.f / std::max(L, 1e-30f);
      for (int j = 0; j < D; ++j) o[j] *= inv;
    }
  });
  return out;
}
