"""Building the model from a checkpoint: its numbers from the file's config, its tensors or dummy ones."""

import jax
import numpy as np
import pytest
from flax import nnx

from worker_svc.loading import load_model, model_config
from worker_svc.weights import CheckpointError


def test_the_config_comes_from_the_file(smollm2_checkpoint):
    _, cfg, _ = model_config(smollm2_checkpoint)
    assert (cfg.layers, cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.tie_embeddings


def test_dummy_weights_have_the_real_shapes_and_are_not_the_real_values(smollm2_checkpoint):
    real = nnx.state(load_model(smollm2_checkpoint, progress=False))
    dummy = nnx.state(load_model(smollm2_checkpoint, dummy=True, progress=False))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), real) == jax.tree.map(lambda a: (a.shape, a.dtype), dummy)
    table_real, table_dummy = real["embed"]["table"][...], dummy["embed"]["table"][...]
    assert not np.allclose(np.asarray(table_real), np.asarray(table_dummy))
    assert np.all(np.asarray(dummy["norm"]["scale"][...]) == 1.0)


def test_an_unknown_architecture_is_refused_by_name(smollm2_checkpoint):
    other = type(smollm2_checkpoint)(smollm2_checkpoint.path, {**smollm2_checkpoint.config, "architectures": ["GPT2LMHeadModel"]},
                                     smollm2_checkpoint.names, smollm2_checkpoint._read)
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        model_config(other)
