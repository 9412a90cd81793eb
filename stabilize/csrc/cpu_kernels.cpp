// The fused CPU RMSNorm/ScaleNorm (fp32 statistics), absmax_into and head_norm_max, built by
// stabilize/cpu_kernels.py with torch.utils.cpp_extension.load (numerics and portability:
// that module's docstring). Build it ahead of a run: python -m stabilize.cpu_kernels build
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SN_X86 1
#if defined(__ELF__) && defined(__has_attribute)
#if __has_attribute(target_clones)
// One copy per ISA, chosen at load time: fast on AVX2 machines, still runs on any x86-64.
#define SN_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#endif
#ifndef SN_CLONES
#define SN_CLONES
#endif

enum Dt : int64_t { F32 = 0, BF16 = 1, F16 = 2 };
using u16 = uint16_t;

// ---- float loops (vectorized per clone; a row fits in L1, so extra passes are cheap) ----
SN_CLONES static float sumsq(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}
SN_CLONES static float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
SN_CLONES static void scale(const float* x, float r, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] * r;
}
SN_CLONES static void mul(const float* a, const float* b, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] * b[i];
}
static inline float round_bf16(float f) {  // fp32 -> bf16 -> fp32, as c10 (nearest even)
  uint32_t u; std::memcpy(&u, &f, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r; std::memcpy(&r, &u, 4);
  return f != f ? f : r;
}
// One function per rounding, no flags: GCC unswitches a flag out of the loop and then does
// not vectorize the copies (measured: 4x slower backward).
// Forward output of a row: y_hat * gamma, y_hat = x * r rounded to the activation dtype.
#define SN_FWD(NAME, V)                                                                   \
  SN_CLONES static void NAME(const float* x, float r, const float* w, float* o, int64_t n) { \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) o[i] = (V) * w[i];               \
  }
SN_FWD(fwd_f32, x[i] * r)
SN_FWD(fwd_bf16, round_bf16(x[i] * r))
// Backward, first pass over a row: acc (dgamma) += gy * y_hat (recomputed as the forward
// rounded it, or precomputed in t); g = gy * gamma; returns g . x.
#define SN_PASS1(NAME, V)                                                                  \
  SN_CLONES static float NAME(const float* x, const float* gy, const float* w, float r,    \
                              const float* t, float* acc, float* g, int64_t n) {           \
    float s = 0.f;                                                                         \
    _Pragma("omp simd reduction(+ : s)") for (int64_t i = 0; i < n; ++i) {                 \
      acc[i] += gy[i] * (V);                                                               \
      g[i] = gy[i] * w[i];                                                                 \
      s += g[i] * x[i];                                                                    \
    }                                                                                      \
    return s;                                                                              \
  }
