// Batched entropic OT (Sinkhorn), one problem at a time in L1/L2 cache, for reprlab.ot.sinkhorn.
//
// Plain C++ with a C ABI (no torch headers, so it builds in seconds and does not depend on torch's C++ ABI);
// reprlab/ot/kernel.py builds it with torch.utils.cpp_extension and calls it through ctypes, which releases
// the GIL, so Python threads run chunks of problems in parallel.
//
// Per problem: gather the valid rows (a > 0) and columns (b > 0) into a dense local copy (padding is skipped,
// not masked), absorb f = row minimum of C into the kernel K = exp((f + g - C) / eps) (g = 0), then run the
// scaling iteration s = 1 / (K (b t)), t = 1 / (K^T (a s)) with K and K^T resident in cache, as two
// register-blocked axpy mat-vecs. Every half-iteration checks the denominators: outside [LO, HI] (finite) the
// scalings are absorbed into the potentials and K is rebuilt; zero, inf or NaN (kernel under/overflow,
// eps tiny against the cost range) switches the problem to log-domain updates until the next block boundary
// (every check_every iterations), where the scaling iteration is tried again from a rebuilt kernel. Same
// iterates as the log-domain Sinkhorn of reprlab.ot.sinkhorn, up to rounding. With a tolerance each problem
// stops at its first check below it. Outputs: plan (zeros at padding), potentials, <P, C>, the plan's
// marginals, iterations, flags.
//
// The vector width comes from the build flags (kernel.py passes -mavx2 -mfma where the CPU has them):
// AVX2 8 floats / 4 doubles, otherwise 16-byte vectors (SSE2 / NEON).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#define RL_VBYTES 32
#define RL_ISA "avx2-fma"
#else
#define RL_VBYTES 16
#define RL_ISA "generic-16B"
#endif

