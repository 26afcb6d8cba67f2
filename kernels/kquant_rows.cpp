// y = x W^T for weights in a GGUF file's own Q4_K or Q6_K blocks and 8-bit activations rounded per row, on CPUs
// with AVX-512 VNNI or with AVX2: a quantized target read at the file's bytes (4.5 and 6.5625 bits a weight, plus
// Q4_K's 6-bit scales widened to bytes, 2.8 %), not rounded again to int4_rows' or int8_rows' formats.
//
// Weights, per output channel o, super-block t of 256 inputs and sub-block s (32 inputs in Q4_K, 16 in Q6_K):
//     Q4_K: W_oj = d_ot sc_os q_oj - dmin_ot mn_os,   q in 0..15, sc and mn in 0..63, d and dmin fp16
//     Q6_K: W_oj = d_ot sc_os (q_oj - 32),             q in 0..63, sc in -128..127, d fp16
// Activations, per row i, rounded as int4_rows.cpp rounds them: a_i = max_j |x_ij| / 127, v_ij = round(x_ij / a_i).
//
//     Q4_K: y_io = a_i sum_t (d_ot A_iot - dmin_ot B_iot),   A = sum_s sc_os P_ios,   B = sum_s mn_os S_is
//     Q6_K: y_io = a_i sum_t d_ot I_iot,                     I = sum_s sc_os (P_ios - 32 S_is)
//     P_ios = sum_{j in s} q_oj v_ij,   S_is = sum_{j in s} v_ij
//
// A, B and I are exact in int32: Q4_K |P| <= 32 * 15 * 127 = 60960, |A| <= 8 * 63 * 60960 = 30723840, |S| <= 4064,
// |B| <= 8 * 63 * 4064 = 2048256; Q6_K |P - 32 S| <= 16 * 32 * 127 = 65024, |I| <= 16 * 128 * 65024 = 133169152
// (partial sums: below these, or for the AVX2 build's I, summing sc P and -32 sc S apart, below 16 * 128 * (2 *
// 32004 + 65024) = 264552448 < 2^31). Per super-block one fp32 step, t in order: acc += d float(A) - dmin float(B)
// (one fmsub) or acc += d float(I) (one fmadd); then y_io = acc a_i + bias_o (one fmadd). The work is split over
// output channels only, so a row's output depends on that row alone, never on how many rows share the call or how
// many threads run it: verifying a tree gives each token bit for bit what a one-token decoding step gives it.
//
// Layout (eagle_fsd.kernels.kquant_rows.pack): channels in blocks of 16, one 32-bit lane each; per block b and
// super-block t one record, (blocks, groups, bytes) uint8. "chunk c" = inputs 4c .. 4c + 3; byte 4l + e of a
// 64-byte register = input 4c + e of lane l (lanes 0-7 and 8-15 are its two 32-byte halves in the AVX2 build).
//   Q4_K, 2368 bytes: [0, 2048) codes: register 8u + r (u = 0..3, r = 0..7) holds chunk 16u + r (sub-block 2u) in
//         its low nibbles and chunk 16u + 8 + r (sub-block 2u + 1) in its high nibbles;
//         [2048, 2176) sc, byte 16s + l; [2176, 2304) mn, byte 32p + 2l + e = mn of sub-block 2p + e;
//         [2304, 2336) d, [2336, 2368) dmin, fp16 per lane.
//   Q6_K, 3360 bytes: [0, 2048) low 4 bits: register 16h + r (h = 0..1, r = 0..15) holds chunk 32h + r in its low
//         nibbles and chunk 32h + 16 + r in its high nibbles; [2048, 3072) high 2 bits: register 8h + m (m = 0..7)
//         holds chunk 32h + 8f + m in bits 2f, 2f + 1 (f = 0..3);
//         [3072, 3328) sc int8, byte 16s + l; [3328, 3360) d, fp16 per lane.
//
// Built twice (eagle_fsd.kernels.kquant_rows, like int4_rows): with AVX-512 VNNI (__AVX512VNNI__ defined), one
// vpdpbusd per 4 unsigned codes x 4 signed activations per lane and one vpmulld by sc per sub-block; and with AVX2 +
// FMA + F16C, per half of 8 lanes: vpmaddubsw into int16 pairs, then vpmaddwd by (sc, sc) into int32. AVX2 int16
// bounds: Q4_K 8 pairs of a sub-block, 8 * 2 * 15 * 127 = 30480 < 2^15; Q6_K 2 pairs, 2 * 2 * 63 * 127 = 32004
// < 2^15, and its 32 S part as (sc, sc) x (-16 S, -16 S), 16 * 16 * 127 = 32512 < 2^15: never saturated, so A, B, I
// are the same integers and, every fp32 step being the same instruction on the same operands, the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16, kSuper = 256, kRowsPerPass = 16, kAhead = 4;  // kAhead: super-blocks prefetched ahead
constexpr int kQ4Bytes = 2368, kQ6Bytes = 3360;