SN_PASS1(pass1_f32, x[i] * r)
SN_PASS1(pass1_bf16, round_bf16(x[i] * r))
SN_PASS1(pass1_pre, t[i])
SN_CLONES static void dx_row(const float* g, const float* x, float r, float c, float* o,
                             int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = r * g[i] - c * x[i];
}
// bf16 <-> fp32 bit for bit as c10::BFloat16: widen by shifting; narrow round-to-nearest-even.
SN_CLONES static void bf2f(const u16* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) { uint32_t u = uint32_t(s[i]) << 16; std::memcpy(d + i, &u, 4); }
}
SN_CLONES static void f2bf(const float* s, u16* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u; std::memcpy(&u, s + i, 4);
    u16 r = u16((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    d[i] = s[i] != s[i] ? u16(0x7FC0) : r;
  }
}
// fp16: F16C instructions where the CPU has them (compilers do not vectorize _Float16), else c10.
#ifdef SN_X86
__attribute__((target("avx2,f16c"))) static void h2f_f16c(const u16* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
  for (; i < n; ++i) d[i] = _cvtsh_ss(s[i]);
}
__attribute__((target("avx2,f16c"))) static void f2h_f16c(const float* s, u16* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
}
// fp16 activations in one pass: round x * r to fp16 and back in registers (what .to(fp16)
// does), times gamma, rounded again on the store; the portable path needs four passes.
__attribute__((target("avx2,f16c"))) static void fwd_f16_f16c(const float* x, float r,
                                                             const float* w, u16* o,
                                                             int64_t n) {
  const __m256 vr = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vr);
    v = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
    _mm_storeu_si128((__m128i*)(o + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    const float t = _cvtsh_ss(_cvtss_sh(x[i] * r, _MM_FROUND_TO_NEAREST_INT));
    o[i] = _cvtss_sh(t * w[i], _MM_FROUND_TO_NEAREST_INT);
  }
}
// The backward's first pass for fp16 activations, y_hat rounded in registers (as pass1_*).
__attribute__((target("avx2,f16c"))) static float pass1_f16_f16c(const float* x,
                                                                const float* gy,
                                                                const float* w, float r,
                                                                float* acc, float* g,
                                                                int64_t n) {
  const __m256 vr = _mm256_set1_ps(r);
  __m256 vs = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i), gv = _mm256_loadu_ps(gy + i);
    __m256 t = _mm256_mul_ps(xv, vr);
    t = _mm256_cvtph_ps(_mm256_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(gv, t)));
    const __m256 gw = _mm256_mul_ps(gv, _mm256_loadu_ps(w + i));
    _mm256_storeu_ps(g + i, gw);
    vs = _mm256_add_ps(vs, _mm256_mul_ps(gw, xv));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vs);
  float s = 0.f;
  for (int k = 0; k < 8; ++k) s += lanes[k];
  for (; i < n; ++i) {
    const float t = _cvtsh_ss(_cvtss_sh(x[i] * r, _MM_FROUND_TO_NEAREST_INT));
    acc[i] += gy[i] * t;
    g[i] = gy[i] * w[i];
    s += g[i] * x[i];
  }
  return s;
}
static bool has_f16c() {
  static const bool v = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") &&
                                                   __builtin_cpu_supports("f16c"));
  return v;
}
#endif
static void h2f(const u16* s, float* d, int64_t n) {
#ifdef SN_X86
  if (has_f16c()) return h2f_f16c(s, d, n);
#endif
  for (int64_t i = 0; i < n; ++i) d[i] = float(c10::Half(s[i], c10::Half::from_bits()));
}
static void f2h(const float* s, u16* d, int64_t n) {
#ifdef SN_X86
  if (has_f16c()) return f2h_f16c(s, d, n);
#endif
  for (int64_t i = 0; i < n; ++i) d[i] = c10::Half(s[i]).x;
}

// ---- rows of any dtype <-> float ----
static const float* load(const at::Tensor& t, int64_t row, float* buf) {
  const int64_t n = t.size(1);
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>() + row * n;  // no copy
  const u16* s = reinterpret_cast<const u16*>(t.data_ptr()) + row * n;
  if (t.scalar_type() == at::kBFloat16) bf2f(s, buf, n); else h2f(s, buf, n);
  return buf;
}
static void store(const float* s, at::Tensor& t, int64_t row) {
  const int64_t n = t.size(1);
  if (t.scalar_type() == at::kFloat) {
    std::memcpy(t.data_ptr<float>() + row * n, s, n * 4);
    return;
  }
  u16* d = reinterpret_cast<u16*>(t.data_ptr()) + row * n;
  if (t.scalar_type() == at::kBFloat16) f2bf(s, d, n); else f2h(s, d, n);
}
// Round a float row to the activation dtype in place (what .to(act) does to a fp32 tensor).
static void round_to(at::ScalarType act, float* v, u16* tmp, int64_t n) {
  if (act == at::kBFloat16) { f2bf(v, tmp, n); bf2f(tmp, v, n); }
  if (act == at::kHalf) { f2h(v, tmp, n); h2f(tmp, v, n); }
}
// Enough rows per task that a thread's share is worth waking it for.
static int64_t grain(int64_t d) { return std::max<int64_t>(1, 32768 / d); }
// dgamma partials per fixed block of rows: the sum does not depend on the thread count.
static constexpr int64_t kBlock = 32;

