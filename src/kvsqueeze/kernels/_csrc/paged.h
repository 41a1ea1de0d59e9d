// The paged entry point: one call per layer and step for every sequence of a paged pool (vLLM's KV blocks,
// kernels/paged.py), so the per-sequence work of building a plan is C++, not Python.
#pragma once

// Pages of a paged pool (vLLM's KV blocks, kernels/paged.py) as a stored run, read in place: ``pool`` is uint8
// [blocks, H, bytes], and each listed block holds ``n`` tokens of every KV head.  ``layout`` gives the byte offset
// within a head's page of its 6 parts in plan order (keys: codes, scale, zero; values: the same), then each part's
// row bytes (a row is a token, or the whole page for per-channel parameters); codes are bytes, parameters fp16.
// Page i holds positions [i n, (i + 1) n); pages that reach ``query_start`` or past it hold the step's own tokens
// (causal among themselves).  The first page's first ``skip`` tokens are left out (the caller holds them exactly:
// sink tokens): its segment starts at row ``skip`` of every per-token part, while per-channel parameters (one row
// per page) stay where they are.
std::shared_ptr<StoredRun> read_pages(const at::Tensor& pool, const std::vector<int64_t>& blocks, int64_t n,
                                      int64_t query_start, const std::vector<int64_t>& layout,
                                      const std::vector<int64_t>& formats, int64_t D, int64_t skip) {
  TORCH_CHECK(pool.scalar_type() == at::kByte && pool.dim() == 3 && pool.stride(2) == 1,
              "the page pool must be uint8 [blocks, H, bytes] with contiguous bytes");
  TORCH_CHECK(layout.size() == 12 && formats.size() == 24, "a page layout has 6 offsets and 6 row sizes, and the "
              "plan's formats are 2 (exact tokens, then the pages')");
  TORCH_CHECK(D > 0 && D <= 512 && n > 0, "head_dim up to 512 is supported");
  TORCH_CHECK(skip >= 0 && skip < n, "the tokens left out of the first page must be fewer than a page");
  const char* base = static_cast<const char*>(pool.data_ptr());
  const char* end = static_cast<const char*>(pool.storage().data()) + pool.storage().nbytes();
  const int64_t nb = pool.size(0);
  auto run = std::make_shared<StoredRun>();
  run->parts = {pool};
  run->formats = formats;
  run->Hkv = pool.size(1);
  const Fmt page_fmt[2] = {read_fmt(formats.data() + 12), read_fmt(formats.data() + 18)};  // keys, values
  for (const Fmt& f : page_fmt) TORCH_CHECK(f.kind == INT_TOKEN || f.kind == INT_CHANNEL, "pages hold integer codes");
  run->segs.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    TORCH_CHECK(blocks[i] >= 0 && blocks[i] < nb, "page block ", blocks[i], " is outside the pool of ", nb);
    Seg s;
    const int64_t from = i == 0 ? skip : 0;
    Side* sides[2] = {&s.k, &s.v};
    for (int w = 0; w < 2; ++w) {
      sides[w]->f = page_fmt[w];
      Part* parts[3] = {&sides[w]->x, &sides[w]->scale, &sides[w]->zero};
      for (int j = 0; j < 3; ++j) {
        Part& p = *parts[j];
        p.sr = layout[6 + 3 * w + j];
        const bool per_token = j == 0 || sides[w]->f.kind == INT_TOKEN;
        p.ptr = base + blocks[i] * pool.stride(0) + layout[3 * w + j] + (per_token ? from * p.sr : 0);
        p.end = end;
        p.sh = pool.size(1) == 1 ? 0 : pool.stride(1);
        p.dt = j == 0 ? at::kByte : at::kHalf;  // codes, then fp16 parameters
      }
    }
    s.pos = static_cast<int64_t>(i) * n + from;
    s.n = n - from;
    s.fmt = 1;
    s.is_new = s.pos + s.n > query_start;
    run->segs.push_back(s);
  }
  return run;
}

