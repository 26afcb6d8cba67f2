"""Would AMX make a verify's extra rows cheap? An int8 x int8 product through AMX tiles (TDPBSSD, up to 16 rows per
tile) beside the engine's AVX-512 VNNI kernels on the same shape: int8_rows (8-bit weights, the same bytes) and
kquant_rows' Q4_K (the GGUF blocks the target runs). ms a call at 1 / 3 / 5 / 8 / 16 rows, 2 threads, weights from
memory (copies rotated past the L3), arms in random order, median of REPS. Only on a CPU with amx_int8 whose kernel
grants the process its tile state (arch_prctl ARCH_REQ_XCOMP_PERM).

The AMX product is exact in int32 (checked against torch on fresh inputs before timing); activations are rounded per
row as int8_rows rounds them. A probe: no Q4_K unpacking into tiles, no engine path.

    python benchmarks/amx_rows_probe.py [OUT IN]   (default 8960 1536, the MLP's gate / up projection)
"""
import random
import statistics
import sys
import time

import torch
from torch.utils import cpp_extension

from eagle_fsd.kernels import int8_rows as k8
from eagle_fsd.kernels import kquant_rows as kq
from eagle_fsd.kernels.int4_rows import cpu_flags

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed));

bool request_tiles() { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }

// tiles 0, 1: C (m x 16 int32), 2: A (m rows x 64 int8), 3, 4: B (16 x 64 int8, 4 inputs of 16 channels a row)
void configure(int m) {
  alignas(64) TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 3; ++t) { c.rows[t] = m; c.colsb[t] = 64; }
  for (int t = 3; t < 5; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  asm volatile("" : : "r"(&c) : "memory");  // gcc 12 takes _tile_loadconfig for an 8-byte read: keep every store
  _tile_loadconfig(&c);
}

// c[h] (m x 16) = a (m, k) times column block 2 p + h of the packed weights, with the tiles configured for m rows
void pair_products(const int8_t* a, int64_t k, const int8_t* packed, int64_t chunks, int64_t p, int32_t (*c)[256]) {
  const int8_t* b0 = packed + (2 * p) * chunks * 1024;
  const int8_t* b1 = b0 + chunks * 1024;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t t = 0; t < chunks; ++t) {
    _tile_loadd(2, a + 64 * t, k);
    _tile_loadd(3, b0 + 1024 * t, 64);
    _tile_loadd(4, b1 + 1024 * t, 64);
    _tile_dpbssd(0, 2, 3);
    _tile_dpbssd(1, 2, 4);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
}

// y (m, n) = (a * ascale) (w * wscale)^T with w packed as (n / 16, k / 64, 16, 64): B[r][4 c + i] = w[16 b + c][64 t
// + 4 r + i]; a (m <= 16, k) int8, every row rounded on its own scale.
torch::Tensor amx_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), chunks = k / 64;
  TORCH_CHECK(m >= 1 && m <= 16 && k % 64 == 0 && blocks % 2 == 0, "amx_rows: m <= 16, k % 64, even blocks");
  auto a = torch::empty({m, k}, torch::kInt8);
  std::vector<float> ascale(m);
  const float* xp = x.data_ptr<float>();
  int8_t* ap = a.data_ptr<int8_t>();
  for (int64_t i = 0; i < m; ++i) {
    float peak = 1e-30f;
    for (int64_t j = 0; j < k; ++j) peak = std::max(peak, std::fabs(xp[i * k + j]));
    ascale[i] = peak / 127.f;
    for (int64_t j = 0; j < k; ++j) ap[i * k + j] = static_cast<int8_t>(std::nearbyint(xp[i * k + j] * 127.f / peak));
  }
  auto y = torch::empty({m, blocks * 16}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = wscale.data_ptr<float>();
  at::parallel_for(0, blocks / 2, 1, [&](int64_t begin, int64_t end) {
    configure(static_cast<int>(m));
    alignas(64) int32_t c[2][16 * 16];
    for (int64_t p = begin; p < end; ++p) {
      pair_products(ap, k, wp, chunks, p, c);
      for (int h = 0; h < 2; ++h)
        for (int64_t i = 0; i < m; ++i)
          for (int j = 0; j < 16; ++j) {
            const int64_t col = 32 * p + 16 * h + j;
            yp[i * blocks * 16 + col] = static_cast<float>(c[h][16 * i + j]) * ascale[i] * sp[col];
          }
    }
    _tile_release();
  });
  return y;
}

