// y = x W^T for 4-bit weights and 8-bit activations rounded per row, on CPUs with AVX-512 VNNI or with AVX2.
//
// Weights, per output channel o and group g of 32 inputs:  W_oj = s_og q_oj + m_og,  q in 0..15, s and m fp16.
// Activations, per row i:  x_ij ~ a_i v_ij,  a_i = max_j |x_ij| / 127,  v_ij = round(x_ij / a_i) in -127..127.
//
//     y_io = a_i sum_g ( s_og P_iog + m_og S_ig ),   P_iog = sum_{j in g} q_oj v_ij,   S_ig = sum_{j in g} v_ij
//
// P and S are exact in int32. The sum over groups is fp32, in a fixed order (even and odd g summed apart, then
// added); the work is split over output channels only. So a row's output depends on that row alone, never
// on how many rows share the call or how many threads run it: verifying a tree gives each token bit for bit what
// a one-token decoding step gives it.
//
// Layout (eagle_fsd.kernels.int4_rows.pack_int4): channels in blocks of 16, one 32-bit lane each. For block b and
// group g, 256 bytes hold 8 registers' worth of 4-input chunks, chunk c in the low nibbles and chunk c + 4 in the
// high nibbles of bytes [64c, 64c + 64) (byte 4l + t = input 4c + t of lane l); then 32 fp16: s of the 16 lanes, m
// of the 16 lanes. One VNNI instruction multiplies a chunk of 4 unsigned nibbles by 4 signed activations per lane
// and adds the 4 products to the lane's int32.
//
// Built twice (eagle_fsd.kernels.int4_rows): with AVX-512 VNNI (__AVX512VNNI__ defined) and with AVX2 + FMA + F16C
// only. The AVX2 build reads the same layout as two halves of 8 lanes (32 of each chunk's 64 bytes). Per pair of
// inputs it multiplies the unsigned nibbles by the signed activations into int16 (_mm256_maddubs_epi16, |2 * 15 *
// 127| = 3810), adds a group's 8 chunks in int16 (8 * 3810 = 30480 < 2^15, so never saturated) and widens to int32
// with one multiply-add by ones: P is the same exact integer. Every floating-point step is the same instruction on
// the same operands per lane, so both builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16, kGroup = 32, kRowsPerPass = 16;

// v (rows, k) int8, a (rows), sums (rows, k / 32) float: S_ig, exact (|S| <= 32 * 127)
void round_rows(const float* x, int64_t rows, int64_t k, int8_t* v, float* a, float* sums) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * k;
    float peak = 0.f;
    for (int64_t j = 0; j < k; ++j) peak = std::max(peak, std::fabs(xi[j]));
    peak = std::max(peak, 1e-30f);
    const float scale = 127.f / peak;
    a[i] = peak / 127.f;
    for (int64_t g = 0; g < k / kGroup; ++g) {
      int32_t sum = 0;
      for (int64_t j = g * kGroup; j < (g + 1) * kGroup; ++j) {
        const int32_t u = static_cast<int32_t>(std::nearbyint(xi[j] * scale));
        v[i * k + j] = static_cast<int8_t>(u);
        sum += u;
      }
      sums[i * (k / kGroup) + g] = static_cast<float>(sum);
    }
  }
}

#if defined(__AVX512VNNI__)
// channels [16 b, 16 b + 16) of rows [r0, r1). Each row's groups alternate between two fp32 sums, even and odd g,
// added at the end: a fixed order (the same for any number of rows), half as long a chain of dependent additions.
void block_product(const uint8_t* packed, int64_t b, int64_t groups, const int8_t* v, const float* sums,
                   const float* a, const float* bias, int64_t k, int64_t ldy, int64_t r0, int64_t r1, float* y) {
  __m512 acc[2][kRowsPerPass];
  for (int64_t i = r0; i < r1; ++i) acc[0][i - r0] = acc[1][i - r0] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* block = packed + b * groups * 320;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = block + g * 320;
    for (int line = 0; line < 320; line += 64)  // 8 groups ahead: 20-30 % faster from memory at 1-8 rows
      _mm_prefetch(reinterpret_cast<const char*>(w + 8 * 320 + line), _MM_HINT_T0);
    __m512i q[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = _mm512_loadu_si512(w + 64 * c);
      q[c] = _mm512_and_si512(bytes, low);
      q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 288)));
    __m512* sum = acc[g & 1];
    for (int64_t i = r0; i < r1; ++i) {
      const int32_t* vi = reinterpret_cast<const int32_t*>(v + i * k + g * kGroup);
      __m512i p[4];  // four independent integer sums (exact: their order does not matter)
      for (int c = 0; c < 4; ++c)
        p[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_set1_epi32(vi[c]));
      for (int c = 0; c < 4; ++c) p[c] = _mm512_dpbusd_epi32(p[c], q[c + 4], _mm512_set1_epi32(vi[c + 4]));
      const __m512i total = _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3]));
      const __m512 term = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[i * groups + g]),
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(total), s));
      sum[i - r0] = _mm512_add_ps(sum[i - r0], term);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  const __m512 beta = bias ? _mm512_loadu_ps(bias + b * kLanes) : zero;
  for (int64_t i = r0; i < r1; ++i) {
    const __m512 total = _mm512_add_ps(acc[0][i - r0], acc[1][i - r0]);
    _mm512_storeu_ps(y + i * ldy + b * kLanes, _mm512_fmadd_ps(total, _mm512_set1_ps(a[i]), beta));
  }
}