// The rounded rows (as int4_rows.cpp's round_rows: the same v and a) and per-row sums S of their sub-blocks:
// Q4_K: per pair p of 32-input sub-blocks one int32 holding int16 S_2p (low half) and S_2p+1 (high half);
// Q6_K: per 16-input sub-block -32 S (VNNI: the initial value of P - 32 S) or int16 -16 S twice (AVX2).
struct Rows {
  std::vector<int8_t> v;
  std::vector<float> a;
  std::vector<int32_t> sums;
  int64_t k, per_row;  // inputs, sums per row
};

Rows round_rows(const float* x, int64_t rows, int64_t k, bool q6) {
  Rows r{std::vector<int8_t>(rows * k), std::vector<float>(rows), {}, k, q6 ? k / 16 : k / 64};
  r.sums.resize(rows * r.per_row);
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * k;
    float peak = 0.f;
    for (int64_t j = 0; j < k; ++j) peak = std::max(peak, std::fabs(xi[j]));
    peak = std::max(peak, 1e-30f);
    const float scale = 127.f / peak;
    r.a[i] = peak / 127.f;
    int8_t* vi = r.v.data() + i * k;
    for (int64_t j = 0; j < k; ++j) vi[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(xi[j] * scale)));
    const int width = q6 ? 16 : 32;
    for (int64_t s = 0; s < k / width; ++s) {
      int32_t sum = 0;
      for (int64_t j = s * width; j < (s + 1) * width; ++j) sum += vi[j];
      if (!q6) {
        const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(sum));
        r.sums[i * r.per_row + s / 2] |= static_cast<int32_t>(s % 2 ? half << 16 : half);
      } else {
#if defined(__AVX512VNNI__)
        r.sums[i * r.per_row + s] = -32 * sum;
#else
        r.sums[i * r.per_row + s] = static_cast<int32_t>(static_cast<uint16_t>(static_cast<int16_t>(-16 * sum)) *
                                                         0x10001u);
#endif
      }
    }
  }
  return r;
}

// The line at `offset` of the record kAhead super-blocks ahead, into L2, beside each load of a line of this record:
// measured from memory at 1-8 rows, that beats prefetching whole records at once (up to 2x slower at 3-8 rows) and
// prefetching into L1.
inline void ahead(const uint8_t* w, int bytes, int offset) {
  _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * bytes + offset), _MM_HINT_T1);
}

#if defined(__AVX512VNNI__)
inline __m512i dot4(__m512i sum, __m512i codes, const int32_t* four) {  // sum + 4 codes x 4 activations per lane
  return _mm512_dpbusd_epi32(sum, codes, _mm512_set1_epi32(*four));
}

