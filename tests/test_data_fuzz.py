"""Dataset indexes are untrusted input: MDS ``index.json`` (written by the real
``streaming.MDSWriter``) and the aionvme ``index.aionvme`` (written by
``write_dataset``, mutated and re-sealed with a valid checksum so the
mutation gets past the first check), mutated as the safetensors header is
fuzzed in tests/test_safetensors.py. Every mutant opens and reads a whole
epoch, or raises a :class:`DatasetError` (a typed error of the data
package); nothing else, never a file outside the dataset directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import zlib

import numpy as np
import pytest

from _fuzz import fuzz_settings
from _mds_stub import import_streaming
from aionvme.data import CorruptDatasetError, Dataset, DatasetError, Loader, sync_write_dataset
from aionvme.data._format import INDEX_END, INDEX_MAGIC, INDEX_NAME

_INTERESTING = [0, 1, -1, 4095, 4096, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63)]


@pytest.fixture(scope="module")
def mds_template(tmp_path_factory):
    streaming = import_streaming()
    d = tmp_path_factory.mktemp("mdsfuzz") / "mds"
    rng = np.random.default_rng(0)
    cols = {"x": "ndarray:float32:2,2", "v": "ndarray", "b": "bytes", "s": "str", "i": "int", "j": "json"}
    with streaming.MDSWriter(out=str(d), columns=cols, size_limit=1 << 11) as w:
        for i in range(24):
            w.write(
                {
                    "x": rng.standard_normal((2, 2)).astype(np.float32),
                    "v": np.arange(i % 5 + 1, dtype=np.int16),
                    "b": bytes(i % 7),
                    "s": f"s{i}",
                    "i": i,
                    "j": {"k": [i]},
                }
            )
    fixed = tmp_path_factory.mktemp("mdsfuzz") / "fixed"
    with streaming.MDSWriter(
        out=str(fixed), columns={"x": "ndarray:int32:3", "y": "float32"}, size_limit=1 << 10
    ) as w:
        for i in range(20):
            w.write({"x": np.full(3, i, np.int32), "y": np.float32(i)})
    return [d, fixed]


@pytest.fixture(scope="module")
def aio_template(tmp_path_factory):
    d = tmp_path_factory.mktemp("aiofuzz") / "ds"
    rng = np.random.default_rng(1)
    sync_write_dataset(
        d,
        (
            {"x": rng.standard_normal(8).astype(np.float32), "id": np.int64(i), "v": np.arange(i % 4 + 1)}
            for i in range(12)
        ),
        shard_size="16K",
    )
    return d


_OPENED: list[str] | None = None  # paths opened from Python while a mutant is read


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # (cannot be removed: it records only while _OPENED is a list)


def _copy(template, tmp_path, k: int):
    dst = tmp_path / f"m{k}"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(template, dst)
    return dst


def _read_all(path) -> str:
    """The oracle: open and read an epoch (checksums verified where there are
    some), or raise a DatasetError; any other exception fails the test. Every
    file opened (from Python, and every file the loader reads) lies inside
    the directory."""
    global _OPENED
    root = os.path.realpath(path)
    _OPENED = []
    try:
        try:
            ds = Dataset(path)
        except DatasetError:
            return "rejected"
        return _read_epoch(ds, root)
    finally:
        opened, _OPENED = _OPENED, None
        outside = [
            p
            for p in opened
            if os.path.commonpath([os.path.realpath(p), root]) != root
            and not p.endswith((".py", ".pyc", ".so"))  # a module imported on first use
        ]
        assert not outside, f"opened outside the dataset directory: {outside}"


def _read_epoch(ds, root: str) -> str:
    try:
        assert all(os.path.commonpath([f, root]) == root for f in ds.layout.files), ds.layout.files
        verify = ds.format == "aionvme"
        with Loader(ds, batch_size=5, prefetch="4M", verify=verify) as loader:
            n = sum(len(next(iter(b.values()))) for b in loader) if ds.keys else 0
        assert n == len(ds) or not ds.keys
        return "loaded"
    except DatasetError:
        return "rejected"
    finally:
        ds.close()


def _mutate_text(draw, text: str) -> str:
    from hypothesis import strategies as hst

    kind = draw(hst.sampled_from(["byte", "number", "insert", "delete", "truncate", "name"]))
    if kind == "byte":
        pos = draw(hst.integers(0, len(text) - 1))
        ch = draw(hst.sampled_from(list('[]{}",:- 0123456789eE.nul/\x00')))
        return text[:pos] + ch + text[pos + 1 :]
    if kind == "truncate":
        return text[: draw(hst.integers(0, len(text) - 1))]
    if kind == "number":
        numbers = list(re.finditer(r"\d+", text))
        m = draw(hst.sampled_from(numbers))
        v = int(m.group())
        new = draw(
            hst.sampled_from([*_INTERESTING, v + 1, v - 1, v * 2, -v]).map(str)
            | hst.sampled_from(["1e3", "1.5", "null", "-0", "[]", '"7"', "{}", "true"])
        )
        return text[: m.start()] + new + text[m.end() :]
    if kind == "name":  # a file name swapped for one outside the directory (or nothing)
        names = list(re.finditer(r'"(shard[^"]*|index[^"]*)"', text))
        if not names:
            return text
        m = draw(hst.sampled_from(names))
        new = draw(
            hst.sampled_from(["/etc/passwd", "../outside", "..", ".", "", "a/../../x", "sub/x", "index.json"])
        )
        return text[: m.start()] + json.dumps(new) + text[m.end() :]
    if kind == "insert":
        pos = draw(hst.integers(0, len(text)))
        ins = draw(hst.sampled_from(["[" * 50_000, "{" * 5_000, '"x":1,', " ", "null,", '"a",', "-1,"]))
        return text[:pos] + ins + text[pos:]
    a = draw(hst.integers(0, len(text) - 1))
    return text[:a] + text[a + draw(hst.integers(1, 20)) :]


def _mds_mutant(draw, root) -> None:
    from hypothesis import strategies as hst

    index = root / "index.json"
    if draw(hst.integers(0, 4)) == 0:  # a shard's header (sample count, offsets)
        shard = root / json.loads(index.read_text())["shards"][0]["raw_data"]["basename"]
        data = bytearray(shard.read_bytes())
        pos = draw(hst.integers(0, min(len(data) - 1, 64)))
        data[pos] = draw(hst.integers(0, 255))
        shard.write_bytes(bytes(data))
        return
    index.write_text(_mutate_text(draw, index.read_text()))


def _reseal(js: bytes, region: bytes) -> bytes:
    """An index with header js and the original arrays region, length and crc made valid."""
    head = INDEX_MAGIC + struct.pack("<II", 1, len(js)) + js
    body = head + bytes((-len(head)) % 8) + region
    return body + struct.pack("<I", zlib.crc32(body)) + INDEX_END


def _aio_mutant(draw, root) -> None:
    from hypothesis import strategies as hst

    path = root / INDEX_NAME
    data = path.read_bytes()
    body = data[:-12]
    (js_len,) = struct.unpack("<I", body[12:16])
    js = body[16 : 16 + js_len].decode()
    region = body[(16 + js_len + 7) // 8 * 8 :]
    if draw(hst.integers(0, 3)) == 0:  # the arrays: shard numbers, offsets, lengths, shapes
        r = bytearray(region)
        for _ in range(draw(hst.integers(1, 4))):
            pos = draw(hst.integers(0, len(r) - 1))
            r[pos] = draw(hst.sampled_from([0, 1, 0x7F, 0x80, 0xFF]) | hst.integers(0, 255))
        region = bytes(r)
    else:
        js = _mutate_text(draw, js)
    path.write_bytes(_reseal(js.encode("utf-8", "surrogatepass"), region))


def _fuzz(examples: int, mutant):
    from hypothesis import given
    from hypothesis import strategies as hst

    @fuzz_settings(examples)
    @given(data=hst.data())
    def run(tmp_path, templates, data):
        template = templates[data.draw(hst.integers(0, len(templates) - 1))]
        root = _copy(template, tmp_path, 0)
        mutant(data.draw, root)
        _read_all(root)

    return run


def test_mds_index_mutants_load_or_raise_dataset_errors(tmp_path, mds_template):
    _fuzz(40, _mds_mutant)(tmp_path, mds_template)


def test_aionvme_index_mutants_load_or_raise_dataset_errors(tmp_path, aio_template):
    _fuzz(40, _aio_mutant)(tmp_path, [aio_template])


@pytest.mark.slow
def test_index_fuzz_soak(tmp_path, mds_template, aio_template):
    _fuzz(1500, _mds_mutant)(tmp_path, mds_template)
    _fuzz(1500, _aio_mutant)(tmp_path, [aio_template])


def test_the_fuzz_oracle_sees_both_outcomes(tmp_path, mds_template, aio_template):
    for t in [*mds_template, aio_template]:
        assert _read_all(_copy(t, tmp_path, 1)) == "loaded"
    broken = _copy(aio_template, tmp_path, 2)
    (broken / INDEX_NAME).write_bytes(b"nope")
    assert _read_all(broken) == "rejected"


# -- the cases the issue names, one by one ---------------------------------------------------


def _edit_index(root, edit) -> None:
    index = json.loads((root / "index.json").read_text())
    edit(index)
    (root / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.mds", "a/../../outside.mds", "link.mds"])
def test_mds_shard_names_are_confined_to_the_directory(tmp_path, mds_template, name):
    """A basename of /etc/passwd, a .. path, or a symbolic link that leaves the
    directory is refused, naming index.json; the outside file is never opened."""
    root = _copy(mds_template[0], tmp_path, 3)
    outside = tmp_path / "outside.mds"
    shutil.copy(root / "shard.00000.mds", outside)  # a valid shard: only the confinement refuses it
    os.symlink(outside, root / "link.mds")

    def edit(index):
        index["shards"][0]["raw_data"]["basename"] = name

    _edit_index(root, edit)
    with pytest.raises(CorruptDatasetError, match="outside the dataset directory") as e:
        Dataset(root)
    assert str(e.value.filename).endswith("index.json")


def test_symlinks_inside_the_directory_are_followed(tmp_path, mds_template):
    root = _copy(mds_template[0], tmp_path, 4)
    os.rename(root / "shard.00000.mds", root / "real.mds")
    os.symlink("real.mds", root / "shard.00000.mds")
    assert _read_all(root) == "loaded"


def test_aionvme_shard_name_outside_and_fifo(tmp_path, aio_template):
    """The aionvme index is sealed by a crc, which a forger recomputes: its
    shard names are confined too, and a FIFO is refused without blocking."""
    root = _copy(aio_template, tmp_path, 5)
    data = (root / INDEX_NAME).read_bytes()
    (js_len,) = struct.unpack("<I", data[12:16])
    js = data[16 : 16 + js_len].decode()
    region = data[:-12][(16 + js_len + 7) // 8 * 8 :]
    for name, match in [
        ("/etc/passwd", "outside"),
        ("../ds2/shard-00000.bin", "outside"),
        ("fifo", "regular"),
    ]:
        (root / INDEX_NAME).write_bytes(_reseal(js.replace("shard-00000.bin", name).encode(), region))
        if name == "fifo" and not (root / "fifo").exists():
            os.mkfifo(root / "fifo")
        with pytest.raises(CorruptDatasetError, match=match):
            Dataset(root)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda ix: ix["shards"][0].update(samples=-3), "samples|sample count"),
        (lambda ix: ix["shards"][0].update(samples=2**40), "cannot hold"),
        (lambda ix: ix["shards"][0].pop("column_names"), "column"),
        (lambda ix: ix["shards"][0].update(column_encodings=["ndarray:int32:-3", "float32"]), "shape"),
        (lambda ix: ix["shards"][0].update(column_sizes=[7, 4]), "size"),
        (lambda ix: ix.update(shards={"a": 1}), "list of shards"),
        (lambda ix: ix["shards"].__setitem__(0, "x"), "not an object"),
    ],
)
def test_mds_malformed_index_fields(tmp_path, mds_template, edit, match):
    """Negative or impossible counts and shapes, missing fields, wrong types:
    CorruptDatasetError (on main: RuntimeError, KeyError, AttributeError)."""
    root = _copy(mds_template[1], tmp_path, 6)
    _edit_index(root, edit)
    with pytest.raises(CorruptDatasetError, match=match):
        Dataset(root)


def test_mds_deeply_nested_index(tmp_path, mds_template):
    root = _copy(mds_template[1], tmp_path, 7)
    (root / "index.json").write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(CorruptDatasetError, match="RecursionError"):
        Dataset(root)
