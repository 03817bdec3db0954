// Host emulation of the CUDA capture kernel's selection (csrc/capture_cuda.cu): the same radix
// passes, decision functions (capture_select.h) and candidate-buffer state machine, run on one
// "block", against a brute-force transcription of the semantics. It lets machines without a GPU
// check the selection logic; the kernel's memory protocol itself needs the GPU tests.
// Usage: cuda_select_emulation [candidate capacity]; exit status 0 iff no mismatch.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "kernels/capture_scan.h"
#include "kernels/capture_select.h"
#include "kernels/det_log.h"
using namespace mask_replay;

struct P {
  float t;
  int64_t k;
  double p, mp;
};

// brute force, straight from the semantics text (the min-p log is det_log, which
// tests/ops/test_det_log.py pins to a correctly rounded reference)
std::vector<int> brute(const std::vector<float>& z, P pr) {
  int V = z.size();
  std::vector<float> x(V);
  float m = -INFINITY;
  for (int i = 0; i < V; ++i) {
    x[i] = mr_div(z[i], pr.t);
    if (std::isfinite(x[i]) && x[i] > m) m = x[i];
  }
  float thr = min_p_active(pr.mp) ? mr_add(m, det_log(pr.mp)) : kLowestFinite;
  std::vector<int> s0;
  for (int i = 0; i < V; ++i)
    if (std::isfinite(x[i]) && x[i] >= thr) s0.push_back(i);
  std::vector<int> s1 = s0;
  if (pr.k > 0 && pr.k < (int64_t)s0.size()) {
    std::vector<uint32_t> keys;
    for (int i : s0) keys.push_back(order_key(x[i]));
    std::sort(keys.rbegin(), keys.rend());
    uint32_t vk = keys[pr.k - 1];
    s1.clear();
    for (int i : s0)
      if (order_key(x[i]) >= vk) s1.push_back(i);
  }
  std::vector<int> s2 = s1;
  if (top_p_active(pr.p)) {
    int64_t Z = 0;
    std::vector<int64_t> q(V);
    for (int i : s1) {
      q[i] = mass_q(det_exp(mr_add(x[i], -m)));
      Z += q[i];
    }
    s2.clear();
    for (int i : s1) {
      int64_t A = 0;
      uint32_t ki = order_key(x[i]);
      for (int j : s1)
        if (order_key(x[j]) > ki) A += q[j];
      if (below_top_p(A, pr.p, Z)) s2.push_back(i);
    }
  }
  return s2;
}

// emulation of the kernel passes including the candidate-buffer state machine
int64_t CAP = 16;
std::vector<int> emu(const std::vector<float>& z, P pr) {
  int V = z.size();
  uint32_t mk = 0;
  for (int i = 0; i < V; ++i) {
    float x = mr_div(z[i], pr.t);
    if (std::isfinite(x)) mk = std::max(mk, order_key(x));
  }
  float m = key_value(mk);
  uint32_t k0 = min_p_active(pr.mp) ? order_key(mr_add(m, det_log(pr.mp))) : order_key(kLowestFinite);
  uint32_t k1 = 0, k2 = 0;
  std::vector<uint32_t> ck(CAP);
  std::vector<unsigned long long> cm(CAP);
  int cstate = 0;
  unsigned cand_count = 0;
  unsigned c[256];
  unsigned long long ms[256];
  auto hist = [&](uint32_t lo, uint32_t prefix, int pass) {
    for (int d = 0; d < 256; ++d) {
      c[d] = 0;
      ms[d] = 0;
    }
    if (cstate == 2) {
      for (unsigned j = 0; j < cand_count; ++j) {
        uint32_t key = ck[j];
        if ((key & radix_prefix_mask(pass)) != prefix) continue;
        int d = radix_digit(key, pass);
        c[d]++;
        ms[d] += cm[j];
      }
      return;
    }
    for (int i = 0; i < V; ++i) {
      float x = mr_div(z[i], pr.t);
      if (!std::isfinite(x)) continue;
      uint32_t key = order_key(x);
      if (key < lo || (key & radix_prefix_mask(pass)) != prefix) continue;
      int d = radix_digit(key, pass);
      unsigned long long q = mass_q(det_exp(mr_add(x, -m)));
      c[d]++;
      ms[d] += q;
      if (cstate == 1) {
        unsigned pos = cand_count++;
        if (pos < CAP) {
          ck[pos] = key;
          cm[pos] = q;
        }
      }
    }
  };
  auto advance = [&](int pass, unsigned in_bucket) {
    if (cstate == 1) {
      if (cand_count > CAP) {
        printf("OVERRUN\n");
        exit(1);
      }
      cstate = 2;
    } else if (cstate == 0 && pass <= 1 && in_bucket <= CAP) {
      cand_count = 0;
      cstate = 1;
    }
  };
  if (pr.k > 0) {
    int64_t need = pr.k;
    uint32_t prefix = 0;
    bool on = true;
    for (int pass = 0; pass < 4 && on; ++pass) {
      hist(k0, prefix, pass);
      if (pass == 0) {
        int64_t tot = 0;
        for (int d = 0; d < 256; ++d) tot += c[d];
        if (!(need < tot)) {
          on = false;
          break;
        }
      }
      int d = select_topk_digit(c, need);
      if (d < 0) {
        printf("INTERNAL topk\n");
        exit(1);
      }
      advance(pass, c[d]);
      prefix |= (uint32_t)d << (24 - 8 * pass);
      if (pass == 3) {
        k1 = prefix;
        cstate = 0;
      }
    }
  }
  if (top_p_active(pr.p)) {
    uint32_t lo = std::max(k0, k1), prefix = 0;
    int64_t above = 0, Z = 0;
    for (int pass = 0; pass < 4; ++pass) {
      hist(lo, prefix, pass);
      if (pass == 0) {
        unsigned long long t = 0;
        for (int d = 0; d < 256; ++d) t += ms[d];
        Z = t;
      }
      int d = select_topp_digit(c, ms, above, pr.p, Z);
      if (d < 0) {
        printf("INTERNAL topp\n");
        exit(1);
      }
      advance(pass, c[d]);
      prefix |= (uint32_t)d << (24 - 8 * pass);
      if (pass == 3) k2 = prefix;
    }
  }
  uint32_t kf = std::max(k0, std::max(k1, k2));
  std::vector<int> out;
  for (int i = 0; i < V; ++i) {
    float x = mr_div(z[i], pr.t);
    if (std::isfinite(x) && order_key(x) >= kf) out.push_back(i);
  }
  return out;
}