namespace {

template <typename T>
struct Vec {
  static constexpr int W = RL_VBYTES / sizeof(T);
  typedef T V __attribute__((vector_size(RL_VBYTES)));
};

template <typename T>
inline typename Vec<T>::V vload(const T* p) {
  return *reinterpret_cast<const typename Vec<T>::V*>(p);
}
template <typename T>
inline void vstore(T* p, typename Vec<T>::V x) {
  *reinterpret_cast<typename Vec<T>::V*>(p) = x;
}

inline int64_t round_up(int64_t x, int64_t w) { return (x + w - 1) / w * w; }

// exp for float vectors (Cephes expf: range reduction by ln 2 in two parts, degree-6 polynomial, about 1 ulp);
// below ln(FLT_MIN) the result is 0 (no subnormals), above ~88.7 it saturates at 2^128 (never reached here:
// exponents are <= 0 at a kernel build up to rounding, and a build only happens after an absorption).
inline Vec<float>::V vexp(Vec<float>::V x) {
  typedef Vec<float>::V V;
  typedef int32_t I __attribute__((vector_size(RL_VBYTES)));
  const V lo = x < -87.33654475f ? V{} + 1.0f : V{};  // lanes that underflow to 0
  x = x < -87.33654475f ? V{} - 87.33654475f : x;
  x = x > 88.3762626647949f ? V{} + 88.3762626647949f : x;
  V fx = x * 1.44269504088896341f + 0.5f;
  I ni = __builtin_convertvector(fx, I);  // truncation toward zero ...
  V n = __builtin_convertvector(ni, V);
  V adj = n > fx ? V{} + 1.0f : V{};  // ... corrected to floor
  n = n - adj;
  ni = __builtin_convertvector(n, I);
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V r2 = r * r;
  V y = 1.9875691500e-4f + V{};
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
  I bits = (ni + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  y = y * scale;
  return lo > 0.0f ? V{} : y;
}

inline Vec<double>::V vexp(Vec<double>::V x) {  // float64 is not the hot path: libm per lane
  Vec<double>::V y;
  for (int i = 0; i < Vec<double>::W; ++i) y[i] = std::exp(x[i]);
  return y;
}

// log for float vectors of positive normal numbers (Cephes logf: mantissa in [sqrt(1/2), sqrt(2)), degree-8
// polynomial, about 1 ulp).
inline Vec<float>::V vlog(Vec<float>::V x) {
  typedef Vec<float>::V V;
  typedef int32_t I __attribute__((vector_size(RL_VBYTES)));
  I xi;
  std::memcpy(&xi, &x, sizeof(V));
  V e = __builtin_convertvector((xi >> 23) - 126, V);
  xi = (xi & 0x807fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  V mant;
  std::memcpy(&mant, &xi, sizeof(V));
  const V small = mant < 0.707106781186547524f ? V{} + 1.0f : V{};
  e = e - small;
  mant = mant - 1.0f + small * mant;  // m - 1, or 2m - 1 below sqrt(1/2)
  const V z = mant * mant;
  V y = 7.0376836292e-2f + V{};
  y = y * mant - 1.1514610310e-1f;
  y = y * mant + 1.1676998740e-1f;
  y = y * mant - 1.2420140846e-1f;
  y = y * mant + 1.4249322787e-1f;
  y = y * mant - 1.6668057665e-1f;
  y = y * mant + 2.0000714765e-1f;
  y = y * mant - 2.4999993993e-1f;
  y = y * mant + 3.3333331174e-1f;
  y = y * mant * z;
  y = y + e * -2.12194440e-4f;
  y = y - 0.5f * z;
  return mant + y + e * 0.693359375f;
}

inline Vec<double>::V vlog(Vec<double>::V x) {
  Vec<double>::V y;
  for (int i = 0; i < Vec<double>::W; ++i) y[i] = std::log(x[i]);
  return y;
}

// out[j, i] = in[i, j] for i < rows (rows..padded_rows of out are 0), j < cols; in has row stride ldi (a multiple
// of W), out row stride ldo (a multiple of W, >= padded rows). Vector 8x8 blocks for AVX2 floats.
template <typename T>
void transpose(const T* in, int64_t ldi, int64_t rows, int64_t cols, T* out, int64_t ldo) {
  const int64_t rows_p = round_up(rows, Vec<T>::W);
  for (int64_t j = 0; j < cols; ++j) {
    T* o = out + j * ldo;
    for (int64_t i = 0; i < rows; ++i) o[i] = in[i * ldi + j];
    for (int64_t i = rows; i < rows_p; ++i) o[i] = T(0);
  }
}

#if RL_VBYTES == 32
template <>
void transpose<float>(const float* in, int64_t ldi, int64_t rows, int64_t cols, float* out, int64_t ldo) {
  typedef Vec<float>::V V;
  typedef int32_t I __attribute__((vector_size(32)));
  for (int64_t i0 = 0; i0 < rows; i0 += 8) {
    for (int64_t j0 = 0; j0 < cols; j0 += 8) {
      V r[8];
      for (int q = 0; q < 8; ++q) r[q] = i0 + q < rows ? vload(in + (i0 + q) * ldi + j0) : V{};
      V t[8], u[8];
      for (int q = 0; q < 4; ++q) {
        t[2 * q] = __builtin_shuffle(r[2 * q], r[2 * q + 1], I{0, 8, 1, 9, 4, 12, 5, 13});
        t[2 * q + 1] = __builtin_shuffle(r[2 * q], r[2 * q + 1], I{2, 10, 3, 11, 6, 14, 7, 15});
      }
      for (int q = 0; q < 2; ++q) {
        u[4 * q] = __builtin_shuffle(t[4 * q], t[4 * q + 2], I{0, 1, 8, 9, 4, 5, 12, 13});
        u[4 * q + 1] = __builtin_shuffle(t[4 * q], t[4 * q + 2], I{2, 3, 10, 11, 6, 7, 14, 15});
        u[4 * q + 2] = __builtin_shuffle(t[4 * q + 1], t[4 * q + 3], I{0, 1, 8, 9, 4, 5, 12, 13});
        u[4 * q + 3] = __builtin_shuffle(t[4 * q + 1], t[4 * q + 3], I{2, 3, 10, 11, 6, 7, 14, 15});
      }
      for (int q = 0; q < 4; ++q) {
        const int64_t j = j0 + q;
        if (j < cols) vstore(out + j * ldo + i0, __builtin_shuffle(u[q], u[q + 4], I{0, 1, 2, 3, 8, 9, 10, 11}));
        if (j + 4 < cols)
          vstore(out + (j + 4) * ldo + i0, __builtin_shuffle(u[q], u[q + 4], I{4, 5, 6, 7, 12, 13, 14, 15}));
      }
    }
  }
}
#endif

// out[0 : NB*W] = sum_r coef[r] * M[r, 0 : NB*W] (row stride ld), accumulators in registers; rows are taken two
// at a time into separate accumulators so short outputs (NB = 2, 3) still keep the FMA pipes busy.
template <typename T, int NB>
inline void axpy_block(const T* __restrict M, int64_t ld, const T* __restrict coef, int64_t rows,
                       T* __restrict out) {
  typedef typename Vec<T>::V V;
  constexpr int W = Vec<T>::W;
  V acc0[NB], acc1[NB];
#pragma GCC unroll 16
  for (int q = 0; q < NB; ++q) acc0[q] = acc1[q] = V{};
  int64_t r = 0;
  for (; r + 1 < rows; r += 2) {
    const T c0 = coef[r], c1 = coef[r + 1];
    const T* p0 = M + r * ld;
    const T* p1 = p0 + ld;
#pragma GCC unroll 16
    for (int q = 0; q < NB; ++q) {
      acc0[q] += c0 * vload(p0 + q * W);
      acc1[q] += c1 * vload(p1 + q * W);
    }
  }
  if (r < rows) {
    const T c0 = coef[r];
    const T* p0 = M + r * ld;
#pragma GCC unroll 16
    for (int q = 0; q < NB; ++q) acc0[q] += c0 * vload(p0 + q * W);
  }
#pragma GCC unroll 16
  for (int q = 0; q < NB; ++q) vstore(out + q * W, acc0[q] + acc1[q]);
}

// out[0 : nvec*W] = coef[0 : rows] @ M (M: rows x ld, ld = nvec*W), in register blocks of at most 8 vectors.
template <typename T>
void matvec(const T* M, int64_t ld, const T* coef, int64_t rows, int64_t nvec, T* out) {
  constexpr int W = Vec<T>::W;
  int64_t q0 = 0;
  for (; nvec - q0 >= 8; q0 += 8) axpy_block<T, 8>(M + q0 * W, ld, coef, rows, out + q0 * W);
  const T* Mq = M + q0 * W;
  T* oq = out + q0 * W;
  switch (nvec - q0) {
    case 1: axpy_block<T, 1>(Mq, ld, coef, rows, oq); break;
    case 2: axpy_block<T, 2>(Mq, ld, coef, rows, oq); break;
    case 3: axpy_block<T, 3>(Mq, ld, coef, rows, oq); break;
    case 4: axpy_block<T, 4>(Mq, ld, coef, rows, oq); break;
    case 5: axpy_block<T, 5>(Mq, ld, coef, rows, oq); break;
    case 6: axpy_block<T, 6>(Mq, ld, coef, rows, oq); break;
    case 7: axpy_block<T, 7>(Mq, ld, coef, rows, oq); break;
    default: break;
  }
}

// Scalings are absorbed when a denominator leaves [LO, HI]: scalings then stay within 2^+-30 (float) or
// 2^+-200 (double) of 1, so an entry of K that underflowed at its build (< ~1e-38 / 1e-308) stays below
// ~1e-20 (float) of the plan's mass, and no product in the next half-iteration can overflow.
template <typename T>
struct Range;
template <>
struct Range<float> {
  static constexpr float LO = 0x1p-30f, HI = 0x1p30f;
};
template <>
struct Range<double> {
  static constexpr double LO = 0x1p-200, HI = 0x1p200;
};

enum Status : int32_t {  // as in kernel.py
  USED_LOG = 1,
  NONFINITE_COST = 2,
  ABSORBED = 4,
  BAD_A = 8,     // a weight of a is negative, inf or NaN
  BAD_B = 16,
  EMPTY_A = 32,  // every weight of a is 0
  EMPTY_B = 64,
};

template <typename T>
struct Work {
  // One problem's dense copy of its valid entries and the iteration state, padded to the vector width.
  int64_t n, m, np, mp;  // valid sizes, padded sizes
  T *Cl, *K, *KT, *s, *u, *t, *v, *accn, *accm, *a, *b, *f, *g, *tmp, *t0, *loga, *logb, *rows;
  bool cols_prefix;
  int64_t *ri, *ci;
  void* mem;
  bool alloc(int64_t n_max, int64_t m_max) {
    constexpr int W = Vec<T>::W;
    const int64_t npm = round_up(n_max, W), mpm = round_up(m_max, W);
    const int64_t big = n_max * mpm, bigT = mpm * npm;
    const int64_t vec = npm > mpm ? npm : mpm;
    const int64_t total_T = 2 * big + bigT + 6 * npm + 6 * mpm + 3 * vec + 16 * W;
    const size_t bytes = round_up(total_T * sizeof(T) + (n_max + m_max) * sizeof(int64_t) + 64, 64);
    mem = std::aligned_alloc(64, bytes);
    if (!mem) return false;
    T* p = static_cast<T*>(mem);
    auto take = [&](int64_t count) {
      T* q = p;
      p += round_up(count, W);
      return q;
    };
    Cl = take(big);
    K = take(big);
    KT = take(bigT);
    s = take(npm);
    u = take(npm);
    a = take(npm);
    f = take(npm);
    t = take(mpm);
    v = take(mpm);
    b = take(mpm);
    g = take(mpm);
    accn = take(vec);
    accm = take(vec);
    tmp = take(vec);
    t0 = take(mpm);
    loga = take(npm);
    logb = take(mpm);
    rows = take(npm);
    ri = reinterpret_cast<int64_t*>(p);
    ci = ri + n_max;
    return true;
  }
};

template <typename T>
class Problem {
 public:
  Problem(Work<T>& w, T eps) : w_(w), eps_(eps), inv_eps_(T(1) / eps) {}

  // Build K = exp((f + g - C) / eps) and its transpose; padding lanes are 0.
  void build_kernel() {
    constexpr int W = Vec<T>::W;
    const int64_t n = w_.n, m = w_.m, mp = w_.mp, np = w_.np;
    for (int64_t i = 0; i < n; ++i) {
      const T fi = w_.f[i];
      const T* c = w_.Cl + i * mp;
      T* k = w_.K + i * mp;
      for (int64_t j = 0; j < mp; j += W) vstore(k + j, vexp((fi + vload(w_.g + j) - vload(c + j)) * inv_eps_));
      for (int64_t j = m; j < mp; ++j) k[j] = T(0);
    }
    transpose(w_.K, mp, n, m, w_.KT, np);
  }

  void reset_scalings() {
    for (int64_t i = 0; i < w_.np; ++i) {
      w_.s[i] = T(1);
      w_.u[i] = w_.a[i];
    }
    for (int64_t j = 0; j < w_.mp; ++j) {
      w_.t[j] = T(1);
      w_.v[j] = w_.b[j];
    }
  }

  // `iters` scaling iterations (no checks inside: a non-finite state is sticky under this homogeneous map, so
  // the caller's check at the block end sees it). Padding lanes of s, u, t, v may hold inf/NaN: never read.
  void scaling_block(int64_t iters) {
    typedef typename Vec<T>::V V;
    constexpr int W = Vec<T>::W;
    const int64_t n = w_.n, m = w_.m, np = w_.np, mp = w_.mp;
    for (int64_t k = 0; k < iters; ++k) {
      // f half: s = 1 / (K (b t)), through K^T's rows: accn = sum_j v_j KT[j, :]
      if (!accn_ready_) matvec(w_.KT, np, w_.v, m, np / W, w_.accn);
      accn_ready_ = false;
      for (int64_t i = 0; i < np; i += W) {
        V s = T(1) / vload(w_.accn + i);
        vstore(w_.s + i, s);
        vstore(w_.u + i, vload(w_.a + i) * s);
      }
      // g half: t = 1 / (K^T (a s)): accm = sum_i u_i K[i, :]
      matvec(w_.K, mp, w_.u, n, mp / W, w_.accm);
      for (int64_t j = 0; j < mp; j += W) {
        V t = T(1) / vload(w_.accm + j);
        vstore(w_.t + j, t);
        vstore(w_.v + j, vload(w_.b + j) * t);
      }
    }
  }

  // 2: some scaling is zero, inf, NaN or subnormal (its reciprocal would overflow); 1: all usable but some
  // outside [LO, HI] (absorb); 0: fine.
  int scalings_state() const {
    typedef typename Vec<T>::V V;
    constexpr int W = Vec<T>::W;
    const T tiny = std::numeric_limits<T>::min(), huge = T(1) / tiny;
    V bad{}, out{};
    for (int side = 0; side < 2; ++side) {
      T* x = side ? w_.t : w_.s;
      const int64_t len = side ? w_.m : w_.n;
      for (int64_t i = len; i < round_up(len, W); ++i) x[i] = T(1);  // padding lanes: never read otherwise
      for (int64_t i = 0; i < len; i += W) {
        const V y = vload(x + i);
        bad = (y >= tiny && y <= huge) ? bad : V{} + T(1);  // NaN fails both comparisons
        out = (y < Range<T>::LO || y > Range<T>::HI) ? V{} + T(1) : out;
      }
    }
    T b = 0, o = 0;
    for (int q = 0; q < W; ++q) {
      b += bad[q];
      o += out[q];
    }
    return b > 0 ? 2 : (o > 0 ? 1 : 0);
  }

  // x[0:len] += eps * log(y[0:len]) (y positive normal; padding lanes of y set to 1 first).
  void add_eps_log(T* x, T* y, int64_t len) const {
    constexpr int W = Vec<T>::W;
    for (int64_t i = len; i < round_up(len, W); ++i) y[i] = T(1);
    for (int64_t i = 0; i < len; i += W) vstore(x + i, vload(x + i) + eps_ * vlog(vload(y + i)));
  }

  // Absorb the scalings into the potentials (f += eps log s, g += eps log t), rebuild K, reset s = t = 1.
  void absorb() {
    add_eps_log(w_.f, w_.s, w_.n);
    add_eps_log(w_.g, w_.t, w_.m);
    reset_scalings();
    build_kernel();
    accn_ready_ = false;
  }

  // L1 marginal error of P = diag(a s) K diag(b t) (scaling state): rows a s (K v) with K v kept for the next
  // f half, columns b t (K^T u) from the last g half.
  T scaling_marginal_error() {
    constexpr int W = Vec<T>::W;
    matvec(w_.KT, w_.np, w_.v, w_.m, w_.np / W, w_.accn);
    accn_ready_ = true;
    T err = 0;
    for (int64_t i = 0; i < w_.n; ++i) err += std::fabs(w_.u[i] * w_.accn[i] - w_.a[i]);
    for (int64_t j = 0; j < w_.m; ++j) err += std::fabs(w_.v[j] * w_.accm[j] - w_.b[j]);
    return err;
  }

  // Log-domain iteration on the potentials (scalings must be 1): f_i = -eps log sum_j b_j exp((g_j - C_ij)/eps),
  // then g_j = -eps log sum_i a_i exp((f_i - C_ij)/eps), max-shifted.
  void log_iteration() {
    const int64_t n = w_.n, m = w_.m, mp = w_.mp;
    for (int64_t i = 0; i < n; ++i) {
      const T* c = w_.Cl + i * mp;
      for (int64_t j = 0; j < m; ++j) w_.tmp[j] = (w_.g[j] - c[j]) * inv_eps_ + w_.logb[j];
      w_.f[i] = -eps_ * logsumexp(w_.tmp, m);
    }
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t i = 0; i < n; ++i) w_.tmp[i] = (w_.f[i] - w_.Cl[i * mp + j]) * inv_eps_ + w_.loga[i];
      w_.g[j] = -eps_ * logsumexp(w_.tmp, n);
    }
  }

  // Leave the scaling state for the log domain: potentials f, g with the scalings' logs added, scalings 1.
  void to_potentials() {
    add_eps_log(w_.f, w_.s, w_.n);
    add_eps_log(w_.g, w_.t, w_.m);
    reset_scalings();
  }

  // L1 marginal error of the log-domain plan a b exp((f + g - C)/eps).
  T log_marginal_error() {
    const int64_t n = w_.n, m = w_.m, mp = w_.mp;
    for (int64_t j = 0; j < m; ++j) w_.accm[j] = T(0);
    T err = 0;
    for (int64_t i = 0; i < n; ++i) {
      T row = 0;
      for (int64_t j = 0; j < m; ++j) {
        const T p = w_.a[i] * w_.b[j] * std::exp((w_.f[i] + w_.g[j] - w_.Cl[i * mp + j]) * inv_eps_);
        row += p;
        w_.accm[j] += p;
      }
      err += std::fabs(row - w_.a[i]);
    }
    for (int64_t j = 0; j < m; ++j) err += std::fabs(w_.accm[j] - w_.b[j]);
    return err;
  }

 private:
  T logsumexp(T* x, int64_t len) {
    typedef typename Vec<T>::V V;
    constexpr int W = Vec<T>::W;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < len; ++i) mx = x[i] > mx ? x[i] : mx;
    const int64_t padded = round_up(len, W);
    for (int64_t i = len; i < padded; ++i) x[i] = -std::numeric_limits<T>::infinity();
    V acc{};
    for (int64_t i = 0; i < padded; i += W) acc += vexp(vload(x + i) - mx);
    T sum = 0;
    for (int q = 0; q < W; ++q) sum += acc[q];
    return mx + std::log(sum);
  }

