// The elementwise steps between a decoder layer's products, for forwards of a few rows on a CPU, one call each:
//
//     rms_norm:  y_ij = w_j x_ij / sqrt(mean_j x_ij^2 + eps)
//     rope:      per head h, first half a = x[h, :D/2], second half b = x[h, D/2:], c = cos, s = sin of the row:
//                y[h, :D/2] = a c[:D/2] - b s[:D/2],   y[h, D/2:] = b c[D/2:] + a s[D/2:]
//                (x cos + rotate_half(x) sin), written as (1, heads, rows, D): the layout attention reads
//     silu_mul:  y = g sigmoid(g) u   (ATen's own silu and product, called from here)
//
// A few rows make each step a few microseconds of arithmetic, which PyTorch spreads over several operators of
// about as many microseconds of dispatch each; here each is one call. Every row is computed alone, in a fixed
// order, so a row's output does not depend on the other rows of the call or on the threads. rope's products and
// sums are transformers' own (x cos + rotate_half(x) sin, each product and the sum rounded once): the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

constexpr int64_t kRowsPerTask = 64;  // a draft or verification forward's rows run on one thread; a prompt's split

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              name, ": expected a 2-D fp32 CPU tensor with contiguous rows, got ", x.sizes(), " ", x.scalar_type());
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == width,
              "rms_norm weight: expected ", width, " contiguous fp32 values");
  auto y = torch::empty({rows, width}, x.options());
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x.data_ptr<float>() + i * x.stride(0);
      float* yi = y.data_ptr<float>() + i * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < width; ++j) squares += xi[j] * xi[j];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) yi[j] = w[j] * (xi[j] * inv);
    }
  });
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w x / sqrt(mean x^2 + eps) per row");
  m.def("rope", &rope, "rotary embedding of the first heads of each row, as (1, heads, rows, dim)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
