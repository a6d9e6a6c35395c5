"""A GGUF file's header, read over a memory map without a Python object per array element.

gguf's GGUFReader builds one or two numpy arrays per element of every metadata array, which for a
262k-token vocabulary costs seconds and hundreds of MB in every process that opens the file. Here:

- scalars are decoded when the header is read; a numeric array is one numpy view of the map;
- a string array is the table of its items' offsets (one walk over the length prefixes), and its
  items are decoded to str only when asked for;
- tensor infos carry what GGUFReader's `ReaderTensor` does (name, ggml type, dims innermost first,
  n_bytes from GGML_QUANT_SIZES, absolute data offset, `data` as a view of the map shaped as
  GGUFReader shapes it: quantized and BF16 tensors as uint8 rows).

Every length is checked against the file size first, so a truncated or hostile header raises
`GGUFHeaderError` (a ValueError) instead of reading past the end or allocating a huge table.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # GGUFValueType
# GGUFValueType -> struct code of a scalar (numpy dtype is the same code)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml types GGUFReader exposes as elements (the rest as uint8 block bytes)
_ELEMENT_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


class GGUFHeaderError(ValueError):
    """The header is not a readable GGUF header (truncated, bad lengths, unknown types)."""


@dataclass
class Field:
    """One metadata key/value. `offset`/`nbytes` span its whole record (key included), as laid out
    in the file; `types` is [type] or [ARRAY, item type]."""
    name: str
    offset: int
    nbytes: int
    types: list[int]
    count: int = 1  # items of an array
    value: Any = None  # a scalar's value; a numeric array's numpy view
    starts: np.ndarray | None = None  # a string array: each item's length prefix offset
    header: "GGUFHeader | None" = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.count

    def contents(self, index: int | None = None) -> Any:
        """The value (a list for an array), or item `index` of an array, as GGUFReader's contents gives it."""
        if self.types[0] != ARRAY:
            return self.value
        if self.starts is not None:
            if index is not None:
                return self.header._string(int(self.starts[index]))
            return self.header._strings(self.starts)
        if self.value is None:  # an array of arrays: not read (layerline uses none)
            raise GGUFHeaderError(f"metadata {self.name} is an array of arrays, which layerline does not read")
        return self.value[index].item() if index is not None else self.value.tolist()