// x: [N, D] contiguous; w: [D] fp32, gamma already cast to the activation dtype (or empty).
std::vector<at::Tensor> rms_forward(const at::Tensor& x, const at::Tensor& w, double eps,
                                    bool mean, int64_t act_code) {
  const at::ScalarType act =
      act_code == BF16 ? at::kBFloat16 : (act_code == F16 ? at::kHalf : at::kFloat);
  const int64_t N = x.size(0), D = x.size(1);
  at::Tensor y = at::empty({N, D}, x.options().dtype(act));
  at::Tensor rstd = at::empty({N}, x.options().dtype(at::kFloat));
  const std::vector<float> ones(w.numel() ? 0 : D, 1.f);  // no gamma: * 1 is exact
  const float* wp = w.numel() ? w.data_ptr<float>() : ones.data();
  float* rp = rstd.data_ptr<float>();
  const float epsf = float(eps), dd = float(D);
  at::parallel_for(0, N, grain(D), [&](int64_t r0, int64_t r1) {
    std::vector<float> xb(D), t(D);
    std::vector<u16> tmp(D);
    for (int64_t i = r0; i < r1; ++i) {
      const float* xf = load(x, i, xb.data());
      const float ss = sumsq(xf, D);
      const float r = 1.f / std::sqrt((mean ? ss / dd : ss) + epsf);  // as torch.rsqrt
      rp[i] = r;
      // explicit: (x * r).to(act) * gamma.to(act), rounded again by the store
      float* o = act == at::kFloat ? y.data_ptr<float>() + i * D : t.data();
#ifdef SN_X86
      if (act == at::kHalf && has_f16c()) {
        fwd_f16_f16c(xf, r, wp, reinterpret_cast<u16*>(y.data_ptr()) + i * D, D);
        continue;
      }
#endif
      if (act == at::kHalf) {
        scale(xf, r, o, D);
        round_to(act, o, tmp.data(), D);
        mul(o, wp, o, D);
      } else {
        (act == at::kFloat ? fwd_f32 : fwd_bf16)(xf, r, wp, o, D);
      }
      if (act != at::kFloat) store(o, y, i);
    }
  });
  return {y, rstd};
}

// gy: [N, D] contiguous in the activation dtype; returns dx (x's dtype) and dgamma (fp32).
std::vector<at::Tensor> rms_backward(const at::Tensor& gy, const at::Tensor& x,
                                     const at::Tensor& rstd, const at::Tensor& w, bool mean) {
  const int64_t N = x.size(0), D = x.size(1), nb = (N + kBlock - 1) / kBlock;
  const at::ScalarType act = gy.scalar_type();
  at::Tensor dx = at::empty_like(x);
  const float* wp = w.numel() ? w.data_ptr<float>() : nullptr;
  at::Tensor part = at::empty({wp ? nb : 0, D}, x.options().dtype(at::kFloat));
  const float* rp = rstd.data_ptr<float>();
  const float inv = mean ? 1.f / float(D) : 1.f;
  at::parallel_for(0, nb, std::max<int64_t>(1, grain(D) / kBlock), [&](int64_t b0, int64_t b1) {
    std::vector<float> xb(D), gb(D), t(D), g(D);
    std::vector<u16> tmp(D);
    for (int64_t b = b0; b < b1; ++b) {
      float* pb = wp ? part.data_ptr<float>() + b * D : nullptr;
      if (pb) std::fill(pb, pb + D, 0.f);
      for (int64_t i = b * kBlock; i < std::min(N, (b + 1) * kBlock); ++i) {
        const float* xf = load(x, i, xb.data());
        const float* gf = load(gy, i, gb.data());
        const float r = rp[i];
        const float* gx = gf;  // dL/d(x * r)
        float gdotx;
        if (wp) {
          auto pass1 = act == at::kFloat ? pass1_f32 : pass1_bf16;
#ifdef SN_X86
          if (act == at::kHalf && has_f16c()) {
            gdotx = pass1_f16_f16c(xf, gf, wp, r, pb, g.data(), D);
            gx = g.data();
            float* o = x.scalar_type() == at::kFloat ? dx.data_ptr<float>() + i * D : t.data();
            dx_row(gx, xf, r, r * r * r * gdotx * inv, o, D);
            if (x.scalar_type() != at::kFloat) store(o, dx, i);
            continue;
          }
#endif
          if (act == at::kHalf) {  // no inline fp16 rounding in portable code: a pass more
            scale(xf, r, t.data(), D);
            round_to(act, t.data(), tmp.data(), D);
            pass1 = pass1_pre;
          }
          gdotx = pass1(xf, gf, wp, r, t.data(), pb, g.data(), D);
          gx = g.data();
        } else {
          gdotx = dot(gx, xf, D);
        }
        // d/dx of x * (mean x^2 + eps)^-1/2: r * g - x * r^3 * (g . x) / D
        float* o = x.scalar_type() == at::kFloat ? dx.data_ptr<float>() + i * D : t.data();
        dx_row(gx, xf, r, r * r * r * gdotx * inv, o, D);
        if (x.scalar_type() != at::kFloat) store(o, dx, i);
      }
    }
  });
  at::Tensor dw = at::zeros({wp ? D : 0}, x.options().dtype(at::kFloat));
  if (wp) {
    float* dp = dw.data_ptr<float>();
    const float* pp = part.data_ptr<float>();
    at::parallel_for(0, D, 2048, [&](int64_t j0, int64_t j1) {
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = j0; j < j1; ++j) dp[j] += pp[b * D + j];
    });
  }
  return {dx, dw};
}

