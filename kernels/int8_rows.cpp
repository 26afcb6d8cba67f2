// y = x W^T for 8-bit weights and activations rounded per row: the target's int8 x int8 product
// (eagle_fsd.target_quant) at the pace of its weight reads, where FBGEMM's operator costs a fixed 40-70 us a call and
// reads a few rows no faster than it computes many. Built twice, like int4_rows.cpp: with AVX-512 VNNI (8-bit
// activations, r = 127, z = 128) and with AVX2 only (7-bit activations, r = 63, z = 64).
//
// Weights, per output channel o: W_oj ~ s_o q_oj, q in -127..127, s fp32. Activations, per row i:
//
//     u_ij = round(r x_ij / m_i) + z   (1..2z - 1),   m_i = max_j |x_ij|
//     y_io = (m_i / r) s_o (P_io - z Q_o) + bias_o,   P_io = sum_j q_oj u_ij,   Q_o = sum_j q_oj
//
// VNNI: one vpdpbusd multiplies 4 unsigned u by 4 signed q per lane and adds them to the lane's int32 (|P| <
// 255 * 127 * k, far inside int32). AVX2: one vpmaddubsw multiplies them and adds pairs in int16: |2 * 127 * 127| =
// 32258 < 2^15, so no pair saturates (8-bit u could: that is why these CPUs take 7 bits), and one vpmaddwd by ones
// widens the pairs to int32. Either way P and Q are exact; every float step is per element; the work is split over
// output channels only: a row's output depends on that row alone, never on how many rows share the call or how many
// threads run it.
//
// Layout (eagle_fsd.kernels.int8_rows.pack_int8_rows): channels in blocks of 16, inputs in chunks of 4; for block b
// and chunk c, 64 bytes, byte 4l + t = q of channel 16b + l at input 4c + t: one AVX-512 register, or lanes 0-7 and
// 8-15 in two AVX2 registers of 32 bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512VNNI__)
constexpr int kRowsPerPass = 8, kLevels = 127, kZero = 128;
#else
constexpr int kRowsPerPass = 4, kLevels = 63, kZero = 64;
#endif
constexpr int kLanes = 16, kChunk = 4;

// u (rows, chunks * 4): the rounded rows, inputs past k at z (value 0); a (rows): m_i / r
void round_rows(const float* x, int64_t rows, int64_t k, int64_t width, uint8_t* u, float* a) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * k;
    float peak = 0.f;
    for (int64_t j = 0; j < k; ++j) peak = std::max(peak, std::fabs(xi[j]));
    peak = std::max(peak, 1e-30f);
    const float scale = static_cast<float>(kLevels) / peak;
    a[i] = peak / static_cast<float>(kLevels);
    uint8_t* ui = u + i * width;
    for (int64_t j = 0; j < k; ++j)
      ui[j] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(xi[j] * scale)) + kZero);
    for (int64_t j = k; j < width; ++j) ui[j] = kZero;
  }
}

// channels [16 b, 16 b + 16) of rows [r0, r0 + R): R rows share each 64-byte load of the block's codes
template <int R>
void block_product(const int8_t* packed, int64_t b, int64_t chunks, const uint8_t* u, const int32_t* qsum,
                   const float* scale, const float* a, const float* bias, int64_t ldy, int64_t r0, float* y) {
#if defined(__AVX512VNNI__)
  __m512i acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_si512();
  const int64_t width = chunks * kChunk;
  const int8_t* block = packed + b * chunks * 64;
  for (int64_t c = 0; c < chunks; ++c) {
    const int8_t* w = block + c * 64;
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * 64), _MM_HINT_T0);
    const __m512i q = _mm512_loadu_si512(w);
    for (int i = 0; i < R; ++i) {
      int32_t four;  // u of inputs 4c .. 4c + 3 of row r0 + i
      std::memcpy(&four, u + (r0 + i) * width + c * kChunk, 4);
      acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(four), q);
    }
  }
  const int64_t lane0 = b * kLanes;
  const __m512i offset = _mm512_mullo_epi32(_mm512_set1_epi32(kZero), _mm512_loadu_si512(qsum + lane0));  // z Q_o
  const __m512 s = _mm512_loadu_ps(scale + lane0);
  const __m512 beta = bias ? _mm512_loadu_ps(bias + lane0) : _mm512_setzero_ps();
  for (int i = 0; i < R; ++i) {
    const __m512 p = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], offset));  // P - z Q, exact in int32
    _mm512_storeu_ps(y + (r0 + i) * ldy + lane0,
                     _mm512_fmadd_ps(_mm512_mul_ps(p, s), _mm512_set1_ps(a[r0 + i]), beta));
  }
