// The elementwise steps between a decoder layer's products, for forwards of a few rows on a CPU, one call each:
//
//     rms_norm:  y_ij = w_j x_ij / sqrt(mean_j x_ij^2 + eps)
//     rope:      per head h, first half a = x[h, :D/2], second half b = x[h, D/2:], c = cos, s = sin of the row:
//                y[h, :D/2] = a c[:D/2] - b s[:D/2],   y[h, D/2:] = b c[D/2:] + a s[D/2:]
//                (x cos + rotate_half(x) sin), written as (1, heads, rows, D): the layout attention reads
//     silu_mul:  y = g sigmoid(g) u   (ATen's own silu and product, called from here)
//     attend:    a layer's attention for a few query rows on top of a cached prefix (below)
//
// A few rows make each step a few microseconds of arithmetic, which PyTorch spreads over several operators of
// about as many microseconds of dispatch each; here each is one call. Every row is computed alone, in a fixed
// order, so a row's output does not depend on the other rows of the call or on the threads. rope's products and
// sums are transformers' own (x cos + rotate_half(x) sin, each product and the sum rounded once): the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 64;  // a draft or verification forward's rows run on one thread; a prompt's split

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              name, ": expected a 2-D fp32 CPU tensor with contiguous rows, got ", x.sizes(), " ", x.scalar_type());
}

// y (rows, width) = w x / sqrt(mean x^2 + eps) per row of x (rows, width; row stride x_stride)
void rms_norm_rows(const float* x, int64_t x_stride, int64_t rows, int64_t width, const float* w, double eps,
                   float* y) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x + i * x_stride;
      float* yi = y + i * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < width; ++j) squares += xi[j] * xi[j];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) yi[j] = w[j] * (xi[j] * inv);
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == width,
              "rms_norm weight: expected ", width, " contiguous fp32 values");
  auto y = torch::empty({rows, width}, x.options());
  rms_norm_rows(x.data_ptr<float>(), x.stride(0), rows, width, weight.data_ptr<float>(), eps, y.data_ptr<float>());
  return y;
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads) {
  check_rows(x, "rope x");
  check_rows(cos, "rope cos");
  check_rows(sin, "rope sin");
  const int64_t rows = x.size(0), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(x.size(1) == heads * dim && dim % 2 == 0 && cos.size(0) == rows && sin.sizes() == cos.sizes(),
              "rope: x ", x.sizes(), " is not ", heads, " heads of the cos/sin width ", cos.sizes());
  auto y = torch::empty({1, heads, rows, dim}, x.options());
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cos.data_ptr<float>() + i * cos.stride(0);
      const float* s = sin.data_ptr<float>() + i * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        const float* a = x.data_ptr<float>() + i * x.stride(0) + h * dim;
        const float* b = a + half;
        float* out = y.data_ptr<float>() + (h * rows + i) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          out[j] = a[j] * c[j] - b[j] * s[j];
          out[half + j] = b[j] * c[half + j] + a[j] * s[half + j];
        }
      }
    }
  });
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  auto y = at::silu(gate);  // ATen's vectorized exp; two calls from C++ cost about what one from Python does
  return y.mul_(up);
}

// Attention's inner loops for one query head over its visible slots: scores s_t = scale (q . k_t), weights
// exp(s_t - max s) and their sum, and acc += w_t v_t. Each is a fixed sequence of operations on its own operands
// (per head, per slot, in slot order), so a row's result does not depend on the call it is in. A fp32 cache whose
// head width is a multiple of 16 runs them on vectors of 16 floats (one AVX-512 register, two AVX2 ones); the
// exponential is then Cephes' polynomial expf (a relative error of about 2^-23), flushed to 0 below e^-87.
typedef float Floats __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

inline float lane_sum(Floats v) {  // a fixed tree over the lanes
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float x[kLanes];
  store(x, v);
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j) x[j] += x[j + width];
  return x[0];
#endif
}

inline bool any_above(Floats v, float bound) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(bound), _CMP_GT_OQ) != 0;
#else
  const Ints above = v > bound;
  bool any = false;
  for (int64_t lane = 0; lane < kLanes; ++lane) any |= above[lane] != 0;
  return any;
#endif
}

