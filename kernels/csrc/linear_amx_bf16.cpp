// Dense bf16 linears on AMX tiles (TDPBF16PS): the encoders' linears (embedding models)
// where the CPU has AMX-BF16. About 10x the vdpbf16ps kernels of linear_bf16.cpp on a
// batch of rows (benchmarks/embeddings.py, BENCHMARKS.md).
//
// Shapes (N out features, K in features, M rows of x; K a multiple of 32):
//   weight bf16 [N, K] -> packed bf16 [T, K/32, 16, 32], T = 2 * ceil(N / 32) column tiles:
//     block (t, g) is one B tile, outputs 16t .. 16t + 15 by inputs 32g .. 32g + 31, in
//     VNNI order: row p, element 2n + e = W[16t + n, 32g + 2p + e] (zero past N)
//   x float32 [M, K] -> rounded to bf16 (nearest even) -> y float32 [M, N] (+ bias [N])
//
// The recipe: y[m, n] starts at zero and TDPBF16PS adds the K/32 blocks' dot products into
// it in order. Every element runs that sequence whatever M is and wherever its row falls in
// a tile (rows past M are zeros in a padded copy of x), so a row's outputs do not depend on
// what shares its batch. They are not linear_bf16.cpp's bits: the tile unit's rounding of
// its dot products is its own (against a float64 sum rounded once, about 7% of single-pair
// sums differ in the last bit on Emerald Rapids; neither order of two rounded FMAs matches
// it), so no other instruction set can reproduce them. That is why only encoders take this
// path: an embedding is compared by cosine, while a decoder's greedy tokens are pinned to
// the one recipe every CPU computes (tests/test_cpu_kernels_isa.py).
//
// Blocking: 32 rows of x by 32 outputs, four float32 accumulator tiles; a work item is one
// block of 32 rows against a run of 32-output column blocks. A block's weight tiles
// (K / 32 KiB per 16 outputs) and its rows of x (K / 16 KiB) stay in L1 / L2 while they meet.

#include "amx.h"
#include "kernels.h"

namespace pagedllm {
namespace {

constexpr int64_t kTileOutputs = 16;             // outputs per B tile
constexpr int64_t kBlockRows = 32;               // rows of x per block (two A tiles)
constexpr int64_t kBlockCols = 32;               // outputs per block (two B tiles)
constexpr int64_t kTileValues = 16 * 32;         // bf16 values in one 1 KiB tile

void check_packed(const Tensor& packed) {
  check_cpu_contiguous(packed, "packed");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(0) % 2 == 0 && packed.size(2) == 16 && packed.size(3) == 32,
              "packed must be bf16 [T, K/32, 16, 32] with T even (amx_bf16_pack), got ",
              packed.scalar_type(), " ", packed.sizes());
}

#ifdef PAGEDLLM_AMX_BF16
// The 32 x 32 block of y at rows r0.., outputs c0.. : four accumulators over all of K.
// xb: bf16 rows of x (row stride k), 32 rows from r0 present (zeros past M);
// wb: the block's first B tile column (tile t0's K/32 tiles, then t0 + 1's).
inline void amx_block(const bf16* xb, const bf16* wb, int64_t k, const float* bias, float* out,
                      int64_t ldo, int64_t rows, int64_t cols) {
  const int64_t groups = k / 32, x_stride = k * 2;
  const bf16* x0 = xb;
  const bf16* x1 = xb + 16 * k;
  const bf16* w0 = wb;
  const bf16* w1 = wb + groups * kTileValues;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, x0 + g * 32, x_stride);
    _tile_loadd(5, x1 + g * 32, x_stride);
    _tile_loadd(6, w0 + g * kTileValues, 64);
    _tile_loadd(7, w1 + g * kTileValues, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  // y = sums + bias (as `y.add_(bias)` after the matmul would round it), while in L1.
  if (rows == kBlockRows && cols == kBlockCols) {  // the common case: straight into y
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    _tile_stored(2, out + 16 * ldo, ldo * 4);
    _tile_stored(3, out + 16 * ldo + 16, ldo * 4);
    if (bias != nullptr) {
      const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
      for (int64_t r = 0; r < kBlockRows; ++r) {
        float* row = out + r * ldo;
        _mm512_storeu_ps(row, _mm512_add_ps(_mm512_loadu_ps(row), b0));
        _mm512_storeu_ps(row + 16, _mm512_add_ps(_mm512_loadu_ps(row + 16), b1));
      }
    }
    return;
  }
  alignas(64) float block[kBlockRows][kBlockCols];
  _tile_stored(0, &block[0][0], kBlockCols * 4);
  _tile_stored(1, &block[0][16], kBlockCols * 4);
  _tile_stored(2, &block[16][0], kBlockCols * 4);
  _tile_stored(3, &block[16][16], kBlockCols * 4);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * ldo + c] = bias != nullptr ? block[r][c] + bias[c] : block[r][c];
}