  Work<T>& w_;
  const T eps_, inv_eps_;
  bool accn_ready_ = false;  // accn holds K v for the current K and v (computed by a convergence check)
};

template <typename T>
struct Args {
  const T *C, *a, *b;
  int64_t n, m;
  T eps;
  int64_t iters;
  double tol;  // < 0: none
  int64_t check_every;
  T *plan, *f, *g;
  double *cost, *err, *ent;  // <P, C>; L1 marginal error; eps * sum P (log P - 1), log P from the potentials
  int32_t *iters_out, *flags;
};

// Check problem p's weights (flags BAD_* / EMPTY_*, 0 if fine) and their sums.
template <typename T>
int32_t check_weights(const Args<T>& A, int64_t p, T& suma, T& sumb) {
  const T* ap = A.a + p * A.n;
  const T* bp = A.b + p * A.m;
  int32_t flags = 0;
  suma = sumb = T(0);
  for (int64_t i = 0; i < A.n; ++i) {
    if (!(ap[i] >= T(0) && ap[i] <= std::numeric_limits<T>::max())) flags |= BAD_A;
    suma += ap[i];
  }
  for (int64_t j = 0; j < A.m; ++j) {
    if (!(bp[j] >= T(0) && bp[j] <= std::numeric_limits<T>::max())) flags |= BAD_B;
    sumb += bp[j];
  }
  if (!(flags & BAD_A) && !(suma > T(0))) flags |= EMPTY_A;
  if (!(flags & BAD_B) && !(sumb > T(0))) flags |= EMPTY_B;
  return flags;
}

