"""The aionvme dataset format: shards of page-aligned fields and one index.

Directory::

    index.aionvme          written last: its presence means the dataset is complete
    shard-00000.bin        4096-byte header, then each sample's fields: a field
    shard-00001.bin        over 2048 bytes starts on a 4096-byte boundary (O_DIRECT,
                           zero-copy), smaller ones are packed into shared pages,
                           never across a page boundary

The index gives every field's offset, so where the writer puts a field is not
part of the format: readers of version 1 read packed shards as they are
(checked against the reader from before packing), hence no version bump.

Shard header (little-endian): magic ``AIONVSHD``, u32 format version, u32 shard
number, 16-byte dataset id (a random UUID, also in the index: a shard from
another write is refused), u64 file size; zeros up to 4096 bytes.

Index: magic ``AIONVIDX``, u32 version, u32 JSON length, the JSON header
(fields, shards, sample count, where each array lies), zero padding to 8
bytes, the arrays (per field: shard u32, offset u64, nbytes u64, crc32 u32
of the field's bytes, and for fields whose shape varies the shapes i64
[n, ndim]), then u32 crc32 of everything before it and magic ``AIONVEND``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import uuid
import zlib
from typing import Any

import numpy as np

from ._errors import CorruptDatasetError, UnsupportedDatasetError
from ._layout import ALIGN, Field, FileStat, Layout, open_member, read_member

INDEX_NAME = "index.aionvme"
SHARD_MAGIC = b"AIONVSHD"
INDEX_MAGIC = b"AIONVIDX"
INDEX_END = b"AIONVEND"
VERSION = 1
_SHARD_HEAD = struct.Struct("<8sII16sQ")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


def new_dataset_id() -> bytes:
    return uuid.uuid4().bytes


def shard_header(shard: int, dataset_id: bytes, size: int) -> bytes:
    head = _SHARD_HEAD.pack(SHARD_MAGIC, VERSION, shard, dataset_id, size)
    return head + bytes(ALIGN - len(head))


def encode_index(header: dict[str, Any], arrays: list[np.ndarray[Any, Any]]) -> bytes:
    """The index file's bytes; header gets the arrays' places added."""
    places = []
    pos = 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        places.append([pos, a.dtype.str, list(a.shape)])
        pos += (a.nbytes + 7) // 8 * 8
    header = dict(header, arrays=places)
    js = json.dumps(header, separators=(",", ":")).encode()
    parts = [INDEX_MAGIC, struct.pack("<II", VERSION, len(js)), js]
    head_len = 16 + len(js)
    parts.append(bytes((-head_len) % 8))
    for a in arrays:
        b = np.ascontiguousarray(a).tobytes()
        parts.append(b)
        parts.append(bytes((-len(b)) % 8))
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body)) + INDEX_END


_ARRAY_DTYPES = {"<u4", "<u8", "<i8", "<i4"}  # what encode_index writes (uint32, uint64, int64 arrays)
_TORCH_ONLY = {
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


def _nonneg(v: object, what: str, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CorruptDatasetError(f"index {what} is {v!r}, not an int >= 0", path)
    return v


def _shape(v: object, what: str, path: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 32:
        raise CorruptDatasetError(f"index {what} is {v!r}, not a shape", path)
    return tuple(_nonneg(x, what, path) for x in v)


def _parse_json(raw: bytes, what: str, path: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise CorruptDatasetError(f"{what} is not JSON: {type(e).__name__}: {e}", path) from None


def decode_index(data: bytes, path: str) -> tuple[dict[str, Any], list[np.ndarray[Any, Any]]]:
    """Check and parse an index file's bytes (CorruptDatasetError naming path)."""
    if len(data) < 28 or data[:8] != INDEX_MAGIC or data[-8:] != INDEX_END:
        raise CorruptDatasetError("not an aionvme dataset index, or truncated", path)
    body = data[:-12]
    (crc,) = struct.unpack("<I", data[-12:-8])
    if zlib.crc32(body) != crc:
        raise CorruptDatasetError("index checksum mismatch", path)
    version, js_len = struct.unpack("<II", body[8:16])
    if version > VERSION:
        raise UnsupportedDatasetError(f"index format version {version} is newer than this reader's", path)
    if 16 + js_len > len(body):
        raise CorruptDatasetError(f"index header of {js_len} bytes runs past the file", path)
    header = _parse_json(body[16 : 16 + js_len], "index header", path)
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise CorruptDatasetError("index header is not an object with 'arrays'", path)
    start = (16 + js_len + 7) // 8 * 8
    arrays = []
    for place in header["arrays"]:
        if not isinstance(place, list) or len(place) != 3 or place[1] not in _ARRAY_DTYPES:
            raise CorruptDatasetError(f"index array {place!r} is malformed", path)
        pos = _nonneg(place[0], "array position", path)
        shape = _shape(place[2], "array shape", path)
        if len(shape) > 2:
            raise CorruptDatasetError(f"index array of shape {shape}", path)
        dtype = np.dtype(place[1])
        count = math.prod(shape)
        if start + pos + count * dtype.itemsize > len(body):
            raise CorruptDatasetError("index array out of range", path)
        arrays.append(np.frombuffer(body, dtype=dtype, count=count, offset=start + pos).reshape(shape))
    return header, arrays


