// Paged decode attention on Intel AMX tiles, for bf16 caches (included by paged_decode_attention.cpp).
//
// Why: the vector kernel spends its time on horizontal sums (a dot product per key per query head) and on
// widening bf16 to fp32; at batch 256 x ~200 tokens it ran ~6x slower than the cache could be read. AMX
// multiplies bf16 tiles straight from the cache with fp32 accumulation, so both costs go away.
//
// Per (sequence, kv head) task, with G query heads sharing the kv head:
//   1. scores: for each 16-key chunk, S[16 keys x 16 heads] = K rows (a tile loaded in place from the cache,
//      row stride = the cache's slot stride) x Q^T (the G query rows in AMX's pair-interleaved "VNNI" layout,
//      padded to 16 heads with zeros). Exact bf16 products, fp32 sums.
//   2. softmax over each head's column of S in fp32 (max, exp, sum): every key row is one 16-lane vector,
//      so the per-head reductions are lane-wise, no horizontal sums.
//   3. out = P V: P (G x keys, rounded to bf16 as flash attention does for its PV product) times V, whose rows
//      are pair-interleaved into VNNI layout 32 keys at a time; four fp32 accumulator tiles hold 64 output
//      columns, so head_dim 128 takes two passes over P. Rows past the sequence's length are zeros in the
//      interleaved V, never read from the cache (stale slots could hold anything, and 0 * NaN is NaN).
//   4. out /= the fp32 softmax sum.
// Two passes over the keys (scores, then values) instead of an online softmax: the scores of one task are
// 64 bytes per key (a 4k-token context: 256 KB, in L2), and the accumulators never need rescaling.
//
// Used for bf16 caches with head_dim a multiple of 64, block_size a multiple of 16 and at most 16 query heads
// per kv head, on CPUs and kernels that have AMX (compiled with -march=native on such a CPU, and the OS
// granted the tile state); everything else takes the vector kernel.
#pragma once

#include <atomic>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define OI_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

std::atomic<bool> g_amx_enabled{true};

#ifdef OI_HAVE_AMX
// the score rows below are one 16-key vector each: AVX-512 builds only, where vec.h's vectors are 16 wide
static_assert(kW == 16, "the AMX kernel assumes 16-lane vectors");

// Linux hands out the 8 KB of tile state per process on request (arch_prctl); without it the first tile
// instruction faults. oneDNN asks too; asking twice is harmless.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-3: out accumulators [G x 16 fp32]; tmm4: P [G x 32 keys bf16]; tmm5: the B operand [16 x 64 bytes]
// (Q^T or V, VNNI); tmm6: scores [16 keys x 16 heads fp32]; tmm7: K rows [16 keys x 32 dims bf16].
void configure_tiles(int64_t G) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 5; ++i) {
    cfg.rows[i] = static_cast<uint8_t>(G);
    cfg.colsb[i] = 64;
  }
  for (int i = 5; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Interleave rows a and b (32 bf16 each) into VNNI pairs: lo = a0 b0 a1 b1 .. a15 b15, hi = a16 b16 .. a31 b31.
inline void interleave_pairs(__m512i a, __m512i b, uint16_t* lo, uint16_t* hi) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  _mm512_storeu_si512(lo, _mm512_permutex2var_epi16(a, _mm512_load_si512(kLo), b));
  _mm512_storeu_si512(hi, _mm512_permutex2var_epi16(a, _mm512_load_si512(kHi), b));
}

