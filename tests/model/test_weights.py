"""Checkpoint readers against transformers: same config, same names, bit-identical tensors.

transformers dequantizes a GGUF with the same `gguf.quants.dequantize` we call, so every tensor must
match exactly (max abs diff 0), the un-permuted Q and K included.
"""

import json
import struct

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file as save_numpy

from worker_svc.weights import CheckpointError, open_checkpoint
from worker_svc.weights.gguf_file import unpermute_rotary

torch = pytest.importorskip("torch")


def hf_config_fields(model, keys) -> dict:
    """transformers' config, keyed like ours (transformers 5 keeps rope_theta in rope_parameters)."""
    fields = {key: getattr(model.config, key) for key in keys if key not in ("architectures", "rope_theta")}
    fields["architectures"] = [type(model).__name__]  # a GGUF-loaded config leaves it None
    fields["rope_theta"] = model.config.rope_parameters["rope_theta"]
    return fields


def untied_state_dict(model) -> dict[str, np.ndarray]:
    """The model's tensors as a checkpoint holds them: a tied lm_head is the embedding, not a tensor."""
    state = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        del state["lm_head.weight"]
    return state


def assert_same_tensors(checkpoint, reference: dict[str, np.ndarray]) -> None:
    assert sorted(checkpoint.names) == sorted(reference)
    for name, expected in reference.items():
        got = checkpoint.read(name)
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


# --- the bundled SmolLM2 GGUF (llama, Q4_1 with a Q8_0 embedding) ---


def test_gguf_config_matches_transformers(smollm2_checkpoint, hf_smollm2):
    config = smollm2_checkpoint.config
    assert config == hf_config_fields(hf_smollm2, config)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (3, 64, 1536)
    assert (config["vocab_size"], config["rope_theta"]) == (49152, 100000.0)
    assert np.float32(config["rms_norm_eps"]) == np.float32(1e-5)  # stored as float32


def test_gguf_tensors_equal_transformers(smollm2_checkpoint, hf_smollm2):
    assert "lm_head.weight" not in smollm2_checkpoint.names
    assert_same_tensors(smollm2_checkpoint, untied_state_dict(hf_smollm2))


def test_gguf_shapes_are_hugging_face_shapes(smollm2_checkpoint):
    read = smollm2_checkpoint.read
    assert read("model.embed_tokens.weight").shape == (49152, 576)  # [V, D]
    assert read("model.layers.0.self_attn.q_proj.weight").shape == (576, 576)  # [N*H, D]
    assert read("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)  # [K*H, D]
    assert read("model.layers.0.mlp.down_proj.weight").shape == (576, 1536)  # [D, F]
    assert read("model.norm.weight").shape == (576,)


def test_sharded_hf_dir_reads_back_equal(smollm2_hf_dir, smollm2_checkpoint, hf_smollm2):
    shards = set(json.loads((smollm2_hf_dir / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1
    checkpoint = open_checkpoint(smollm2_hf_dir)
    assert {key: checkpoint.config[key] for key in smollm2_checkpoint.config} == smollm2_checkpoint.config
    assert_same_tensors(checkpoint, untied_state_dict(hf_smollm2))


# --- the Q/K permutation ---


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_rotary_inverts_llama_cpp():
    rng = np.random.default_rng(0)
    q, k, bias = rng.normal(size=(9 * 64, 576)), rng.normal(size=(3 * 64, 576)), rng.normal(size=(3 * 64,))
    np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(q, 9, 9), 9), q)
    np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(k, 9, 3), 3), k)
    np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(bias, 9, 3), 3), bias)
    # One head of H=4: the file interleaves the two rotary halves' rows as (0, 2, 1, 3).
    np.testing.assert_array_equal(unpermute_rotary(np.array([0, 2, 1, 3]), 1), [0, 1, 2, 3])


# --- a tiny Qwen3 GGUF, written here: q_norm/k_norm, no permutation, untied, F16 and Q8_0 ---