// Gather the valid rows/columns of problem p into w (dense, padded to the vector width), weights renormalised to
// sum to 1; f = row minimum. Returns false if a valid cost is not finite.
template <typename T>
bool gather(const Args<T>& A, Work<T>& w, int64_t p, T suma, T sumb) {
  typedef typename Vec<T>::V V;
  constexpr int W = Vec<T>::W;
  const int64_t N = A.n, M = A.m;
  const T* C = A.C + p * N * M;
  const T* ap = A.a + p * N;
  const T* bp = A.b + p * M;
  int64_t n = 0, m = 0;
  for (int64_t i = 0; i < N; ++i)
    if (ap[i] > T(0)) w.ri[n++] = i;
  for (int64_t j = 0; j < M; ++j)
    if (bp[j] > T(0)) w.ci[m++] = j;
  w.n = n;
  w.m = m;
  w.np = round_up(n, W);
  w.mp = round_up(m, W);
  w.cols_prefix = w.ci[m - 1] == m - 1;  // valid columns are 0..m-1 (padding at the end, the common layout)
  const int64_t mp = w.mp;
  V nonfinite{};  // c * 0 is 0 for finite c, NaN for inf or NaN
  for (int64_t i = 0; i < n; ++i) {
    const T* crow = C + w.ri[i] * M;
    T* cl = w.Cl + i * mp;
    if (w.cols_prefix) {
      std::memcpy(cl, crow, sizeof(T) * m);
    } else {
      for (int64_t j = 0; j < m; ++j) cl[j] = crow[w.ci[j]];
    }
    for (int64_t j = m; j < mp; ++j) cl[j] = std::numeric_limits<T>::infinity();  // for the minimum
    V mn = vload(cl);
    for (int64_t j = W; j < mp; j += W) {
      const V x = vload(cl + j);
      mn = x < mn ? x : mn;
    }
    T fi = mn[0];
    for (int q = 1; q < W; ++q) fi = mn[q] < fi ? mn[q] : fi;
    for (int64_t j = m; j < mp; ++j) cl[j] = T(0);
    for (int64_t j = 0; j < mp; j += W) nonfinite += vload(cl + j) * T(0);
    w.f[i] = fi;  // f absorbed as the row minimum: every row of the first kernel has an entry equal to 1
  }
  for (int q = 0; q < W; ++q)
    if (nonfinite[q] != T(0)) return false;
  for (int64_t i = 0; i < w.np; ++i) {
    w.a[i] = i < n ? ap[w.ri[i]] / suma : T(0);
    if (i >= n) w.f[i] = T(0);
  }
  for (int64_t j = 0; j < w.mp; ++j) {
    w.b[j] = j < m ? bp[w.ci[j]] / sumb : T(0);
    w.g[j] = T(0);
  }
  return true;
}

