// Decode attention over the paged KV cache on XLA:CPU: each token's queries against its row's cached
// keys and values, read where they lie in the cache, as a running softmax state (max, sum, weighted
// values). And the same over a step's own keys and values (`PagedOwn`): each token's against its row's
// tokens in the step up to its own. XLA FFI handlers; attention_kernel.py compiles this file on the
// machine that runs it and says why it exists.
//
// A layer's own terms: a sliding window is each token's lowest visible cached position (`lowest`; its
// own keys' window is their first index, attention_kernel.py), so the positions below it, whole pages
// included, are never read; soft-capping (Gemma 2) maps each score s to cap * tanh(s / cap).
//
// A block's positions lie in pages the page table scatters through the cache, which the CPU's prefetcher
// cannot foresee: while the kernel reads one block's keys and values, it asks the CPU for the next block's
// (32-row steps faster, more so at long contexts; docs/journal.md).
//
// Each token's context is cut into segments of SEGMENT positions; a part is one (token, segment), and
// a token's segments are combined in order. The bounds are fixed, whichever thread runs a part, so a
// result does not depend on the thread count, the pool's timing or the step's other tokens.

#include <cmath>
#include <vector>

#include "cpu_kernel.h"

namespace {

using namespace jaxstream;

constexpr int64_t SEGMENT = 256;  // positions per part
constexpr int64_t BLOCK = 16;  // positions whose scores are exponentiated together (one vector)
constexpr float NEG_INF = -1e30f;  // attention.py's: an empty state's max

// exp(x) for x <= 0, within ~2 float32 ulp; 0 below -87 (exp(-87) is float32's smallest normal's size,
// and the masked scores, -inf, must weigh exactly 0). 2^n exp(r) with |r| <= ln 2 / 2, a degree-6
// polynomial for exp(r).
inline f16v exp_nonpositive(f16v x) {
  const f16v lowest = x < -87.0f ? f16v{} - 87.0f : x;  // no inf or NaN inside
  const f16v shifter = f16v{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f16v t = lowest * 1.44269504f + shifter;
  const f16v n = t - shifter;
  const f16v r = (lowest - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts
  f16v p = f16v{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i16v32 bits;
  std::memcpy(&bits, &t, sizeof bits);
  i16v32 pb;
  std::memcpy(&pb, &p, sizeof pb);
  pb += (bits - 0x4B400000) << 23;  // t's low bits hold n
  f16v out;
  std::memcpy(&out, &pb, sizeof out);
  return x < -87.0f ? f16v{} : out;
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i16v32{__VA_ARGS__})
#endif

// The 16 sums of 16 vectors, as one vector: out[i] = sum of a[i]'s lanes. A tree of shuffles and adds,
// where a sum per vector would add its lanes one after another.
inline f16v sums(const f16v* a) {
  f16v b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // lanes 0-7: a[2j]'s halves added, 8-15: a[2j + 1]'s
    b[j] = SHUFFLE(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)  // 4 lanes of each of a[4j], a[4j + 2], a[4j + 1], a[4j + 3]
    c[j] = SHUFFLE(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)  // 2 lanes each: a[8j], a[8j + 4], a[8j + 2], a[8j + 6], a[8j + 1], ...
    d[j] = SHUFFLE(c[2 * j], c[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE(c[2 * j], c[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // One lane each, in bit-reversed order: a[0], a[8], a[4], a[12], a[2], ...
  const f16v e = SHUFFLE(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                 SHUFFLE(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return SHUFFLE(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// What the kernel reads, in elements: cache [L, P, Z, K, H] of Cache (float, or bfloat16 bits as
// uint16_t), q [T, K, G, H] float32, pages [T, O], cached [T], lowest [T]. Or, for the step's own keys
// (`PagedOwn`), k and v [T, K, H] as one layer of one page of T positions, `pages` and `lowest` null,
// and token t's positions the `cached[t]` ones from index first[t]. softcap 0: scores uncapped.
template <typename Cache>
struct Inputs {
  const float* q;
  const Cache* k;
  const Cache* v;
  const int32_t* pages;
  const int32_t* cached;
  int64_t layer, P, Z, K, G, H, O;
  const int32_t* first = nullptr;
  const int32_t* lowest = nullptr;
  float softcap = 0.0f;
};

// The state of token t's heads over its cached positions [p0, p1): max m [K*G], sum l [K*G] and
// weighted values acc [K*G, H], written to `state` as m, l, acc. G and H are compile-time, so a key
// head's queries and weighted values stay in registers while its positions stream past.
template <int G, int H, typename Cache>
void segment(const Inputs<Cache>& in, int64_t t, int64_t p0, int64_t p1, float* state) {
  constexpr int V = H / 16;  // vectors per head
  const int64_t K = in.K, KG = K * G, row = K * H;  // row: one position's keys, every head
  float* m = state;
  float* l = m + KG;
  float* acc = l + KG;
  std::fill(m, m + KG, NEG_INF);
  std::fill(l, l + KG, 0.0f);
  std::fill(acc, acc + KG * H, 0.0f);
  const float* q = in.q + t * KG * H;
  const int32_t* pages = in.pages ? in.pages + t * in.O : nullptr;
  const Cache* layer_k = in.k + in.layer * in.P * in.Z * row;
  const Cache* layer_v = in.v + in.layer * in.P * in.Z * row;
  std::vector<f16v> partial(KG * BLOCK);  // [K*G, BLOCK]: each score's products, 16 lanes to add
  std::vector<f16v> weights(KG);  // each head's softmax weights of the block's positions
  int64_t at[BLOCK], next[BLOCK];  // each position's offset in the layer's cache, this block's and the next's
  auto offsets = [&](int64_t b, int64_t* out) {
    const int64_t n = std::min(BLOCK, p1 - b);
    for (int64_t i = 0; i < BLOCK; ++i) {  // past n: position b's again, its score masked below
      const int64_t position = b + (i < n ? i : 0);
      if (pages == nullptr) {  // the step's own keys, from the token's first
        out[i] = (in.first[t] + position) * row;
        continue;
      }
      const int64_t page = std::clamp<int64_t>(pages[position / in.Z], 0, in.P - 1);  // never past the cache
      out[i] = (page * in.Z + position % in.Z) * row;
    }
  };
  offsets(p0, next);
  for (int64_t b = p0; b < p1; b += BLOCK) {
    const int64_t n = std::min(BLOCK, p1 - b);
    std::copy(next, next + BLOCK, at);
    const bool ask = b + BLOCK < p1;
    if (ask) offsets(b + BLOCK, next);
    for (int64_t kh = 0; kh < K; ++kh) {
      f16v qv[G][V];
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < V; ++h) qv[g][h] = load(q + (kh * G + g) * H + h * 16);
      for (int64_t i = 0; i < BLOCK; ++i) {
        const Cache* key = layer_k + at[i] + kh * H;
        if (ask) ask_for(layer_k + next[i] + kh * H, H * sizeof(Cache));
        f16v kv[V];
        for (int h = 0; h < V; ++h) kv[h] = load(key + h * 16);
        for (int g = 0; g < G; ++g) {
          f16v a = qv[g][0] * kv[0];
          for (int h = 1; h < V; ++h) a += qv[g][h] * kv[h];
          partial[(kh * G + g) * BLOCK + i] = a;
        }
      }
    }
    for (int64_t j = 0; j < KG; ++j) {
      f16v s = sums(&partial[j * BLOCK]);
      if (in.softcap > 0.0f)
        for (int64_t i = 0; i < BLOCK; ++i) s[i] = in.softcap * std::tanh(s[i] / in.softcap);
      for (int64_t i = n; i < BLOCK; ++i) s[i] = -INFINITY;
      float top = m[j];
      for (int k = 0; k < BLOCK; ++k) top = std::max(top, s[k]);
      const float rescale = std::exp(m[j] - top);
      const f16v p = exp_nonpositive(s - top);
      l[j] = l[j] * rescale + sum(p);
      m[j] = top;
      weights[j] = p;
      float* out = acc + j * H;
      if (rescale != 1.0f)
        for (int h = 0; h < H; h += 16) store(out + h, load(out + h) * rescale);
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      f16v o[G][V];
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < V; ++h) o[g][h] = load(acc + (kh * G + g) * H + h * 16);
      for (int64_t i = 0; i < n; ++i) {
        const Cache* value = layer_v + at[i] + kh * H;
        if (ask) ask_for(layer_v + next[i] + kh * H, H * sizeof(Cache));
        f16v vv[V];
        for (int h = 0; h < V; ++h) vv[h] = load(value + h * 16);
        for (int g = 0; g < G; ++g) {
          const float w = weights[kh * G + g][i];
          for (int h = 0; h < V; ++h) o[g][h] += w * vv[h];
        }
      }
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < V; ++h) store(acc + (kh * G + g) * H + h * 16, o[g][h]);
    }
  }
}

template <typename Cache>
using Segment = void (*)(const Inputs<Cache>&, int64_t, int64_t, int64_t, float*);

// segment for query heads per key head G and head dimension H; null where they are not among those compiled.
template <typename Cache>
Segment<Cache> segment_for(int64_t G, int64_t H) {
#define JAXSTREAM_CASE(g, h) \
  if (G == g && H == h) return &segment<g, h, Cache>;
  // The groupings of the models served (SmolLM2, Qwen3, Llama 3): each instance adds to the build's time.
  JAXSTREAM_CASE(1, 64) JAXSTREAM_CASE(2, 64) JAXSTREAM_CASE(3, 64) JAXSTREAM_CASE(4, 64) JAXSTREAM_CASE(8, 64)
  JAXSTREAM_CASE(1, 128) JAXSTREAM_CASE(2, 128) JAXSTREAM_CASE(3, 128) JAXSTREAM_CASE(4, 128) JAXSTREAM_CASE(8, 128)
#undef JAXSTREAM_CASE
  return nullptr;
}

template <typename Cache>
ffi::Error attend(ffi::ThreadPool& pool, const Inputs<Cache>& in, int64_t T, float* top, float* total, float* out) {
  const Segment<Cache> run = segment_for<Cache>(in.G, in.H);
  if (run == nullptr)
    return ffi::Error::InvalidArgument("paged decode attention: head dimension 64 or 128, 1, 2, 3, 4 or 8 query heads per key head");
  const int64_t KG = in.K * in.G, H = in.H, width = KG * (H + 2);
  // Token t reads positions [lo[t], hi[t]): its parts are the segments that hold them, [first[t], first[t + 1]).
  std::vector<int64_t> first(T + 1, 0), lo(T), hi(T);
  for (int64_t t = 0; t < T; ++t) {
    hi[t] = std::clamp<int64_t>(in.cached[t], 0, in.O * in.Z);
    lo[t] = in.lowest ? std::clamp<int64_t>(in.lowest[t], 0, hi[t]) : 0;
    first[t + 1] = first[t] + (hi[t] + SEGMENT - 1) / SEGMENT - lo[t] / SEGMENT;
  }
  std::vector<float> states(first[T] * width);
  std::vector<int64_t> token(first[T]);
  for (int64_t t = 0; t < T; ++t) std::fill(token.begin() + first[t], token.begin() + first[t + 1], t);
  for_parts(pool, first[T], [&](int64_t part) {
    const int64_t t = token[part], start = (lo[t] / SEGMENT + part - first[t]) * SEGMENT;
    run(in, t, std::max(start, lo[t]), std::min(start + SEGMENT, hi[t]), &states[part * width]);
  });
  for (int64_t t = 0; t < T; ++t) {  // combine each token's segments, in order
    float* m = top + t * KG;
    float* l = total + t * KG;
    float* acc = out + t * KG * H;
    std::fill(m, m + KG, NEG_INF);
    std::fill(l, l + KG, 0.0f);
    std::fill(acc, acc + KG * H, 0.0f);
    for (int64_t part = first[t]; part < first[t + 1]; ++part) {
      const float* s = &states[part * width];
      for (int64_t j = 0; j < KG; ++j) {
        const float merged = std::max(m[j], s[j]);
        const float mine = std::exp(m[j] - merged), theirs = std::exp(s[j] - merged);
        l[j] = l[j] * mine + s[KG + j] * theirs;
        m[j] = merged;
        for (int64_t h = 0; h < H; ++h) acc[j * H + h] = acc[j * H + h] * mine + s[2 * KG + j * H + h] * theirs;
      }
    }
  }
  return ffi::Error::Success();
}

using Queries = ffi::Buffer<ffi::F32, 4>;  // [T, K, G, H]
using Pages = ffi::Buffer<ffi::S32, 2>;  // [T, O]
using Cached = ffi::Buffer<ffi::S32, 1>;  // [T]
using Layer = ffi::Buffer<ffi::S32, 0>;
using Heads = ffi::Buffer<ffi::F32, 3>;  // [T, K, G]: each head's max or sum
using Weighted = ffi::Buffer<ffi::F32, 4>;  // [T, K, G, H]

// Token t's queries against its row's cached positions lowest[t] .. cached[t] - 1, in its pages pages[t].
ffi::Error PagedDecode(ffi::ThreadPool pool, Queries q, ffi::AnyBuffer k, ffi::AnyBuffer v, Layer layer, Pages pages,
                       Cached cached, Cached lowest, float softcap, ffi::Result<Heads> top, ffi::Result<Heads> total,
                       ffi::Result<Weighted> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t T = qd[0], K = qd[1], G = qd[2], H = qd[3];
  const bool same_cache = std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end());
  if (kd.size() != 5 || !same_cache || kd[3] != K || kd[4] != H || pages.dimensions()[0] != T || cached.dimensions()[0] != T ||
      lowest.dimensions()[0] != T || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("paged decode attention: operand shapes do not agree");
  const int64_t L = kd[0], index = *layer.typed_data();
  if (index < 0 || index >= L) return ffi::Error::InvalidArgument("paged decode attention: layer out of range");
  float *m = top->typed_data(), *l = total->typed_data(), *acc = out->typed_data();
  if (k.element_type() == ffi::F32) {
    const Inputs<float> in{q.typed_data(), k.typed_data<float>(), v.typed_data<float>(), pages.typed_data(),
                           cached.typed_data(), index, kd[1], kd[2], K, G, H, pages.dimensions()[1],
                           nullptr, lowest.typed_data(), softcap};
    return attend(pool, in, T, m, l, acc);
  }
  if (k.element_type() == ffi::U16) {
    const Inputs<uint16_t> in{q.typed_data(), k.typed_data<uint16_t>(), v.typed_data<uint16_t>(), pages.typed_data(),
                              cached.typed_data(), index, kd[1], kd[2], K, G, H, pages.dimensions()[1],
                              nullptr, lowest.typed_data(), softcap};
    return attend(pool, in, T, m, l, acc);
  }
  return ffi::Error::InvalidArgument("paged decode attention: the cache holds float32 or bfloat16 bits (uint16)");
}

using Keys = ffi::Buffer<ffi::F32, 3>;  // [T, K, H]
using Firsts = ffi::Buffer<ffi::S32, 1>;  // [T]

// The step's own keys and values: token t's queries against positions first[t] .. first[t] + count[t] - 1
// of k and v [T, K, H] (its row's tokens in this step up to its own), the same state as over the cache.
ffi::Error PagedOwn(ffi::ThreadPool pool, Queries q, Keys k, Keys v, Firsts first, Cached count, float softcap,
                    ffi::Result<Heads> top, ffi::Result<Heads> total, ffi::Result<Weighted> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t T = qd[0], K = qd[1], G = qd[2], H = qd[3];
  const bool same = std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end());
  if (!same || kd[0] != T || kd[1] != K || kd[2] != H || first.dimensions()[0] != T || count.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("own-token attention: operand shapes do not agree");
  const int32_t *f = first.typed_data(), *n = count.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (f[t] < 0 || n[t] < 0 || f[t] + int64_t{n[t]} > T)
      return ffi::Error::InvalidArgument("own-token attention: a token's positions run past the step");
  Inputs<float> in{q.typed_data(), k.typed_data(), v.typed_data(), nullptr, n, 0, 1, T, K, G, H, 1};
  in.first = f;
  in.softcap = softcap;
  return attend(pool, in, T, top->typed_data(), total->typed_data(), out->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxstreamPagedOwn, PagedOwn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()
                                  .Arg<Keys>()
                                  .Arg<Keys>()
                                  .Arg<Firsts>()
                                  .Arg<Cached>()
                                  .Attr<float>("softcap")
                                  .Ret<Heads>()
                                  .Ret<Heads>()
                                  .Ret<Weighted>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxstreamPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Layer>()
                                  .Arg<Pages>()
                                  .Arg<Cached>()
                                  .Arg<Cached>()
                                  .Attr<float>("softcap")
                                  .Ret<Heads>()
                                  .Ret<Heads>()
                                  .Ret<Weighted>());