// channels [16 b, 16 b + 16) of rows [r0, r1)
void q4k_block(const uint8_t* packed, int64_t b, int64_t groups, const Rows& x, const float* bias, int64_t ldy,
               int64_t r0, int64_t r1, float* y) {
  __m512 acc[kRowsPerPass];
  __m512i big[kRowsPerPass];  // A of the super-block
  for (int64_t i = r0; i < r1; ++i) acc[i - r0] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t t = 0; t < groups; ++t) {
    const uint8_t* w = packed + (b * groups + t) * kQ4Bytes;
    for (int64_t i = r0; i < r1; ++i) big[i - r0] = _mm512_setzero_si512();
    for (int u = 0; u < 4; ++u) {  // sub-blocks 2u (low nibbles) and 2u + 1 (high nibbles)
      __m512i q[16];
      for (int r = 0; r < 8; ++r) {
        ahead(w, kQ4Bytes, 512 * u + 64 * r);
        if (r < 2) ahead(w, kQ4Bytes, 2048 + 64 * (2 * u + r));  // the scales: lines 32-36 (and 3 of the next)
        const __m512i bytes = _mm512_loadu_si512(w + 512 * u + 64 * r);
        q[r] = _mm512_and_si512(bytes, low);
        q[r + 8] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      }
      const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2048 + 32 * u)));
      const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2064 + 32 * u)));
      for (int64_t i = r0; i < r1; ++i) {
        const int32_t* vi = reinterpret_cast<const int32_t*>(x.v.data() + i * x.k + t * kSuper + 64 * u);
        __m512i p[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                        _mm512_setzero_si512()};  // two independent sums per sub-block
        for (int r = 0; r < 4; ++r)
          for (int h = 0; h < 4; ++h) p[h] = dot4(p[h], q[4 * h + r], vi + 4 * h + r);
        const __m512i first = _mm512_mullo_epi32(_mm512_add_epi32(p[0], p[1]), sc0);
        const __m512i second = _mm512_mullo_epi32(_mm512_add_epi32(p[2], p[3]), sc1);
        big[i - r0] = _mm512_add_epi32(big[i - r0], _mm512_add_epi32(first, second));
      }
    }
    __m512i mn[4];
    for (int p = 0; p < 4; ++p)
      mn[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2176 + 32 * p)));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2304)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2336)));
    for (int64_t i = r0; i < r1; ++i) {
      const int32_t* si = x.sums.data() + i * x.per_row + 4 * t;
      __m512i m = _mm512_madd_epi16(mn[0], _mm512_set1_epi32(si[0]));
      for (int p = 1; p < 4; ++p) m = _mm512_add_epi32(m, _mm512_madd_epi16(mn[p], _mm512_set1_epi32(si[p])));
      const __m512 term = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(big[i - r0]),
                                          _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));
      acc[i - r0] = _mm512_add_ps(acc[i - r0], term);
    }
  }
  const __m512 beta = bias ? _mm512_loadu_ps(bias + b * kLanes) : _mm512_setzero_ps();
  for (int64_t i = r0; i < r1; ++i)
    _mm512_storeu_ps(y + i * ldy + b * kLanes, _mm512_fmadd_ps(acc[i - r0], _mm512_set1_ps(x.a[i]), beta));
}

void q6k_block(const uint8_t* packed, int64_t b, int64_t groups, const Rows& x, const float* bias, int64_t ldy,
               int64_t r0, int64_t r1, float* y) {
  __m512 acc[kRowsPerPass];
  __m512i big[kRowsPerPass];  // I of the super-block
  for (int64_t i = r0; i < r1; ++i) acc[i - r0] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  for (int64_t t = 0; t < groups; ++t) {
    const uint8_t* w = packed + (b * groups + t) * kQ6Bytes;
    for (int64_t i = r0; i < r1; ++i) big[i - r0] = _mm512_setzero_si512();
    for (int u = 0; u < 4; ++u) {  // high registers 4u + e: sub-blocks s0 + 2f, chunks 4 (s0 + 2f) + e, f = 0..3
      const int lo = 16 * (u / 2) + 4 * (u % 2), s0 = 8 * (u / 2) + u % 2;
      __m512i q[4][4];
      for (int e = 0; e < 4; ++e) {
        for (int at : {2048 + 64 * (4 * u + e), 64 * (lo + e), 64 * (lo + e + 8)}) ahead(w, kQ6Bytes, at);
        if (e < 2) ahead(w, kQ6Bytes, 3072 + 64 * (2 * u + e));  // the scales: lines 48-52 (and 3 of the next)
        const __m512i hi = _mm512_loadu_si512(w + 2048 + 64 * (4 * u + e));
        const __m512i lo0 = _mm512_loadu_si512(w + 64 * (lo + e)), lo1 = _mm512_loadu_si512(w + 64 * (lo + e + 8));
        q[0][e] = _mm512_or_si512(_mm512_and_si512(lo0, low), _mm512_and_si512(_mm512_slli_epi16(hi, 4), high));
        q[1][e] = _mm512_or_si512(_mm512_and_si512(lo1, low), _mm512_and_si512(_mm512_slli_epi16(hi, 2), high));
        q[2][e] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo0, 4), low), _mm512_and_si512(hi, high));
        q[3][e] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo1, 4), low),
                                  _mm512_and_si512(_mm512_srli_epi16(hi, 2), high));
      }
      __m512i sc[4];
      for (int f = 0; f < 4; ++f)
        sc[f] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 3072 + 16 * (s0 + 2 * f))));
      for (int64_t i = r0; i < r1; ++i) {
        const int32_t* vi = reinterpret_cast<const int32_t*>(x.v.data() + i * x.k + t * kSuper);
        const int32_t* ci = x.sums.data() + i * x.per_row + 16 * t;
        __m512i p[4];
        for (int f = 0; f < 4; ++f) p[f] = _mm512_set1_epi32(ci[s0 + 2 * f]);  // -32 S
        for (int e = 0; e < 4; ++e)
          for (int f = 0; f < 4; ++f) p[f] = dot4(p[f], q[f][e], vi + 4 * (s0 + 2 * f) + e);
        __m512i sum = big[i - r0];
        for (int f = 0; f < 4; ++f) sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(p[f], sc[f]));
        big[i - r0] = sum;
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 3328)));
    for (int64_t i = r0; i < r1; ++i) acc[i - r0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(big[i - r0]), acc[i - r0]);
  }
  const __m512 beta = bias ? _mm512_loadu_ps(bias + b * kLanes) : _mm512_setzero_ps();
  for (int64_t i = r0; i < r1; ++i)
    _mm512_storeu_ps(y + i * ldy + b * kLanes, _mm512_fmadd_ps(acc[i - r0], _mm512_set1_ps(x.a[i]), beta));
}