inline Floats exp_lanes(const Floats x) {  // e^x for x <= 0: 2^n p(r), x = n ln 2 + r, |r| <= ln(2) / 2
  const Ints keep = x >= -87.33654f;  // the lanes below give 0
  const Floats n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const Floats r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Floats p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Floats y = (p * (r * r) + r) + 1.0f;
  const Ints two_n = (__builtin_convertvector(n, Ints) + 127) << 23;
  return (Floats)((Ints)(y * (Floats)two_n) & keep);
}

template <typename T>
void head_scores(const T* q, const T* keys, const int64_t* slots, int64_t count, int64_t dim, T scale, T* s) {
  for (int64_t t = 0; t < count; ++t) {
    const T* k = keys + slots[t] * dim;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
    s[t] = dot * scale;
  }
}

inline void head_scores(const float* q, const float* keys, const int64_t* slots, int64_t count, int64_t dim,
                        float scale, float* s) {
  if (dim % kLanes) return head_scores<float>(q, keys, slots, count, dim, scale, s);
  for (int64_t t = 0; t < count; ++t) {
    const float* k = keys + slots[t] * dim;
    Floats even = {}, odd = {};
    int64_t d = 0;
    for (; d + 2 * kLanes <= dim; d += 2 * kLanes) {
      even += load(q + d) * load(k + d);
      odd += load(q + d + kLanes) * load(k + d + kLanes);
    }
    if (d < dim) even += load(q + d) * load(k + d);
    s[t] = lane_sum(even + odd) * scale;
  }
}

template <typename T>
T exp_weights(T* s, int64_t count) {  // s_t -> exp(s_t - max s); returns their sum, in slot order
  T peak = -std::numeric_limits<T>::infinity(), total = 0;
  for (int64_t t = 0; t < count; ++t) peak = std::max(peak, s[t]);
  for (int64_t t = 0; t < count; ++t) {
    s[t] = std::exp(s[t] - peak);
    total += s[t];
  }
  return total;
}

inline float exp_weights(float* s, int64_t count) {  // s holds room for count rounded up to 16
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < count; ++t) peak = std::max(peak, s[t]);
  Floats total = {};
  for (int64_t t = 0; t < count; t += kLanes) {
    Floats w = exp_lanes(load(s + t) - peak);
    if (t + kLanes > count)  // lanes past the last slot weigh nothing
      for (int64_t j = count - t; j < kLanes; ++j) w[j] = 0.0f;
    store(s + t, w);
    total += w;
  }
  return lane_sum(total);
}

template <typename T>
void weighted_sum(const T* w, const T* values, const int64_t* slots, int64_t count, int64_t dim, T* acc) {
  std::fill(acc, acc + dim, T(0));  // acc = sum_t w_t v_t, in slot order
  for (int64_t t = 0; t < count; ++t) {
    const T* v = values + slots[t] * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += w[t] * v[d];
  }
}

template <int L>  // columns [0, 16 L) of a head's acc, held in L vectors
void weighted_columns(const float* w, const float* values, const int64_t* slots, int64_t count, int64_t dim,
                      float* acc) {
  Floats sum[L] = {};
  for (int64_t t = 0; t < count; ++t) {
    const float* v = values + slots[t] * dim;
#pragma GCC unroll 8
    for (int l = 0; l < L; ++l) sum[l] += w[t] * load(v + l * kLanes);
  }
  for (int l = 0; l < L; ++l) store(acc + l * kLanes, sum[l]);
}

inline void weighted_sum(const float* w, const float* values, const int64_t* slots, int64_t count, int64_t dim,
                         float* acc) {
  if (dim % kLanes) return weighted_sum<float>(w, values, slots, count, dim, acc);
  for (int64_t d = 0; d < dim;) {  // in pieces of 8, 4, 2 and 1 vectors
    const int64_t left = (dim - d) / kLanes;
    if (left >= 8) {
      weighted_columns<8>(w, values + d, slots, count, dim, acc + d), d += 8 * kLanes;
    } else if (left >= 4) {
      weighted_columns<4>(w, values + d, slots, count, dim, acc + d), d += 4 * kLanes;
    } else if (left >= 2) {
      weighted_columns<2>(w, values + d, slots, count, dim, acc + d), d += 2 * kLanes;
    } else {
      weighted_columns<1>(w, values + d, slots, count, dim, acc + d), d += kLanes;
    }
  }
}

