"""JAX's own Pallas kernels (jax.experimental.pallas.ops), behind the layers' one seam
(worker_svc/layers/kernels.py), as worker.attention_backend=pallas (and `auto` on a GPU) runs them.

- attention.py: attention over the paged KV cache by JAX's GPU paged-attention kernel body, and
  over a step's own keys by JAX's GPU flash-attention kernel, each returning the running softmax
  state the layers combine;
- kernels.py: `PallasKernels`, the `Kernels` value the model's Numerics holds.

On a CPU the same kernels run in Pallas' interpret mode: slow, but the same arithmetic, so CI and a
machine without an accelerator check the whole path. Only start-up (worker_svc/start.py, through
worker_svc/attention_backend.py) imports this package.
"""
