"""MosaicML streaming MDS datasets (``index.json`` + ``shard.NNNNN.mds``), read
by parsing the format here (no ``streaming`` import) and reading each
sample's byte range with aionvme.

Shard file (streaming/base/format/mds/writer.py ``encode_joint_shard``):
u32 sample count n, u32 offsets[n + 1] (absolute, from the file start), the
writer's config JSON, then the samples. A sample is a u32 size per
variable-size column, then each column's bytes in column order.

Columns supported: ``bytes``, ``str``, ``int``, the fixed-size scalars
(``uint8`` ... ``float64``), ``str_int``, ``str_float``, ``json``, and
``ndarray`` in all four forms (``ndarray``, ``ndarray:DTYPE``,
``ndarray:DTYPE:D0,D1,...``, and a static shape with a dynamic dtype). Image
encodings (``pil``, ``jpeg``, ``png``, lists of them) and ``pkl`` are
refused. Compressed shards are read where their decompressed file is present.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from ._errors import CorruptDatasetError, UnsupportedDatasetError
from ._layout import Decoded, DecodedField, Field, FileStat, Layout, open_member, read_member

_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError)

_SCALARS = {
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
}
_VALUE_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}


class _Column:
    """One MDS column: how to decode it, and whether it has a fixed dtype and shape."""

    def __init__(self, name: object, encoding: object, size: object, where: str) -> None:
        if not isinstance(name, str) or not isinstance(encoding, str):
            raise CorruptDatasetError(f"MDS column {name!r} with encoding {encoding!r}", where)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise CorruptDatasetError(f"MDS column {name!r} has size {size!r}", where)
        self.name = name
        self.encoding = encoding
        self.size = size
        self.dtype: str | None = None
        self.shape: tuple[int, ...] | None = None
        base, _, rest = encoding.partition(":")
        if encoding == "int":
            self.dtype, self.shape = "int64", ()
        elif encoding in _SCALARS:
            self.dtype, self.shape = encoding, ()
        elif base == "ndarray":
            dt, _, shp = rest.partition(":")
            if dt and dt not in _VALUE_DTYPES.values():
                raise UnsupportedDatasetError(f"MDS column {name!r}: ndarray dtype {dt!r}", where)
            self.dtype = dt or None
            try:
                self.shape = tuple(int(x) for x in shp.split(",")) if shp else None
            except ValueError:
                self.shape = (-1,)
            if self.shape is not None and (min(self.shape, default=0) < 0 or len(self.shape) > 32):
                raise CorruptDatasetError(f"MDS column {name!r}: shape in {encoding!r}", where)
        elif encoding not in ("bytes", "str", "json", "str_int", "str_float"):
            raise UnsupportedDatasetError(
                f"MDS column {name!r} has encoding {encoding!r}; supported: bytes, str, int, json, "
                "str_int, str_float, uint8..float64, ndarray[:dtype[:shape]]",
                where,
            )
        if self.fixed and size is not None:
            want = np.dtype(self.dtype).itemsize * math.prod(self.shape or ())
            if size != want:
                raise CorruptDatasetError(
                    f"MDS column {name!r} ({encoding}) has size {size}, its dtype and shape {want}", where
                )

    @property
    def fixed(self) -> bool:
        """A numeric value of one dtype and shape (stacked into a [B, ...] tensor)."""
        return self.dtype is not None and self.shape is not None

    def decode(self, data: memoryview) -> Any:
        e = self.encoding
        if e == "bytes":
            return bytes(data)
        if e == "str":
            return str(data, "utf-8")
        if e == "json":
            return json.loads(str(data, "utf-8"))
        if e == "str_int":
            return int(str(data, "utf-8"))
        if e == "str_float":
            return float(str(data, "utf-8"))
        if self.fixed:
            return np.frombuffer(data, dtype=self.dtype).reshape(self.shape or ()).copy()
        # ndarray: [dtype: 1 if dynamic] [ndim<<2 | shape dtype: 1, shape if dynamic] values
        i = 0
        dtype = self.dtype
        if dtype is None:
            dtype = _VALUE_DTYPES[data[0]]
            i = 1
        shape = self.shape
        if shape is None:
            byte = data[i]
            ndim, sdt = byte >> 2, _SHAPE_DTYPES[byte & 3]
            w = np.dtype(sdt).itemsize
            shape = tuple(int(x) for x in np.frombuffer(data[i + 1 : i + 1 + ndim * w], dtype=sdt))
            i += 1 + ndim * w
        return np.frombuffer(data[i:], dtype=dtype).reshape(shape).copy()


def _int(v: object, what: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CorruptDatasetError(f"MDS {what} is {v!r}, not an int >= 0", where)
    return v


def _shard(
    real_root: str, si: int, sh: object, index_path: str
) -> tuple[str, os.stat_result, int, list[Any]]:
    """Shard si of index.json, opened and checked: (path, stat, header bytes, column specs)."""
    if not isinstance(sh, dict):
        raise CorruptDatasetError(f"MDS shard {si} is {sh!r}, not an object", index_path)
    if sh.get("format") != "mds" or sh.get("version") != 2:
        raise UnsupportedDatasetError(
            f"shard {si} is format {sh.get('format')!r} version {sh.get('version')!r}, not mds 2",
            index_path,
        )
    raw = sh.get("raw_data")
    if not isinstance(raw, dict) or "basename" not in raw:
        why = "compressed, and its decompressed file is not here" if sh.get("zip_data") else "missing"
        raise UnsupportedDatasetError(f"MDS shard {si} is {why}", index_path)
    try:
        path, fd, st = open_member(real_root, raw["basename"], index_path, f"MDS shard {si}")
    except FileNotFoundError:
        why = "compressed, and its decompressed file is not here" if sh.get("zip_data") else "missing"
        raise UnsupportedDatasetError(
            f"MDS shard {si} is {why}", os.path.join(real_root, str(raw["basename"]))
        ) from None
    try:
        specs = [sh.get("column_names"), sh.get("column_encodings"), sh.get("column_sizes")]
        if not all(isinstance(x, list) for x in specs) or len({len(x) for x in specs}) != 1:  # type: ignore[arg-type]
            raise CorruptDatasetError(f"MDS shard {si}: column names, encodings and sizes", index_path)
        if raw.get("bytes") is not None and st.st_size != raw["bytes"]:
            raise CorruptDatasetError(
                f"MDS shard is {st.st_size} bytes, index.json says {raw['bytes']!r} (truncated or replaced)",
                path,
            )
        n = _int(sh.get("samples"), f"shard {si} sample count", index_path)
        need = 4 * (n + 2)
        if need > st.st_size:
            raise CorruptDatasetError(f"MDS shard of {st.st_size} bytes cannot hold {n} samples", path)
        head = os.pread(fd, need, 0)
    finally:
        os.close(fd)
    if len(head) < need:
        raise CorruptDatasetError("MDS shard header truncated", path)
    return path, st, n, [head, *specs]


def read_layout(root: str) -> Layout:
    """Open an MDS directory: index.json, then every shard's header and size.

    index.json is untrusted: every file it names is confined to ``root`` (no
    absolute path, no ``..``, no symbolic link out: ``open_member``), and
    any malformed part raises :class:`CorruptDatasetError` (or
    :class:`UnsupportedDatasetError` for what is valid but not read here)."""
    real_root = os.path.realpath(root)
    index_path, data = read_member(real_root, "index.json", "MDS index.json")
    try:
        index = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptDatasetError(
            f"MDS index.json is not JSON: {type(e).__name__}: {e}", index_path
        ) from None
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise CorruptDatasetError("MDS index.json has no list of shards", index_path)
    files: list[str] = []
    stats: list[FileStat] = []
    begins: list[np.ndarray[Any, Any]] = []
    ends: list[np.ndarray[Any, Any]] = []
    shard_of: list[np.ndarray[Any, Any]] = []
    columns: list[_Column] | None = None
    for si, sh in enumerate(shards):
        path, st, n, (head, names, encodings, sizes) = _shard(real_root, si, sh, index_path)
        cols = [_Column(nm, e, sz, path) for nm, e, sz in zip(names, encodings, sizes)]
        if columns is None:
            columns = cols
        elif [(c.name, c.encoding) for c in cols] != [(c.name, c.encoding) for c in columns]:
            raise UnsupportedDatasetError("MDS shards have different columns", path)
        count = int(np.frombuffer(head, np.uint32, 1)[0])
        offsets = np.frombuffer(head, np.uint32, n + 1, 4).astype(np.int64)
        if count != n:
            raise CorruptDatasetError(f"MDS shard header says {count} samples, index.json {n}", path)
        bad = np.nonzero(np.diff(offsets) < 0)[0]
        if offsets[0] < 4 * (n + 2) or len(bad) or offsets[-1] != st.st_size:
            first = int(bad[0]) if len(bad) else None
            raise CorruptDatasetError(
                f"MDS shard offsets are inconsistent (data ends at {int(offsets[-1])}, "
                f"the file at {st.st_size})",
                path,
                first,
            )
        files.append(path)
        stats.append(FileStat.of(st))
        begins.append(offsets[:-1])
        ends.append(offsets[1:])
        shard_of.append(np.full(n, si, dtype=np.int64))
    columns = columns or []
    begin = np.concatenate(begins) if begins else np.zeros(0, np.int64)
    nbytes = (np.concatenate(ends) if ends else np.zeros(0, np.int64)) - begin
    file = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int64)
    total = len(begin)
    info = {"columns": {c.name: c.encoding for c in columns}}
    if columns and all(c.fixed and c.size is not None for c in columns):
        # every column has a fixed size and no per-sample size header: each column
        # sits at a fixed place in its sample, read straight into batch rows
        fields: dict[str, Field] = {}
        pos = 0
        want = sum(int(c.size or 0) for c in columns)
        bad = np.nonzero(nbytes != want)[0]
        if len(bad):
            j = int(bad[0])
            raise CorruptDatasetError(
                f"MDS sample is {int(nbytes[j])} bytes, its columns {want}", files[file[j]], j
            )
        for c in columns:
            dt = np.dtype(c.dtype)
            fields[c.name] = Field(
                name=c.name,
                dtype=dt.name,
                itemsize=dt.itemsize,
                ndim=len(c.shape or ()),
                shape=c.shape,
                file=file,
                offset=begin + pos,
                nbytes=np.full(total, int(c.size or 0), dtype=np.int64),
            )
            pos += int(c.size or 0)
        return Layout("mds", root, files, stats, total, fields, info=info)
    decoded_fields = {
        c.name: DecodedField(
            c.name,
            "fixed" if c.fixed else ("array" if c.encoding.startswith("ndarray") else "object"),
            c.dtype,
            c.shape,
        )
        for c in columns
    }
    nvar = sum(1 for c in columns if c.size is None)

    def decode(data: memoryview, sample: int) -> dict[str, Any]:
        try:
            sizes = np.frombuffer(data[: 4 * nvar], np.uint32).tolist() if nvar else []
            i = 4 * nvar
            out = {}
            vs = iter(sizes)
            for c in columns or []:
                size = c.size if c.size is not None else next(vs)
                if i + size > len(data):
                    raise ValueError(f"column {c.name!r} runs past the sample's end")
                out[c.name] = c.decode(data[i : i + size])
                i += size
            if i != len(data):
                raise ValueError(f"{len(data) - i} bytes after the last column")
            return out
        except _MALFORMED as e:  # (UnicodeDecodeError is a ValueError)
            raise CorruptDatasetError(
                f"MDS sample does not decode: {e}", files[int(file[sample])], sample
            ) from None

    dec = Decoded(file, begin, nbytes, decoded_fields, decode)
    return Layout("mds", root, files, stats, total, {}, dec, info=info)