// attend: rope the rows' queries and keys, store keys and values at cache slots start .. start + n - 1, and attend.
// Query row i of head h (key/value head g = h / (H / G)) sees slot j < start + n where mask[i][j] (a committed
// prefix, the scratch entries of earlier draft levels that are its ancestors, this call's rows); over those keys, in
// ascending slot order,
//     s_j = scale (q . k_j),   out = sum_j exp(s_j - max s) v_j / sum_j exp(s_j - max s)
// in the cache's type T (float64 for a model attending in float64, eagle_fsd.target_quant). A row's result depends
// on its query and its visible keys only, summed over a list of them in a fixed order (masked keys are skipped, not
// zeroed): a plain decoding step and a tree verification give a token the same bits. The work is rows x keys x dim,
// so this is for a few rows; a prompt goes to SDPA.
template <typename T>
void attend_rows(const float* qkv, int64_t qkv_stride, const float* cos, const float* sin, T* keys, T* values,
                 int64_t max_len, int64_t start, const bool* mask, int64_t n, int64_t heads, int64_t kv_heads,
                 int64_t dim, double scale, float* out) {
  const int64_t half = dim / 2, group = heads / kv_heads;
  std::vector<float> roped(dim);
  for (int64_t i = 0; i < n; ++i) {  // keys and values of this call into the cache
    const float* row = qkv + i * qkv_stride;
    const float *c = cos + i * dim, *s = sin + i * dim;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* a = row + (heads + g) * dim;
      const float* b = a + half;
      for (int64_t j = 0; j < half; ++j) {
        roped[j] = a[j] * c[j] - b[j] * s[j];
        roped[half + j] = b[j] * c[half + j] + a[j] * s[half + j];
      }
      T* k = keys + (g * max_len + start + i) * dim;
      T* v = values + (g * max_len + start + i) * dim;
      const float* v_in = row + (heads + kv_heads + g) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        k[d] = static_cast<T>(roped[d]);
        v[d] = static_cast<T>(v_in[d]);
      }
    }
  }
  const int64_t width = start + n;
  std::vector<std::vector<int64_t>> visible(n);  // each row's visible slots, ascending
  for (int64_t i = 0; i < n; ++i) {
    visible[i].reserve(width);
    for (int64_t j = 0; j < width; ++j)
      if (mask[i * width + j]) visible[i].push_back(j);
  }
  // One task is a row and a key/value head with the `group` query heads that share it, which read its keys and values
  // one after the other, from the core's caches after the first. Tasks run head-major, so a thread's consecutive
  // tasks read the same head's cache.
  const int64_t work = width * dim * group;  // multiply-adds of one task, twice
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(work, 1));
  const int64_t room = (width + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, n * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> q(group * dim), scores(group * room), acc(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / n, i = task % n;
      const float *c = cos + i * dim, *s = sin + i * dim;
      const std::vector<int64_t>& slots = visible[i];
      const int64_t count = static_cast<int64_t>(slots.size());
      const T* key_head = keys + g * max_len * dim;
      const T* value_head = values + g * max_len * dim;
      for (int64_t u = 0; u < group; ++u) {
        const float* row = qkv + i * qkv_stride + (g * group + u) * dim;
        T* qu = q.data() + u * dim;
        for (int64_t j = 0; j < half; ++j) {  // rope in fp32, as the keys were
          qu[j] = static_cast<T>(row[j] * c[j] - row[half + j] * s[j]);
          qu[half + j] = static_cast<T>(row[half + j] * c[half + j] + row[j] * s[half + j]);
        }
        head_scores(qu, key_head, slots.data(), count, dim, static_cast<T>(scale), scores.data() + u * room);
        const T total = exp_weights(scores.data() + u * room, count);
        weighted_sum(scores.data() + u * room, value_head, slots.data(), count, dim, acc.data());
        float* o = out + i * heads * dim + (g * group + u) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<float>(acc[d] / total);
      }
    }
  });
}