def _dtype(name: object, itemsize: object, path: str) -> tuple[str, int]:
    """A field's dtype name and itemsize as the writer stores them (numeric numpy, or torch-only)."""
    isz = _nonneg(itemsize, "itemsize", path)
    if isinstance(name, str) and name in _TORCH_ONLY:
        ok = _TORCH_ONLY[name] == isz
    else:
        try:
            dt = np.dtype(name)  # type: ignore[call-overload]
        except (TypeError, ValueError, SyntaxError):
            dt = None
        ok = dt is not None and dt.kind in "biufc" and dt.name == name and dt.itemsize == isz
    if not ok or not isz:
        raise CorruptDatasetError(f"index field dtype {name!r} with itemsize {itemsize!r}", path)
    return str(name), isz


def _field(fd: object, arrays: list[np.ndarray[Any, Any]], n: int, path: str) -> Field:
    """One field of the index header, checked against itself (not yet against the shards)."""
    if (
        not isinstance(fd, dict)
        or not isinstance(fd.get("name"), str)
        or not isinstance(fd.get("arrays"), dict)
    ):
        raise CorruptDatasetError(f"index field {fd!r} is malformed", path)
    name = fd["name"]
    dtype, itemsize = _dtype(fd.get("dtype"), fd.get("itemsize"), path)
    ndim = _nonneg(fd.get("ndim"), "ndim", path)
    shape = None if fd.get("shape") is None else _shape(fd["shape"], f"field {name!r} shape", path)
    if shape is not None and len(shape) != ndim:
        raise CorruptDatasetError(f"index field {name!r}: shape {shape} with ndim {ndim}", path)
    ia = fd["arrays"]
    got: dict[str, np.ndarray[Any, Any]] = {}
    for key in ("shard", "offset", "nbytes", "crc", "shapes"):
        if key not in ia:
            if key == "shapes":
                continue
            raise CorruptDatasetError(f"index field {name!r} has no {key} array", path)
        k = _nonneg(ia[key], f"field {name!r} array number", path)
        if k >= len(arrays):
            raise CorruptDatasetError(f"index field {name!r}: array {k} does not exist", path)
        a = arrays[k]
        want = (n, ndim) if key == "shapes" else (n,)
        if a.shape != want:
            raise CorruptDatasetError(
                f"index field {name!r}: {key} array of shape {a.shape}, not {want}", path
            )
        got[key] = a
    if (shape is None) != ("shapes" in got):
        raise CorruptDatasetError(f"index field {name!r}: a shape and per-sample shapes, or neither", path)
    nbytes = got["nbytes"].astype(np.int64)
    offset = got["offset"].astype(np.int64)
    shapes = got.get("shapes")
    if shapes is not None:
        if (shapes < 0).any():
            raise CorruptDatasetError(f"index field {name!r}: a negative shape", path)
        with np.errstate(over="ignore"):
            want_nb = np.prod(shapes, axis=1, dtype=np.int64) * itemsize if ndim else np.full(n, itemsize)
    else:
        want_nb = np.full(n, math.prod(shape or ()) * itemsize, dtype=np.int64)
    bad = np.nonzero((nbytes < 0) | (offset < 0) | (nbytes != want_nb))[0]
    if len(bad):
        raise CorruptDatasetError(
            f"index field {name!r}: {int(nbytes[bad[0]])} bytes at {int(offset[bad[0]])} "
            "do not hold its shape",
            path,
            int(bad[0]),
        )
    return Field(
        name=name,
        dtype=dtype,
        itemsize=itemsize,
        ndim=ndim,
        shape=shape,
        file=got["shard"].astype(np.int64),
        offset=offset,
        nbytes=nbytes,
        shapes=shapes.astype(np.int64) if shapes is not None else None,
        crc=got["crc"],
    )