// Write the plan P = (a s)_i K_ij (b t)_j (scaling state) or a_i b_j exp((f_i + g_j - C_ij)/eps) (log state)
// into the padded output layout (zeros at padding), with its marginals, <P, C>, and the potentials.
template <typename T>
void write_outputs(const Args<T>& A, Work<T>& w, Problem<T>& pr, int64_t p, bool log_state) {
  typedef typename Vec<T>::V V;
  constexpr int W = Vec<T>::W;
  const int64_t N = A.n, M = A.m, n = w.n, m = w.m, mp = w.mp;
  T* P = A.plan + p * N * M;
  T* fo = A.f + p * N;
  T* go = A.g + p * M;
  T* ro = w.rows;  // the plan's row sums, in the gathered (valid-row) order
  std::memset(fo, 0, sizeof(T) * N);
  std::memset(go, 0, sizeof(T) * M);
  for (int64_t j = 0; j < mp; ++j) w.accm[j] = T(0);  // column sums
  for (int64_t j = m; j < mp; ++j) w.v[j] = T(0);  // padding lanes may hold 0 * inf from the iteration
  if (log_state) {  // the plan from the potentials, into K (no longer needed)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < mp; j += W)
        vstore(w.K + i * mp + j, vexp((w.f[i] + vload(w.g + j) - vload(w.Cl + i * mp + j)) / A.eps));
    for (int64_t i = 0; i < w.np; ++i) w.u[i] = w.a[i];
    for (int64_t j = 0; j < mp; ++j) w.v[j] = w.b[j];
  }
  double cost = 0;
  int64_t next = 0;  // next output row to write
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = w.ri[i];
    if (r > next) std::memset(P + next * M, 0, sizeof(T) * M * (r - next));  // padded rows
    next = r + 1;
    const T ui = w.u[i];
    const T* k = w.K + i * mp;
    const T* cl = w.Cl + i * mp;
    V rowv{}, cv{};
    for (int64_t j = 0; j < mp; j += W) {  // padding lanes: K = 0 and b = 0 there
      const V pv = ui * vload(k + j) * vload(w.v + j);
      vstore(w.tmp + j, pv);
      rowv += pv;
      cv += pv * vload(cl + j);
      vstore(w.accm + j, vload(w.accm + j) + pv);
    }
    T row = 0;
    double c_row = 0;
    for (int q = 0; q < W; ++q) {
      row += rowv[q];
      c_row += double(cv[q]);
    }
    T* Prow = P + r * M;
    if (w.cols_prefix) {
      std::memcpy(Prow, w.tmp, sizeof(T) * m);
      if (M > m) std::memset(Prow + m, 0, sizeof(T) * (M - m));
    } else {
      std::memset(Prow, 0, sizeof(T) * M);
      for (int64_t j = 0; j < m; ++j) Prow[w.ci[j]] = w.tmp[j];
    }
    ro[i] = row;
    cost += c_row;
  }
  if (N > next) std::memset(P + next * M, 0, sizeof(T) * M * (N - next));
  if (!log_state) {
    pr.add_eps_log(w.f, w.s, n);
    pr.add_eps_log(w.g, w.t, m);
  }
  for (int64_t i = 0; i < n; ++i) fo[w.ri[i]] = w.f[i];
  for (int64_t j = 0; j < m; ++j) go[w.ci[j]] = w.g[j];
  // L1 marginal error, and the entropy term through the marginals: log P = log a + log b + (f + g - C) / eps, so
  // eps sum P log P = sum_i rows_i (eps log a_i + f_i) + sum_j cols_j (eps log b_j + g_j) - <P, C>.
  double err = 0, plogp = -cost, mass = 0;
  for (int64_t i = 0; i < n; ++i) {
    err += std::fabs(double(ro[i]) - double(w.a[i]));
    plogp += double(ro[i]) * (double(A.eps) * std::log(double(w.a[i])) + double(w.f[i]));
    mass += double(ro[i]);
  }
  for (int64_t j = 0; j < m; ++j) {
    err += std::fabs(double(w.accm[j]) - double(w.b[j]));
    plogp += double(w.accm[j]) * (double(A.eps) * std::log(double(w.b[j])) + double(w.g[j]));
  }
  A.cost[p] = cost;
  A.err[p] = err;
  A.ent[p] = plogp - double(A.eps) * mass;
}