#else
inline __m256i pair2(__m256i codes, const int32_t* four) {  // 4 codes x 4 activations per lane, as 2 int16 sums
  return _mm256_maddubs_epi16(codes, _mm256_set1_epi32(*four));
}

inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The same for AVX2: lanes [8 h, 8 h + 8) of the block in half h, both halves within one pass over the super-blocks.
void q4k_block(const uint8_t* packed, int64_t b, int64_t groups, const Rows& x, const float* bias, int64_t ldy,
               int64_t r0, int64_t r1, float* y) {
  __m256 acc[2][kRowsPerPass];
  __m256i big[kRowsPerPass];
  for (int h = 0; h < 2; ++h)
    for (int64_t i = r0; i < r1; ++i) acc[h][i - r0] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t t = 0; t < groups; ++t) {
    const uint8_t* w = packed + (b * groups + t) * kQ4Bytes;
    for (int h = 0; h < 2; ++h) {
      for (int64_t i = r0; i < r1; ++i) big[i - r0] = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        __m256i q[16];
        for (int r = 0; r < 8; ++r) {
          if (h == 0) ahead(w, kQ4Bytes, 512 * u + 64 * r);
          if (h == 0 && r < 2) ahead(w, kQ4Bytes, 2048 + 64 * (2 * u + r));
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 512 * u + 64 * r + 32 * h));
          q[r] = _mm256_and_si256(bytes, low);
          q[r + 8] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        }
        __m256i sc[2];  // (sc, sc) int16 per lane
        for (int s = 0; s < 2; ++s) {
          const __m256i wide = _mm256_cvtepu8_epi32(load8(w + 2048 + 32 * u + 16 * s + 8 * h));
          sc[s] = _mm256_or_si256(wide, _mm256_slli_epi32(wide, 16));
        }
        for (int64_t i = r0; i < r1; ++i) {
          const int32_t* vi = reinterpret_cast<const int32_t*>(x.v.data() + i * x.k + t * kSuper + 64 * u);
          __m256i sum = big[i - r0];
          for (int s = 0; s < 2; ++s) {
            const int32_t* vs = vi + 8 * s;
            const __m256i* qs = q + 8 * s;
            const __m256i pairs = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_add_epi16(pair2(qs[0], vs), pair2(qs[1], vs + 1)),
                                 _mm256_add_epi16(pair2(qs[2], vs + 2), pair2(qs[3], vs + 3))),
                _mm256_add_epi16(_mm256_add_epi16(pair2(qs[4], vs + 4), pair2(qs[5], vs + 5)),
                                 _mm256_add_epi16(pair2(qs[6], vs + 6), pair2(qs[7], vs + 7))));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, sc[s]));
          }
          big[i - r0] = sum;
        }
      }
      __m256i mn[4];
      for (int p = 0; p < 4; ++p) mn[p] = _mm256_cvtepu8_epi16(load16(w + 2176 + 32 * p + 16 * h));
      const __m256 d = _mm256_cvtph_ps(load16(w + 2304 + 16 * h));
      const __m256 dmin = _mm256_cvtph_ps(load16(w + 2336 + 16 * h));
      for (int64_t i = r0; i < r1; ++i) {
        const int32_t* si = x.sums.data() + i * x.per_row + 4 * t;
        __m256i m = _mm256_madd_epi16(mn[0], _mm256_set1_epi32(si[0]));
        for (int p = 1; p < 4; ++p) m = _mm256_add_epi32(m, _mm256_madd_epi16(mn[p], _mm256_set1_epi32(si[p])));
        const __m256 term = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(big[i - r0]),
                                            _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)));
        acc[h][i - r0] = _mm256_add_ps(acc[h][i - r0], term);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 beta = bias ? _mm256_loadu_ps(bias + b * kLanes + 8 * h) : _mm256_setzero_ps();
    for (int64_t i = r0; i < r1; ++i)
      _mm256_storeu_ps(y + i * ldy + b * kLanes + 8 * h,
                       _mm256_fmadd_ps(acc[h][i - r0], _mm256_set1_ps(x.a[i]), beta));
  }
}

