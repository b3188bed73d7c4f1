"""GGUFFile reads what gguf.GGUFReader reads (same values, Python types, tensor dtypes, shapes and bytes), and
a hostile file -- truncated, bit-flipped, with huge lengths or counts or bad offsets -- is a ValueError
(a CheckpointError through open_gguf), never another exception, a large allocation or a read outside it."""

from __future__ import annotations

import gc
import itertools
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.gguf_file import GGUFFile
from tunix_rt.checkpoints.gguf_loader import open_gguf

T = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def _typed(value):
    """A value with the type of every element spelled out, so 1 == 1.0 == True do not pass for each other."""
    return [_typed(v) for v in value] if isinstance(value, list) else (type(value), repr(value))


def _assert_same(ours: GGUFFile, theirs: gguf.GGUFReader) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for key, field in ours.fields.items():
        assert _typed(field.contents()) == _typed(theirs.fields[key].contents()), key
    assert len(ours.tensors) == len(theirs.tensors)
    for t, ref in zip(ours.tensors, theirs.tensors):
        assert (t.name, t.tensor_type, list(t.shape)) == (ref.name, ref.tensor_type, ref.shape.tolist())
        assert (t.data.dtype, t.data.shape) == (ref.data.dtype, ref.data.shape), t.name
        assert t.data.tobytes() == ref.data.tobytes(), t.name
        assert not t.data.flags.owndata and not t.data.flags.writeable, t.name  # a view of the mapped file


def test_default_model_reads_like_gguf():
    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    _assert_same(GGUFFile(path), gguf.GGUFReader(path))


def _tensors(rng) -> dict[str, tuple[np.ndarray, Q | None]]:
    """name -> (array as GGUFWriter takes it, raw type): float and block types, 1-D and 2-D."""
    out = {}
    for shape in [(256,), (3, 256)]:
        x = rng.standard_normal(shape).astype(np.float32)
        n = len(shape)
        out[f"f32.{n}d"] = (x, None)
        out[f"f16.{n}d"] = (x.astype(np.float16), None)
        for qtype in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
            out[f"{qtype.name}.{n}d"] = (gguf.quants.quantize(x, qtype), qtype)
        q6k = rng.integers(0, 256, (*shape[:-1], gguf.GGML_QUANT_SIZES[Q.Q6_K][1]), dtype=np.uint8)
        q6k[..., -2:] = np.array([0.01], np.float16).view(np.uint8)  # d, the block's scale, closes it
        out[f"Q6_K.{n}d"] = (q6k, Q.Q6_K)
    return out


def _write(path, alignment: int | None = None) -> None:
    """A file with every value type, arrays of each (strings and nested arrays too) and many tensor types."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    scalars = {T.UINT8: 255, T.INT8: -128, T.UINT16: 65535, T.INT16: -32768, T.UINT32: 2**32 - 1, T.INT32: -(2**31),
               T.FLOAT32: 0.1, T.BOOL: True, T.UINT64: 2**64 - 1, T.INT64: -(2**63), T.FLOAT64: 1e-300}
    for vtype, value in scalars.items():
        writer.add_key_value(f"scalar.{vtype.name}", value, vtype)
        items = [False, True, False] if vtype == T.BOOL else [value, 0, value]
        writer.add_key_value(f"array.{vtype.name}", items, T.ARRAY, sub_type=vtype)
    writer.add_key_value("scalar.bool_false", False, T.BOOL)
    writer.add_key_value("scalar.float32_nan", float("nan"), T.FLOAT32)
    writer.add_key_value("string.empty", "", T.STRING)
    writer.add_string("string.unicode", "héllo 日本語 🦊\n\x00 end")
    writer.add_array("array.STRING", ["", "a", "Ġ t", "日本", "🦊" * 40])
    writer.add_array("array.nested_int", [[1, 2], [3], [4, 5, 6]])
    writer.add_array("array.nested_str", [["a", "b"], ["c"]])
    for name, (array, raw_dtype) in _tensors(np.random.default_rng(0)).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 1, 64, 4096])
def test_written_file_reads_like_gguf(tmp_path, alignment):
    path = tmp_path / "all.gguf"
    _write(path, alignment)
    ours = GGUFFile(path)
    _assert_same(ours, gguf.GGUFReader(path))
    assert {t.tensor_type for t in ours.tensors} == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K}


def test_version_2_reads_like_gguf(tmp_path):
    path = tmp_path / "v2.gguf"
    _write(path)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path.write_bytes(data)
    ours = GGUFFile(path)
    assert ours.fields["GGUF.version"].contents() == 2
    _assert_same(ours, gguf.GGUFReader(path))


def test_tensor_data_outlives_the_file_object(tmp_path):
    """The views keep the mapping alive: dropping the GGUFFile (and collecting it) leaves the data readable."""
    path = tmp_path / "t.gguf"
    _write(path)
    want = gguf.GGUFReader(path).tensors[0].data.copy()
    data = GGUFFile(path).tensors[0].data
    gc.collect()
    np.testing.assert_array_equal(data, want)


# --- files built byte by byte: empty arrays (GGUFWriter refuses them) and hostile files --------------------------


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _array(item_type: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", item_type, count) + items


def _info(name: str, dims, tensor_type: int = Q.F32, offset: int = 0) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", tensor_type, offset)


def _file(kvs=(), infos=(), data=b"", *, version=3, n_kv=None, n_tensors=None, alignment=32) -> bytes:
    head = struct.pack("<4sIQQ", b"GGUF", version, len(infos) if n_tensors is None else n_tensors,
                       len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


def _small_file() -> bytes:
    """A valid file of a few hundred bytes: a string, numeric and string arrays, alignment, two tensors."""
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 32, dtype=np.float32), Q.Q8_0).tobytes()
    kvs = [_kv("general.architecture", T.STRING, _str("llama")),
           _kv("general.alignment", T.UINT32, struct.pack("<I", 16)),
           _kv("ids", T.ARRAY, _array(T.INT32, 3, struct.pack("<3i", 1, -2, 3))),
           _kv("tokens", T.ARRAY, _array(T.STRING, 2, _str("ab") + _str("ü"))),
           _kv("flag", T.BOOL, b"\x01")]
    infos = [_info("a", [4], Q.F32, 0), _info("b", [32], Q.Q8_0, 16)]
    return _file(kvs, infos, np.arange(4, dtype=np.float32).tobytes() + q8, alignment=16)


_names = itertools.count()


def _saved(directory, data: bytes):
    """The bytes written to a new file in `directory` (Hypothesis examples share one)."""
    path = directory / f"{next(_names)}.gguf"
    path.write_bytes(data)
    return path


def _parse(path) -> GGUFFile:
    """GGUFFile(path), checking that parsing never allocates more than a little, whatever the file claims."""
    tracemalloc.start()
    try:
        return GGUFFile(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, f"parsing {path.stat().st_size} bytes allocated {peak} bytes"


def test_empty_arrays_read_like_gguf(tmp_path):
    kvs = [_kv(f"empty.{t.name}", T.ARRAY, _array(t, 0)) for t in T]
    kvs.append(_kv("nested.empty_inner", T.ARRAY, _array(T.ARRAY, 2, _array(T.UINT8, 1, b"\x07") + _array(T.UINT8, 0))))
    path = _saved(tmp_path, _file(kvs))
    _assert_same(_parse(path), gguf.GGUFReader(path))


def test_small_file_is_valid(tmp_path):
    path = _saved(tmp_path, _small_file())
    ours = _parse(path)
    assert ours.fields["tokens"].contents() == ["ab", "ü"]
    np.testing.assert_array_equal(ours.tensors[0].data, np.arange(4, dtype=np.float32))
    _assert_same(ours, gguf.GGUFReader(path))


def test_every_truncation_is_a_value_error(tmp_path):
    data = _small_file()
    for n in range(len(data)):
        with pytest.raises(ValueError):
            _parse(_saved(tmp_path, data[:n]))


@pytest.fixture(scope="module")
def flip_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flips")


@settings(max_examples=500)  # about 1 in 20 changed files still parses and is compared
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4))
def test_flipped_header_bytes_are_read_like_gguf_or_refused(flip_dir, flips):
    """Any bytes of the header changed: a ValueError, or a file gguf.GGUFReader reads the same way."""
    data = bytearray(_small_file())
    header = len(data) - 16 - 34  # the two tensors' 16 and 34 bytes close the file
    for pos, xor in flips:
        data[pos % header] ^= xor
    path = _saved(flip_dir, bytes(data))
    try:
        ours = _parse(path)
    except ValueError:
        return
    _assert_same(ours, gguf.GGUFReader(path))


HUGE = 2**62
_HOSTILE = {
    "empty file": b"",
    "short header": b"GGUF\x03\x00\x00\x00",
    "bad magic": b"GGML" + _file()[4:],
    "version 1": _file(version=1),
    "version 4": _file(version=4),
    "big-endian": _file(version=3 << 24),
    "huge kv count": _file(n_kv=HUGE),
    "huge tensor count": _file(n_tensors=HUGE),
    "huge key length": _file([struct.pack("<Q", HUGE) + b"key"]),
    "huge string length": _file([_kv("s", T.STRING, struct.pack("<Q", HUGE) + b"abc")]),
    "huge numeric array": _file([_kv("a", T.ARRAY, _array(T.UINT64, HUGE, b"\0" * 64))]),
    "huge string array": _file([_kv("a", T.ARRAY, _array(T.STRING, HUGE, _str("x") * 4))]),
    "huge string in an array": _file([_kv("a", T.ARRAY, _array(T.STRING, 2, _str("x") + struct.pack("<Q", HUGE)))]),
    "huge nested array": _file([_kv("a", T.ARRAY, _array(T.ARRAY, HUGE, _array(T.UINT8, 0) * 4))]),
    "arrays nested too deep": _file([_kv("a", T.ARRAY, _array(T.ARRAY, 1) * 9 + _array(T.UINT8, 0))]),
    "unknown value type": _file([_kv("x", 13, b"\0" * 16)]),
    "unknown array item type": _file([_kv("x", T.ARRAY, _array(99, 1, b"\0" * 16))]),
    "key not UTF-8": _file([_kv(b"\xff\xfe", T.UINT8, b"\0")]),
    "string in an array not UTF-8": _file([_kv("a", T.ARRAY, _array(T.STRING, 1, _str(b"\xc3")))]),
    "duplicate key": _file([_kv("k", T.UINT8, b"\1"), _kv("k", T.UINT8, b"\2")]),
    "key shadowing GGUF.version": _file([_kv("GGUF.version", T.UINT32, b"\3\0\0\0")]),
    "alignment 0": _file([_kv("general.alignment", T.UINT32, struct.pack("<I", 0))]),
    "alignment 3": _file([_kv("general.alignment", T.UINT32, struct.pack("<I", 3))], alignment=3),
    "alignment not uint32": _file([_kv("general.alignment", T.UINT64, struct.pack("<Q", 32))]),
    "n_dims 9": _file(infos=[_info("t", [1] * 9)], data=bytes(4)),
    "n_dims 0": _file(infos=[_info("t", [])], data=bytes(4)),
    "unknown tensor type": _file(infos=[_info("t", [4], 4)], data=bytes(64)),
    "tensor offset past the end": _file(infos=[_info("t", [4], Q.F32, 1 << 40)], data=bytes(16)),
    "tensor offset not aligned": _file(infos=[_info("t", [4], Q.F32, 4)], data=bytes(32)),
    "tensor larger than the file": _file(infos=[_info("t", [2**40, 2**20])], data=bytes(16)),
    "tensor with too many elements": _file(infos=[_info("t", [2**32, 2**32])], data=bytes(16)),
    "ne0 not a block multiple": _file(infos=[_info("t", [16], Q.Q8_0)], data=bytes(34)),
    "duplicate tensor name": _file(infos=[_info("t", [4]), _info("t", [4], offset=32)], data=bytes(64)),
    "tensor name not UTF-8": _file(infos=[_str(b"\x80") + _info("", [4])[8:]], data=bytes(16)),
}


@pytest.mark.parametrize("name", _HOSTILE)
def test_hostile_file_is_a_value_error(tmp_path, name):
    path = _saved(tmp_path, _HOSTILE[name])
    with pytest.raises(ValueError) as raised:
        _parse(path)
    assert type(raised.value) is ValueError and str(raised.value)
    with pytest.raises(CheckpointError, match=r"is not a readable GGUF file \(corrupt or truncated\): .+"):
        open_gguf(path)
