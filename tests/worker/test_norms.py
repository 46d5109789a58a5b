"""RMSNorm's offset (Gemma's "(1 + w)" norm) against its formula, the checkpoint's w kept as it is."""

import jax.numpy as jnp
import numpy as np

from worker_svc.layers.norms import RMSNorm


def test_an_offset_norm_scales_by_offset_plus_its_weight_in_float32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    norm = RMSNorm(8, 1e-6, offset=1.0, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(norm.scale[...], np.float32), 0)  # the stand-in is the identity
    w = rng.standard_normal(8).astype(np.float32)
    norm.scale[...] = jnp.asarray(w, jnp.bfloat16)
    got = np.asarray(norm(jnp.asarray(x, jnp.bfloat16)), np.float32)
    x32 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    w32 = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    want = x32 / np.sqrt((x32 * x32).mean(-1, keepdims=True) + 1e-6) * (1.0 + w32)
    np.testing.assert_allclose(got, want, rtol=1e-2)
    plain = RMSNorm(8, 1e-6, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(plain(jnp.asarray(x))), x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6), rtol=1e-5)
