// y = x W^T for 4-bit weights and 8-bit activations rounded per row, on CPUs with AVX-512 VNNI or with AVX2.
//
// Weights, per output channel o and group g of G inputs (G = 32, or a multiple of 32: a drafter's coarser groups):
// W_oj = s_og q_oj + m_og,  q in 0..15, s and m fp16.
// Activations, per row i:  x_ij ~ a_i v_ij,  a_i = max_j |x_ij| / 127,  v_ij = round(x_ij / a_i) in -127..127.
//
//     y_io = a_i sum_g ( s_og P_iog + m_og S_ig ),   P_iog = sum_{j in g} q_oj v_ij,   S_ig = sum_{j in g} v_ij
//
// P and S are exact in int32 (|P| <= 15 * 127 G). The sum over groups is fp32, in a fixed order (even and odd g
// summed apart, then added); the work is split over output channels only. So a row's output depends on that row
// alone, never on how many rows share the call or how many threads run it: verifying a tree gives each token bit for
// bit what a one-token decoding step gives it.
//
// Layout (eagle_fsd.kernels.int4_rows.pack_int4): channels in blocks of 16, one 32-bit lane each. For block b and
// group g, per part of 32 inputs, 256 bytes hold 8 registers' worth of 4-input chunks, chunk c in the low nibbles and
// chunk c + 4 in the high nibbles of bytes [64c, 64c + 64) (byte 4l + t = input 4c + t of lane l); after the G / 32
// parts, 32 fp16: s of the 16 lanes, m of the 16 lanes (8 G + 64 bytes a group: 5 bits a weight at G = 32, 4.25 at
// 128). One VNNI instruction multiplies a chunk of 4 unsigned nibbles by 4 signed activations per lane
// and adds the 4 products to the lane's int32.
//
// Built twice (eagle_fsd.kernels.int4_rows): with AVX-512 VNNI (__AVX512VNNI__ defined) and with AVX2 + FMA + F16C
// only. The AVX2 build reads the same layout as two halves of 8 lanes (32 of each chunk's 64 bytes). Per pair of
// inputs it multiplies the unsigned nibbles by the signed activations into int16 (_mm256_maddubs_epi16, |2 * 15 *
// 127| = 3810), adds a part's 8 chunks in int16 (8 * 3810 = 30480 < 2^15, so never saturated) and widens to int32
// with one multiply-add by ones: P is the same exact integer. Every floating-point step is the same instruction on
// the same operands per lane, so both builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16, kPart = 32, kRowsPerPass = 16;
constexpr int64_t kPartBytes = 256, kScaleBytes = 64, kPrefetchBytes = 8 * (kPartBytes + kScaleBytes);

// v (rows, k) int8, a (rows), sums (rows, k / group) float: S_ig, exact (|S| <= group * 127)
void round_rows(const float* x, int64_t rows, int64_t k, int64_t group, int8_t* v, float* a, float* sums) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * k;
    float peak = 0.f;
    for (int64_t j = 0; j < k; ++j) peak = std::max(peak, std::fabs(xi[j]));
    peak = std::max(peak, 1e-30f);
    const float scale = 127.f / peak;
    a[i] = peak / 127.f;
    for (int64_t g = 0; g < k / group; ++g) {
      int32_t sum = 0;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) {
        const int32_t u = static_cast<int32_t>(std::nearbyint(xi[j] * scale));
        v[i * k + j] = static_cast<int8_t>(u);
        sum += u;
      }
      sums[i * (k / group) + g] = static_cast<float>(sum);
    }
  }
}