void q6k_block(const uint8_t* packed, int64_t b, int64_t groups, const Rows& x, const float* bias, int64_t ldy,
               int64_t r0, int64_t r1, float* y) {
  __m256 acc[2][kRowsPerPass];
  __m256i big[kRowsPerPass];
  for (int h = 0; h < 2; ++h)
    for (int64_t i = r0; i < r1; ++i) acc[h][i - r0] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
  for (int64_t t = 0; t < groups; ++t) {
    const uint8_t* w = packed + (b * groups + t) * kQ6Bytes;
    for (int h = 0; h < 2; ++h) {
      for (int64_t i = r0; i < r1; ++i) big[i - r0] = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        const int lo = 16 * (u / 2) + 4 * (u % 2), s0 = 8 * (u / 2) + u % 2;
        __m256i q[4][4];
        for (int e = 0; e < 4; ++e) {
          if (h == 0)
            for (int at : {2048 + 64 * (4 * u + e), 64 * (lo + e), 64 * (lo + e + 8)}) ahead(w, kQ6Bytes, at);
          if (h == 0 && e < 2) ahead(w, kQ6Bytes, 3072 + 64 * (2 * u + e));
          auto load = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + at + 32 * h)); };
          const __m256i hi = load(2048 + 64 * (4 * u + e)), lo0 = load(64 * (lo + e)), lo1 = load(64 * (lo + e + 8));
          q[0][e] = _mm256_or_si256(_mm256_and_si256(lo0, low), _mm256_and_si256(_mm256_slli_epi16(hi, 4), high));
          q[1][e] = _mm256_or_si256(_mm256_and_si256(lo1, low), _mm256_and_si256(_mm256_slli_epi16(hi, 2), high));
          q[2][e] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low), _mm256_and_si256(hi, high));
          q[3][e] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low),
                                    _mm256_and_si256(_mm256_srli_epi16(hi, 2), high));
        }
        __m256i sc[4];  // (sc, sc) int16 per lane
        for (int f = 0; f < 4; ++f) {
          const __m256i wide = _mm256_cvtepi8_epi32(load8(w + 3072 + 16 * (s0 + 2 * f) + 8 * h));
          sc[f] = _mm256_blend_epi16(wide, _mm256_slli_epi32(wide, 16), 0xAA);
        }
        for (int64_t i = r0; i < r1; ++i) {
          const int32_t* vi = reinterpret_cast<const int32_t*>(x.v.data() + i * x.k + t * kSuper);
          const int32_t* ci = x.sums.data() + i * x.per_row + 16 * t;
          __m256i sum = big[i - r0];
          for (int f = 0; f < 4; ++f) {
            const int32_t* vs = vi + 4 * (s0 + 2 * f);
            const __m256i first = _mm256_add_epi16(pair2(q[f][0], vs), pair2(q[f][1], vs + 1));
            const __m256i second = _mm256_add_epi16(pair2(q[f][2], vs + 2), pair2(q[f][3], vs + 3));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(
                _mm256_add_epi32(_mm256_madd_epi16(first, sc[f]), _mm256_madd_epi16(second, sc[f])),
                _mm256_madd_epi16(sc[f], _mm256_set1_epi32(ci[s0 + 2 * f]))));  // sc x (-16 S, -16 S)
          }
          big[i - r0] = sum;
        }
      }
      const __m256 d = _mm256_cvtph_ps(load16(w + 3328 + 16 * h));
      for (int64_t i = r0; i < r1; ++i)
        acc[h][i - r0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(big[i - r0]), acc[h][i - r0]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 beta = bias ? _mm256_loadu_ps(bias + b * kLanes + 8 * h) : _mm256_setzero_ps();
    for (int64_t i = r0; i < r1; ++i)
      _mm256_storeu_ps(y + i * ldy + b * kLanes + 8 * h,
                       _mm256_fmadd_ps(acc[h][i - r0], _mm256_set1_ps(x.a[i]), beta));
  }
}
#endif