#else
// The same for AVX2: lanes [8 h, 8 h + 8) of the block in half h, both halves within one pass over the groups.
void block_product(const uint8_t* packed, int64_t b, int64_t groups, const int8_t* v, const float* sums,
                   const float* a, const float* bias, int64_t k, int64_t ldy, int64_t r0, int64_t r1, float* y) {
  __m256 acc[2][2][kRowsPerPass];  // [half][g & 1][row]
  for (int h = 0; h < 2; ++h)
    for (int64_t i = r0; i < r1; ++i) acc[h][0][i - r0] = acc[h][1][i - r0] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* block = packed + b * groups * 320;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = block + g * 320;
    for (int line = 0; line < 320; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + 8 * 320 + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i q[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c + 32 * h));
        q[c] = _mm256_and_si256(bytes, low);
        q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      }
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 256 + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 288 + 16 * h)));
      __m256* sum = acc[h][g & 1];
      for (int64_t i = r0; i < r1; ++i) {
        const int32_t* vi = reinterpret_cast<const int32_t*>(v + i * k + g * kGroup);
        __m256i pairs = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(vi[0]));
        for (int c = 1; c < 8; ++c)
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(q[c], _mm256_set1_epi32(vi[c])));
        const __m256i total = _mm256_madd_epi16(pairs, ones);
        const __m256 term = _mm256_fmadd_ps(m, _mm256_set1_ps(sums[i * groups + g]),
                                            _mm256_mul_ps(_mm256_cvtepi32_ps(total), s));
        sum[i - r0] = _mm256_add_ps(sum[i - r0], term);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 beta = bias ? _mm256_loadu_ps(bias + b * kLanes + 8 * h) : _mm256_setzero_ps();
    for (int64_t i = r0; i < r1; ++i) {
      const __m256 total = _mm256_add_ps(acc[h][0][i - r0], acc[h][1][i - r0]);
      _mm256_storeu_ps(y + i * ldy + b * kLanes + 8 * h, _mm256_fmadd_ps(total, _mm256_set1_ps(a[i]), beta));
    }
  }
}
#endif

// y (rows, ldy): columns [0, 16 blocks) = x (rows, k) W^T + bias, for W packed as (blocks, k / 32, 320) by pack_int4.
// The entry eagle_fsd.kernels.decoder_glue's layer loop calls by address (its RowProduct; qsum, scale unused).
void int4_rows_into(const float* x, int64_t rows, int64_t k, const void* weights, const int32_t*, const float*,
                    const float* bias, int64_t blocks, int64_t groups, float* y, int64_t ldy) {
  std::vector<int8_t> v(rows * k);
  std::vector<float> a(rows), sums(rows * groups);
  round_rows(x, rows, k, v.data(), a.data(), sums.data());
  const uint8_t* w = static_cast<const uint8_t*>(weights);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass)
        block_product(w, b, groups, v.data(), sums.data(), a.data(), bias, k, ldy, r0,
                      std::min(rows, r0 + kRowsPerPass), y);
  });
}

}  // namespace

// x (rows, k) fp32; packed (n / 16, k / 32, 320) uint8; bias (n) fp32 or empty; returns (rows, n) fp32
torch::Tensor int4_rows_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: (rows, k) float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 320 && packed.scalar_type() == torch::kUInt8,
              "packed: (n / 16, k / 32, 320) uint8 from pack_int4");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(1), n = packed.size(0) * kLanes;
  TORCH_CHECK(k == groups * kGroup, "x has ", k, " inputs, the packed weight ", groups * kGroup);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.scalar_type() == torch::kFloat32), "bias: (n) float32");
  x = x.contiguous();
  packed = packed.contiguous();
  if (bias.numel()) bias = bias.contiguous();
  auto y = torch::empty({rows, n}, torch::kFloat32);
  int4_rows_into(x.data_ptr<float>(), rows, k, packed.data_ptr<uint8_t>(), nullptr, nullptr,
                 bias.numel() ? bias.data_ptr<float>() : nullptr, packed.size(0), groups, y.data_ptr<float>(), n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("int4_rows_linear", &int4_rows_linear, "4-bit weights x 8-bit row-rounded activations");
  module.def("entry", [] { return reinterpret_cast<int64_t>(&int4_rows_into); }, "address of int4_rows_into");
}