#if defined(__AVX512VNNI__)
// channels [16 b, 16 b + 16) of rows [r0, r1), r1 - r0 <= kRowsPerPass; R > 0: exactly R rows, a count the compiler
// knows, so that the rows' sums stay in registers (one row in groups of 32: 0.6-0.8x the time of R = 0 with the
// weights in cache, benchmarks/int4_revision_ab.py). Each row's groups alternate between two fp32 sums, even and odd g,
// added at the end: a fixed order (the same for any number of rows), half as long a chain of dependent additions.
template <int R>
void block_product(const uint8_t* packed, int64_t b, int64_t groups, const int8_t* v, const float* sums,
                   const float* a, const float* bias, int64_t k, int64_t ldy, int64_t r0, int64_t r1, float* y) {
  constexpr int kCap = R ? R : kRowsPerPass;
  if (R) r1 = r0 + R;
  const int64_t group = k / groups, parts = group / kPart, group_bytes = kPartBytes * parts + kScaleBytes;
  __m512 acc[2][kCap];
  __m512i whole[kCap];  // P_iog, summed over the group's parts of 32 inputs (exact in int32)
  for (int64_t i = r0; i < r1; ++i) acc[0][i - r0] = acc[1][i - r0] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* block = packed + b * groups * group_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = block + g * group_bytes;
    for (int64_t line = 0; line < group_bytes; line += 64)  // 2.5 kB ahead: 20-30 % faster from memory at 1-8 rows
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + line), _MM_HINT_T0);
    for (int64_t part = 0; part < parts; ++part) {
      __m512i q[8];
      for (int c = 0; c < 4; ++c) {
        const __m512i bytes = _mm512_loadu_si512(w + kPartBytes * part + 64 * c);
        q[c] = _mm512_and_si512(bytes, low);
        q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      }
      for (int64_t i = r0; i < r1; ++i) {
        const int32_t* vi = reinterpret_cast<const int32_t*>(v + i * k + g * group + part * kPart);
        __m512i p[4];  // four independent integer sums (exact: their order does not matter)
        for (int c = 0; c < 4; ++c)
          p[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_set1_epi32(vi[c]));
        for (int c = 0; c < 4; ++c) p[c] = _mm512_dpbusd_epi32(p[c], q[c + 4], _mm512_set1_epi32(vi[c + 4]));
        const __m512i total = _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3]));
        whole[i - r0] = part ? _mm512_add_epi32(whole[i - r0], total) : total;
      }
    }
    const uint8_t* scales = w + kPartBytes * parts;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    __m512* sum = acc[g & 1];
    for (int64_t i = r0; i < r1; ++i) {
      const __m512 term = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[i * groups + g]),
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(whole[i - r0]), s));
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
template <int R>
void block_product(const uint8_t* packed, int64_t b, int64_t groups, const int8_t* v, const float* sums,
                   const float* a, const float* bias, int64_t k, int64_t ldy, int64_t r0, int64_t r1, float* y) {
  constexpr int kCap = R ? R : kRowsPerPass;
  if (R) r1 = r0 + R;
  const int64_t group = k / groups, parts = group / kPart, group_bytes = kPartBytes * parts + kScaleBytes;
  __m256 acc[2][2][kCap];  // [half][g & 1][row]
  __m256i whole[kCap];      // P_iog of the half's lanes, summed over the group's parts (exact in int32)
  for (int h = 0; h < 2; ++h)
    for (int64_t i = r0; i < r1; ++i) acc[h][0][i - r0] = acc[h][1][i - r0] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* block = packed + b * groups * group_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = block + g * group_bytes;
    for (int64_t line = 0; line < group_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + line), _MM_HINT_T0);
    const uint8_t* scales = w + kPartBytes * parts;
    for (int h = 0; h < 2; ++h) {
      for (int64_t part = 0; part < parts; ++part) {
        __m256i q[8];
        for (int c = 0; c < 4; ++c) {
          const __m256i bytes =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kPartBytes * part + 64 * c + 32 * h));
          q[c] = _mm256_and_si256(bytes, low);
          q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        }
        for (int64_t i = r0; i < r1; ++i) {
          const int32_t* vi = reinterpret_cast<const int32_t*>(v + i * k + g * group + part * kPart);
          __m256i pairs = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(vi[0]));
          for (int c = 1; c < 8; ++c)
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(q[c], _mm256_set1_epi32(vi[c])));
          const __m256i total = _mm256_madd_epi16(pairs, ones);  // widened per part of 32: never saturated
          whole[i - r0] = part ? _mm256_add_epi32(whole[i - r0], total) : total;
        }
      }
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32 + 16 * h)));
      __m256* sum = acc[h][g & 1];
      for (int64_t i = r0; i < r1; ++i) {
        const __m256 term = _mm256_fmadd_ps(m, _mm256_set1_ps(sums[i * groups + g]),
                                            _mm256_mul_ps(_mm256_cvtepi32_ps(whole[i - r0]), s));
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

// y (rows, ldy): columns [0, 16 blocks) = x (rows, k) W^T + bias, for W packed as (blocks, groups, 8 group + 64) by
// pack_int4, a group of k / groups inputs.
// The entry eagle_fsd.kernels.decoder_glue's layer loop calls by address (its RowProduct; qsum, scale unused).
void int4_rows_into(const float* x, int64_t rows, int64_t k, const void* weights, const int32_t*, const float*,
                    const float* bias, int64_t blocks, int64_t groups, float* y, int64_t ldy) {
  std::vector<int8_t> v(rows * k);
  std::vector<float> a(rows), sums(rows * groups);
  round_rows(x, rows, k, k / groups, v.data(), a.data(), sums.data());
  const uint8_t* w = static_cast<const uint8_t*>(weights);
  // one or two rows in groups of 32 (a target's step) take the fixed-count copy; in coarser groups (a drafter's) it
  // measured no faster from memory (0.95-1.2x at one row, AVX2 build), so they keep the general one
  const auto product = k / groups != kPart || rows > 2 ? block_product<0> : rows == 1 ? block_product<1>
                                                                                      : block_product<2>;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass)
        product(w, b, groups, v.data(), sums.data(), a.data(), bias, k, ldy, r0, std::min(rows, r0 + kRowsPerPass), y);
  });
}

}  // namespace

// x (rows, k) fp32; packed (n / 16, k / group, 8 group + 64) uint8, group a multiple of 32; bias (n) fp32 or empty;
// returns (rows, n) fp32
torch::Tensor int4_rows_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: (rows, k) float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) > 0 && packed.scalar_type() == torch::kUInt8,
              "packed: (n / 16, k / group, 8 group + 64) uint8 from pack_int4");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(1), n = packed.size(0) * kLanes;
  const int64_t group = (packed.size(2) - kScaleBytes) / 8;
  TORCH_CHECK(group > 0 && group % kPart == 0 && packed.size(2) == 8 * group + kScaleBytes,
              "packed: groups of ", packed.size(2), " bytes are not 8 group + 64 for a group a multiple of 32");
  TORCH_CHECK(k == groups * group, "x has ", k, " inputs, the packed weight ", groups * group);
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