template <typename T>
void solve_one(const Args<T>& A, Work<T>& w, int64_t p) {
  T suma, sumb;
  const int32_t bad = check_weights(A, p, suma, sumb);
  if (bad || !gather(A, w, p, suma, sumb)) {
    A.flags[p] = bad ? bad : NONFINITE_COST;
    A.iters_out[p] = 0;
    A.cost[p] = A.err[p] = A.ent[p] = NAN;
    return;
  }
  Problem<T> pr(w, A.eps);
  pr.reset_scalings();
  pr.build_kernel();
  int32_t flags = 0;
  bool log_state = false;
  const bool check = A.tol >= 0;
  int64_t done = 0;
  while (done < A.iters) {
    // blocks end at multiples of check_every (and at iters)
    const int64_t to_boundary = A.check_every - done % A.check_every;
    const int64_t block = to_boundary < A.iters - done ? to_boundary : A.iters - done;
    if (!log_state) {
      std::memcpy(w.t0, w.t, sizeof(T) * w.m);  // the block's start (f, g are in K; s is recomputed)
      pr.scaling_block(block);
      const int st = pr.scalings_state();
      if (st == 2) {
        // Over/underflow (eps tiny against the cost range): redo this block in the log domain from its start.
        std::memcpy(w.t, w.t0, sizeof(T) * w.m);
        for (int64_t i = 0; i < w.n; ++i) w.s[i] = T(1);
        pr.to_potentials();
        if (!(flags & USED_LOG)) {  // log weights, first time in the log domain
          for (int64_t i = 0; i < w.n; ++i) w.loga[i] = std::log(w.a[i]);
          for (int64_t j = 0; j < w.m; ++j) w.logb[j] = std::log(w.b[j]);
        }
        log_state = true;
        flags |= USED_LOG;
      } else {
        done += block;
        if (check && done < A.iters && !(pr.scaling_marginal_error() > T(A.tol))) break;
        if (st == 1) {
          pr.absorb();
          flags |= ABSORBED;
        }
        continue;
      }
    }
    for (int64_t k = 0; k < block; ++k) pr.log_iteration();
    done += block;
    if (check && done < A.iters && !(pr.log_marginal_error() > T(A.tol))) break;
    if (done < A.iters) {  // try the scaling iteration again, from a kernel with the potentials absorbed
      pr.build_kernel();
      log_state = false;
    }
  }
  write_outputs(A, w, pr, p, log_state);
  A.iters_out[p] = int32_t(done);
  A.flags[p] = flags;
}

