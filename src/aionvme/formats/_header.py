"""The safetensors header: dtype table, parsing with full validation, and
building. Pure functions, no I/O, no torch.

Layout of a file (https://github.com/huggingface/safetensors, "Format")::

    [8 bytes: N, little-endian u64][N bytes: JSON header][data region]

The header maps each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the data region, which starts at 8 + N),
plus an optional ``"__metadata__": {str: str}``. The header may be padded
with trailing spaces.

Validation mirrors the reference reader (safetensors 0.8, ``Metadata::validate``)
and is stricter in one place: a name that appears twice in the JSON is an
error here, where the reference silently keeps the last one. What the
reference rejects, we reject: unknown dtypes, negative or non-integer shapes,
``end - begin`` different from the tensor's size, and any data region not
covered exactly once (gaps, overlaps, bytes past the last tensor), element
counts or sizes that overflow 64 bits. Stricter here also: a dimension above
2**63 - 1 (no torch or numpy tensor can have it) and JSON nested too deeply
to parse (the reference's parser has its own depth limit). Every check runs
before anything larger than the header is allocated.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..exceptions import AionvmeError

__all__ = [
    "DTYPES",
    "MAX_HEADER_SIZE",
    "DType",
    "SafetensorsError",
    "SafetensorsHeader",
    "TensorInfo",
    "TensorNotFoundError",
    "build_header",
    "header_length",
    "parse_header",
]

# The reference reader refuses headers above 100 MB (safetensors::tensor::MAX_HEADER_SIZE);
# so do we, which also bounds what a corrupt length field can make us allocate.
MAX_HEADER_SIZE = 100_000_000
METADATA_KEY = "__metadata__"


class SafetensorsError(AionvmeError, ValueError):
    """A safetensors file (or index) is malformed, or a tensor cannot be
    represented as asked. ``filename`` and, where one is to blame, ``tensor``
    say where."""

    def __init__(self, message: str, filename: object = None, tensor: str | None = None) -> None:
        where = f"{filename!s}: " if filename is not None else ""
        what = f"tensor {tensor!r}: " if tensor is not None else ""
        super().__init__(f"{where}{what}{message}")
        self.filename = filename
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), str(self), self.filename, self.tensor))


def _rebuild_error(cls: type[SafetensorsError], text: str, filename: object, tensor: str | None) -> Any:
    exc = cls.__new__(cls)
    ValueError.__init__(exc, text)
    exc.filename = filename
    exc.tensor = tensor
    return exc


class TensorNotFoundError(AionvmeError, KeyError):
    """``keys=`` named tensors the file (or sharded index) does not hold."""

    def __init__(self, missing: Iterable[str], filename: object) -> None:
        self.missing = sorted(missing)
        self.filename = filename
        shown = ", ".join(repr(k) for k in self.missing[:10])
        more = f" and {len(self.missing) - 10} more" if len(self.missing) > 10 else ""
        super().__init__(f"{filename!s}: no tensor named {shown}{more}")

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (multiprocessing, loaders)
        return (type(self), (self.missing, self.filename))


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its name in the header, its size, and the numpy
    and torch dtypes it maps to (None where that library has none)."""

    code: str
    bits: int
    numpy: str | None
    torch: str | None

    @property
    def itemsize(self) -> int:
        """Bytes per element; 1 for sub-byte types (their alignment unit)."""
        return max(1, self.bits // 8)


# The dtypes of safetensors 0.8 (safetensors::Dtype), in its order of
# alignment. torch names are attributes of the torch module; a torch too old
# to have one gets a clear error when such a tensor is materialized.
DTYPES: dict[str, DType] = {
    d.code: d
    for d in (
        DType("F64", 64, "float64", "float64"),
        DType("I64", 64, "int64", "int64"),
        DType("U64", 64, "uint64", "uint64"),
        DType("C64", 64, "complex64", "complex64"),
        DType("F32", 32, "float32", "float32"),
        DType("I32", 32, "int32", "int32"),
        DType("U32", 32, "uint32", "uint32"),
        DType("F16", 16, "float16", "float16"),
        DType("BF16", 16, None, "bfloat16"),
        DType("I16", 16, "int16", "int16"),
        DType("U16", 16, "uint16", "uint16"),
        DType("I8", 8, "int8", "int8"),
        DType("U8", 8, "uint8", "uint8"),
        DType("BOOL", 8, "bool", "bool"),
        DType("F8_E4M3", 8, None, "float8_e4m3fn"),
        DType("F8_E5M2", 8, None, "float8_e5m2"),
        DType("F8_E4M3FNUZ", 8, None, "float8_e4m3fnuz"),
        DType("F8_E5M2FNUZ", 8, None, "float8_e5m2fnuz"),
        DType("F8_E8M0", 8, None, "float8_e8m0fnu"),
        # Sub-byte types: the header's shape counts 4- or 6-bit elements.
        # torch packs F4 two to a byte (float4_e2m1fn_x2, last dim halved);
        # F6 has no torch or numpy dtype.
        DType("F4", 4, None, "float4_e2m1fn_x2"),
        DType("F6_E2M3", 6, None, None),
        DType("F6_E3M2", 6, None, None),
    )
}

# numpy / torch dtype name -> safetensors code, for writing.
NUMPY_CODES = {d.numpy: d.code for d in DTYPES.values() if d.numpy is not None}
TORCH_CODES = {d.torch: d.code for d in DTYPES.values() if d.torch is not None}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``begin``/``end`` are relative to the data region."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated header.

    Attributes
    ----------
    tensors : dict of name -> TensorInfo, in the order of the JSON header.
    metadata : dict of str -> str (empty when the file has none).
    data_start : file offset of the data region (8 + header length).
    data_len : bytes in the data region.
    """

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    data_len: int


def header_length(prefix: bytes, file_size: int, filename: object = None) -> int:
    """The header length N from a file's first 8 bytes, checked against the
    file size and :data:`MAX_HEADER_SIZE` before anything is allocated."""
    if file_size < 8 or len(prefix) < 8:
        raise SafetensorsError(
            f"too short to be a safetensors file ({file_size} bytes; the length field alone is 8)",
            filename,
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > file_size - 8:
        raise SafetensorsError(
            f"header length {n} exceeds the {file_size - 8} bytes after the length field "
            "(truncated file, or not safetensors)",
            filename,
        )
    if n > MAX_HEADER_SIZE:
        raise SafetensorsError(f"header length {n} exceeds the limit of {MAX_HEADER_SIZE} bytes", filename)
    if n < 2:
        raise SafetensorsError(f"header length {n} is too small for a JSON object", filename)
    return int(n)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    pass


def _parse_int(text: str) -> int | float:
    """JSON integers; a negative one (``-0`` included, which int() would make
    0) becomes a float, so the shape and offset checks refuse it as the
    reference does (it reads them as unsigned)."""
    return float(text) if text.startswith("-") else int(text)


_U64_MAX = (1 << 64) - 1
# torch and numpy index with int64: no dimension may exceed this, even in an
# empty tensor (torch.empty((2**63, 0)) raises a TypeError, numpy a ValueError).
_DIM_MAX = (1 << 63) - 1


def _shape(value: Any, filename: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise SafetensorsError(
            f"shape must be a list of non-negative integers, got {value!r}", filename, name
        )
    # The reference multiplies the dimensions left to right with overflow
    # checks in u64: [2**32, 2**32, 0] is an error there although its product is 0.
    n = 1
    for d in value:
        if d > _DIM_MAX:
            raise SafetensorsError(f"shape {value!r}: dimension {d} exceeds 2**63 - 1", filename, name)
        n *= d
        if n > _U64_MAX:
            raise SafetensorsError(f"shape {value!r}: the element count overflows 64 bits", filename, name)
    return tuple(value)


def parse_header(raw: bytes, file_size: int, filename: object = None) -> SafetensorsHeader:
    """Parse and validate the JSON header ``raw`` (the N bytes after the
    length field) of a file of ``file_size`` bytes."""
    n = len(raw)
    data_start = 8 + n
    data_len = file_size - data_start
    if data_len < 0:
        raise SafetensorsError(f"file of {file_size} bytes ends inside its {n}-byte header", filename)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not UTF-8 ({e.reason} at byte {8 + e.start})", filename) from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_parse_int)
    except _DuplicateKey as e:
        raise SafetensorsError("name appears twice in the header", filename, str(e.args[0])) from None
    except ValueError as e:  # json.JSONDecodeError
        raise SafetensorsError(f"header is not valid JSON: {e}", filename) from None
    except RecursionError:  # e.g. 100,000 '[': the reference refuses such nesting too
        raise SafetensorsError("header JSON is nested too deeply", filename) from None
    if not isinstance(obj, dict):
        raise SafetensorsError(f"header is a JSON {type(obj).__name__}, not an object", filename)

    metadata: dict[str, str] = {}
    meta = obj.pop(METADATA_KEY, None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SafetensorsError("__metadata__ must be an object of strings to strings", filename)
        metadata = meta

    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        if not isinstance(entry, dict):
            raise SafetensorsError(f"entry is a JSON {type(entry).__name__}, not an object", filename, name)
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise SafetensorsError(f"entry lacks {', '.join(missing)}", filename, name)
        code = entry["dtype"]
        dt = DTYPES.get(code) if isinstance(code, str) else None
        if dt is None:
            raise SafetensorsError(f"unknown dtype {code!r} (known: {', '.join(DTYPES)})", filename, name)
        shape = _shape(entry["shape"], filename, name)
        offs = entry["data_offsets"]
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise SafetensorsError(
                f"data_offsets must be [begin, end] integers, got {offs!r}", filename, name
            )
        begin, end = offs
        if end < begin:
            raise SafetensorsError(f"data_offsets [{begin}, {end}] end before they begin", filename, name)
        if end > data_len:
            raise SafetensorsError(
                f"data_offsets [{begin}, {end}] run past the data region of {data_len} bytes "
                "(truncated file?)",
                filename,
                name,
            )
        nbits = math.prod(shape) * dt.bits
        if nbits > _U64_MAX:
            raise SafetensorsError(
                f"shape {list(shape)} of {code}: the size in bytes overflows 64 bits", filename, name
            )
        if nbits % 8:
            raise SafetensorsError(
                f"{math.prod(shape)} elements of {code} do not fill whole bytes", filename, name
            )
        if nbits // 8 != end - begin:
            raise SafetensorsError(
                f"shape {list(shape)} of {code} is {nbits // 8} bytes, but data_offsets "
                f"[{begin}, {end}] hold {end - begin}",
                filename,
                name,
            )
        tensors[name] = TensorInfo(name, dt, shape, begin, end)

    # The data region must be covered exactly once: sorted by begin, each
    # tensor starts where the previous ended, and the last ends at the file's end.
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            raise SafetensorsError(
                f"data_offsets [{t.begin}, {t.end}] overlap another tensor's bytes (up to {pos})",
                filename,
                t.name,
            )
        if t.begin > pos:
            raise SafetensorsError(
                f"bytes [{pos}, {t.begin}) of the data region belong to no tensor "
                f"(the format has no gaps; the next tensor starts at {t.begin})",
                filename,
                t.name,
            )
        pos = t.end
    if pos != data_len:
        raise SafetensorsError(
            f"the tensors end at byte {pos} of the data region, but the file holds {data_len} "
            "(trailing bytes, or a truncated header)",
            filename,
        )
    return SafetensorsHeader(tensors, metadata, data_start, data_len)


def build_header(
    entries: Iterable[tuple[str, str, tuple[int, ...], int, int]],
    metadata: Mapping[str, str] | None,
    pad_to: int = 8,
) -> bytes:
    """Length field + JSON header for (name, code, shape, begin, end) entries,
    padded with spaces so the data region starts on a multiple of ``pad_to``
    (8 like the reference writer, or more for aligned data)."""
    obj: dict[str, Any] = {}
    if metadata:
        obj[METADATA_KEY] = dict(metadata)
    for name, code, shape, begin, end in entries:
        obj[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    js = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    js += b" " * (-(8 + len(js)) % pad_to)
    return struct.pack("<Q", len(js)) + js
