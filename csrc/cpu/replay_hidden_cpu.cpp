// CPU kernels of the sparse LM head: logits only for (row, token in K), O(nnz x d) in forward
// and backward, never an [N, V] tensor.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/replay_math.h"
#include "parallel_grain.h"
#include "replay_checks.h"
#include "replay_hidden.h"

namespace mask_replay {
namespace {

// Eight independent partial sums so the compiler can keep them in one vector register (the host
// build forbids reassociation, so a single accumulator would stay scalar).
template <class T, class A>
A dot(const T* a, const T* b, int64_t d) {
  A acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= d; k += 8)
    for (int u = 0; u < 8; ++u) acc[u] += static_cast<A>(a[k + u]) * static_cast<A>(b[k + u]);
  A tail = 0;
  for (; k < d; ++k) tail += static_cast<A>(a[k]) * static_cast<A>(b[k]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

template <class T, class A>
void axpy(A c, const T* x, A* acc, int64_t d) {
  for (int64_t k = 0; k < d; ++k) acc[k] += c * static_cast<A>(x[k]);
}

// One piece of the weight gradient: columns [c0, c1) of the row of the token whose entries are
// the sorted positions [begin, end).
struct WeightItem {
  int64_t begin, end, c0, c1;
};

// Items over the sorted ids: each token's run whole when it is cheap, else cut into column blocks
// (multiples of 16 columns) of about `target` multiply-adds each. Any cut gives the same bits: a
// column's sum runs over the token's entries in order, whichever item holds it.
std::vector<WeightItem> weight_items(const int32_t* sids, int64_t nnz, int64_t d, int64_t threads) {
  constexpr int64_t kMinWork = int64_t{1} << 15;  // below this an item costs more to schedule than to run
  const int64_t target = std::max(kMinWork, nnz * d / std::max<int64_t>(1, threads * 8));
  std::vector<WeightItem> items;
  int64_t begin = 0;
  while (begin < nnz) {
    int64_t end = begin + 1;
    while (end < nnz && sids[end] == sids[begin]) ++end;
    const int64_t len = end - begin;
    const int64_t cols = len * d <= target ? std::max<int64_t>(d, 1) : std::max<int64_t>(16, target / len / 16 * 16);
    int64_t c0 = 0;
    do {  // d = 0 still gets its item: it writes the bias
      items.push_back({begin, end, c0, std::min(d, c0 + cols)});
      c0 += cols;
    } while (c0 < d);
    begin = end;
  }
  return items;
}

// Boundaries b[0] = 0 <= ... <= b[P] = items.size() cutting the items into P consecutive parts of
// about equal cost (multiply-adds, plus a little per item).
std::vector<int64_t> balanced_parts(const std::vector<WeightItem>& items, int64_t parts) {
  int64_t total = 0;
  for (const WeightItem& it : items) total += (it.end - it.begin) * (it.c1 - it.c0) + 64;
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    done += (items[i].end - items[i].begin) * (items[i].c1 - items[i].c0) + 64;
    if (done * parts >= total * static_cast<int64_t>(bounds.size()) && i + 1 < static_cast<int64_t>(items.size()))
      bounds.push_back(i + 1);
  }
  bounds.push_back(static_cast<int64_t>(items.size()));
  return bounds;
}

template <class T, class A>
A head_logit(const T* h, const T* w, int64_t ws, const T* b, int64_t id, int64_t d, A t) {
  A z = dot<T, A>(h, w + id * ws, d);
  if (b) z += static_cast<A>(b[id]);
  return z / t;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_fwd_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                                                              const at::Tensor& bias, const at::Tensor& token_ids,
                                                              const at::Tensor& offsets, const at::Tensor& sampled,
                                                              const at::Tensor& temperature, bool fallback) {
  const HeadOperands hd =
      head_operands("replay_from_hidden", hidden, weight, bias, token_ids, offsets, sampled, temperature);
  const RowInputs in = hd.rows.view();
  const int64_t d = hd.d;
  ForwardOutputs f = forward_outputs(hidden, in.n);
  f.logp.zero_();  // fallback rows are filled by the dense helper, which needs defined values
  f.lse.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "hidden_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* hp = hd.h.const_data_ptr<scalar_t>();
    const scalar_t* wp = hd.w.const_data_ptr<scalar_t>();
    const scalar_t* bp = hd.bias ? hd.b.const_data_ptr<scalar_t>() : nullptr;
    A* lp = f.logp.data_ptr<A>();
    A* lsp = f.lse.data_ptr<A>();
    int8_t* sp = f.status.data_ptr<int8_t>();
    at::parallel_for(0, in.n, rows_per_task(in.nnz, in.n, d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int8_t st = precheck_row(in, r);
        if (st != kReplayed) {
          sp[r] = st;
          continue;
        }
        const int64_t lo = in.off[r], hi = in.off[r + 1];
        const A t = static_cast<A>(in.ts[r]);
        A m, xy = 0;
        double s;
        bool found;
        st = support_scan(
            in.ids, lo, hi, in.vocab, in.ys[r],
            [&](int64_t id) { return head_logit<scalar_t, A>(hp + r * d, wp, hd.ws, bp, id, d, t); }, m, s, xy, found);
        if (st == kReplayed) st = row_decision(hi - lo, found, fallback);
        sp[r] = st;
        if (st != kReplayed) continue;  // fallback rows are filled below, errors raised
        const double l = lse_value(m, s);
        lsp[r] = static_cast<A>(l);
        lp[r] = static_cast<A>(static_cast<double>(xy) - l);
      }
    });
  });
  return finish_hidden_fwd(hd, f, fallback);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_bwd_cpu(const at::Tensor& grad, const at::Tensor& hidden,
                                                              const at::Tensor& weight, const at::Tensor& bias,
                                                              const at::Tensor& token_ids, const at::Tensor& offsets,
                                                              const at::Tensor& sampled, const at::Tensor& temperature,
                                                              const at::Tensor& lse, const at::Tensor& status) {
  const char* op = "replay_from_hidden_bwd";
  const HeadOperands hd = head_operands(op, hidden, weight, bias, token_ids, offsets, sampled, temperature);
  const RowInputs in = hd.rows.view();
  const int64_t n = in.n, d = hd.d, vocab = in.vocab, nnz = in.nnz;
  const SavedOperands sv =
      saved_operands(op, grad, lse, status, n, replay_out_dtype(hidden.scalar_type()), hidden.device());
  at::Tensor gh = at::empty({n, d}, hidden.options());
  // Written completely by pass 2 (zeros outside the supports).
  at::Tensor gw = at::empty({vocab, d}, weight.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor gb = hd.bias ? at::empty({vocab}, bias.options()) : at::empty({0}, hidden.options());
  const auto acc_t = replay_out_dtype(hidden.scalar_type());
  at::Tensor coef = at::zeros({nnz}, hidden.options().dtype(acc_t));
  at::Tensor row_of = at::empty({nnz}, hidden.options().dtype(at::kLong));
  at::Tensor err = row_status(hidden, n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "hidden_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* hp = hd.h.const_data_ptr<scalar_t>();
    const scalar_t* wp = hd.w.const_data_ptr<scalar_t>();
    const scalar_t* bp = hd.bias ? hd.b.const_data_ptr<scalar_t>() : nullptr;
    const A* gp = sv.g.const_data_ptr<A>();
    const A* lsp = sv.ls.const_data_ptr<A>();
    const int8_t* sp = sv.st.const_data_ptr<int8_t>();
    A* cp = coef.data_ptr<A>();
    int64_t* rp = row_of.data_ptr<int64_t>();
    int8_t* ep = err.data_ptr<int8_t>();
    scalar_t* ghp = gh.data_ptr<scalar_t>();
    // Pass 1, rows in parallel: every row checked (pass 2 reads the ids of all of them), then the
    // coefficient of every entry and grad_hidden = sum_K c_j w_j.
    at::parallel_for(0, n, rows_per_task(nnz, n, d), [&](int64_t r0, int64_t r1) {
      std::vector<A> acc(d);
      for (int64_t r = r0; r < r1; ++r) {
        int8_t e0 = precheck_row(in, r);
        if (e0 == kReplayed) e0 = check_entries(in.ids, in.off[r], in.off[r + 1], vocab);
        ep[r] = e0;
        if (e0 != kReplayed) continue;  // raised before pass 2
        const int64_t lo = in.off[r], hi = in.off[r + 1];
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t e = lo; e < hi; ++e) rp[e] = r;
        if (sp[r] == kReplayed) {  // fallback rows: coefficients stay 0, filled by the dense helper
          const A t = static_cast<A>(in.ts[r]);
          const A gt = gp[r] / t;
          const double l = static_cast<double>(lsp[r]);
          for (int64_t e = lo; e < hi; ++e) {
            const int64_t id = in.ids[e];
            const A q = prob_of(head_logit<scalar_t, A>(hp + r * d, wp, hd.ws, bp, id, d, t), l);
            const A c = grad_coef(gt, q, id == in.ys[r]);
            cp[e] = c;
            if (c != A(0)) axpy(c, wp + id * hd.ws, acc.data(), d);
          }
        }
        for (int64_t k = 0; k < d; ++k) ghp[r * d + k] = static_cast<scalar_t>(acc[k]);
      }
    });
    // From here on every id is in [0, V) and every entry has its row.
    raise_row_error("replay_from_hidden_bwd", err, hd.rows);
    // Pass 2: grad_weight[j] = sum over entries of token j of c * h[row]. Entries are grouped by
    // token (stable sort), and every column of a weight row is summed by one thread over its
    // token's entries in that order: deterministic, no atomics, accumulated in A even for bf16
    // weights, and the same bits for any thread count. The work is cut into (token, column block)
    // items of balanced cost, so a token in every row (one run of N entries) spreads over all
    // threads instead of holding one of them for N x d steps.
    at::Tensor sids, order;
    if (nnz > 0) std::tie(sids, order) = at::sort(hd.rows.ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const int32_t* sip = nnz > 0 ? sids.const_data_ptr<int32_t>() : nullptr;
    const int64_t* orp = nnz > 0 ? order.const_data_ptr<int64_t>() : nullptr;
    scalar_t* gwp = gw.data_ptr<scalar_t>();
    scalar_t* gbp = hd.bias ? gb.data_ptr<scalar_t>() : nullptr;
    const std::vector<WeightItem> items = weight_items(sip, nnz, d, at::get_num_threads());
    std::vector<char> present(vocab, 0);
    for (int64_t q = 0; q < nnz; ++q) present[sip[q]] = 1;
    // Rows of tokens in no support are zeroed here; the items write every other element once.
    at::parallel_for(0, vocab, rows_per_task(d), [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        if (present[j]) continue;
        std::memset(static_cast<void*>(gwp + j * d), 0, sizeof(scalar_t) * d);
        if (gbp) gbp[j] = scalar_t(0);
      }
    });
    const std::vector<int64_t> parts = balanced_parts(items, at::get_num_threads() * 8);
    const int64_t nparts = static_cast<int64_t>(parts.size()) - 1;  // all on this thread when the work is small
    at::parallel_for(0, nparts, nnz * d < kMinTaskWork ? std::max<int64_t>(nparts, 1) : 1, [&](int64_t p0, int64_t p1) {
      std::vector<A> acc(d);
      for (int64_t i = parts[p0]; i < parts[p1]; ++i) {
        const WeightItem& it = items[i];
        const int64_t j = sip[it.begin], cols = it.c1 - it.c0;
        std::fill(acc.begin(), acc.begin() + cols, A(0));
        double bsum = 0.0;
        for (int64_t q = it.begin; q < it.end; ++q) {
          const int64_t e = orp[q];
          const A c = cp[e];
          if (c == A(0)) continue;
          axpy(c, hp + rp[e] * d + it.c0, acc.data(), cols);
          bsum += static_cast<double>(c);
        }
        scalar_t* out = gwp + j * d + it.c0;
        for (int64_t k = 0; k < cols; ++k) out[k] = static_cast<scalar_t>(acc[k]);
        if (gbp && it.c0 == 0) gbp[j] = static_cast<scalar_t>(bsum);
      }
    });
  });
  return finish_hidden_bwd(hd, sv, err, gh, gw, gb);  // the error check again is a no-op
}

}  // namespace

TORCH_LIBRARY_IMPL(mask_replay, CPU, m) { impl_ops(m, kHeadOps, &hidden_fwd_cpu, &hidden_bwd_cpu); }

}  // namespace mask_replay