bool amx_decode_attention(const Problem& pb, char* out, const char* q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache) {
  const int64_t D = pb.D, G = pb.G, bs = pb.block_size;
  if (!g_amx_enabled.load(std::memory_order_relaxed) || k_cache.scalar_type() != at::kBFloat16 || D % 64 ||
      bs % 16 || G > 16 || !amx_permitted()) {
    return false;
  }
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr<c10::BFloat16>());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr<c10::BFloat16>());
  int64_t max_len = 0;
  for (int64_t b = 0; b < pb.B; ++b) max_len = std::max(max_len, pb.lens[b]);
  const int64_t l16 = (max_len + 15) / 16 * 16, l32 = (max_len + 31) / 32 * 32;
  const int64_t ntasks = pb.B * pb.Hk, nchunks = D / 32;
  const int64_t kstride = pb.c_st * 2;  // bytes between a block's consecutive slots
  std::atomic<int64_t> next{0};
  const int64_t nworkers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, nworkers, 1, [&](int64_t w0, int64_t w1) {
    configure_tiles(G);
    std::vector<float> S(l16 * 16), O(G * D), qrow(D), sum(16);
    std::vector<uint16_t> qt(nchunks * 16 * 32), qbits(D), pt(G * l32), vb(4 * 16 * 32), sb(l16 * 16);
    const uint16_t zeros[32] = {};
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t task = next.fetch_add(1); task < ntasks; task = next.fetch_add(1)) {
        const int64_t b = task / pb.Hk, h = task % pb.Hk;
        const int64_t len = pb.lens[b];
        char* orow = out + (b * pb.out_sb + h * G * pb.out_sh) * pb.qsize;
        if (len <= 0) {
          std::fill(O.begin(), O.begin() + D, 0.0f);
          for (int64_t g = 0; g < G; ++g) store_any(O.data(), orow + g * pb.out_sh * pb.qsize, pb.qtype, D);
          continue;
        }
        const int64_t* table = pb.tables + b * pb.max_blocks;
        // Q^T in VNNI, one [16 x 32] tile per 32 dims: qt[c][i][2 g + j] = q[g][32 c + 2 i + j]
        std::fill(qt.begin(), qt.end(), 0);
        const char* qbase = q + (b * pb.q_sb + h * G * pb.q_sh) * pb.qsize;
        for (int64_t g = 0; g < G; ++g) {
          const char* src = qbase + g * pb.q_sh * pb.qsize;
          const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
          if (pb.qtype != at::kBFloat16) {  // bf16 q is used as is; others are rounded to bf16 first
            load_any(src, pb.qtype, qrow.data(), D);
            store_row(qrow.data(), reinterpret_cast<c10::BFloat16*>(qbits.data()), D);
            bits = qbits.data();
          }
          uint32_t* pairs = reinterpret_cast<uint32_t*>(qt.data());  // a (dim 2i, 2i + 1) pair is 32 bits
          const uint32_t* qp32 = reinterpret_cast<const uint32_t*>(bits);
          for (int64_t i = 0; i < D / 2; ++i) pairs[(i / 16) * 256 + (i % 16) * 16 + g] = qp32[i];
        }
        // 1. scores, 16 keys at a time, K tiles read in place
        const int64_t nk = (len + 15) / 16;
        for (int64_t c = 0; c < nk; ++c) {
          const int64_t t0 = c * 16;
          const int64_t off = table[t0 / bs] * pb.c_sblk + (t0 % bs) * pb.c_st + h * D;
          const uint16_t* krow = kc + off;
          // blocks sit anywhere in the cache: request the next chunk's K rows, and this chunk's V rows for
          // pass 3, while this one multiplies (hardware prefetchers cannot guess the block order)
          if (c + 1 < nk) {
            const int64_t t1 = t0 + 16;
            prefetch_rows(kc + table[t1 / bs] * pb.c_sblk + (t1 % bs) * pb.c_st + h * D,
                          std::min<int64_t>(16, len - t1), pb.c_st, D);
          }
          prefetch_rows(vc + off, std::min<int64_t>(16, len - t0), pb.c_st, D);
          _tile_zero(6);
          for (int64_t j = 0; j < nchunks; ++j) {
            _tile_loadd(7, krow + 32 * j, kstride);
            _tile_loadd(5, qt.data() + j * 512, 64);
            _tile_dpbf16ps(6, 7, 5);
          }
          _tile_stored(6, S.data() + t0 * 16, 64);
        }
        // 2. softmax per head (lane g of every key row); rows >= len are never read
        vfloat m = splat(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < len; ++t) {
          const vfloat s = loadv(S.data() + t * 16) * pb.scale;
          storev(S.data() + t * 16, s);
          m = vmax(m, s);
        }
        vfloat z = {};
        for (int64_t t = 0; t < len; ++t) {
          const vfloat p = vexp_neg(loadv(S.data() + t * 16) - m);
          storev(S.data() + t * 16, p);
          z += p;
        }
        storev(sum.data(), z);
        // P^T as bf16 [G x keys]: each key row rounded as one vector, then G 16-bit moves per key
        store_row(S.data(), reinterpret_cast<c10::BFloat16*>(sb.data()), len * 16);
        for (int64_t g = 0; g < G; ++g) {
          uint16_t* row = pt.data() + g * l32;
          for (int64_t t = 0; t < len; ++t) row[t] = sb[t * 16 + g];
          std::fill(row + len, row + l32, 0);
        }
        // 3. P V, 64 output columns per pass, 32 keys per step
        const int64_t ng = (len + 31) / 32;
        for (int64_t dh = 0; dh < D; dh += 64) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kg = 0; kg < ng; ++kg) {
            // each 16 keys sit in one block (block_size % 16 == 0): one table lookup per 16, not per key
            const uint16_t* half[2];
            for (int64_t j = 0; j < 2; ++j) {
              const int64_t t = kg * 32 + 16 * j;
              half[j] = t < len ? vc + table[t / bs] * pb.c_sblk + (t % bs) * pb.c_st + h * D + dh : nullptr;
            }
            for (int64_t p = 0; p < 16; ++p) {
              const int64_t t = kg * 32 + 2 * p;
              const uint16_t* base = half[p / 8] + (2 * p % 16) * pb.c_st;
              const uint16_t* ra = t < len ? base : nullptr;
              const uint16_t* rb = t + 1 < len ? base + pb.c_st : nullptr;
              for (int64_t r = 0; r < 2; ++r) {
                const __m512i a = _mm512_loadu_si512(ra ? ra + 32 * r : zeros);
                const __m512i bv = _mm512_loadu_si512(rb ? rb + 32 * r : zeros);
                interleave_pairs(a, bv, vb.data() + (2 * r) * 512 + p * 32, vb.data() + (2 * r + 1) * 512 + p * 32);
              }
            }
            _tile_loadd(4, pt.data() + kg * 32, l32 * 2);
            _tile_loadd(5, vb.data(), 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, vb.data() + 512, 64);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, vb.data() + 1024, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, vb.data() + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
          _tile_stored(0, O.data() + dh, D * 4);
          _tile_stored(1, O.data() + dh + 16, D * 4);
          _tile_stored(2, O.data() + dh + 32, D * 4);
          _tile_stored(3, O.data() + dh + 48, D * 4);
        }
        // 4. normalise (sum >= 1: the max contributes exp(0)) and store in q's dtype
        for (int64_t g = 0; g < G; ++g) {
          scale_row(O.data() + g * D, 1.0f / sum[g], D);
          store_any(O.data() + g * D, orow + g * pb.out_sh * pb.qsize, pb.qtype, D);
        }
      }
    }
    _tile_release();  // leave no tile state behind for whatever runs on this thread next
  });
  return true;
}

bool amx_available() { return amx_permitted(); }

#else

bool amx_decode_attention(const Problem&, char*, const char*, const at::Tensor&, const at::Tensor&) { return false; }

bool amx_available() { return false; }

#endif

}  // namespace