template <typename T>
int solve_range(const Args<T>& A, int64_t lo, int64_t hi) {
  Work<T> w;
  if (!w.alloc(A.n, A.m)) return 1;
  for (int64_t p = lo; p < hi; ++p) solve_one(A, w, p);
  std::free(w.mem);
  return 0;
}

}  // namespace

extern "C" {

const char* rl_ot_isa() { return RL_ISA; }

// Peak-throughput probe for the benchmark's compute bound: 12 independent chains of float multiply-adds
// (fused where the build has FMA) in vector registers, `reps` times; returns the float operations done
// (2 per multiply-add per lane). `seed` keeps the compiler from folding the loop.
double rl_ot_fma_probe(int64_t reps, float seed) {
  typedef Vec<float>::V V;
  constexpr int W = Vec<float>::W;
  V acc[12];
  for (int q = 0; q < 12; ++q) acc[q] = V{} + (seed + float(q));
  volatile float xs = 0.999999f, ys = 1e-7f;  // opaque to the optimiser
  const V x = V{} + xs, y = V{} + ys;
  for (int64_t r = 0; r < reps; ++r) {
#pragma GCC unroll 12
    for (int q = 0; q < 12; ++q) acc[q] = acc[q] * x + y;
  }
  V sum{};
  for (int q = 0; q < 12; ++q) sum += acc[q];
  volatile float sink = sum[0];
  (void)sink;
  return double(reps) * 12 * W * 2;
}

// ABI version: kernel.py refuses a cached library whose version differs.
int rl_ot_abi_version() { return 2; }

int rl_ot_sinkhorn_f32(const float* C, const float* a, const float* b, int64_t lo, int64_t hi, int64_t n,
                       int64_t m, double eps, int64_t iters, double tol, int64_t check_every, float* plan,
                       float* f, float* g, double* cost, double* err, double* ent, int32_t* iters_out,
                       int32_t* flags) {
  Args<float> A{C, a, b, n, m, float(eps), iters, tol, check_every, plan, f, g, cost, err, ent, iters_out, flags};
  return solve_range(A, lo, hi);
}

int rl_ot_sinkhorn_f64(const double* C, const double* a, const double* b, int64_t lo, int64_t hi, int64_t n,
                       int64_t m, double eps, int64_t iters, double tol, int64_t check_every, double* plan,
                       double* f, double* g, double* cost, double* err, double* ent, int32_t* iters_out,
                       int32_t* flags) {
  Args<double> A{C, a, b, n, m, eps, iters, tol, check_every, plan, f, g, cost, err, ent, iters_out, flags};
  return solve_range(A, lo, hi);
}

}  // extern "C"
