// MLA decode attention on Intel AMX tiles, for bf16 latent caches (included by mla_decode.cpp).
//
// The same scheme as amx_decode_attention.h (read that first), for one kv head whose values are the first Dv
// entries of each key row. Per (sequence, chunk of at most 16 heads):
//   1. scores: for each 16-key chunk, S[16 keys x 16 heads] = K rows (a tile loaded in place from the cache,
//      row stride = D) x Q^T in VNNI pairs (D / 32 tiles; 18 for DeepSeek's 576);
//   2. softmax per head over the whole sequence in fp32 (lane g of every key row of S);
//   3. out = P V: P as bf16 [G x keys] times the rows' first Dv entries, pair-interleaved 32 keys at a time; four
//      fp32 accumulator tiles hold 64 output columns, Dv / 64 passes (8 for 512). Rows past the sequence's length
//      are zeros in the interleaved V, never read from the cache (stale slots may hold NaN; 0 * NaN is NaN);
//   4. out /= the fp32 softmax sum.
// Taken for bf16 caches with D % 32 == 0, Dv % 64 == 0, block_size % 16 == 0 on CPUs and builds with AMX (and the
// OS granted the tile state); everything else takes the vector kernel. OPENINFER_CPU_AMX=0 turns it off.
#pragma once

#include <atomic>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define OI_MLA_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

std::atomic<bool> g_mla_amx_enabled{true};

#ifdef OI_MLA_HAVE_AMX
// the score rows below are one 16-key vector each: AVX-512 builds only, where vec.h's vectors are 16 wide
static_assert(kW == 16, "the AMX kernel assumes 16-lane vectors");