// query [T, Hq, D] float32 (each sequence's queries are its last tokens, rows query_start_loc[s] ..
// query_start_loc[s + 1]); block_table [S, max_blocks]; seq_lens [S]; exact: 2 tensors per sequence, its sink copies
// [2, H, >= skip, D] and its partial last page [2, H, n, D] (keys, values), undefined or empty where it has none.
// Per sequence: its pages read in place (read_pages; the first page's first ``skip`` tokens taken from the sink
// copies), then the partial page, through the decode entry for up to ``max_queries`` queries, else the
// multi-query one.  Returns float32 [T, Hq, D].
at::Tensor attend_paged(const at::Tensor& query, const at::Tensor& pool, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        const std::vector<at::Tensor>& exact, int64_t n, const std::vector<int64_t>& layout,
                        const std::vector<int64_t>& formats, int64_t skip, double scaling, int64_t chunk,
                        int64_t max_queries, int64_t q_tile, int64_t k_tile) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 3, "query must be float32 [T, Hq, D]");
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const int64_t S = lens.numel(), D = query.size(2);
  TORCH_CHECK(table.dim() == 2 && table.size(0) >= S && qsl.numel() >= S + 1 &&
              static_cast<int64_t>(exact.size()) == 2 * S, "one block-table row, two bounds and two exact "
              "tensors per sequence");
  const int64_t* tb = table.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* qs = qsl.data_ptr<int64_t>();
  auto out = at::zeros({query.size(0), query.size(1), D}, query.options());
  auto one = [&](int64_t s) {
    const int64_t q0 = qs[s], ql = qs[s + 1] - qs[s], length = ln[s], n_full = length / n, tail = length % n;
    if (ql == 0) return;
    TORCH_CHECK(ql <= length && n_full <= table.size(1), "sequence ", s, ": more queries or pages than it holds");
    KernelPlan p;
    p.formats = formats;
    p.query_start = length - ql;
    p.scaling = scaling;
    const at::Tensor& sinks = exact[2 * s];
    const at::Tensor& part = exact[2 * s + 1];
    const int64_t sk = n_full && skip && sinks.defined() && sinks.numel() ? skip : 0;
    auto add_exact = [&](const at::Tensor& buf, int64_t pos, int64_t len) {  // keys, values [1, H, len, D]
      const at::Tensor none;
      for (int w = 0; w < 2; ++w) {
        p.parts.push_back(buf.select(0, w).narrow(1, 0, len).unsqueeze(0));
        p.parts.push_back(none);
        p.parts.push_back(none);
      }
      p.positions.push_back(pos);
      p.lengths.push_back(len);
      p.is_new.push_back(pos + len > length - ql);
      p.format_index.push_back(0);
    };
    if (sk) add_exact(sinks, 0, sk);
    if (tail) {
      TORCH_CHECK(part.defined() && part.numel(), "paged KV: the partial page of sequence ", s, " (block ",
                  tb[s * table.size(1) + n_full], ") has no stored tokens");
      add_exact(part, n_full * n, tail);
    }
    const std::vector<int64_t> blocks(tb + s * table.size(1), tb + s * table.size(1) + n_full);
    p.head = read_pages(pool, blocks, n, length - ql, layout, formats, D, sk);
    p.head_at = sk ? 1 : 0;  // the pages go after the sinks, before the partial page
    const at::Tensor q = query.narrow(0, q0, ql).permute({1, 0, 2}).unsqueeze(0).contiguous();
    const at::Tensor o = ql > max_queries ? attend_multi(q, p, q_tile, k_tile) : attend(q, p, chunk);
    out.narrow(0, q0, ql).copy_(o.select(0, 0).permute({1, 0, 2}));
  };
  // Several sequences per thread: each thread takes whole sequences (the kernel's own parallel loops then run
  // inline), where one call per sequence in turn spent each call's serial set-up and merge with the other threads
  // idle (batch 8 x 2048 kivi-4, 2 threads: 0.59 ms against 0.42 for the same tokens in one batched call, but
  // 0.90 against 0.83 at 1 thread).  Fewer sequences: each still spreads over the threads.
  const int threads = at::get_num_threads();
  if (threads > 1 && S >= 2 * threads) {
    // the caller's thread-local state (vLLM runs under inference mode, whose tensors other threads may not write)
    const at::ThreadLocalState state;
    at::parallel_for(0, S, 1, [&](int64_t lo, int64_t hi) {
      const at::ThreadLocalStateGuard guard(state);
      for (int64_t s = lo; s < hi; ++s) one(s);
    });
  } else {
    for (int64_t s = 0; s < S; ++s) one(s);
  }
  return out;
}
