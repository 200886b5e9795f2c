"""A directory of ``.npy`` or ``.safetensors`` files, one sample per file
(sorted by name). Each file's header is parsed when the dataset opens; the
loader then reads only the tensors' byte ranges."""

from __future__ import annotations

import ast
import json
import math
import os
import struct
from typing import Any

import numpy as np

from ._errors import CorruptDatasetError, UnsupportedDatasetError
from ._layout import Field, FileStat, Layout, open_member

# safetensors dtype names -> storage names (numpy names, or torch's for the rest)
_ST_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_ST_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _npy_header(path: str, fd: int) -> tuple[str, int, tuple[int, ...], int]:
    """(dtype name, itemsize, shape, data offset) of a .npy file."""
    head = os.pread(fd, 4096, 0)
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
        raise CorruptDatasetError("not a .npy file (bad magic or truncated)", path)
    major = head[6]
    if major == 1:
        (hlen,) = struct.unpack("<H", head[8:10])
        start = 10
    else:
        (hlen,) = struct.unpack("<I", head[8:12])
        start = 12
    if hlen > 1 << 20:
        raise CorruptDatasetError(f".npy header of {hlen} bytes", path)
    if start + hlen > len(head):
        head = os.pread(fd, start + hlen, 0)
    try:
        d = ast.literal_eval(head[start : start + hlen].decode("latin1"))
        dt = np.dtype(d["descr"])
        shape = tuple(int(x) for x in d["shape"])
        fortran = bool(d["fortran_order"])
    except (ValueError, SyntaxError, KeyError, TypeError, RecursionError, MemoryError) as e:
        raise CorruptDatasetError(f".npy header does not parse: {e!r}", path) from None
    if any(x < 0 for x in shape):
        raise CorruptDatasetError(f".npy shape {shape}", path)
    if dt.hasobject or dt.kind not in "biufc" or not dt.isnative:
        raise UnsupportedDatasetError(f".npy dtype {dt.str} (need a native-order numeric dtype)", path)
    if fortran and sum(1 for x in shape if x > 1) > 1:
        raise UnsupportedDatasetError(".npy in Fortran order", path)
    return dt.name, dt.itemsize, shape, start + hlen


def _safetensors_header(path: str, fd: int) -> tuple[dict[str, Any], int]:
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise CorruptDatasetError("safetensors header truncated", path)
    (n,) = struct.unpack("<Q", head)
    if n > 100 << 20:
        raise CorruptDatasetError(f"safetensors header of {n} bytes", path)
    raw = os.pread(fd, n, 8)
    if len(raw) < n:
        raise CorruptDatasetError("safetensors header truncated", path)
    try:
        h = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptDatasetError(f"safetensors header is not JSON: {type(e).__name__}: {e}", path) from None
    if not isinstance(h, dict):
        raise CorruptDatasetError("safetensors header is not a JSON object", path)
    h.pop("__metadata__", None)
    return h, 8 + n


def read_layout(root: str, kind: str, key: str = "data") -> Layout:
    """Open a directory of .npy (kind "npy") or .safetensors (kind "safetensors") files."""
    suffix = ".npy" if kind == "npy" else ".safetensors"
    real_root = os.path.realpath(root)
    names = sorted(e.name for e in os.scandir(root) if e.name.endswith(suffix) and e.is_file())
    files = [os.path.join(real_root, x) for x in names]
    n = len(files)
    stats: list[FileStat] = []
    per: dict[str, dict[str, list[Any]]] = {}
    dtypes: dict[str, tuple[str, int, int]] = {}
    for i, path in enumerate(files):
        path, fd, st = open_member(real_root, names[i], path, "file")  # no symbolic link out
        files[i] = path
        try:
            if kind == "npy":
                dt, isz, shape, off = _npy_header(path, fd)
                entries = {key: (dt, isz, shape, off, off + isz * math.prod(shape))}
            else:
                h, base = _safetensors_header(path, fd)
                entries = {}
                for name, t in h.items():
                    try:
                        dt = _ST_DTYPES[t["dtype"]]
                        shape = tuple(int(x) for x in t["shape"])
                        b, e = (int(x) for x in t["data_offsets"])
                        if min(shape, default=0) < 0 or not 0 <= b <= e:
                            raise ValueError
                    except (KeyError, TypeError, ValueError):
                        raise UnsupportedDatasetError(
                            f"safetensors tensor {name!r}: {t!r}", path, i
                        ) from None
                    isz = _ST_ITEMSIZE.get(dt) or np.dtype(dt).itemsize
                    if e - b != isz * math.prod(shape):
                        raise CorruptDatasetError(
                            f"safetensors tensor {name!r}: size does not match shape", path, i
                        )
                    entries[name] = (dt, isz, shape, base + b, base + e)
        finally:
            os.close(fd)
        if i == 0:
            for name, (dt, isz, shape, _, _) in entries.items():
                dtypes[name] = (dt, isz, len(shape))
                per[name] = {"offset": [], "nbytes": [], "shape": []}
        if set(entries) != set(dtypes):
            raise UnsupportedDatasetError(
                f"keys {sorted(entries)} differ from the first file's {sorted(dtypes)}", path, i
            )
        for name, (dt, isz, shape, b, e) in entries.items():
            if (dt, isz, len(shape)) != dtypes[name]:
                raise UnsupportedDatasetError(
                    f"{name!r} is {dt} with {len(shape)} dimensions, the first file's "
                    f"{dtypes[name][0]} with {dtypes[name][2]}",
                    path,
                    i,
                )
            if e > st.st_size:
                raise CorruptDatasetError(
                    f"{name!r} ends at {e}, the file at {st.st_size} (truncated)", path, i
                )
            per[name]["offset"].append(b)
            per[name]["nbytes"].append(e - b)
            per[name]["shape"].append(shape)
        stats.append(FileStat.of(st))
    fields: dict[str, Field] = {}
    for name, (dt, isz, ndim) in dtypes.items():
        shapes = per[name]["shape"]
        fixed = all(s == shapes[0] for s in shapes)
        fields[name] = Field(
            name=name,
            dtype=dt,
            itemsize=isz,
            ndim=ndim,
            shape=shapes[0] if fixed else None,
            file=np.arange(n, dtype=np.int64),
            offset=np.asarray(per[name]["offset"], dtype=np.int64),
            nbytes=np.asarray(per[name]["nbytes"], dtype=np.int64),
            shapes=None if fixed else np.asarray(shapes, dtype=np.int64).reshape(n, ndim),
        )
    return Layout(kind, root, files, stats, n, fields)