@dataclass
class Tensor:
    """One tensor info, the fields of gguf's ReaderTensor that layerline reads."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, innermost first (uint64)
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray  # a read-only view of the map


class GGUFHeader:
    """The metadata and tensor infos of the GGUF file at `path` (see the module doc)."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        with open(path, "rb") as f:
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFHeaderError("the file is empty") from None
        self.size = len(self._mm)
        self.data = np.frombuffer(self._mm, dtype=np.uint8)  # read-only, like GGUFReader's data
        self._need(0, 24, "the header")
        if self._mm[:4] != GGUF_MAGIC:
            raise GGUFHeaderError("GGUF magic invalid")
        self.byte_order = "I"
        version = struct.unpack_from("<I", self._mm, 4)[0]
        if version & 0xFFFF == 0:  # written for the other byte order (GGUFReader's test)
            self.byte_order = "S"
        self._e = ">" if self.byte_order == "S" else "<"
        self.version, tensor_count, kv_count = struct.unpack_from(self._e + "IQQ", self._mm, 4)
        if self.version not in VERSIONS:
            raise GGUFHeaderError(f"GGUF version {self.version} (readable: {', '.join(map(str, VERSIONS))})")
        off = 24
        # each key/value takes at least 13 bytes, each tensor info at least 24: a count past that is not a file
        if kv_count * 13 > self.size or tensor_count * 24 > self.size:
            raise GGUFHeaderError(f"counts of {kv_count} key/values and {tensor_count} tensors exceed the file")
        self.fields: dict[str, Field] = {}
        for _ in range(kv_count):
            off = self._read_kv(off)
        infos = []
        for _ in range(tensor_count):
            name, off = self._str_at(off)
            (n_dims,) = self._unpack("I", off)
            self._need(off + 4, 8 * n_dims + 12, f"tensor {name}'s info")
            dims = np.array(struct.unpack_from(f"{self._e}{n_dims}Q", self._mm, off + 4), dtype=np.uint64)
            raw_type, rel = struct.unpack_from(self._e + "IQ", self._mm, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, rel))
        self.alignment = DEFAULT_ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.types != [4]:
                raise GGUFHeaderError("general.alignment is not a uint32")
            self.alignment = int(align.value)
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise GGUFHeaderError(f"general.alignment {self.alignment} is not a power of two")
        self.data_offset = off + -off % self.alignment
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise GGUFHeaderError(f"tensor {name} appears twice")
            seen.add(name)
            try:
                ttype = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[ttype]
            except (ValueError, KeyError):
                raise GGUFHeaderError(f"tensor {name} has unknown ggml type {raw_type}") from None
            n_elems = int(np.prod(dims.astype(object))) if len(dims) else 1
            n_bytes = n_elems * type_size // block
            start = self.data_offset + int(rel)
            self._need(start, n_bytes, f"tensor {name}'s data")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            dtype = _ELEMENT_DTYPES.get(ttype.name)
            if dtype is None:
                dtype, count, np_dims = np.uint8, n_bytes, quant_shape_to_byte_shape(np_dims, ttype)
            else:
                count = n_elems
            view = np.frombuffer(self._mm, dtype=np.dtype(dtype).newbyteorder(self._e), count=count, offset=start)
            self.tensors.append(Tensor(name, ttype, dims, n_elems, n_bytes, start, view.reshape(np_dims)))

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    # --- reading --------------------------------------------------------------------------------------

    def _need(self, off: int, n: int, what: str) -> None:
        if n < 0 or off + n > self.size:
            raise GGUFHeaderError(f"{what} ({n} bytes at offset {off}) runs past the end of the file "
                                  f"({self.size} bytes); the file is truncated or corrupt")

    def _unpack(self, code: str, off: int) -> tuple:
        self._need(off, struct.calcsize("<" + code), "a header value")
        return struct.unpack_from(self._e + code, self._mm, off)

    def _str_at(self, off: int) -> tuple[str, int]:
        """(the string at `off`, the offset after it)."""
        (n,) = self._unpack("Q", off)
        self._need(off + 8, n, "a string")
        return self._decode(off + 8, n), off + 8 + n

    def _decode(self, off: int, n: int) -> str:
        try:
            return self._mm[off:off + n].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"the string at offset {off} is not UTF-8") from None

    def _string(self, start: int) -> str:
        (n,) = struct.unpack_from(self._e + "Q", self._mm, start)
        return self._decode(start + 8, n)

    def _strings(self, starts: np.ndarray) -> list[str]:
        if not len(starts):
            return []
        lo = int(starts[0])
        (last,) = struct.unpack_from(self._e + "Q", self._mm, int(starts[-1]))
        buf = self._mm[lo:int(starts[-1]) + 8 + last]  # one copy of the array's bytes, then slices of it
        fmt, out = self._e + "Q", []
        for s in (starts - lo).tolist():
            (n,) = struct.unpack_from(fmt, buf, s)
            out.append(buf[s + 8:s + 8 + n].decode("utf-8", errors="strict"))
        return out

    def _read_kv(self, off: int) -> int:
        start = off
        key, off = self._str_at(off)
        (vtype,) = self._unpack("I", off)
        off += 4
        f = Field(key, start, 0, [vtype], header=self)
        if vtype == STRING:
            f.value, off = self._str_at(off)
        elif vtype in _SCALAR:
            (f.value,) = self._unpack(_SCALAR[vtype], off)
            off += struct.calcsize("<" + _SCALAR[vtype])
        elif vtype == ARRAY:
            off = self._read_array(f, off)
        else:
            raise GGUFHeaderError(f"metadata {key} has unknown value type {vtype}")
        if key in self.fields:
            raise GGUFHeaderError(f"metadata {key} appears twice")
        f.nbytes = off - start
        self.fields[key] = f
        return off

    def _read_array(self, f: Field, off: int) -> int:
        itype, count = self._unpack("IQ", off)
        off += 12
        f.types.append(itype)
        f.count = count
        if itype in _SCALAR:
            code = _SCALAR[itype]
            self._need(off, count * struct.calcsize("<" + code), f"metadata {f.name}'s {count} items")
            f.value = np.frombuffer(self._mm, dtype=np.dtype(code).newbyteorder(self._e), count=count, offset=off)
            return off + f.value.nbytes
        if itype == STRING:
            self._need(off, 8 * count, f"metadata {f.name}'s {count} strings")
            starts, fmt, mm, size = [], self._e + "Q", self._mm, self.size
            for i in range(count):  # one walk over the length prefixes
                if off + 8 > size:
                    self._need(off, 8, f"metadata {f.name}'s string {i}")
                starts.append(off)
                off += 8 + struct.unpack_from(fmt, mm, off)[0]
                if off > size:
                    self._need(starts[-1], off - starts[-1], f"metadata {f.name}'s string {i}")
            starts = np.array(starts, dtype=np.int64)
            f.starts = starts
            return off
        if itype == ARRAY:  # nested arrays: only their extent (GGUFReader flattens them; layerline reads none)
            for _ in range(count):
                inner = Field(f.name, off, 0, [ARRAY], header=self)
                off = self._read_array(inner, off)
            return off
        raise GGUFHeaderError(f"metadata {f.name} is an array of unknown type {itype}")