// the int32 products alone, for the exactness check
torch::Tensor amx_int32(torch::Tensor a, torch::Tensor packed) {
  const int64_t m = a.size(0), k = a.size(1), blocks = packed.size(0);
  auto y = torch::empty({m, blocks * 16}, torch::kInt32);
  int32_t* yp = y.data_ptr<int32_t>();
  configure(static_cast<int>(m));
  alignas(64) int32_t c[2][16 * 16];
  for (int64_t p = 0; p < blocks / 2; ++p) {
    pair_products(a.data_ptr<int8_t>(), k, packed.data_ptr<int8_t>(), k / 64, p, c);
    for (int h = 0; h < 2; ++h)
      for (int64_t i = 0; i < m; ++i)
        for (int j = 0; j < 16; ++j) yp[i * blocks * 16 + 32 * p + 16 * h + j] = c[h][16 * i + j];
  }
  _tile_release();
  return y;
}

// Q4_K blocks as kquant_rows packs them (per 16 channels and 256 inputs, 2368 bytes): line r of quarter u (64 bytes at
// 512 u + 64 r) holds in its low nibbles inputs 4 r .. 4 r + 3 of sub-block 2 u for each channel, in its high nibbles
// those of sub-block 2 u + 1: a B tile row each. The sub-block sums of a quarter go through two tiles (TDPBSUD, exact
// in int32), then every row is scaled and summed as kquant_rows' VNNI build does it, in the same order: the same bits.
torch::Tensor q4k_rows(torch::Tensor x, torch::Tensor packed) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(m >= 1 && m <= 16 && k == groups * 256, "q4k_rows: m <= 16, k = 256 groups");
  // activations per row on their own scale, and each 32-input sub-block's sum (two int16 in an int32)
  std::vector<int8_t> v(m * k);
  std::vector<float> scale(m);
  std::vector<int32_t> sums(m * (k / 64), 0);
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x.data_ptr<float>() + i * k;
    float peak = 0.f;
    for (int64_t j = 0; j < k; ++j) peak = std::max(peak, std::fabs(xi[j]));
    peak = std::max(peak, 1e-30f);
    const float up = 127.f / peak;
    scale[i] = peak / 127.f;
    for (int64_t j = 0; j < k; ++j)
      v[i * k + j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(xi[j] * up)));
    for (int64_t s = 0; s < k / 32; ++s) {
      int32_t total = 0;
      for (int64_t j = 32 * s; j < 32 * s + 32; ++j) total += v[i * k + j];
      const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(total));
      sums[i * (k / 64) + s / 2] |= static_cast<int32_t>(s % 2 ? half << 16 : half);
    }
  }
  auto y = torch::empty({m, blocks * 16}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 2; ++t) { c.rows[t] = m; c.colsb[t] = 64; }      // C: sub-blocks 2 u, 2 u + 1
    for (int t = 2; t < 4; ++t) { c.rows[t] = m; c.colsb[t] = 32; }      // A: their 32 inputs of each row
    for (int t = 4; t < 6; ++t) { c.rows[t] = 8; c.colsb[t] = 64; }      // B: their nibbles, 8 lines
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
    alignas(64) uint8_t low[8 * 64], high[8 * 64];
    alignas(64) int32_t c0[16 * 16], c1[16 * 16];
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = begin; b < end; ++b) {
      __m512 acc[16];
      __m512i big[16];
      for (int64_t i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t t = 0; t < groups; ++t) {
        const uint8_t* w = wp + (b * groups + t) * 2368;
        for (int64_t i = 0; i < m; ++i) big[i] = _mm512_setzero_si512();
        for (int u = 0; u < 4; ++u) {
          for (int r = 0; r < 8; ++r) {
            const __m512i bytes = _mm512_loadu_si512(w + 512 * u + 64 * r);
            _mm512_store_si512(low + 64 * r, _mm512_and_si512(bytes, nibble));
            _mm512_store_si512(high + 64 * r, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
          }
          _tile_loadd(2, v.data() + t * 256 + 64 * u, k);
          _tile_loadd(3, v.data() + t * 256 + 64 * u + 32, k);
          _tile_loadd(4, low, 64);
          _tile_loadd(5, high, 64);
          _tile_zero(0);
          _tile_zero(1);
          _tile_dpbsud(0, 2, 4);
          _tile_dpbsud(1, 3, 5);
          _tile_stored(0, c0, 64);
          _tile_stored(1, c1, 64);
          const auto* scales = reinterpret_cast<const __m128i*>(w + 2048 + 32 * u);  // sub-blocks 2 u, 2 u + 1
          const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(scales));
          const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(scales + 1));
          for (int64_t i = 0; i < m; ++i) {
            const __m512i first = _mm512_mullo_epi32(_mm512_load_si512(c0 + 16 * i), sc0);
            const __m512i second = _mm512_mullo_epi32(_mm512_load_si512(c1 + 16 * i), sc1);
            big[i] = _mm512_add_epi32(big[i], _mm512_add_epi32(first, second));
          }
        }
        __m512i mins[4];
        for (int p = 0; p < 4; ++p)
          mins[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2176 + 32 * p)));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2304)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2336)));
        for (int64_t i = 0; i < m; ++i) {
          const int32_t* si = sums.data() + i * (k / 64) + 4 * t;
          __m512i lows = _mm512_madd_epi16(mins[0], _mm512_set1_epi32(si[0]));
          for (int p = 1; p < 4; ++p)
            lows = _mm512_add_epi32(lows, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(si[p])));
          acc[i] = _mm512_add_ps(acc[i], _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(big[i]),
                                                        _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(lows))));
        }
      }
      for (int64_t i = 0; i < m; ++i)
        _mm512_storeu_ps(yp + i * blocks * 16 + b * 16, _mm512_fmadd_ps(acc[i], _mm512_set1_ps(scale[i]),
                                                                        _mm512_setzero_ps()));
    }
    _tile_release();
  });
  return y;
}
"""
REPS, ROWS = 200, (1, 3, 5, 8, 16)


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """int8 (n, k) -> (n / 16, k / 64, 16, 64): B[r][4 c + i] = w[16 b + c][64 t + 4 r + i]."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // 64, 16, 64)


