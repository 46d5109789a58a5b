"""jaxstream's own XLA:CPU kernels, behind the layers' one seam (worker_svc/layers/kernels.py).

- product_kernel.py and .cc: weight products of few rows, float32 and int8 weights, a layer read
  where it lies in its stack;
- attention_kernel.py and .cc: attention over the paged KV cache and over a step's own keys;
- build.py (with cpu_kernel.h, which both .cc share): compiles a kernel with the machine's C++
  compiler, caches it, and registers its XLA custom calls;
- kernels.py: `CpuKernels`, the `Kernels` value the model's Numerics holds.

Only start-up (worker_svc/start.py) imports this package: it builds the kernels its config asks
for, where they apply, and hands the model a `CpuKernels` of those that built.
"""