// ---- |x| max, the monitors' per-norm statistic ----
// The magnitude bits (sign cleared) compared as unsigned integers order NaN > inf > finite
// magnitudes, so one integer max (which vectorizes, unlike a float max with NaN rules) gives
// |x| max with NaN and inf propagated, in a single read of x.
SN_CLONES static uint32_t maxbits32(const uint32_t* p, int64_t n) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = p[i] & 0x7FFFFFFFu;
    m = v > m ? v : m;
  }
  return m;
}
SN_CLONES static uint32_t maxbits16(const u16* p, int64_t n) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = uint32_t(p[i]) & 0x7FFFu;
    m = v > m ? v : m;
  }
  return m;
}

// out[k] = max(out[k], |x| max), NaN if either is NaN. x: contiguous fp32/bf16/fp16;
// out: contiguous fp32. Chunks of fixed size, so the result is thread-count independent.
void absmax_into(const at::Tensor& x, at::Tensor& out, int64_t k) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.scalar_type() == at::kFloat);
  TORCH_CHECK(k >= 0 && k < out.numel(), "absmax_into: slot out of range");
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
  constexpr int64_t kChunk = 1 << 16;
  const int64_t n = x.numel(), nc = (n + kChunk - 1) / kChunk;
  std::vector<uint32_t> part(std::max<int64_t>(nc, 1), 0u);
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(n, i0 + kChunk) - i0;
      part[c] = dt == at::kFloat
                    ? maxbits32(reinterpret_cast<const uint32_t*>(x.data_ptr()) + i0, len)
                    : maxbits16(reinterpret_cast<const u16*>(x.data_ptr()) + i0, len);
    }
  });
  uint32_t b = 0;
  for (uint32_t v : part) b = std::max(b, v);
  float m;
  if (dt == at::kFloat) std::memcpy(&m, &b, 4);
  else if (dt == at::kBFloat16) { const uint32_t u = b << 16; std::memcpy(&m, &u, 4); }
  else m = float(c10::Half(u16(b), c10::Half::from_bits()));
  float* o = out.data_ptr<float>() + k;
  if (!(*o != *o) && (m != m || m > *o)) *o = m;
}

// ---- the attention bound's per-head max row norm ----
// x: [B, H, T, D], any strides but the last (1), fp32/bf16/fp16. out[h] = max over b, t of
// ||x[b, h, t]||_2, sums of squares in fp32 (16-bit rows widened first), NaN propagated: the
// attention bound's q and k pass read once, with no [B, H, T] intermediate and no copy of a
// strided view. Tasks are (b, h) pairs reduced in a fixed order: thread-count independent.
at::Tensor head_norm_max(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "head_norm_max: [B, H, T, D], last dim dense");
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  std::vector<float> part(std::max<int64_t>(B * H, 1), 0.f);
  const char* base = reinterpret_cast<const char*>(x.data_ptr());
  const int64_t es = x.element_size();
  at::parallel_for(0, B * H, std::max<int64_t>(1, 32768 / std::max<int64_t>(T * D, 1)),
                   [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(dt == at::kFloat ? 0 : D);
    for (int64_t p = p0; p < p1; ++p) {
      const char* row = base + ((p / H) * s0 + (p % H) * s1) * es;
      float m = 0.f;
      bool nan = false;
      for (int64_t t = 0; t < T; ++t, row += s2 * es) {
        const float* r = reinterpret_cast<const float*>(row);
        if (dt != at::kFloat) {
          const u16* h = reinterpret_cast<const u16*>(row);
          if (dt == at::kBFloat16) bf2f(h, buf.data(), D); else h2f(h, buf.data(), D);
          r = buf.data();
        }
        const float s = sumsq(r, D);
        nan |= s != s;
        m = s > m ? s : m;
      }
      part[p] = nan ? NAN : m;
    }
  });
  at::Tensor out = at::empty({H}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    float m = 0.f;
    bool nan = false;
    for (int64_t b = 0; b < B; ++b) {
      const float v = part[b * H + h];
      nan |= v != v;
      m = v > m ? v : m;
    }
    o[h] = nan ? NAN : std::sqrt(m);
  }
  return out;
}