torch::Tensor attend(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& keys, const torch::Tensor& values, int64_t start,
                     const torch::Tensor& mask, int64_t heads, int64_t kv_heads, double scale) {
  check_rows(qkv, "attend qkv");
  check_rows(cos, "attend cos");
  check_rows(sin, "attend sin");
  const int64_t n = qkv.size(0), dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && kv_heads > 0 && heads % kv_heads == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "attend: qkv ", qkv.sizes(), " is not q | k | v of ", heads, " + 2 x ", kv_heads, " heads of width ",
              dim);
  TORCH_CHECK(cos.size(0) == n && sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "attend: cos/sin ", cos.sizes(), " are not ", n, " contiguous rows");
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.size(1) == kv_heads && keys.size(3) == dim &&
              keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous() &&
              values.scalar_type() == keys.scalar_type(),
              "attend: the cache ", keys.sizes(), " is not (1, ", kv_heads, ", max_len, ", dim, ") contiguous");
  TORCH_CHECK(start >= 0 && start + n <= keys.size(2), "attend: ", n, " rows at slot ", start,
              " overflow the cache of ", keys.size(2));
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == n &&
              mask.size(1) == start + n && mask.is_contiguous(),
              "attend: mask must be a contiguous (", n, ", ", start + n, ") bool mask, got ", mask.sizes(), " ",
              mask.scalar_type());
  auto out = torch::empty({n, heads * dim}, qkv.options());
  const float* rows = qkv.data_ptr<float>();
  if (keys.scalar_type() == torch::kFloat64) {
    attend_rows<double>(rows, qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), keys.data_ptr<double>(),
                        values.data_ptr<double>(), keys.size(2), start, mask.data_ptr<bool>(), n, heads, kv_heads,
                        dim, scale, out.data_ptr<float>());
  } else {
    TORCH_CHECK(keys.scalar_type() == torch::kFloat32, "attend: the cache must be fp32 or fp64, got ",
                keys.scalar_type());
    attend_rows<float>(rows, qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), keys.data_ptr<float>(),
                       values.data_ptr<float>(), keys.size(2), start, mask.data_ptr<bool>(), n, heads, kv_heads,
                       dim, scale, out.data_ptr<float>());
  }
  return out;
}

// A product of the layer loop below: y (rows, ldy) columns [0, 16 blocks) = x (rows, k) W^T + bias, the C entry of
// int4_rows.cpp or int8_rows.cpp (weights, qsum, scale and `inner` (groups or chunks) as that kernel packs them).
using RowProduct = void (*)(const float* x, int64_t rows, int64_t k, const void* weights, const int32_t* qsum,
                            const float* scale, const float* bias, int64_t blocks, int64_t inner, float* y,
                            int64_t ldy);

struct ProductCall {  // one kernel call, writing columns [offset, offset + 16 blocks) of its part's output
  RowProduct entry;
  const void* weights;
  const int32_t* qsum;
  const float* scale;
  const float* bias;
  int64_t k, blocks, inner, offset;
};

enum Part { kQkv, kO, kGateUp, kDown, kParts };

const void* pointer_or_null(const torch::Tensor& t) { return t.numel() ? t.data_ptr() : nullptr; }