def main() -> None:
    if "amx_int8" not in cpu_flags():
        raise SystemExit("amx_rows_probe: this CPU has no amx_int8")
    out_features, in_features = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (8960, 1536)
    torch.set_num_threads(2)
    ext = cpp_extension.load_inline("eagle_fsd_amx_rows_probe", [SOURCE],
                                    functions=["request_tiles", "amx_rows", "amx_int32", "q4k_rows"],
                                    extra_cflags=["-O3", "-fopenmp", "-mamx-tile", "-mamx-int8", "-mavx512f",
                                                  "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
    if not ext.request_tiles():
        raise SystemExit("amx_rows_probe: the kernel did not grant the tile state (arch_prctl)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    q, scale = k8.quantize_int8(w)
    for m in ROWS:  # exact int32 products on fresh inputs
        a = torch.randint(-127, 128, (m, in_features), dtype=torch.int8, generator=g)
        assert torch.equal(ext.amx_int32(a, pack_tiles(q)), a.int() @ q.int().T), f"amx_int32 differs at {m} rows"
    raw = kq.random_blocks("q4_k", out_features, in_features, g)
    count = max(8, -(-200_000_000 // q.numel()))
    tiles = [pack_tiles(q).clone() for _ in range(count)]
    vnni = [tuple(t.clone() for t in k8.pack_int8_rows(q, scale)) for _ in range(count)]
    q4k = [kq.pack("q4_k", raw).clone() for _ in range(count)]
    ext8, extq, empty = k8._extension("avx512_vnni"), kq._extension("avx512_vnni"), torch.empty(0)
    for m in ROWS:  # the Q4_K blocks through tiles give the VNNI kernel's bits
        x = torch.randn(m, in_features, generator=g)
        assert torch.equal(ext.q4k_rows(x, q4k[0]), extq.kquant_rows_linear(x, q4k[0], 4, empty)), f"q4k at {m} rows"
    print(f"{out_features} x {in_features}, 2 threads, {count} copies of each; ms a call (median of {REPS})")
    for m in ROWS:
        x = torch.randn(m, in_features, generator=g)
        arms = {"amx int8": lambda r: ext.amx_rows(x, tiles[r], scale),
                "int8_rows vnni": lambda r: ext8.int8_rows_linear(x, *vnni[r], empty),
                "kquant q4_k vnni": lambda r: extq.kquant_rows_linear(x, q4k[r], 4, empty),
                "q4_k through tiles": lambda r: ext.q4k_rows(x, q4k[r])}
        times, rng = {name: [] for name in arms}, random.Random(m)
        for r in range(REPS + 5):
            for name in rng.sample(list(arms), len(arms)):
                start = time.perf_counter_ns()
                arms[name](r % count)
                times[name].append(time.perf_counter_ns() - start)
        medians = ", ".join(f"{name} {statistics.median(t[5:]) / 1e6:.3f}" for name, t in times.items())
        print(f"  rows {m:2d}: {medians}", flush=True)


if __name__ == "__main__":
    main()
