"""The GGUF index (servelm/loader/gguf_index.py): the same fields and tensors as gguf-py's
reader, read from $SERVELM_HOME/index after the first parse, rebuilt when the file changes."""

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _write(path, seed=0, n_tokens=300):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_string("general.name", "tiny-index")
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list([f"tok{i}" for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    w.add_array("tokenizer.ggml.merges", ["t o", "to k"])
    w.add_tensor("f32.weight", rng.standard_normal((4, 32), dtype=np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((3, 32)).astype(np.float16))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        data = rng.standard_normal((8, 64), dtype=np.float32)
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(f"{qtype.name.lower()}.weight", q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _same_as_reader(indexed, path):
    reader = gguf.GGUFReader(path, "r")
    assert set(indexed.fields) == set(reader.fields)
    for key, field in reader.fields.items():
        assert indexed.fields[key].contents() == field.contents(), key
    assert [t.name for t in indexed.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(indexed.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert list(mine.shape) == list(theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data)), mine.name
        assert np.array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                              gguf.quants.dequantize(theirs.data, theirs.tensor_type))


def test_index_reads_what_the_reader_reads_and_is_cached(tmp_path, home):
    from servelm.loader.gguf_index import open_indexed

    path = _write(tmp_path / "m.gguf")
    first = open_indexed(path)
    assert not first.from_cache
    assert len(list((home / "index").glob("*.msgpack"))) == 1
    second = open_indexed(path)
    assert second.from_cache
    _same_as_reader(first, path)
    _same_as_reader(second, path)


def test_a_changed_file_is_parsed_again(tmp_path, home):
    from servelm.loader.gguf_index import open_indexed

    path = _write(tmp_path / "m.gguf", seed=0, n_tokens=300)
    assert open_indexed(path).fields["tokenizer.ggml.tokens"].contents()[-1] == "tok299"
    _write(path, seed=1, n_tokens=310)  # rewritten in place: size and mtime change
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = open_indexed(path)
    assert not again.from_cache
    assert again.fields["tokenizer.ggml.tokens"].contents()[-1] == "tok309"
    _same_as_reader(again, path)


def test_a_corrupt_index_is_ignored_and_replaced(tmp_path, home, caplog):
    from servelm.loader.gguf_index import index_dir, open_indexed

    path = _write(tmp_path / "m.gguf")
    open_indexed(path)
    (entry,) = index_dir().glob("*.msgpack")
    entry.write_bytes(b"\x93not an index")
    with caplog.at_level("WARNING"):
        rebuilt = open_indexed(path)
    assert not rebuilt.from_cache and "unreadable GGUF index" in caplog.text
    _same_as_reader(rebuilt, path)
    assert open_indexed(path).from_cache


def test_loader_config_and_tokenizer_through_the_cached_index(default_model_path, tmp_path,
                                                              monkeypatch):
    """The default model's config and tokenizer are the same parsed fresh and from the index."""
    from servelm.loader import gguf_loader
    from servelm.loader.gguf_index import open_indexed

    monkeypatch.setenv("SERVELM_HOME", str(tmp_path))
    fresh = open_indexed(default_model_path, use_cache=True)
    assert not fresh.from_cache
    gguf_loader.gguf_reader.cache_clear()
    try:
        config = gguf_loader.load_gguf_config(default_model_path, "m")
        tok = gguf_loader.load_gguf_tokenizer(default_model_path)
        assert gguf_loader.gguf_reader(default_model_path).from_cache
    finally:
        gguf_loader.gguf_reader.cache_clear()
    reader = gguf.GGUFReader(default_model_path, "r")  # gguf-py's own parse, once
    monkeypatch.setattr(gguf_loader, "gguf_reader", lambda p: reader)
    assert gguf_loader.load_gguf_config(default_model_path, "m") == config
    ref = gguf_loader.load_gguf_tokenizer(default_model_path)
    text = "Hello, world! Servelm's index: 12345 tokens."
    assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token_ids == ref.eos_token_ids