// ---- AdamW's step, summed before it is taken ----
SN_CLONES static void adamw_run(const float* P, const float* G, const float* M, const float* V,
                                int64_t i0, int64_t i1, float fc, float w1, float fb2, float w2,
                                float bc2, float fe, float decay, float gain, float* out) {
  float su = 0.f, sw = 0.f, sr = 0.f;
  const float ibc2 = 1.f / bc2;
  if (M != nullptr) {  // two loops, no branch inside: each one vectorizes
#pragma omp simd reduction(+ : su, sw, sr)
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = G[i] * fc, gg = gi * gi;
      const float mi = M[i] + w1 * (gi - M[i]);
      const float vh = (V[i] * fb2 + gg * w2) * ibc2;
      const float ch = P[i] * decay + mi / (std::sqrt(vh) + fe) * gain;
      su += ch * ch;
      sw += P[i] * P[i];
      sr += vh > 0.f ? gg / vh : 0.f;
    }
  } else {
#pragma omp simd reduction(+ : su, sw, sr)
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = G[i] * fc, gg = gi * gi;
      const float vh = gg * w2 * ibc2;
      const float ch = P[i] * decay + gi * w1 / (std::sqrt(vh) + fe) * gain;
      su += ch * ch;
      sw += P[i] * P[i];
      sr += vh > 0.f ? gg / vh : 0.f;
    }
  }
  out[0] = su, out[1] = sw, out[2] = sr;
}
// adamw_sums: p, g, m, v: fp32, contiguous, the same numel (m, v: AdamW's exp_avg / exp_avg_sq; with
// has_state false they are not read: the first step's moments start at 0). c: the clipping
// coefficient the step will apply to g. Per element, in fp32 as param_stats.adamw_terms
// computes it: m' = lerp(m, c g, 1 - b1), v' = b2 v + (1 - b2) (c g)^2, vhat = v' / bc2,
// change = lr wd p + m' / (sqrt(vhat) + eps) * lr / bc1, ratio = (c g)^2 / vhat (0 where vhat
// is 0). Returns float64 [3]: the sums of change^2, p^2 and ratio (fp32 over 256 elements,
// then double, the chunks in a fixed order: thread-count independent). One read of each
// array where the torch ops made ~20 passes and as many temporaries.
at::Tensor adamw_sums(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                      const at::Tensor& v, bool has_state, double c, double lr, double wd,
                      double eps, double b1, double b2, double step) {
  const int64_t n = p.numel();
  TORCH_CHECK(p.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
              p.is_contiguous() && g.is_contiguous() && g.numel() == n, "adamw_sums: p, g");
  TORCH_CHECK(!has_state || (m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              m.is_contiguous() && v.is_contiguous() && m.numel() == n && v.numel() == n),
              "adamw_sums: m, v");
  const float fc = float(c), w1 = float(1.0 - b1), fb2 = float(b2), w2 = float(1.0 - b2);
  const float bc2 = float(1.0 - std::pow(b2, step)), fe = float(eps);
  const float decay = float(lr * wd), gain = float(lr / (1.0 - std::pow(b1, step)));
  const float* P = p.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  const float* M = has_state ? m.data_ptr<float>() : nullptr;
  const float* V = has_state ? v.data_ptr<float>() : nullptr;
  constexpr int64_t kChunk = 1 << 14;
  const int64_t nc = std::max<int64_t>((n + kChunk - 1) / kChunk, 1);
  std::vector<double> part(3 * nc, 0.0);
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t k = c0; k < c1; ++k) {
      const int64_t i0 = k * kChunk, i1 = std::min(n, i0 + kChunk);
      double su = 0.0, sw = 0.0, sr = 0.0;
      for (int64_t j = i0; j < i1; j += 256) {  // fp32 partials of 256, summed in double
        float a[3];
        adamw_run(P, G, M, V, j, std::min(i1, j + 256), fc, w1, fb2, w2, bc2, fe, decay, gain, a);
        su += a[0], sw += a[1], sr += a[2];
      }
      part[3 * k] = su, part[3 * k + 1] = sw, part[3 * k + 2] = sr;
    }
  });
  at::Tensor out = at::zeros({3}, p.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (int64_t k = 0; k < nc; ++k) o[0] += part[3 * k], o[1] += part[3 * k + 1], o[2] += part[3 * k + 2];
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // wrap_pybind_function: a TORCH_CHECK failure is a Python RuntimeError, as load_inline did
  m.def("rms_forward", torch::wrap_pybind_function(rms_forward), "rms_forward");
  m.def("rms_backward", torch::wrap_pybind_function(rms_backward), "rms_backward");
  m.def("absmax_into", torch::wrap_pybind_function(absmax_into), "absmax_into");
  m.def("head_norm_max", torch::wrap_pybind_function(head_norm_max), "head_norm_max");
  m.def("adamw_sums", torch::wrap_pybind_function(adamw_sums), "adamw_sums");
}