bool mla_amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The next 16 keys' rows (n rows of D values), one prefetch per 64-byte line, while this chunk's tiles run: a
// sequence's blocks sit anywhere in the pool, so the hardware prefetcher cannot guess where the next chunk is.
template <typename T>
inline void prefetch_block(const T* p, int64_t n, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * D * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

struct alignas(64) MlaTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-3: out accumulators [G x 16 fp32]; tmm4: P [G x 32 keys bf16]; tmm5: B operand [16 x 64 bytes] (Q^T or
// V, VNNI); tmm6: scores [16 keys x 16 heads fp32]; tmm7: K rows [16 keys x 32 dims bf16].
void mla_configure_tiles(int64_t G) {
  MlaTileConfig cfg{};
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

// rows a and b (32 bf16 each) into VNNI pairs: lo = a0 b0 .. a15 b15, hi = a16 b16 .. a31 b31
inline void mla_interleave(__m512i a, __m512i b, uint16_t* lo, uint16_t* hi) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  _mm512_storeu_si512(lo, _mm512_permutex2var_epi16(a, _mm512_load_si512(kLo), b));
  _mm512_storeu_si512(hi, _mm512_permutex2var_epi16(a, _mm512_load_si512(kHi), b));
}

bool amx_mla_decode(const MlaProblem& pb, char* out, const char* q, const at::Tensor& cache) {
  const int64_t D = pb.D, Dv = pb.Dv, bs = pb.bs;
  if (!g_mla_amx_enabled.load(std::memory_order_relaxed) || cache.scalar_type() != at::kBFloat16 || D % 32 ||
      Dv % 64 || bs % 16 || !mla_amx_permitted()) {
    return false;
  }
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(cache.const_data_ptr<c10::BFloat16>());
  const int64_t GC = std::min<int64_t>(16, pb.heads_per_task);
  const int64_t chunks = (pb.H + GC - 1) / GC;
  int64_t max_len = 0;
  for (int64_t b = 0; b < pb.B; ++b) max_len = std::max(max_len, pb.lens[b]);
  const int64_t l16 = (max_len + 15) / 16 * 16, l32 = (max_len + 31) / 32 * 32;
  const int64_t ntasks = pb.B * chunks, nchunks = D / 32;
  const int64_t kstride = D * 2;  // bytes between a block's consecutive slots
  std::atomic<int64_t> next{0};
  const int64_t nworkers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, nworkers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> S(std::max<int64_t>(l16, 16) * 16), O(GC * Dv), qrow(D);
    std::vector<uint16_t> qt(nchunks * 16 * 32), qbits(D), pt(GC * std::max<int64_t>(l32, 32)), vb(4 * 16 * 32),
        sb(std::max<int64_t>(l16, 16) * 16);
    const uint16_t zeros[32] = {};
    int64_t configured = -1;
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t task = next.fetch_add(1); task < ntasks; task = next.fetch_add(1)) {
        const int64_t b = task / chunks, h0 = (task % chunks) * GC;
        const int64_t G = std::min(GC, pb.H - h0);
        const int64_t len = pb.lens[b];
        char* obase = out + (b * pb.out_sb + h0 * pb.out_sh) * pb.qsize;
        if (len <= 0) {
          std::fill(O.begin(), O.begin() + Dv, 0.0f);
          for (int64_t g = 0; g < G; ++g) store_any(O.data(), obase + g * pb.out_sh * pb.qsize, pb.qtype, Dv);
          continue;
        }
        if (G != configured) {  // the last chunk of heads may be smaller
          mla_configure_tiles(G);
          configured = G;
        }
        const int64_t* table = pb.tables + b * pb.max_blocks;
        // Q^T in VNNI, one [16 x 32] tile per 32 dims: qt[c][i][2 g + j] = q[g][32 c + 2 i + j]
        std::fill(qt.begin(), qt.end(), 0);
        const char* qbase = q + (b * pb.q_sb + h0 * pb.q_sh) * pb.qsize;
        for (int64_t g = 0; g < G; ++g) {
          const char* src = qbase + g * pb.q_sh * pb.qsize;
          const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
          if (pb.qtype != at::kBFloat16) {  // bf16 q is used as is; others are rounded to bf16 first
            load_any(src, pb.qtype, qrow.data(), D);
            store_row(qrow.data(), reinterpret_cast<c10::BFloat16*>(qbits.data()), D);
            bits = qbits.data();
          }
          uint32_t* pairs = reinterpret_cast<uint32_t*>(qt.data());
          uint32_t pair;
          for (int64_t i = 0; i < D / 2; ++i) {
            std::memcpy(&pair, bits + 2 * i, sizeof(pair));
            pairs[(i / 16) * 256 + (i % 16) * 16 + g] = pair;
          }
        }
        // 1. scores, 16 keys at a time, K tiles read in place (16 keys never straddle a block: bs % 16 == 0)
        const int64_t nk = (len + 15) / 16;
        for (int64_t c = 0; c < nk; ++c) {
          const int64_t t0 = c * 16;
          const uint16_t* krow = kc + table[t0 / bs] * pb.c_sblk + (t0 % bs) * D;
          if (c + 1 < nk) {
            const int64_t t1 = t0 + 16;
            prefetch_block(kc + table[t1 / bs] * pb.c_sblk + (t1 % bs) * D, std::min<int64_t>(16, len - t1), D);
          }
          _tile_zero(6);
          for (int64_t j = 0; j < nchunks; ++j) {
            _tile_loadd(7, krow + 32 * j, kstride);
            _tile_loadd(5, qt.data() + j * 512, 64);
            _tile_dpbf16ps(6, 7, 5);
          }
          _tile_stored(6, S.data() + t0 * 16, 64);
        }
        // 2. softmax per head (lane g of every key row); rows >= len never take part
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
        store_row(S.data(), reinterpret_cast<c10::BFloat16*>(sb.data()), len * 16);
        for (int64_t g = 0; g < G; ++g) {
          uint16_t* row = pt.data() + g * l32;
          for (int64_t t = 0; t < len; ++t) row[t] = sb[t * 16 + g];
          std::fill(row + len, row + l32, 0);
        }
        // 3. P V, 64 output columns per pass, 32 keys per step
        const int64_t ng = (len + 31) / 32;
        for (int64_t dh = 0; dh < Dv; dh += 64) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kg = 0; kg < ng; ++kg) {
            const uint16_t* half[2];
            for (int64_t j = 0; j < 2; ++j) {
              const int64_t t = kg * 32 + 16 * j;
              half[j] = t < len ? kc + table[t / bs] * pb.c_sblk + (t % bs) * D + dh : nullptr;
            }
            for (int64_t p = 0; p < 16; ++p) {
              const int64_t t = kg * 32 + 2 * p;
              const uint16_t* ra = t < len ? half[p / 8] + (2 * p % 16) * D : nullptr;
              const uint16_t* rb = t + 1 < len ? half[p / 8] + (2 * p % 16 + 1) * D : nullptr;
              for (int64_t r = 0; r < 2; ++r) {
                const __m512i a = _mm512_loadu_si512(ra ? ra + 32 * r : zeros);
                const __m512i bv = _mm512_loadu_si512(rb ? rb + 32 * r : zeros);
                mla_interleave(a, bv, vb.data() + (2 * r) * 512 + p * 32, vb.data() + (2 * r + 1) * 512 + p * 32);
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
          _tile_stored(0, O.data() + dh, Dv * 4);
          _tile_stored(1, O.data() + dh + 16, Dv * 4);
          _tile_stored(2, O.data() + dh + 32, Dv * 4);
          _tile_stored(3, O.data() + dh + 48, Dv * 4);
        }
        // 4. normalise (sum >= 1: the max contributes exp(0)) and store in q's dtype
        for (int64_t g = 0; g < G; ++g) {
          scale_row(O.data() + g * Dv, 1.0f / z[g], Dv);
          store_any(O.data() + g * Dv, obase + g * pb.out_sh * pb.qsize, pb.qtype, Dv);
        }
      }
    }
    _tile_release();  // leave no tile state behind for whatever runs on this thread next
  });
  return true;
}

bool mla_amx_available() { return mla_amx_permitted(); }

#else

bool amx_mla_decode(const MlaProblem&, char*, const char*, const at::Tensor&) { return false; }

bool mla_amx_available() { return false; }

#endif

}  // namespace
