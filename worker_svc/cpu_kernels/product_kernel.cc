// Weight products of a few rows on XLA:CPU: y[t, o] = scale[o] * sum_i x[t, i] * w[i, o] (or w[o, i]), float32
// activations, float32 sums, and weights of float32, or int8 converted to float32 in registers (scaled per
// output channel). The weight is one layer of a stack [L, A, B], chosen by an index operand: the layer scan
// hands the whole stack and its row, so the layer's weight is read where it lies, not sliced out first. XLA
// FFI handlers; product_kernel.py compiles this file on the machine that runs it and says why it exists.
//
// Each output is a fixed function of its row of x and the weights: the work is split into parts of fixed
// bounds, whichever thread runs a part (up to 8 rows, parts of w's rows, added in their order; more rows,
// blocks of output columns, each output one sum). So a result does not depend on the thread count, the
// pool's timing, or the other rows of x.

#include "cpu_kernel.h"

namespace {

using namespace jaxstream;

// An output channel's sum, times its scale (int8 weights) or as it is (float32 weights: no scale).
inline float scaled(float s, const float* scale, int64_t o) { return scale ? s * scale[o] : s; }

// acc[t, :] = sum of x[t, i] * w[i, :] over rows i in [i0, i1), for TT rows of x (a compile-time count,
// so their values stay in registers), read in order, four rows of w at a time.
template <int TT, typename W>
void rows_part(const float* x, const W* w, float* acc, int64_t In, int64_t Out, int64_t i0, int64_t i1) {
  const int64_t out16 = Out / 16 * 16;
  std::memset(acc, 0, sizeof(float) * TT * Out);
  int64_t i = i0;
  for (; i + 4 <= i1; i += 4) {
    const W *r0 = w + i * Out, *r1 = r0 + Out, *r2 = r1 + Out, *r3 = r2 + Out;
    float xs[TT][4];
    for (int t = 0; t < TT; ++t)
      for (int k = 0; k < 4; ++k) xs[t][k] = x[t * In + i + k];
    for (int64_t o = 0; o < out16; o += 16) {
      const f16v w0 = load(r0 + o), w1 = load(r1 + o), w2 = load(r2 + o), w3 = load(r3 + o);
      for (int t = 0; t < TT; ++t)
        store(acc + t * Out + o, load(acc + t * Out + o) + (xs[t][0] * w0 + xs[t][1] * w1 + xs[t][2] * w2 + xs[t][3] * w3));
    }
    for (int64_t o = out16; o < Out; ++o)
      for (int t = 0; t < TT; ++t)
        acc[t * Out + o] += xs[t][0] * r0[o] + xs[t][1] * r1[o] + xs[t][2] * r2[o] + xs[t][3] * r3[o];
  }
  for (; i < i1; ++i) {
    const W* r0 = w + i * Out;
    for (int64_t o = 0; o < out16; o += 16) {
      const f16v w0 = load(r0 + o);
      for (int t = 0; t < TT; ++t) store(acc + t * Out + o, load(acc + t * Out + o) + x[t * In + i] * w0);
    }
    for (int64_t o = out16; o < Out; ++o)
      for (int t = 0; t < TT; ++t) acc[t * Out + o] += x[t * In + i] * r0[o];
  }
}

// rows_part for T rows of x, a pass over the weight for each PASS rows: float32 weights in passes of 8
// (ROW_PASS_MAX: the weight read once), int8 ones in passes of 4 (their bytes are a quarter; the [8, Out]
// sums of a pass of 8 outgrew the CPU's first cache and made int8 slower; docs/journal.md).
template <typename W>
void rows_parts(const float* x, const W* w, float* acc, int64_t T, int64_t In, int64_t Out, int64_t i0, int64_t i1) {
  constexpr int64_t PASS = sizeof(W) == 1 ? 4 : 8;
  for (int64_t t = 0; t < T; t += PASS) {
    const float* xt = x + t * In;
    float* at = acc + t * Out;
    switch (std::min<int64_t>(PASS, T - t)) {
      case 1: rows_part<1>(xt, w, at, In, Out, i0, i1); break;
      case 2: rows_part<2>(xt, w, at, In, Out, i0, i1); break;
      case 3: rows_part<3>(xt, w, at, In, Out, i0, i1); break;
      case 4: rows_part<4>(xt, w, at, In, Out, i0, i1); break;
      case 5: rows_part<5>(xt, w, at, In, Out, i0, i1); break;
      case 6: rows_part<6>(xt, w, at, In, Out, i0, i1); break;
      case 7: rows_part<7>(xt, w, at, In, Out, i0, i1); break;
      default: rows_part<8>(xt, w, at, In, Out, i0, i1); break;
    }
  }
}

// w [In, Out] (a layer's projections): w's rows in ROW_PARTS parts, each summed into its own [T, Out],
// and the parts added in order.
constexpr int64_t ROW_PARTS = 8;
constexpr int64_t ROW_PASS_MAX = 8;  // more rows go by columns (below)
constexpr int64_t MAX_ROWS = 32;  // product_kernel.py's: the most rows of x

template <typename W>
void in_out(ffi::ThreadPool& pool, const float* x, const W* w, const float* scale, float* y, int64_t T,
            int64_t In, int64_t Out) {
  const int64_t parts = std::min(ROW_PARTS, In), n = T * Out, n16 = n / 16 * 16;
  std::unique_ptr<float[]> partial(new float[parts * n]);
  float* s = partial.get();
  for_parts(pool, parts, [&](int64_t p) { rows_parts(x, w, s + p * n, T, In, Out, In * p / parts, In * (p + 1) / parts); });
  for (int64_t p = 1; p < parts; ++p) {
    const float* q = s + p * n;
    int64_t k = 0;
    for (; k < n16; k += 16) store(s + k, load(s + k) + load(q + k));
    for (; k < n; ++k) s[k] += q[k];
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < Out; ++o) y[t * Out + o] = scaled(s[t * Out + o], scale, o);
}

// w [Out, In] (a tied LM head's table): each output one row's dot product, four rows at a time; the rows
// in parts of OUT_ROWS.
constexpr int64_t OUT_ROWS = 512;

template <int TT, typename W>
void out_in_part(const float* x, const W* w, const float* scale, float* y, int64_t In, int64_t Out, int64_t o0,
                 int64_t o1) {
  const int64_t in16 = In / 16 * 16;
  int64_t o = o0;
  for (; o + 4 <= o1; o += 4) {
    const W* r[4] = {w + o * In, w + (o + 1) * In, w + (o + 2) * In, w + (o + 3) * In};
    f16v a[TT][4] = {};
    for (int64_t i = 0; i < in16; i += 16) {
      const f16v w0 = load(r[0] + i), w1 = load(r[1] + i), w2 = load(r[2] + i), w3 = load(r[3] + i);
      for (int t = 0; t < TT; ++t) {
        const f16v xv = load(x + t * In + i);
        a[t][0] += xv * w0;
        a[t][1] += xv * w1;
        a[t][2] += xv * w2;
        a[t][3] += xv * w3;
      }
    }
    for (int t = 0; t < TT; ++t)
      for (int k = 0; k < 4; ++k) {
        float s = sum(a[t][k]);
        for (int64_t i = in16; i < In; ++i) s += x[t * In + i] * r[k][i];
        y[t * Out + o + k] = scaled(s, scale, o + k);
      }
  }
  for (; o < o1; ++o) {
    const W* r0 = w + o * In;
    for (int t = 0; t < TT; ++t) {
      f16v a0 = {};
      for (int64_t i = 0; i < in16; i += 16) a0 += load(x + t * In + i) * load(r0 + i);
      float s = sum(a0);
      for (int64_t i = in16; i < In; ++i) s += x[t * In + i] * r0[i];
      y[t * Out + o] = scaled(s, scale, o);
    }
  }
}

template <typename W>
void out_in(ffi::ThreadPool& pool, const float* x, const W* w, const float* scale, float* y, int64_t T,
            int64_t In, int64_t Out) {
  const int64_t parts = (Out + OUT_ROWS - 1) / OUT_ROWS;
  for_parts(pool, parts, [&](int64_t p) {
    const int64_t o0 = p * OUT_ROWS, o1 = std::min(Out, (p + 1) * OUT_ROWS);
    for (int64_t t = 0; t < T; t += 4) {  // at most 4 rows of x at a time
      const float* xt = x + t * In;
      float* yt = y + t * Out;
      switch (std::min<int64_t>(4, T - t)) {
        case 1: out_in_part<1>(xt, w, scale, yt, In, Out, o0, o1); break;
        case 2: out_in_part<2>(xt, w, scale, yt, In, Out, o0, o1); break;
        case 3: out_in_part<3>(xt, w, scale, yt, In, Out, o0, o1); break;
        default: out_in_part<4>(xt, w, scale, yt, In, Out, o0, o1); break;
      }
    }
  });
}

// w [In, Out] for more rows (ROW_PASS_MAX + 1 to 32): the work is split by output columns instead, each
// part a block of COLUMNS outputs over all of w's rows, straight into y: the block's sums for 8 rows of x
// (16 vectors) stay in registers while w's rows stream by, and no part's sums are added to another's. An
// output is one sum over i in order, whatever the rows.
//
// w's rows go by chunks of CHUNK: every 8 rows of x run over a chunk while it is in the first cache (the
// sums kept in `sums` between chunks), and while the first 8 run over it, the CPU is asked for the next
// chunk. A block's 128 bytes of a row lie Out floats apart, a stride the CPU's prefetcher does not follow:
// without the ask, every pass over the block's rows waited on memory, and the products of 32 rows ran at
// ~40% of the multiply-add rate; with it, at ~60% (docs/journal.md).
constexpr int64_t COLUMNS = 32;  // two vectors: 8 rows x 2 sums + 2 of w in registers; measured (docs/journal.md)
constexpr int64_t COLUMN_ROWS = 8;
constexpr int64_t CHUNK = 32;  // rows of w: 4 KB of a block's float32 weights (16 to 128 measured)

// sums[t, :] += x[t, i] * w[i, o0:o0 + 16 V] for i in [i0, i1), TT rows of x; with `ask`, the CPU is
// asked for the same columns CHUNK rows further on.
template <int TT, int V, typename W>
void column_chunk(const float* x, const W* w, float* sums, int64_t In, int64_t Out, int64_t o0, int64_t i0,
                  int64_t i1, bool ask) {
  f16v acc[TT][V];
  for (int t = 0; t < TT; ++t)
    for (int k = 0; k < V; ++k) acc[t][k] = load(sums + (t * V + k) * 16);
  for (int64_t i = i0; i < i1; ++i) {
    const W* r = w + i * Out + o0;
    if (ask) ask_for(r + CHUNK * Out, 16 * V * sizeof(W));
    f16v wv[V];
    for (int k = 0; k < V; ++k) wv[k] = load(r + 16 * k);
    for (int t = 0; t < TT; ++t) {
      const float xt = x[t * In + i];
      for (int k = 0; k < V; ++k) acc[t][k] += xt * wv[k];
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int k = 0; k < V; ++k) store(sums + (t * V + k) * 16, acc[t][k]);
}

// column_chunk for T rows of x: COLUMN_ROWS at a time, then the rest together (TT a compile-time count).
template <int V, typename W>
void column_chunks(const float* x, const W* w, float* sums, int64_t T, int64_t In, int64_t Out, int64_t o0,
                   int64_t i0, int64_t i1, bool ask) {
  int64_t t = 0;
  for (; t + COLUMN_ROWS <= T; t += COLUMN_ROWS, ask = false)
    column_chunk<COLUMN_ROWS, V>(x + t * In, w, sums + t * V * 16, In, Out, o0, i0, i1, ask);
  const float* xt = x + t * In;
  float* st = sums + t * V * 16;
  switch (T - t) {
    case 0: break;
    case 1: column_chunk<1, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
    case 2: column_chunk<2, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
    case 3: column_chunk<3, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
    case 4: column_chunk<4, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
    case 5: column_chunk<5, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
    case 6: column_chunk<6, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
    default: column_chunk<7, V>(xt, w, st, In, Out, o0, i0, i1, ask); break;
  }
}

// The block of 16 V outputs from o0, for every row of x.
template <int V, typename W>
void column_rows(const float* x, const W* w, const float* scale, float* y, int64_t T, int64_t In, int64_t Out,
                 int64_t o0) {
  float sums[MAX_ROWS * COLUMNS] __attribute__((aligned(64))) = {};
  for (int64_t i0 = 0; i0 < In; i0 += CHUNK) {
    const int64_t i1 = std::min(In, i0 + CHUNK);
    column_chunks<V>(x, w, sums, T, In, Out, o0, i0, i1, i1 + CHUNK <= In);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < 16 * V; ++k) y[t * Out + o0 + k] = scaled(sums[t * V * 16 + k], scale, o0 + k);
}

template <typename W>
void columns(ffi::ThreadPool& pool, const float* x, const W* w, const float* scale, float* y, int64_t T, int64_t In,
             int64_t Out) {
  const int64_t blocks = Out / COLUMNS, out16 = Out / 16 * 16;
  for_parts(pool, blocks + 1, [&](int64_t b) {
    if (b < blocks) {
      column_rows<COLUMNS / 16>(x, w, scale, y, T, In, Out, b * COLUMNS);
      return;
    }
    for (int64_t o = blocks * COLUMNS; o < out16; o += 16) column_rows<1>(x, w, scale, y, T, In, Out, o);
    for (int64_t o = out16; o < Out; ++o)  // the last outputs, one by one
      for (int64_t t = 0; t < T; ++t) {
        float a = 0;
        for (int64_t i = 0; i < In; ++i) a += x[t * In + i] * w[i * Out + o];
        y[t * Out + o] = scaled(a, scale, o);
      }
  });
}

using Rows = ffi::Buffer<ffi::F32, 2>;
using Row = ffi::Buffer<ffi::S32, 0>;  // the layer of the weight stack
using Scale = ffi::Buffer<ffi::F32, 1>;

// y = x times layer `row` of the stack w [L, A, B]: [A, B] = [In, Out], or [Out, In] `transposed` (a tied
// LM head's table); `scale` [Out] per output channel, or null.
template <typename W, typename Stack>
ffi::Error Product(ffi::ThreadPool& pool, Rows& x, Stack& w, const float* scale, int64_t scales, Row& row,
                   ffi::Result<Rows>& y, bool transposed) {
  const int64_t T = x.dimensions()[0], In = x.dimensions()[1], Out = y->dimensions()[1], L = w.dimensions()[0];
  const int64_t w_in = transposed ? w.dimensions()[2] : w.dimensions()[1];
  const int64_t w_out = transposed ? w.dimensions()[1] : w.dimensions()[2];
  if (w_in != In || w_out != Out || (scale && scales != Out) || y->dimensions()[0] != T)
    return ffi::Error::InvalidArgument("weight product: operand shapes do not agree");
  const int64_t layer = row.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("weight product: the layer row is out of the stack");
  if (!transposed && T > MAX_ROWS) return ffi::Error::InvalidArgument("weight product: more rows of x than MAX_ROWS");
  if (T == 0 || Out == 0) return ffi::Error::Success();
  if (In == 0) {
    std::fill(y->typed_data(), y->typed_data() + T * Out, 0.0f);
    return ffi::Error::Success();
  }
  const W* wl = w.typed_data() + layer * In * Out;
  if (transposed) {
    out_in<W>(pool, x.typed_data(), wl, scale, y->typed_data(), T, In, Out);
  } else {
    (T > ROW_PASS_MAX ? columns<W> : in_out<W>)(pool, x.typed_data(), wl, scale, y->typed_data(), T, In, Out);
  }
  return ffi::Error::Success();
}

using Int8Stack = ffi::Buffer<ffi::S8, 3>;
using Float32Stack = ffi::Buffer<ffi::F32, 3>;

ffi::Error Int8Product(ffi::ThreadPool pool, Rows x, Int8Stack w, Scale scale, Row row, ffi::Result<Rows> y,
                       bool transposed) {
  return Product<int8_t>(pool, x, w, scale.typed_data(), scale.dimensions()[0], row, y, transposed);
}

ffi::Error Float32Product(ffi::ThreadPool pool, Rows x, Float32Stack w, Row row, ffi::Result<Rows> y, bool transposed) {
  return Product<float>(pool, x, w, nullptr, 0, row, y, transposed);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxstreamInt8Product, Int8Product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Int8Stack>()
                                  .Arg<Scale>()
                                  .Arg<Row>()
                                  .Ret<Rows>()
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxstreamFloat32Product, Float32Product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Float32Stack>()
                                  .Arg<Row>()
                                  .Ret<Rows>()
                                  .Attr<bool>("transposed"));