#else
  __m256i acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < R; ++i) acc[h][i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t width = chunks * kChunk;
  const int8_t* block = packed + b * chunks * 64;
  for (int64_t c = 0; c < chunks; ++c) {
    const int8_t* w = block + c * 64;
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * 64), _MM_HINT_T0);
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    for (int i = 0; i < R; ++i) {
      int32_t four;  // u of inputs 4c .. 4c + 3 of row r0 + i
      std::memcpy(&four, u + (r0 + i) * width + c * kChunk, 4);
      const __m256i ui = _mm256_set1_epi32(four);
      acc[0][i] = _mm256_add_epi32(acc[0][i], _mm256_madd_epi16(_mm256_maddubs_epi16(ui, q0), ones));
      acc[1][i] = _mm256_add_epi32(acc[1][i], _mm256_madd_epi16(_mm256_maddubs_epi16(ui, q1), ones));
    }
  }
  const __m256i zero_point = _mm256_set1_epi32(kZero);
  for (int h = 0; h < 2; ++h) {
    const int64_t lane0 = b * kLanes + 8 * h;
    const __m256i q_sum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qsum + lane0));
    const __m256i offset = _mm256_mullo_epi32(zero_point, q_sum);  // z Q_o
    const __m256 s = _mm256_loadu_ps(scale + lane0);
    const __m256 beta = bias ? _mm256_loadu_ps(bias + lane0) : _mm256_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m256 p = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[h][i], offset));  // P - z Q, exact in int32
      _mm256_storeu_ps(y + (r0 + i) * ldy + lane0, _mm256_fmadd_ps(_mm256_mul_ps(p, s), _mm256_set1_ps(a[r0 + i]), beta));
    }
  }
#endif
}

using BlockProduct = void (*)(const int8_t*, int64_t, int64_t, const uint8_t*, const int32_t*, const float*,
                              const float*, const float*, int64_t, int64_t, float*);
#if defined(__AVX512VNNI__)
constexpr BlockProduct kByRows[] = {nullptr, block_product<1>, block_product<2>, block_product<3>, block_product<4>,
                                    block_product<5>, block_product<6>, block_product<7>, block_product<8>};
#else
constexpr BlockProduct kByRows[] = {nullptr, block_product<1>, block_product<2>, block_product<3>, block_product<4>};
#endif

// y (rows, ldy): columns [0, 16 blocks) = x (rows, k) W^T + bias, for W packed as (blocks, chunks, 64) by
// pack_int8_rows with its Q and scales. The entry eagle_fsd.kernels.decoder_glue's layer loop calls by address.
void int8_rows_into(const float* x, int64_t rows, int64_t k, const void* weights, const int32_t* qsum,
                    const float* scale, const float* bias, int64_t blocks, int64_t chunks, float* y, int64_t ldy) {
  const int64_t width = chunks * kChunk;
  std::vector<uint8_t> u(rows * width);
  std::vector<float> a(rows);
  round_rows(x, rows, k, width, u.data(), a.data());
  const int8_t* w = static_cast<const int8_t*>(weights);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
        kByRows[std::min<int64_t>(kRowsPerPass, rows - r0)](w, b, chunks, u.data(), qsum, scale, a.data(), bias, ldy,
                                                             r0, y);
    }
  });
}

}  // namespace

// x (rows, k) fp32; packed (n / 16, chunks, 64) int8; qsum, scale (n) int32, fp32; bias (n) fp32 or empty;
// returns (rows, n) fp32
torch::Tensor int8_rows_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor qsum, torch::Tensor scale,
                               torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: (rows, k) float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == torch::kInt8,
              "packed: (n / 16, chunks, 64) int8 from pack_int8_rows");
  const int64_t rows = x.size(0), k = x.size(1), chunks = packed.size(1), n = packed.size(0) * kLanes;
  TORCH_CHECK(k <= chunks * kChunk && k > (chunks - 1) * kChunk, "x has ", k, " inputs, the packed weight ",
              chunks * kChunk, " (in chunks of 4)");
  TORCH_CHECK(qsum.numel() == n && qsum.scalar_type() == torch::kInt32, "qsum: (n) int32");
  TORCH_CHECK(scale.numel() == n && scale.scalar_type() == torch::kFloat32, "scale: (n) float32");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.scalar_type() == torch::kFloat32), "bias: (n) float32");
  x = x.contiguous();
  packed = packed.contiguous();
  qsum = qsum.contiguous();
  scale = scale.contiguous();
  if (bias.numel()) bias = bias.contiguous();
  auto y = torch::empty({rows, n}, torch::kFloat32);
  int8_rows_into(x.data_ptr<float>(), rows, k, packed.data_ptr<int8_t>(), qsum.data_ptr<int32_t>(),
                 scale.data_ptr<float>(), bias.numel() ? bias.data_ptr<float>() : nullptr, packed.size(0), chunks,
                 y.data_ptr<float>(), n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("int8_rows_linear", &int8_rows_linear, "8-bit weights x row-rounded activations");
  module.def("entry", [] { return reinterpret_cast<int64_t>(&int8_rows_into); }, "address of int8_rows_into");
}