// A whole decoder forward of a few rows on top of a cached prefix, for a model whose every layer product is an own
// kernel (int4_rows, int8_rows): per layer
//     h = RMSNorm_1(x);  qkv = h W_qkv;  x += attend(qkv) W_o;  h = RMSNorm_2(x);  x += silu_mul(h W_gate, h W_up) W_down
// then the final RMSNorm: eagle_fsd.fused_decoder's forward step for step (the same functions on the same operands,
// so the same bits), without an operator or a Python call between them.
// calls: one row per kernel call, [layer, part, entry address, k, blocks, inner, offset]; weights: four tensors per
// call (packed, qsum, scale, bias; empty where the kernel takes none); norms: 2 per layer then the final one.
torch::Tensor rows_forward(const torch::Tensor& embeds, const std::vector<std::vector<int64_t>>& calls,
                           const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& norms,
                           double eps, const torch::Tensor& cos, const torch::Tensor& sin,
                           const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                           int64_t start, const torch::Tensor& mask, int64_t heads, int64_t kv_heads, double scale,
                           int64_t intermediate) {
  check_rows(embeds, "rows_forward embeds");
  const int64_t n = embeds.size(0), hidden = embeds.size(1), layers = static_cast<int64_t>(keys.size());
  const int64_t dim = cos.size(1), qkv_width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(values.size() == keys.size() && norms.size() == static_cast<size_t>(2 * layers + 1) &&
              weights.size() == 4 * calls.size(), "rows_forward: ", layers, " layers need as many key and value "
              "caches, 2 x layers + 1 norms and 4 weight tensors per call");
  TORCH_CHECK(cos.size(0) == n && sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
              mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.size(0) == n &&
              mask.size(1) == start + n, "rows_forward: cos/sin (n, dim) and a contiguous (n, start + n) bool mask");
  std::vector<std::vector<ProductCall>> plan(layers * kParts);
  const int64_t widths[kParts] = {qkv_width, hidden, 2 * intermediate, hidden};
  const int64_t inputs[kParts] = {hidden, heads * dim, hidden, intermediate};
  for (size_t c = 0; c < calls.size(); ++c) {
    const std::vector<int64_t>& row = calls[c];
    TORCH_CHECK(row.size() == 7 && row[0] >= 0 && row[0] < layers && row[1] >= 0 && row[1] < kParts,
                "rows_forward: call ", c, " is not [layer, part, entry, k, blocks, inner, offset]");
    TORCH_CHECK(row[3] == inputs[row[1]] && row[6] >= 0 && row[6] + 16 * row[4] <= widths[row[1]],
                "rows_forward: call ", c, " reads ", row[3], " inputs or writes past its part's ", widths[row[1]],
                " columns");
    for (int t = 0; t < 4; ++t)
      TORCH_CHECK(weights[4 * c + t].numel() == 0 || weights[4 * c + t].is_contiguous(),
                  "rows_forward: weights of call ", c, " must be contiguous");
    plan[row[0] * kParts + row[1]].push_back(
        {reinterpret_cast<RowProduct>(row[2]), pointer_or_null(weights[4 * c]),
         static_cast<const int32_t*>(pointer_or_null(weights[4 * c + 1])),
         static_cast<const float*>(pointer_or_null(weights[4 * c + 2])),
         static_cast<const float*>(pointer_or_null(weights[4 * c + 3])), row[3], row[4], row[5], row[6]});
  }
  for (int64_t l = 0; l < layers; ++l) {
    TORCH_CHECK(keys[l].dim() == 4 && keys[l].size(1) == kv_heads && keys[l].size(3) == dim &&
                keys[l].is_contiguous() && values[l].sizes() == keys[l].sizes() && values[l].is_contiguous() &&
                values[l].scalar_type() == keys[l].scalar_type() && start + n <= keys[l].size(2),
                "rows_forward: the cache of layer ", l, " is not (1, ", kv_heads, ", max_len >= ", start + n, ", ",
                dim, ") contiguous");
    for (int p = 0; p < kParts; ++p)
      TORCH_CHECK(!plan[l * kParts + p].empty(), "rows_forward: layer ", l, " has no product for part ", p);
  }
  auto options = embeds.options();
  auto x = embeds.clone();
  auto h = torch::empty({n, hidden}, options), qkv = torch::empty({n, qkv_width}, options);
  auto attended = torch::empty({n, heads * dim}, options), y = torch::empty({n, hidden}, options);
  auto gate_up = torch::empty({n, 2 * intermediate}, options);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  auto run = [&](int64_t layer, int part, const float* in, float* out) {
    for (const ProductCall& call : plan[layer * kParts + part])
      call.entry(in, n, call.k, call.weights, call.qsum, call.scale, call.bias, call.blocks, call.inner,
                 out + call.offset, widths[part]);
  };
  auto add_into_x = [&]() {  // x = x + y, as torch's add rounds it
    for (int64_t e = 0; e < n * hidden; ++e) xp[e] = xp[e] + yp[e];
  };
  for (int64_t l = 0; l < layers; ++l) {
    rms_norm_rows(xp, hidden, n, hidden, norms[2 * l].data_ptr<float>(), eps, hp);
    run(l, kQkv, hp, qkv.data_ptr<float>());
    if (keys[l].scalar_type() == torch::kFloat64) {
      attend_rows<double>(qkv.data_ptr<float>(), qkv_width, cos.data_ptr<float>(), sin.data_ptr<float>(),
                          keys[l].data_ptr<double>(), values[l].data_ptr<double>(), keys[l].size(2), start,
                          mask.data_ptr<bool>(), n, heads, kv_heads, dim, scale, attended.data_ptr<float>());
    } else {
      TORCH_CHECK(keys[l].scalar_type() == torch::kFloat32, "rows_forward: the cache must be fp32 or fp64");
      attend_rows<float>(qkv.data_ptr<float>(), qkv_width, cos.data_ptr<float>(), sin.data_ptr<float>(),
                         keys[l].data_ptr<float>(), values[l].data_ptr<float>(), keys[l].size(2), start,
                         mask.data_ptr<bool>(), n, heads, kv_heads, dim, scale, attended.data_ptr<float>());
    }
    run(l, kO, attended.data_ptr<float>(), yp);
    add_into_x();
    rms_norm_rows(xp, hidden, n, hidden, norms[2 * l + 1].data_ptr<float>(), eps, hp);
    run(l, kGateUp, hp, gate_up.data_ptr<float>());
    auto gated = silu_mul(gate_up.narrow(1, 0, intermediate), gate_up.narrow(1, intermediate, intermediate));
    run(l, kDown, gated.data_ptr<float>(), yp);
    add_into_x();
  }
  auto last = torch::empty({n, hidden}, options);
  rms_norm_rows(xp, hidden, n, hidden, norms[2 * layers].data_ptr<float>(), eps, last.data_ptr<float>());
  return last;
}