// for_each_in_slice must visit every index of the slice exactly once, with its own value,
// whatever the alignment of the row, the slice bounds and the thread count.
template <typename T>
int check_slices() {
  alignas(64) static T buf[700];
  for (int j = 0; j < 700; ++j) buf[j] = static_cast<T>(j % 251);
  int bad = 0;
  for (int shift = 0; shift < 9; ++shift) {
    const T* row = buf + shift;
    for (int64_t begin : {0, 1, 3, 8, 37}) {
      for (int64_t end : {begin, begin + 1, begin + 7, begin + 64, int64_t{600}}) {
        for (int64_t nt : {1, 3, 32, 512}) {
          std::vector<int> seen(700, 0);
          for (int64_t tid = 0; tid < nt; ++tid)
            for_each_in_slice(row, begin, end, tid, nt, [&](int64_t i, float v) {
              seen[i] += 1;
              if (v != static_cast<float>(row[i])) seen[i] += 100;
            });
          for (int64_t i = 0; i < 700; ++i)
            if (seen[i] != ((i >= begin && i < end) ? 1 : 0)) ++bad;
        }
      }
    }
  }
  return bad;
}

int main(int argc, char** argv) {
  if (check_slices<float>() + check_slices<uint16_t>()) {
    printf("slice traversal broken\n");
    return 1;
  }
  if (argc > 1) CAP = atoi(argv[1]);
  std::mt19937 rng(1);
  int bad = 0, n = 0;
  for (int it = 0; it < 1500; ++it) {
    int V = std::vector<int>{1, 2, 5, 50, 300, 1000}[rng() % 6];
    std::vector<float> z(V);
    int pat = rng() % 4;
    std::normal_distribution<float> nd(0, pat == 3 ? 50.f : 3.f);
    for (auto& v : z) {
      if (pat == 1)
        v = (float)((int)(rng() % 7) - 3) * 0.5f;
      else if (pat == 2)
        v = 1.5f;
      else
        v = nd(rng);
      if (rng() % 10 == 0) v = -INFINITY;
    }
    z[0] = 0.25f;
    P pr;
    pr.t = std::vector<float>{1.f, 0.3f, 2.f, 1e-3f}[rng() % 4];
    pr.k = std::vector<int64_t>{0, 1, 2, 7, 40, 5000}[rng() % 6];
    pr.p = std::vector<double>{1.0, 0.999, 0.9, 0.5, 0.05, 1e-9}[rng() % 6];
    pr.mp = std::vector<double>{0.0, 0.01, 0.3, 1.0}[rng() % 4];
    auto a = brute(z, pr), b = emu(z, pr);
    ++n;
    if (a != b) {
      ++bad;
      if (bad < 5)
        printf("mismatch it=%d V=%d pat=%d k=%ld p=%g mp=%g: %zu vs %zu\n", it, V, pat, (long)pr.k, pr.p, pr.mp,
               a.size(), b.size());
    }
  }
  printf("%d/%d mismatches\n", bad, n);
  return bad != 0;
}