def read_layout(root: str) -> Layout:
    """Open an aionvme dataset directory: the index, then every shard's size and header.

    Every name in the index is confined to ``root`` (see ``open_member``);
    every malformed part raises :class:`CorruptDatasetError` naming the file."""
    real_root = os.path.realpath(root)
    path, data = read_member(real_root, INDEX_NAME, "dataset index")
    header, arrays = decode_index(data, path)
    n = _nonneg(header.get("n"), "sample count", path)
    try:
        dataset_id = bytes.fromhex(header.get("id"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CorruptDatasetError(f"index dataset id {header.get('id')!r}", path) from None
    shards, fdescs, meta = header.get("shards"), header.get("fields"), header.get("meta", {})
    if not isinstance(shards, list) or not isinstance(fdescs, list) or not isinstance(meta, dict):
        raise CorruptDatasetError("index header has no list of shards and fields", path)
    fields: dict[str, Field] = {}
    for desc in fdescs:
        field = _field(desc, arrays, n, path)
        fields[field.name] = field
    files: list[str] = []
    stats: list[FileStat] = []
    sizes: list[int] = []
    for i, s in enumerate(shards):
        if not isinstance(s, dict):
            raise CorruptDatasetError(f"index shard {s!r} is malformed", path)
        size = _nonneg(s.get("size"), "shard size", path)
        try:
            f, fno, st = open_member(real_root, s.get("name"), path, "shard")
        except FileNotFoundError:
            raise CorruptDatasetError(
                "shard listed in the index is missing", os.path.join(real_root, str(s.get("name")))
            ) from None
        try:
            if st.st_size != size:
                raise CorruptDatasetError(
                    f"shard is {st.st_size} bytes, the index says {size} (truncated or replaced)", f
                )
            head = os.pread(fno, _SHARD_HEAD.size, 0)
        finally:
            os.close(fno)
        if len(head) < _SHARD_HEAD.size:
            raise CorruptDatasetError("shard header truncated", f)
        magic, _version, number, sid, hsize = _SHARD_HEAD.unpack(head)
        if magic != SHARD_MAGIC or number != i or sid != dataset_id or hsize != size:
            raise CorruptDatasetError("shard header does not match the index (damaged or another write's)", f)
        files.append(f)
        stats.append(FileStat.of(st))
        sizes.append(size)
    size_of = np.array(sizes, dtype=np.int64)
    for fd in fields.values():
        if not n:
            continue
        if int(fd.file.max()) >= len(files) or int(fd.file.min()) < 0:
            raise CorruptDatasetError(f"index field {fd.name!r} names a shard that does not exist", path)
        limit = size_of[fd.file]
        # (compared one by one first: offset + nbytes must not overflow)
        bad = np.nonzero((fd.offset < ALIGN) | (fd.offset > limit) | (fd.nbytes > limit - fd.offset))[0]
        if len(bad):
            j = int(bad[0])
            raise CorruptDatasetError(
                f"index puts field {fd.name!r} outside its shard", files[int(fd.file[j])], j
            )
    return Layout("aionvme", root, files, stats, n, fields, info={"id": header["id"], "meta": meta})