// top_logprobs: per row of logits x (rows, V), its k largest logits (larger first, equal ones by column) and their
// log-probabilities x_j - logsumexp(x), logsumexp(x) = m + log sum_j exp(x_j - m) with m = max_j x_j; one pass for
// the k (a block of 16 that holds nothing above the k-th so far is passed over whole), one for the sum.
std::vector<torch::Tensor> top_logprobs(const torch::Tensor& logits, int64_t k) {
  check_rows(logits, "top_logprobs logits");
  const int64_t rows = logits.size(0), width = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= width, "top_logprobs: k = ", k, " must lie in [1, ", width, "]");
  auto logprobs = torch::empty({rows, k}, logits.options());
  auto columns = torch::empty({rows, k}, logits.options().dtype(torch::kLong));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> best(k);
    std::vector<int64_t> where(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits.data_ptr<float>() + r * logits.stride(0);
      int64_t found = 0;
      auto consider = [&](int64_t j) {
        const float v = x[j];
        if (found == k && !(v > best[k - 1])) return;
        int64_t at = found < k ? found++ : k - 1;
        for (; at > 0 && v > best[at - 1]; --at) best[at] = best[at - 1], where[at] = where[at - 1];
        best[at] = v, where[at] = j;
      };
      int64_t j = 0;
      for (; j < k; ++j) consider(j);  // k <= width
      for (; j + kLanes <= width; j += kLanes) {
        if (any_above(load(x + j), best[k - 1]))
          for (int64_t lane = 0; lane < kLanes; ++lane) consider(j + lane);
      }
      for (; j < width; ++j) consider(j);
      const float peak = best[0];
      Floats sum = {};
      int64_t t = 0;
      for (; t + kLanes <= width; t += kLanes) sum += exp_lanes(load(x + t) - peak);
      float total = lane_sum(sum);
      for (; t < width; ++t) total += std::exp(x[t] - peak);
      const float lse = peak + std::log(total);
      float* row_logprobs = logprobs.data_ptr<float>() + r * k;
      int64_t* row_columns = columns.data_ptr<int64_t>() + r * k;
      for (int64_t i = 0; i < k; ++i) row_logprobs[i] = best[i] - lse, row_columns[i] = where[i];
    }
  });
  return {logprobs, columns};
}

torch::Tensor rms_norm_aten(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  // transformers' RMSNorm (Llama, Qwen2) in fp32, operator by operator: the same bits, one call from Python
  auto variance = x.pow(2).mean(-1, true);
  return weight * (x * at::rsqrt(variance + eps));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w x / sqrt(mean x^2 + eps) per row");
  m.def("rope", &rope, "rotary embedding of the first heads of each row, as (1, heads, rows, dim)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attend", &attend, "rope, cache and attend a few rows over a cached prefix");
  m.def("rows_forward", &rows_forward, "a decoder forward of a few rows over a cached prefix, own kernels only");
  m.def("rms_norm_aten", &rms_norm_aten, "transformers' fp32 RMSNorm, its operators called from C++");
  m.def("top_logprobs", &top_logprobs, "the k largest logits of each row, as log-probabilities, and their columns");
}
