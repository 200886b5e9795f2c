"""The aionvme dataset format: shards of page-aligned fields and one index.

Directory::

    index.aionvme          written last: its presence means the dataset is complete
    shard-00000.bin        4096-byte header, then each sample's fields, each
    shard-00001.bin        starting on a 4096-byte boundary (O_DIRECT, zero-copy)

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
import os
import struct
import uuid
import zlib
from typing import Any

import numpy as np

from ._errors import CorruptDatasetError, UnsupportedDatasetError
from ._layout import ALIGN, Field, FileStat, Layout

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
    try:
        header = json.loads(body[16 : 16 + js_len])
    except ValueError as e:
        raise CorruptDatasetError(f"index header is not JSON: {e}", path) from None
    start = (16 + js_len + 7) // 8 * 8
    arrays = []
    for pos, dt, shape in header["arrays"]:
        dtype = np.dtype(dt)
        count = int(np.prod(shape)) if shape else 1
        end = start + pos + count * dtype.itemsize
        if end > len(body):
            raise CorruptDatasetError("index array out of range", path)
        arrays.append(np.frombuffer(body, dtype=dtype, count=count, offset=start + pos).reshape(shape))
    return header, arrays


def read_layout(root: str) -> Layout:
    """Open an aionvme dataset directory: the index, then every shard's size and header."""
    path = os.path.join(root, INDEX_NAME)
    with open(path, "rb") as fh:
        data = fh.read()
    header, arrays = decode_index(data, path)
    try:
        n = int(header["n"])
        dataset_id = bytes.fromhex(header["id"])
        shards = header["shards"]
        fields: dict[str, Field] = {}
        for fd in header["fields"]:
            ia = fd["arrays"]
            shard, offset, nbytes, crc = (arrays[ia[k]] for k in ("shard", "offset", "nbytes", "crc"))
            shapes = arrays[ia["shapes"]] if "shapes" in ia else None
            shape = tuple(fd["shape"]) if fd["shape"] is not None else None
            fields[fd["name"]] = Field(
                name=fd["name"],
                dtype=fd["dtype"],
                itemsize=int(fd["itemsize"]),
                ndim=int(fd["ndim"]),
                shape=shape,
                file=shard.astype(np.int64),
                offset=offset.astype(np.int64),
                nbytes=nbytes.astype(np.int64),
                shapes=shapes,
                crc=crc,
            )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptDatasetError(f"index header is malformed: {e!r}", path) from None
    files = [os.path.join(root, s["name"]) for s in shards]
    stats = []
    for i, (f, s) in enumerate(zip(files, shards)):
        try:
            st = os.stat(f)
        except FileNotFoundError:
            raise CorruptDatasetError("shard listed in the index is missing", f) from None
        if st.st_size != s["size"]:
            raise CorruptDatasetError(
                f"shard is {st.st_size} bytes, the index says {s['size']} (truncated or replaced)", f
            )
        with open(f, "rb", buffering=0) as fh:
            head = fh.read(_SHARD_HEAD.size)
        if len(head) < _SHARD_HEAD.size:
            raise CorruptDatasetError("shard header truncated", f)
        magic, _version, number, sid, size = _SHARD_HEAD.unpack(head)
        if magic != SHARD_MAGIC or number != i or sid != dataset_id or size != s["size"]:
            raise CorruptDatasetError("shard header does not match the index (damaged or another write's)", f)
        stats.append(FileStat.of(st))
    for fd in fields.values():
        if len(fd.file) != n:
            raise CorruptDatasetError(f"index field {fd.name!r} has {len(fd.file)} entries, not {n}", path)
        if n:
            if int(fd.file.max()) >= len(files) or int(fd.file.min()) < 0:
                raise CorruptDatasetError(f"index field {fd.name!r} names a shard that does not exist", path)
            sizes = np.array([s["size"] for s in shards], dtype=np.int64)
            bad = np.nonzero((fd.offset < ALIGN) | (fd.offset + fd.nbytes > sizes[fd.file]))[0]
            if len(bad):
                j = int(bad[0])
                raise CorruptDatasetError(
                    f"index puts field {fd.name!r} outside its shard", files[int(fd.file[j])], j
                )
    return Layout(
        "aionvme", root, files, stats, n, fields, info={"id": header["id"], "meta": header.get("meta", {})}
    )