// x [M, K] float32 -> bf16 [M_pad, K], rows past M zero, in a buffer kept by the calling
// thread (the pool's workers read it while the call lasts).
const bf16* padded_activations(const float* x, int64_t m, int64_t m_pad, int64_t k) {
  thread_local std::vector<bf16> buffer;
  if (static_cast<int64_t>(buffer.size()) < m_pad * k) buffer.resize(m_pad * k);
  bf16* dst = buffer.data();
  parallel_for(0, m_pad, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* row = dst + r * k;
      if (r >= m) {
        std::fill(row, row + k, bf16(0.0f));
        continue;
      }
      for (int64_t i = 0; i < k; i += 16) {  // round to nearest even, as Tensor.to(bf16)
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * k + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i), (__m256i)v);
      }
    }
  });
  return dst;
}
#endif

}  // namespace

namespace api {

bool amx_bf16_available() { return amx::bf16_enabled(); }

Tensor amx_bf16_pack(const Tensor& weight) {
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "weight must be bf16 [N, K], got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n > 0 && k > 0 && k % 32 == 0, "amx_bf16_pack: K must be a positive multiple of 32, got ", k);
  const int64_t tiles = 2 * ((n + kBlockCols - 1) / kBlockCols), groups = k / 32;
  Tensor packed = at::zeros({tiles, groups, 16, 32}, weight.options());
  const bf16* w = weight.data_ptr<bf16>();
  bf16* p = packed.data_ptr<bf16>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t t = row / kTileOutputs, lane = row % kTileOutputs;
    for (int64_t col = 0; col < k; ++col) {
      const int64_t g = col / 32, pair = (col % 32) / 2, e = col % 2;
      p[((t * groups + g) * 16 + pair) * 32 + 2 * lane + e] = w[row * k + col];
    }
  }
  return packed;
}

Tensor amx_bf16_linear(const Tensor& x_in, const Tensor& packed, int64_t n, const Tensor* bias,
                       Tensor* out_buffer) {
  check_packed(packed);
  TORCH_CHECK(bias == nullptr || bias->numel() == 0 ||
                  (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "amx_bf16_linear: bias must be contiguous float32 [", n, "]");
  const int64_t groups = packed.size(1), k = groups * 32;
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kTileOutputs, "amx_bf16_linear: ", n,
              " outputs for ", packed.size(0), " column tiles");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [M, ", k, "], got ", x_in.sizes());
  TORCH_CHECK(amx::bf16_enabled(),
              "amx_bf16_linear needs AMX-BF16 (this CPU or build lacks it, or "
              "PAGEDLLM_DISABLE_AMX is set)");
#ifdef PAGEDLLM_AMX_BF16
  const Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  Tensor out = float_output(out_buffer, m, n, x.options());
  if (m == 0) return out;
  const int64_t row_blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t col_blocks = (n + kBlockCols - 1) / kBlockCols;
  const bf16* xb = padded_activations(x.data_ptr<float>(), m, row_blocks * kBlockRows, k);
  const bf16* wp = packed.data_ptr<bf16>();
  float* op = out.data_ptr<float>();
  const float* bp = bias != nullptr && bias->numel() > 0 ? bias->data_ptr<float>() : nullptr;
  // Enough items for every thread (parallel_for makes up to 4 chunks per thread): with few
  // row blocks (a short query), the columns are cut into runs as well.
  const int64_t wanted = 4 * pool_threads();
  const int64_t runs = row_blocks >= wanted
                           ? 1
                           : std::min(col_blocks, (wanted + row_blocks - 1) / row_blocks);
  const int64_t run_blocks = (col_blocks + runs - 1) / runs;
  parallel_for(0, row_blocks * runs, 1, [&](int64_t begin, int64_t end) {
    amx::configure_thread_square();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item / runs, run = item % runs;
      const int64_t r0 = rb * kBlockRows, rows = std::min(kBlockRows, m - r0);
      const int64_t cb_end = std::min(col_blocks, (run + 1) * run_blocks);
      for (int64_t cb = run * run_blocks; cb < cb_end; ++cb) {
        const int64_t c0 = cb * kBlockCols;
        amx_block(xb + r0 * k, wp + 2 * cb * groups * kTileValues, k,
                  bp != nullptr ? bp + c0 : nullptr, op + r0 * n + c0, n, rows,
                  std::min(kBlockCols, n - c0));
      }
    }
    amx::release_thread();
  });
  return out;
#else
  TORCH_CHECK(false, "unreachable: amx_bf16_linear without AMX-BF16");
#endif
}

}  // namespace api
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // True where amx_bf16_linear runs: the CPU has AMX-BF16, the build has it, it is not off.
  m.def("amx_bf16_enabled() -> bool", []() { return pagedllm::api::amx_bf16_available(); });
  // weight bf16 [N, K] -> packed bf16 [T, K/32, 16, 32] (the B tiles)
  m.def("amx_bf16_pack(Tensor weight) -> Tensor",
        [](const at::Tensor& weight) { return pagedllm::api::amx_bf16_pack(weight); });
  // x [M, K] float32, packed, N, bias float32 [N] or None -> [M, N] float32
  m.def("amx_bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& packed, int64_t n,
           const std::optional<at::Tensor>& bias) {
          return pagedllm::api::amx_bf16_linear(x, packed, n, bias ? &*bias : nullptr);
        });
}