def write_tiny_qwen3(path) -> dict[str, np.ndarray]:
    """A 2-layer Qwen3 whose head_dim (128) is not hidden/heads (64/2); returns its tensors by GGUF name."""
    V, D, N, K, H, F = 96, 64, 2, 1, 128, 80
    rng = np.random.default_rng(1)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(2):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,),
            f"blk.{i}.attn_q.weight": (N * H, D), f"blk.{i}.attn_k.weight": (K * H, D),
            f"blk.{i}.attn_v.weight": (K * H, D), f"blk.{i}.attn_output.weight": (D, N * H),
            f"blk.{i}.attn_q_norm.weight": (H,), f"blk.{i}.attn_k_norm.weight": (H,),
            f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D), f"blk.{i}.ffn_down.weight": (D, F),
        }
    tensors = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(N)
    writer.add_head_count_kv(K)
    writer.add_key_length(H)
    writer.add_value_length(H)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(V)])  # no qwen3.vocab_size: llama.cpp omits it
    writer.add_bos_token_id(5)
    writer.add_eos_token_id(7)
    for name, w in tensors.items():
        if name == "token_embd.weight":
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        elif name == "output.weight":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, w)
    finish_gguf(writer)
    return tensors


def finish_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_gguf_equals_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    written = write_tiny_qwen3(tmp_path / "tiny.gguf")
    checkpoint = open_checkpoint(tmp_path / "tiny.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    assert checkpoint.config == hf_config_fields(model, checkpoint.config)
    assert checkpoint.config["head_dim"] == 128 and checkpoint.config["vocab_size"] == 96
    assert checkpoint.config["tie_word_embeddings"] is False
    assert_same_tensors(checkpoint, untied_state_dict(model))
    # Not permuted: Q reads back as written (F32 is exact).
    read = checkpoint.read
    np.testing.assert_array_equal(read("model.layers.1.self_attn.q_proj.weight"), written["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(read("model.layers.0.self_attn.k_norm.weight"), written["blk.0.attn_k_norm.weight"])


# --- safetensors ---


def write_hf_dir(path, tensors: dict, config: dict | None = None):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {}))
    save_numpy(tensors, str(path / "model.safetensors"))
    return path


def test_bf16_safetensors_reads_as_bfloat16(tmp_path):
    from safetensors.torch import save_file as save_torch  # numpy has no bfloat16 for safetensors.numpy

    w = torch.randn(6, 10, dtype=torch.bfloat16)
    (tmp_path / "config.json").write_text("{}")
    save_torch({"w": w}, str(tmp_path / "model.safetensors"))
    got = open_checkpoint(tmp_path).read("w")
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (6, 10)
    np.testing.assert_array_equal(got.view(np.uint16), w.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(got.astype(np.float32), w.float().numpy())


def test_f16_f32_and_integer_safetensors_read_unchanged(tmp_path):
    rng = np.random.default_rng(2)
    tensors = {
        "half": rng.normal(size=(3, 5)).astype(np.float16),
        "single": rng.normal(size=(4,)).astype(np.float32),
        "ids": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
        "bytes": np.arange(7, dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    checkpoint = open_checkpoint(write_hf_dir(tmp_path / "m", tensors))
    assert sorted(checkpoint.names) == sorted(tensors)
    for name, expected in tensors.items():
        got = checkpoint.read(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert checkpoint.read("half").flags.writeable  # a copy, not a read-only view of the file


def test_hf_dir_config_gets_the_implicit_keys(tmp_path):
    # As transformers 5 writes it: rope_theta inside rope_parameters; no head_dim, kv heads or tie.
    config = {"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    embedding = {"model.embed_tokens.weight": np.zeros((2, 64), np.float32)}
    checkpoint = open_checkpoint(write_hf_dir(tmp_path / "m", embedding, config))
    implicit = {"rope_theta": 5e5, "head_dim": 16, "num_key_value_heads": 4, "tie_word_embeddings": True}
    assert checkpoint.config == config | implicit


def test_hf_dir_qwen3_head_dim_defaults_as_transformers_does(tmp_path):
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / num_attention_heads.
    from transformers import Qwen3Config

    config = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    embedding = {"model.embed_tokens.weight": np.zeros((2, 64), np.float32)}
    checkpoint = open_checkpoint(write_hf_dir(tmp_path / "m", embedding, config))
    assert checkpoint.config["head_dim"] == Qwen3Config(**config).head_dim == 128
    written = open_checkpoint(write_hf_dir(tmp_path / "n", embedding, config | {"head_dim": 32}))
    assert written.config["head_dim"] == 32


# --- bad inputs name what is wrong ---


def write_raw_safetensors(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither a .gguf file"):
        (tmp_path / "weights.bin").write_bytes(b"x")
        open_checkpoint(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        open_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        open_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="package 'no_such_model_pkg' is not installed"):
        open_checkpoint("package:no_such_model_pkg")


def test_sharded_index_errors(tmp_path):
    path = write_hf_dir(tmp_path / "m", {"a": np.zeros(2, np.float32)})
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors' is missing"):
        open_checkpoint(path)
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="maps 'b' to 'model-00001-of-00002.safetensors', which does not hold"):
        open_checkpoint(path)


def test_unknown_tensor_name_suggests_close_ones(tmp_path):
    checkpoint = open_checkpoint(write_hf_dir(tmp_path / "m", {"model.norm.weight": np.ones(4, np.float32)}))
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.norm\.weights'; close names: \['model\.norm\.weight'\]"):
        checkpoint.read("model.norm.weights")


def test_unsupported_dtype_is_named_on_read(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text("{}")
    header = {"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}
    write_raw_safetensors(path / "model.safetensors", header, bytes(4))
    checkpoint = open_checkpoint(path)
    with pytest.raises(CheckpointError, match="tensor 'w' has dtype F8_E4M3, which is not supported"):
        checkpoint.read("w")


def test_truncated_and_malformed_safetensors(tmp_path):
    path = write_hf_dir(tmp_path / "m", {"w": np.zeros((8, 8), np.float32)})
    file = path / "model.safetensors"
    whole = file.read_bytes()
    file.write_bytes(whole[:-10])
    with pytest.raises(CheckpointError, match="truncated: tensor 'w' ends at byte"):
        open_checkpoint(path)
    file.write_bytes(whole[:20])
    with pytest.raises(CheckpointError, match="truncated or not safetensors"):
        open_checkpoint(path)
    file.write_bytes(whole[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(path)
    write_raw_safetensors(file, {"w": {"dtype": "F32", "shape": [8, 8], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"tensor 'w' holds 16 bytes, but F32 \[8, 8\] needs 256"):
        open_checkpoint(path)
    write_raw_safetensors(file, {"w": {"dtype": "F32", "shape": [4]}}, bytes(16))
    with pytest.raises(CheckpointError, match="tensor 'w' has a malformed header entry"):
        open_checkpoint(path)


def test_bad_gguf_files(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(CheckpointError, match="junk.gguf: not a GGUF file, or a truncated one"):
        open_checkpoint(tmp_path / "junk.gguf")
    write_tiny_qwen3(tmp_path / "whole.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="cut.gguf: not a GGUF file, or a truncated one"):
        open_checkpoint(tmp_path / "cut.gguf")
    writer = gguf.GGUFWriter(tmp_path / "big.gguf", "qwen3", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    finish_gguf(writer)
    with pytest.raises(CheckpointError, match="big.gguf: a big-endian GGUF file"):
        open_checkpoint(tmp_path / "big.gguf")


def test_gguf_unsupported_architecture_and_unknown_tensor(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    finish_gguf(writer)
    with pytest.raises(CheckpointError, match="GGUF architecture 'mamba' is not supported"):
        open_checkpoint(tmp_path / "mamba.gguf")

    writer = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    writer.add_block_count(1)
    writer.add_context_length(8)
    writer.add_embedding_length(4)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.add_tensor("rope_freqs.weight", np.ones(2, np.float32))  # Llama 3.1's rope scaling, not read yet
    finish_gguf(writer)
    with pytest.raises(CheckpointError, match="GGUF tensor 'rope_freqs.weight' has no Hugging Face name for llama"):
        open_checkpoint(tmp_path / "llama.gguf")
