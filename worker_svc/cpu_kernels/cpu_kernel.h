// What jaxstream's XLA:CPU kernels (product_kernel.cc, attention_kernel.cc) share: 16-float vectors in
// GCC's vector extension (split where the CPU's vectors are narrower), loads that widen int8 and
// bfloat16 bits to floats in registers, `ask_for` (a prefetch of a span), and `for_parts`, which runs
// fixed parts on XLA's intra-op threads. build.py compiles each kernel with this header on the
// machine that runs it.

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxstream {

typedef float f16v __attribute__((vector_size(64)));  // 16 floats
typedef int32_t i16v32 __attribute__((vector_size(64)));  // 16 int32
typedef uint32_t u16v32 __attribute__((vector_size(64)));
typedef uint16_t u16v16 __attribute__((vector_size(32)));  // 16 uint16
typedef int8_t i16v __attribute__((vector_size(16)));  // 16 int8

inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f16v load(const int8_t* p) {  // 16 int8 values as floats
#if defined(__AVX512F__)
  __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  f16v out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#elif defined(__AVX2__)
  __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  f16v out;
  std::memcpy(&out, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof lo, &hi, sizeof hi);
  return out;
#else
  i16v v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, f16v);
#endif
}

inline f16v load(const uint16_t* p) {  // 16 bfloat16 values (their bits) as floats, exactly
  u16v16 v;
  std::memcpy(&v, p, sizeof v);
  const u16v32 wide = __builtin_convertvector(v, u16v32) << 16;
  f16v out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

inline float sum(f16v v) {  // by halves: four dependent adds, not fifteen
  typedef float f8v __attribute__((vector_size(32)));
  typedef float f4v __attribute__((vector_size(16)));
  const f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Asks the CPU for the cache lines of [p, p + bytes) ahead of their reads: for what its prefetcher does not
// follow (a column block's rows Out floats apart, pages scattered by a page table).
inline void ask_for(const void* p, size_t bytes) {
  for (size_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(static_cast<const char*>(p) + byte);
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// fn(part) for every part in [0, parts), on the calling thread and the pool's: returns when all are done.
// A helper that starts after every part was taken returns at once, touching only `state`.
template <typename F>
void for_parts(ffi::ThreadPool& pool, int64_t parts, const F& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  const F* work = &fn;
  auto run = [state, parts, work]() {
    for (int64_t p; (p = state->next.fetch_add(1)) < parts;) {
      (*work)(p);
      state->done.fetch_add(1);
    }
  };
  for (int64_t h = 1; h < std::min<int64_t>(pool.num_threads(), parts); ++h) pool.Schedule([run]() { run(); });
  run();
  // Parts other threads are running take microseconds; a helper the OS descheduled (other services
  // share the cores) gets the core back after a while of spinning.
  for (int spins = 0; state->done.load() < parts; ++spins) {
    if (spins < 4096) {
      relax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxstream
