"""A GGUF file's header parsed over a read-only memory map: metadata values and zero-copy tensor views.

It stands in for gguf.GGUFReader, which walks every string of a tokenizer through numpy memmap slices
(seconds for SmolLM2's 100K tokens and merges); here numeric arrays are one np.frombuffer and string
arrays one tight loop. Every length, count and offset comes from an untrusted file, so each is checked
against the bytes left before it is used: a bad file raises ValueError saying what is wrong, and never
makes us allocate by a size it claims or read outside it. `fields` and `tensors` match what
gguf.GGUFReader gives (values, Python types, tensor dtypes and shapes), so gguf.quants applies as is.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TYPE_AND_COUNT = struct.Struct("<IQ")  # an array's item type and length; a tensor's type and offset
_VERSIONS = (2, 3)  # v1 had 32-bit lengths; v2 and v3 read the same in little-endian
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: no writer nests deeper, and the bound keeps recursion shallow
_INT64_MAX = 2**63 - 1

# fixed-size value types: (struct format of one value, numpy dtype of an array of them)
_FIXED = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype("?")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
# the fewest bytes one value of each type takes (a string: its length; an array: its type and length)
_MIN_SIZE = {**{t: fmt.size for t, (fmt, _) in _FIXED.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
# tensor types gguf.GGUFReader views by element; every other type is viewed as its blocks' bytes
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


class GGUFField(NamedTuple):
    """One metadata value: a str, a Python int/float/bool, or a flat list of them (nested arrays flattened);
    `item_type`, an array's item type (what a writer copying the field needs, an empty array included)."""

    value_type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None

    def contents(self) -> Any:
        """The value as gguf's ReaderField.contents() gives it; a list is a fresh copy the caller may change."""
        return list(self.value) if isinstance(self.value, list) else self.value


class GGUFTensor(NamedTuple):
    """One tensor: `shape` in ggml order (ne0, the contiguous dimension, first); `data` a read-only view of
    the mapped file, by element for float/int types, else uint8 blocks, as gguf.GGUFReader shapes it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """A GGUF file (version 2 or 3, little-endian): `fields` by key, `tensors` in file order. The file
    stays mapped while any tensor's data is referenced; nothing is copied at open."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER.size:
                raise ValueError(f"the file is {size} bytes long, shorter than a GGUF header ({_HEADER.size} bytes)")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(mapped)
        magic, version, n_tensors, n_kv = cursor.unpack(_HEADER, "the header")
        if magic != b"GGUF":
            raise ValueError(f"the file starts with {magic!r}, not the GGUF magic b'GGUF'")
        if version not in _VERSIONS:
            endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version}{endian} is not supported (only little-endian versions 2 and 3)")
        self.fields: dict[str, GGUFField] = {
            "GGUF.version": GGUFField(GGUFValueType.UINT32, version),
            "GGUF.tensor_count": GGUFField(GGUFValueType.UINT64, n_tensors),
            "GGUF.kv_count": GGUFField(GGUFValueType.UINT64, n_kv),
        }
        cursor.check_count(n_kv, 8 + 4 + 1, "key/value pairs")  # the smallest: an empty key and a uint8
        for _ in range(n_kv):
            key = cursor.string("a metadata key")
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            (value_type,) = cursor.unpack(_U32, f"the type of {key!r}")
            value_type = _value_type(value_type, repr(key))
            item_type = cursor.peek_item_type(repr(key)) if value_type == GGUFValueType.ARRAY else None
            self.fields[key] = GGUFField(value_type, cursor.value(value_type, repr(key)), item_type)
        alignment = self._alignment()
        infos = [cursor.tensor_info(alignment) for _ in range(cursor.check_count(n_tensors, 32, "tensor infos"))]
        data_start = -(-cursor.pos // alignment) * alignment
        base = np.frombuffer(mapped, np.uint8) if infos else None
        self.tensors: list[GGUFTensor] = []
        names = set()
        for name, tensor_type, shape, offset in infos:
            if name in names:
                raise ValueError(f"tensor name {name!r} appears twice")
            names.add(name)
            self.tensors.append(_tensor(base, name, tensor_type, shape, data_start + offset))

    def _alignment(self) -> int:
        """general.alignment (a uint32 power of two) or the default 32."""
        field = self.fields.get("general.alignment")
        if field is None:
            return _DEFAULT_ALIGNMENT
        if field.value_type != GGUFValueType.UINT32:
            raise ValueError(f"general.alignment has type {field.value_type.name}, not UINT32")
        if field.value <= 0 or field.value & (field.value - 1):
            raise ValueError(f"general.alignment {field.value} is not a power of two")
        return field.value


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"{what} has unknown value type {raw}") from None


def _tensor(base: np.ndarray, name: str, tensor_type: GGMLQuantizationType, shape: tuple[int, ...], start: int) -> GGUFTensor:
    """The tensor's view of the mapped file, once its row fits whole blocks and its bytes lie inside the file."""
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if shape[0] % block:
        raise ValueError(f"tensor {name!r} ({tensor_type.name}) has ne0 {shape[0]}, not a multiple of its block size {block}")
    n_bytes = math.prod(shape) // block * block_bytes
    if n_bytes > base.size - start:
        raise ValueError(f"tensor {name!r} needs bytes {start}..{start + n_bytes}, past the end of the {base.size}-byte file")
    numpy_shape = shape[::-1]
    dtype = _ELEMENT_DTYPES.get(tensor_type)
    if dtype is None:
        dtype, numpy_shape = np.dtype(np.uint8), quant_shape_to_byte_shape(numpy_shape, tensor_type)
    return GGUFTensor(name, tensor_type, shape, base[start : start + n_bytes].view(dtype).reshape(numpy_shape))


class _Cursor:
    """A position in the mapped file; every read first checks that its bytes lie inside the file."""

    def __init__(self, mapped: mmap.mmap):
        self.buf, self.pos, self.size = mapped, 0, len(mapped)

    def take(self, n: int, what: str) -> int:
        """The start of the next n bytes; moves past them."""
        if n > self.size - self.pos:
            raise ValueError(f"{what} at byte {self.pos} needs {n} bytes, but the file has {self.size - self.pos} left")
        start = self.pos
        self.pos += n
        return start

    def check_count(self, count: int, min_size: int, what: str) -> int:
        """`count`, once it is clear that many items of at least min_size bytes each can fit in what is left."""
        if count * min_size > self.size - self.pos:
            raise ValueError(f"{count} {what} at byte {self.pos} cannot fit in the {self.size - self.pos} bytes left")
        return count

    def peek_item_type(self, what: str) -> GGUFValueType:
        """The item type of the array whose header comes next (the cursor stays where it is)."""
        if _U32.size > self.size - self.pos:
            raise ValueError(f"the array header of {what} at byte {self.pos} runs past the end of the file")
        return _value_type(_U32.unpack_from(self.buf, self.pos)[0], f"an array item of {what}")

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))

    def string(self, what: str) -> str:
        (n,) = self.unpack(_U64, f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode()
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} at byte {start} is not UTF-8: {e}") from None

    def value(self, value_type: GGUFValueType, what: str, depth: int = 0) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type != GGUFValueType.ARRAY:
            return self.unpack(_FIXED[value_type][0], what)[0]
        if depth == _MAX_NESTING:
            raise ValueError(f"{what} nests arrays more than {_MAX_NESTING} deep")
        item_type, count = self.unpack(_TYPE_AND_COUNT, f"the array header of {what}")
        item_type = _value_type(item_type, f"an array item of {what}")
        self.check_count(count, _MIN_SIZE[item_type], f"{item_type.name} items of {what}")
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        if item_type == GGUFValueType.ARRAY:
            return [item for _ in range(count) for item in self.value(item_type, what, depth + 1)]
        dtype = _FIXED[item_type][1]
        start = self.take(count * dtype.itemsize, what)
        return np.frombuffer(self.buf, dtype, count, start).tolist() if count else []

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings, in one tight loop: a tokenizer's vocabulary and merges are 100K of them."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size or (end := pos + 8 + unpack(buf, pos)[0]) > size:
                claim = f"of {unpack(buf, pos)[0]} bytes " if pos + 8 <= size else ""
                raise ValueError(f"string {len(out)} {claim}of {what} at byte {pos} runs past the end of the file")
            try:
                append(buf[pos + 8 : end].decode())
            except UnicodeDecodeError as e:
                raise ValueError(f"string {len(out)} of {what} at byte {pos} is not UTF-8: {e}") from None
            pos = end
        self.pos = pos
        return out

    def tensor_info(self, alignment: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        """(name, type, shape in ggml order, data offset) of the next tensor info, each value checked."""
        name = self.string("a tensor name")
        (n_dims,) = self.unpack(_U32, f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        shape = self.unpack(struct.Struct(f"<{n_dims}Q"), f"the shape of tensor {name!r}")
        if math.prod(max(d, 1) for d in shape) > _INT64_MAX:
            raise ValueError(f"tensor {name!r} has shape {shape}, more elements than ggml can count")
        raw_type, offset = self.unpack(_TYPE_AND_COUNT, f"the type and offset of tensor {name!r}")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        if offset % alignment:
            raise ValueError(f"tensor {name!r} has data offset {offset}, not a multiple of the alignment {alignment}")
        return name, tensor_type, shape, offset