using BlockProduct = void (*)(const uint8_t*, int64_t, int64_t, const Rows&, const float*, int64_t, int64_t,
                              int64_t, float*);

void rows_into(BlockProduct block, bool q6, const float* x, int64_t rows, int64_t k, const void* weights,
               const float* bias, int64_t blocks, int64_t groups, float* y, int64_t ldy) {
  const Rows r = round_rows(x, rows, k, q6);
  const uint8_t* w = static_cast<const uint8_t*>(weights);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass)
        block(w, b, groups, r, bias, ldy, r0, std::min(rows, r0 + kRowsPerPass), y);
  });
}

// y (rows, ldy): columns [0, 16 blocks) = x (rows, k) W^T + bias, for W packed as (blocks, k / 256, 2368 or 3360)
// by kquant_rows.pack. The entries eagle_fsd.kernels.decoder_glue's layer loop calls by address (its RowProduct;
// qsum, scale unused).
void q4k_rows_into(const float* x, int64_t rows, int64_t k, const void* weights, const int32_t*, const float*,
                   const float* bias, int64_t blocks, int64_t groups, float* y, int64_t ldy) {
  rows_into(q4k_block, false, x, rows, k, weights, bias, blocks, groups, y, ldy);
}

void q6k_rows_into(const float* x, int64_t rows, int64_t k, const void* weights, const int32_t*, const float*,
                   const float* bias, int64_t blocks, int64_t groups, float* y, int64_t ldy) {
  rows_into(q6k_block, true, x, rows, k, weights, bias, blocks, groups, y, ldy);
}

}  // namespace

// x (rows, k) fp32; packed (n / 16, k / 256, 2368 or 3360) uint8; kind 4 (Q4_K) or 6 (Q6_K); bias (n) fp32 or
// empty; returns (rows, n) fp32
torch::Tensor kquant_rows_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, torch::Tensor bias) {
  TORCH_CHECK(kind == 4 || kind == 6, "kind: 4 (Q4_K) or 6 (Q6_K)");
  const int64_t bytes = kind == 4 ? kQ4Bytes : kQ6Bytes;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: (rows, k) float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == bytes && packed.scalar_type() == torch::kUInt8,
              "packed: (n / 16, k / 256, ", bytes, ") uint8 from kquant_rows.pack");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(1), n = packed.size(0) * kLanes;
  TORCH_CHECK(k == groups * kSuper, "x has ", k, " inputs, the packed weight ", groups * kSuper);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.scalar_type() == torch::kFloat32), "bias: (n) float32");
  x = x.contiguous();
  packed = packed.contiguous();
  if (bias.numel()) bias = bias.contiguous();
  auto y = torch::empty({rows, n}, torch::kFloat32);
  (kind == 4 ? q4k_rows_into : q6k_rows_into)(x.data_ptr<float>(), rows, k, packed.data_ptr<uint8_t>(), nullptr,
                                              nullptr, bias.numel() ? bias.data_ptr<float>() : nullptr,
                                              packed.size(0), groups, y.data_ptr<float>(), n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("kquant_rows_linear", &kquant_rows_linear, "GGUF Q4_K / Q6_K weights x 8-bit row-rounded activations");
  module.def("entry", [](int64_t kind) {
    return reinterpret_cast<int64_t>(kind == 4 ? &q4k_rows_into : &q6k_rows_into);
  }, "address of q4k_rows_into (kind 4) or q6k_rows_into (kind 6)");
}
