"""safetensors files: both directions of compatibility with the real
``safetensors`` package, malformed files, keys= subsets, sharded indexes,
dtype/device handling, and atomic saves."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import aionvme as nvme
from _fuzz import fuzz_settings
from aionvme.formats import _header, _safetensors

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
st_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402

# Every dtype the reference package maps to torch, that this torch has.
TORCH_DTYPES = [
    (code, getattr(torch, d.torch))
    for code, d in _header.DTYPES.items()
    if d.torch is not None and hasattr(torch, d.torch) and code in st._TYPES
]


def random_tensor(shape, dtype, seed=0):
    """Random bits of any dtype (NaNs included for floats): compared bytewise."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape, dtype=np.int64)) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same(a, b):
    """Equal dtype, shape and bytes (NaN-safe)."""
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (a.dtype, b.dtype, a.shape, b.shape)
    if isinstance(a, np.ndarray):
        return a.tobytes() == np.asarray(b).tobytes()
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


async def writing_started(directory):
    while not any(p.name.endswith(".tmp") for p in directory.iterdir()):
        await asyncio.sleep(0)


def file_bytes(header: dict, data: bytes, pad: int = 8) -> bytes:
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % pad)
    return struct.pack("<Q", len(js)) + js + data


# -- files written by the real package load with ours ----------------------------------


@pytest.mark.parametrize(("code", "dtype"), TORCH_DTYPES, ids=[c for c, _ in TORCH_DTYPES])
async def test_every_dtype_from_the_reference(tmp_dir, code, dtype):
    tensors = {
        "matrix": random_tensor((7, 13), dtype, 1),
        "scalar": random_tensor((), dtype, 2),
        "empty": random_tensor((0, 5), dtype, 3),
        "vector": random_tensor((1001,), dtype, 4),
    }
    if code == "F4":  # float4_e2m1fn_x2 is two values per byte: the reference saves shape*2
        tensors = {k: v for k, v in tensors.items() if v.dim() > 0}
    path = tmp_dir / "ref.safetensors"
    st.save_file(tensors, path)
    got = await nvme.load_safetensors(path)
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert same(got[k], v), k
    header = await nvme.formats.read_header(path)
    assert {t.dtype.code for t in header.tensors.values()} == {code}


async def test_numpy_files_from_the_reference(tmp_dir):
    rng = np.random.default_rng(0)
    arrays = {
        "f64": rng.standard_normal((3, 4)),
        "f32": rng.standard_normal(17).astype(np.float32),
        "f16": rng.standard_normal((2, 2, 2)).astype(np.float16),
        "i64": rng.integers(-(2**62), 2**62, 5),
        "u16": rng.integers(0, 2**16, 9).astype(np.uint16),
        "u32": rng.integers(0, 2**32, 9).astype(np.uint32),
        "u64": rng.integers(0, 2**63, 9).astype(np.uint64),
        "i8": rng.integers(-128, 128, 3).astype(np.int8),
        "b": rng.integers(0, 2, 6).astype(bool),
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "zero_d": np.array(3.25, dtype=np.float32),
        "empty": np.zeros((4, 0), dtype=np.int32),
    }
    path = tmp_dir / "np.safetensors"
    st_numpy.save_file(arrays, path, metadata={"framework": "numpy"})
    got = await nvme.load_safetensors(path, like="numpy")
    for k, v in arrays.items():
        assert isinstance(got[k], np.ndarray) and same(got[k], v), k
    as_torch = await nvme.load_safetensors(path)
    assert torch.equal(as_torch["f32"], torch.from_numpy(arrays["f32"]))
    assert (await nvme.formats.read_header(path)).metadata == {"framework": "numpy"}


async def test_many_small_tensors_both_directions(tmp_dir):
    rng = np.random.default_rng(1)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.int64, torch.bool]
    tensors = {
        f"layer.{i}.p": random_tensor((int(rng.integers(0, 40)),), dtypes[i % len(dtypes)], i)
        for i in range(3000)
    }
    ref, ours = tmp_dir / "ref.safetensors", tmp_dir / "ours.safetensors"
    st.save_file(tensors, ref)
    got = await nvme.load_safetensors(ref)
    assert all(same(got[k], v) for k, v in tensors.items())
    await nvme.save_safetensors(tensors, ours)
    back = st.load_file(ours)
    assert set(back) == set(tensors) and all(same(back[k], v) for k, v in tensors.items())


async def test_one_large_tensor_both_directions(tmp_dir):
    big = random_tensor((48, 1024, 512), torch.bfloat16, 7)  # 48 MiB
    small = torch.arange(10, dtype=torch.int32)
    ref, ours = tmp_dir / "ref.safetensors", tmp_dir / "ours.safetensors"
    st.save_file({"big": big, "small": small}, ref)
    got = await nvme.load_safetensors(ref)
    assert same(got["big"], big) and same(got["small"], small)
    await nvme.save_safetensors({"small": small, "big": big}, ours)
    back = st.load_file(ours)
    assert same(back["big"], big) and same(back["small"], small)
    # a big file's data region starts on a 4096-byte boundary (spaces pad the header), big
    # tensors first: O_DIRECT writes need no read-modify-write of partial blocks
    header = await nvme.formats.read_header(ours)
    assert header.data_start % 4096 == 0 and header.tensors["big"].begin == 0
    assert os.path.getsize(ours) == header.data_start + big.nbytes + small.nbytes


async def test_loaded_tensors_are_views_of_one_aligned_allocation(tmp_dir):
    tensors = {f"w{i}": random_tensor((256, 64), torch.float32, i) for i in range(4)}
    path = tmp_dir / "m.safetensors"
    st.save_file(tensors, path)
    got = await nvme.load_safetensors(path)
    ptrs = sorted(t.data_ptr() for t in got.values())
    # contiguous in memory exactly as in the file: one allocation, no per-tensor copies
    assert [b - a for a, b in itertools.pairwise(ptrs)] == [256 * 64 * 4] * 3
    # ...but each tensor owns its storage object: nothing looks "shared" to torch/safetensors
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 4
    st.save_file(got, tmp_dir / "again.safetensors")  # refuses tensors that share storage
    got["w0"].add_(1)  # writable
    assert same(got["w1"], tensors["w1"])


async def test_unaligned_offsets_are_copied(tmp_dir):
    # A writer other than the reference may put an F32 tensor at an odd offset.
    f32 = np.array([1.5, -2.0, 3.25], dtype="<f4")
    header = {
        "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "a": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
    }
    path = tmp_dir / "odd.safetensors"
    path.write_bytes(file_bytes(header, b"\x07" + f32.tobytes()))
    ref = st.load_file(path)  # the reference reads it too
    got = await nvme.load_safetensors(path)
    assert torch.equal(got["a"], ref["a"]) and got["a"].data_ptr() % 4 == 0
    npgot = await nvme.load_safetensors(path, like="numpy")
    assert np.array_equal(npgot["a"], f32) and npgot["a"].flags.aligned


# -- files written by ours load with the reference -------------------------------------


@pytest.mark.parametrize(("code", "dtype"), TORCH_DTYPES, ids=[c for c, _ in TORCH_DTYPES])
async def test_every_dtype_to_the_reference(tmp_dir, code, dtype):
    tensors = {"m": random_tensor((5, 6), dtype, 1), "e": random_tensor((2, 0), dtype, 2)}
    if code != "F4":
        tensors["s"] = random_tensor((), dtype, 3)
    path = tmp_dir / "ours.safetensors"
    await nvme.save_safetensors(tensors, path, metadata={"dtype": code})
    back = st.load_file(path)
    for k, v in tensors.items():
        assert same(back[k], v), k
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"dtype": code}
        assert set(f.keys()) == set(tensors)
        assert same(f.get_tensor("m"), tensors["m"])


async def test_header_is_padded_like_the_reference(tmp_dir):
    tensors = {"x": torch.ones(3, dtype=torch.float16), "y": torch.zeros(2, 2, dtype=torch.float64)}
    path = tmp_dir / "ours.safetensors"
    await nvme.save_safetensors(tensors, path, metadata={"a": "b"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    text = raw[8 : 8 + n].decode()
    assert text == text.rstrip() + " " * (len(text) - len(text.rstrip()))
    hdr = json.loads(text)
    # data sorted by alignment (F64 first), the JSON keeps the caller's order
    assert hdr["y"]["data_offsets"] == [0, 32] and hdr["x"]["data_offsets"] == [32, 38]
    assert list(hdr) == ["__metadata__", "x", "y"]
    assert list(await nvme.load_safetensors(path)) == ["x", "y"]


async def test_layout_keeps_blocks_and_items_aligned(tmp_dir):
    tensors = {
        "odd_u8": random_tensor((4097,), torch.uint8, 1),
        "w": random_tensor((512, 1024), torch.bfloat16, 2),  # 1 MiB: a whole number of blocks
        "odd_f16": random_tensor((3, 5), torch.float16, 3),
        "odd_f64": random_tensor((7,), torch.float64, 4),
        "v": random_tensor((1024,), torch.float32, 5),  # 4096 bytes
        "odd_f32": random_tensor((9,), torch.float32, 6),
    }
    path = tmp_dir / "mixed.safetensors"
    await nvme.save_safetensors(tensors, path)
    header = await nvme.formats.read_header(path)
    assert header.data_start % 4096 == 0
    infos = header.tensors
    assert [infos["w"].begin, infos["v"].begin] == [0, 1 << 20]  # whole blocks first, in order
    assert all(t.begin % t.dtype.itemsize == 0 for t in infos.values())
    assert list(infos) == list(tensors)  # the JSON keeps the caller's order
    back = st.load_file(path)
    assert all(same(back[k], v) for k, v in tensors.items())


async def test_numpy_values_and_big_endian(tmp_dir):
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    arrays = {"be": be, "f": np.linspace(0, 1, 5, dtype=np.float32), "t": np.arange(12).reshape(3, 4).T}
    path = tmp_dir / "np.safetensors"
    await nvme.save_safetensors(arrays, path)
    back = st_numpy.load_file(path)
    assert back["be"].dtype == np.dtype("<i4") and np.array_equal(back["be"], be)
    assert np.array_equal(back["t"], arrays["t"]) and np.array_equal(back["f"], arrays["f"])


async def test_non_contiguous_and_shared_tensors(tmp_dir):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "view": base[1], "base": base, "conj": torch.tensor([1 + 2j]).conj()}
    path = tmp_dir / "s.safetensors"
    await nvme.save_safetensors(tensors, path)  # the reference refuses these; we write values
    back = st.load_file(path)
    for k, v in tensors.items():
        assert torch.equal(back[k], v.resolve_conj()), k


async def test_save_rejects_what_the_format_cannot_hold(tmp_dir):
    path = tmp_dir / "x.safetensors"
    with pytest.raises(nvme.SafetensorsError, match="complex128"):
        await nvme.save_safetensors({"c": torch.zeros(2, dtype=torch.complex128)}, path)
    with pytest.raises(nvme.SafetensorsError, match="reserved"):
        await nvme.save_safetensors({"__metadata__": torch.zeros(2)}, path)
    with pytest.raises(TypeError, match="str"):
        await nvme.save_safetensors({1: torch.zeros(2)}, path)
    with pytest.raises(TypeError, match="metadata"):
        await nvme.save_safetensors({"a": torch.zeros(2)}, path, metadata={"a": 1})
    with pytest.raises(TypeError, match="list"):
        await nvme.save_safetensors({"a": [1, 2]}, path)
    with pytest.raises(nvme.SafetensorsError, match="object"):
        await nvme.save_safetensors({"o": np.array([None])}, path)
    assert not path.exists() and list(tmp_dir.iterdir()) == []


# -- malformed files --------------------------------------------------------------------


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
B = {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}

MALFORMED = {
    "empty file": (b"", "too short"),
    "shorter than the length field": (b"\x05\x00\x00", "too short"),
    "header length past the end": (struct.pack("<Q", 1 << 40) + b"{}", "exceeds"),
    "header length 2**64-1": (b"\xff" * 8 + b"{}" * 8, "exceeds"),
    "truncated in the header": (file_bytes(GOOD, b"\0" * 8)[:30], "exceeds"),
    "truncated in the data": (file_bytes(GOOD, b"\0" * 8)[:-3], "run past"),
    "bad JSON": (struct.pack("<Q", 6) + b'{"a":]', "not valid JSON"),
    "not UTF-8": (struct.pack("<Q", 4) + b'{"\xff}', "UTF-8"),
    "JSON list": (file_bytes([1, 2], b""), "not an object"),  # type: ignore[arg-type]
    "unknown dtype": (file_bytes({"a": dict(GOOD["a"], dtype="F128")}, b"\0" * 8), "unknown dtype"),
    "shape/size mismatch": (file_bytes({"a": dict(GOOD["a"], shape=[3])}, b"\0" * 8), "hold 8"),
    "negative dim": (file_bytes({"a": dict(GOOD["a"], shape=[-2])}, b"\0" * 8), "non-negative"),
    "offsets reversed": (file_bytes({"a": dict(GOOD["a"], data_offsets=[8, 0])}, b"\0" * 8), "end before"),
    "out of range": (file_bytes({"a": dict(GOOD["a"], data_offsets=[4, 12])}, b"\0" * 8), "run past"),
    "overlap": (file_bytes({**GOOD, "b": dict(B, data_offsets=[4, 8])}, b"\0" * 8), "overlap"),
    "gap": (file_bytes({**GOOD, "b": dict(B, data_offsets=[12, 16])}, b"\0" * 16), "belong to no tensor"),
    "trailing bytes": (file_bytes(GOOD, b"\0" * 12), "trailing"),
    "missing field": (file_bytes({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "lacks data_offsets"),
    "metadata not strings": (file_bytes({**GOOD, "__metadata__": {"k": 1}}, b"\0" * 8), "__metadata__"),
    "duplicate name": (
        struct.pack("<Q", 112)
        + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        + b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
        + b" " * 6
        + b"\0" * 8,
        "twice",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_files_raise_before_allocating(tmp_dir, monkeypatch, case):
    blob, message = MALFORMED[case]
    path = tmp_dir / "bad.safetensors"
    path.write_bytes(blob)
    allocations = []
    real = _safetensors.AlignedBuffer
    monkeypatch.setattr(_safetensors, "AlignedBuffer", lambda n: allocations.append(n) or real(n))
    tracemalloc.start()
    try:
        with pytest.raises(nvme.SafetensorsError, match=message) as err:
            await nvme.load_safetensors(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert allocations == []  # no data buffer at all
    assert peak < 256 * 1024  # nothing sized by a corrupt length field
    assert isinstance(err.value, ValueError) and isinstance(err.value, nvme.AionvmeError)
    assert str(path) in str(err.value)
    if case not in ("duplicate name",):  # the reference keeps the last duplicate silently
        with pytest.raises(Exception):  # noqa: B017 - the reference's error type is its own
            st.load_file(path)


async def test_errors_name_the_tensor(tmp_dir):
    path = tmp_dir / "bad.safetensors"
    path.write_bytes(file_bytes({"layer.7.w": dict(GOOD["a"], dtype="Q4")}, b"\0" * 8))
    with pytest.raises(nvme.SafetensorsError) as err:
        await nvme.load_safetensors(path)
    assert err.value.tensor == "layer.7.w" and "'layer.7.w'" in str(err.value)
    assert err.value.filename == str(path)


def test_errors_pickle():
    import pickle

    e = pickle.loads(pickle.dumps(nvme.SafetensorsError("bad offsets", "/x.safetensors", "w")))
    assert (str(e), e.filename, e.tensor) == (
        "/x.safetensors: tensor 'w': bad offsets",
        "/x.safetensors",
        "w",
    )
    k = pickle.loads(pickle.dumps(nvme.TensorNotFoundError(["b", "a"], "/x.safetensors")))
    assert (k.missing, k.filename, str(k)) == (
        ["a", "b"],
        "/x.safetensors",
        "/x.safetensors: no tensor named 'a', 'b'",
    )


async def test_missing_file_is_file_not_found(tmp_dir):
    with pytest.raises(FileNotFoundError):
        await nvme.load_safetensors(tmp_dir / "nope.safetensors")


async def test_a_large_header_is_read_in_two_steps(tmp_dir):
    tensors = {f"a_rather_long_tensor_name_to_grow_the_header.{i}": torch.full((1,), i) for i in range(2000)}
    path = tmp_dir / "wide.safetensors"
    st.save_file(tensors, path)
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] > _safetensors._HEADER_PROBE
    got = await nvme.load_safetensors(path)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # and written by us: a header bigger than a staging buffer's small-write threshold
    names = {f"{'x' * 150}.{i}": v for i, (_, v) in enumerate(tensors.items())}
    ours = tmp_dir / "wide_ours.safetensors"
    await nvme.save_safetensors(names, ours)
    assert struct.unpack("<Q", ours.read_bytes()[:8])[0] > _safetensors._SMALL
    back = st.load_file(ours)
    assert all(torch.equal(back[k], v) for k, v in names.items())


# -- keys=, dtype=, device=, like= ------------------------------------------------------


def read_bytes_so_far() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


async def test_keys_reads_only_those_tensors(tmp_dir):
    tensors = {
        "big0": random_tensor((8 << 20,), torch.uint8, 1),
        "small": torch.arange(100, dtype=torch.int16),
        "big1": random_tensor((8 << 20,), torch.uint8, 2),
        "tail": torch.ones(3),
    }
    path = tmp_dir / "k.safetensors"
    st.save_file(tensors, path)
    before = read_bytes_so_far()
    got = await nvme.load_safetensors(path, keys=["tail", "small"])
    read = read_bytes_so_far() - before
    assert list(got) == ["tail", "small"]
    assert torch.equal(got["tail"], tensors["tail"]) and torch.equal(got["small"], tensors["small"])
    assert read < 1 << 20, f"read {read} bytes for two tiny tensors"
    one = await nvme.load_safetensors(path, keys="big1")
    assert list(one) == ["big1"] and torch.equal(one["big1"], tensors["big1"])
    with pytest.raises(nvme.TensorNotFoundError) as err:
        await nvme.load_safetensors(path, keys=["small", "nope"])
    assert isinstance(err.value, KeyError) and err.value.missing == ["nope"] and str(path) in str(err.value)


async def test_dtype_casts_floating_tensors_only(tmp_dir):
    tensors = {
        "w": torch.randn(4, 4, dtype=torch.bfloat16),
        "ids": torch.arange(5),
        "m": torch.ones(2).bool(),
    }
    path = tmp_dir / "d.safetensors"
    st.save_file(tensors, path)
    got = await nvme.load_safetensors(path, dtype=torch.float32)
    assert got["w"].dtype == torch.float32 and torch.equal(got["w"], tensors["w"].float())
    assert got["ids"].dtype == torch.int64 and got["m"].dtype == torch.bool
    by_name = await nvme.load_safetensors(path, dtype="float16")
    assert by_name["w"].dtype == torch.float16
    np_path = tmp_dir / "n.safetensors"
    st_numpy.save_file({"x": np.ones(3, np.float32), "i": np.arange(3)}, np_path)
    got_np = await nvme.load_safetensors(np_path, like="numpy", dtype=np.float64)
    assert got_np["x"].dtype == np.float64 and got_np["i"].dtype == np.int64


async def test_numpy_cannot_hold_bf16(tmp_dir):
    path = tmp_dir / "bf.safetensors"
    st.save_file({"w": torch.ones(2, dtype=torch.bfloat16)}, path)
    with pytest.raises(nvme.SafetensorsError, match="like='torch'"):
        await nvme.load_safetensors(path, like="numpy")


async def test_cuda_without_cuda_raises_before_any_io(tmp_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(nvme.DeviceError, match="CUDA"):
        await nvme.load_safetensors(tmp_dir / "does-not-exist.safetensors", device="cuda")
    with pytest.raises(nvme.DeviceError, match="host"):
        await nvme.load_safetensors(tmp_dir / "does-not-exist.safetensors", device="cuda", like="numpy")
    with pytest.raises(ValueError, match="like"):
        await nvme.load_safetensors(tmp_dir / "x", like="jax")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)
async def test_load_to_cuda(tmp_dir):
    tensors = {"w": random_tensor((300, 70), torch.bfloat16, 1), "i": torch.arange(9)}
    path = tmp_dir / "g.safetensors"
    st.save_file(tensors, path)
    got = await nvme.load_safetensors(path, device="cuda", dtype=torch.float32)
    assert got["w"].is_cuda and got["w"].dtype == torch.float32
    assert torch.equal(got["w"].cpu(), tensors["w"].float()) and torch.equal(got["i"].cpu(), tensors["i"])
    await nvme.save_safetensors({k: v.cuda() for k, v in tensors.items()}, tmp_dir / "from_gpu.safetensors")
    back = st.load_file(tmp_dir / "from_gpu.safetensors")
    assert same(back["w"], tensors["w"])


def test_numpy_use_needs_no_torch(tmp_dir):
    code = f"""
import sys, asyncio, numpy as np
sys.modules["torch"] = None  # any 'import torch' fails
import aionvme as nvme
async def main():
    a = {{"x": np.arange(10, dtype=np.float32), "y": np.ones((2, 3), dtype=np.int8)}}
    await nvme.save_safetensors(a, {str(tmp_dir / "n.safetensors")!r})
    b = await nvme.load_safetensors({str(tmp_dir / "n.safetensors")!r}, like="numpy", keys=["y"])
    assert list(b) == ["y"] and np.array_equal(b["y"], a["y"])
    await nvme.save({{"step": 3, "arr": a["x"]}}, {str(tmp_dir / "c.safetensors")!r})
    c = await nvme.load({str(tmp_dir / "c.safetensors")!r})
    assert c["step"] == 3 and np.array_equal(c["arr"], a["x"])
    print("ok")
asyncio.run(main())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# -- sharded checkpoints ----------------------------------------------------------------


def write_sharded(directory, tensors, nshards):
    names = list(tensors)
    weight_map = {}
    for s in range(nshards):
        shard = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::nshards]}
        st.save_file(part, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


async def test_sharded_index(tmp_dir):
    tensors = {f"layers.{i}.w": random_tensor((64, 33), torch.float16, i) for i in range(10)}
    index = write_sharded(tmp_dir, tensors, 3)
    got = await nvme.load_safetensors_sharded(index)
    assert list(got) == list(json.loads(index.read_text())["weight_map"])  # the index's order
    assert set(got) == set(tensors) and all(same(got[k], v) for k, v in tensors.items())
    sub = await nvme.load_safetensors_sharded(
        str(index), keys=["layers.4.w", "layers.0.w"], dtype=torch.float32
    )
    assert list(sub) == ["layers.4.w", "layers.0.w"] and sub["layers.0.w"].dtype == torch.float32
    with pytest.raises(nvme.TensorNotFoundError, match="nope"):
        await nvme.load_safetensors_sharded(index, keys=["nope"])


async def test_sharded_errors(tmp_dir):
    tensors = {f"w{i}": torch.full((3,), float(i)) for i in range(4)}
    index = write_sharded(tmp_dir, tensors, 2)
    # a shard the index names that lacks a tensor the index maps to it
    data = json.loads(index.read_text())
    data["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(nvme.TensorNotFoundError, match="ghost"):
        await nvme.load_safetensors_sharded(index)
    data["weight_map"].pop("ghost")
    data["weight_map"]["w1"] = "missing-shard.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(FileNotFoundError):
        await nvme.load_safetensors_sharded(index)
    index.write_text('{"weight_map": [1]}')
    with pytest.raises(nvme.SafetensorsError, match="weight_map"):
        await nvme.load_safetensors_sharded(index)
    index.write_text("{not json")
    with pytest.raises(nvme.SafetensorsError, match="JSON"):
        await nvme.load_safetensors_sharded(index)


# -- atomic, durable saves ---------------------------------------------------------------


async def test_save_replaces_atomically(tmp_dir):
    path = tmp_dir / "m.safetensors"
    path.write_bytes(b"old")
    await nvme.save_safetensors({"w": torch.ones(3)}, path)
    assert torch.equal(st.load_file(path)["w"], torch.ones(3))
    assert [p.name for p in tmp_dir.iterdir()] == ["m.safetensors"]


async def test_cancelled_save_keeps_the_old_file(tmp_dir):
    path = tmp_dir / "m.safetensors"
    st.save_file({"old": torch.zeros(2)}, path)
    old = path.read_bytes()
    big = {f"w{i}": random_tensor((16 << 20,), torch.uint8, i) for i in range(6)}  # 96 MiB
    task = asyncio.ensure_future(nvme.save_safetensors(big, path))
    await writing_started(tmp_dir)  # the temporary file exists: the write is under way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert path.read_bytes() == old
    assert [p.name for p in tmp_dir.iterdir()] == ["m.safetensors"]


async def test_failure_midway_keeps_the_old_file(tmp_dir, monkeypatch):
    path = tmp_dir / "m.safetensors"
    st.save_file({"old": torch.zeros(2)}, path)
    old = path.read_bytes()
    from aionvme.formats import _tensors

    real = _tensors.Source.host_bytes

    def host_bytes(self):
        if self.name == "late":
            raise RuntimeError("device lost while reading 'late'")
        return real(self)

    monkeypatch.setattr(_tensors.Source, "host_bytes", host_bytes)
    big = random_tensor((80 << 20,), torch.uint8, 1)  # more than one wave goes out first
    with pytest.raises(RuntimeError, match="device lost"):
        await nvme.save_safetensors({"big": big, "late": torch.ones(4, dtype=torch.uint8)}, path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_dir.iterdir()] == ["m.safetensors"]


# -- hostile headers, and a mutation fuzz against the reference reader ------------------------


def _with_header(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _one_tensor(shape) -> bytes:
    return _with_header(json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode())


HOSTILE = {
    # the issue's two kinds: RecursionError, and torch/numpy errors for huge empty shapes
    "100000 [": _with_header(b"[" * 100_000),
    "nested objects": _with_header(b'{"a":' * 50_000),
    "[2**32, 2**32, 0]": _one_tensor([2**32, 2**32, 0]),
    "[2**64, 0]": _one_tensor([2**64, 0]),
    "[2**63, 0]": _one_tensor([2**63, 0]),
    "[0, 2**32, 2**32]": _one_tensor(
        [0, 2**32, 2**32]
    ),  # product 0 all the way, but torch's strides overflow
}


@pytest.mark.parametrize("like", ["torch", "numpy"])
@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_headers_raise_safetensors_error(tmp_dir, case, like):
    path = tmp_dir / "hostile.safetensors"
    path.write_bytes(HOSTILE[case])
    with pytest.raises(nvme.SafetensorsError) as info:
        await nvme.load_safetensors(path, like=like)
    assert info.value.filename == str(path)
    with pytest.raises(nvme.SafetensorsError):
        await nvme.load(path)
    if case != "[0, 2**32, 2**32]":  # a valid header (the reference's rules): the tensor fails to materialize
        with pytest.raises(nvme.SafetensorsError):
            await nvme.formats.read_header(path)


def test_the_reference_rejects_the_issues_cases_too(tmp_dir):
    # parity: what safetensors.load_file refuses, we refuse (with our typed error)
    for case in ("100000 [", "[2**32, 2**32, 0]", "[2**64, 0]"):
        path = tmp_dir / "h.safetensors"
        path.write_bytes(HOSTILE[case])
        with pytest.raises(Exception, match=r"(?i)header|overflow|json"):
            st.load_file(path)


async def test_an_empty_tensor_numpy_cannot_hold_is_a_safetensors_error(tmp_dir):
    path = tmp_dir / "e.safetensors"
    path.write_bytes(_one_tensor([2**62, 0]))
    assert (await nvme.load_safetensors(path))["a"].shape == (
        2**62,
        0,
    )  # torch can: the reference loads it too
    with pytest.raises(nvme.SafetensorsError, match="numpy"):
        await nvme.load_safetensors(path, like="numpy")


_INTERESTING = [0, 1, 2, 3, 7, 8, 255, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
# where we are documented to be stricter than the reference (see _header's docstring)
_STRICTER = "appears twice|exceeds 2\\*\\*63|nested too deeply"


@pytest.fixture(scope="module")
def seed_files(tmp_path_factory):
    """Files written by the real safetensors package: torch (with bf16, a 0-d,
    an empty and a bool tensor, and metadata) and numpy."""
    d = tmp_path_factory.mktemp("seeds")
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(5, 7, generator=g),
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "u": torch.arange(11, dtype=torch.uint8),
    }
    st.save_file(sd, d / "t.safetensors", metadata={"format": "pt"})
    st_numpy.save_file(
        {"x": np.arange(6.0).reshape(2, 3), "i": np.arange(4, dtype=np.int16)}, d / "n.safetensors"
    )
    return [(d / name).read_bytes() for name in ("t.safetensors", "n.safetensors")]


def _mutate(draw, seed: bytes) -> bytes:
    """One mutation of a real file: a header byte, a number in the JSON, the
    length field, an insertion (deep nesting, a new entry), a deletion, or a
    truncation. The length field follows the header where the mutation is
    to the JSON, so the mutant gets past the first check."""
    from hypothesis import strategies as hst

    n = struct.unpack("<Q", seed[:8])[0]
    header, data = seed[8 : 8 + n].decode(), seed[8 + n :]
    kind = draw(hst.sampled_from(["byte", "number", "length", "insert", "delete", "truncate"]))
    if kind == "byte":
        pos = draw(hst.integers(0, 8 + n - 1))
        ch = draw(hst.sampled_from(list(b'[]{}",:- 0123456789eE.nul\x00\xff')) | hst.integers(0, 255))
        return seed[:pos] + bytes([ch]) + seed[pos + 1 :]
    if kind == "length":
        v = draw(
            hst.integers(-9, 9).map(lambda k: n + k)
            | hst.sampled_from([0, 1, len(seed)])
            | hst.integers(0, 2**64 - 1)
        )
        return struct.pack("<Q", v % 2**64) + seed[8:]
    if kind == "truncate":
        return seed[: draw(hst.integers(0, len(seed) - 1))]
    if kind == "number":
        numbers = list(re.finditer(r"\d+", header))
        m = draw(hst.sampled_from(numbers))
        v = int(m.group())
        new = draw(
            hst.sampled_from([*_INTERESTING, v + 1, v - 1, v * 2, -v]).map(str)
            | hst.sampled_from(["1e3", "1.5", "null", "-0", "[]", '"7"'])
        )
        h = header[: m.start()] + new + header[m.end() :]
    elif kind == "insert":
        pos = draw(hst.integers(0, len(header)))
        ins = draw(
            hst.sampled_from(
                [
                    "[" * 100_000,
                    "{" * 5_000,
                    '"x":1,',
                    " ",
                    '"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},',
                    '"b":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]},',
                ]
            )
        )
        h = header[:pos] + ins + header[pos:]
    else:
        a = draw(hst.integers(0, len(header) - 1))
        h = header[:a] + header[a + draw(hst.integers(1, 20)) :]
    return _with_header(h.encode(), data)


def _check_mutant(path, content: bytes) -> str:
    """Ours loads what the reference loads, identically, or raises
    SafetensorsError; nothing else may come out (an untyped error fails the test)."""
    path.write_bytes(content)
    try:
        ref = st.load_file(path)
    except Exception:
        ref = None
    try:
        ours = nvme.sync_load_safetensors(path)
    except nvme.SafetensorsError as e:
        if ref is not None:
            assert re.search(_STRICTER, str(e)), f"the reference loads it, we raise: {e}"
        return "rejected"
    assert ref is not None, f"we load a file the reference rejects: {content[:300]!r}"
    assert list(ours) == list(ref) or sorted(ours) == sorted(ref)
    for k, t in ours.items():
        r = ref[k]
        assert t.dtype == r.dtype and t.shape == r.shape, k
        if t.numel():
            assert torch.equal(t.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)), k
    return "loaded"


def _fuzz(examples: int):
    from hypothesis import given
    from hypothesis import strategies as hst

    @fuzz_settings(examples)
    @given(data=hst.data())
    def run(path, seeds, data):
        seed = seeds[data.draw(hst.integers(0, len(seeds) - 1))]
        _check_mutant(path, _mutate(data.draw, seed))

    return run


def test_mutated_headers_load_correctly_or_raise_safetensors_error(tmp_path, seed_files):
    _fuzz(30)(tmp_path / "m.safetensors", seed_files)


@pytest.mark.slow
def test_mutation_fuzz_soak(tmp_path, seed_files):
    _fuzz(3000)(tmp_path / "m.safetensors", seed_files)


def test_the_fuzz_oracle_sees_both_outcomes(tmp_path, seed_files):
    # the check itself: an intact file loads, a broken one is rejected
    assert _check_mutant(tmp_path / "a.safetensors", seed_files[0]) == "loaded"
    assert _check_mutant(tmp_path / "b.safetensors", seed_files[0][:100]) == "rejected"
    # found by the fuzz: json reads -0 as the int 0, the reference refuses it
    assert (
        _check_mutant(
            tmp_path / "c.safetensors",
            _with_header(b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'),
        )
        == "rejected"
    )


# -- without torch; blocking twins -----------------------------------------------------------


def test_without_torch_the_error_is_typed_and_says_use_numpy(tmp_path):
    path = tmp_path / "m.safetensors"
    st_numpy.save_file({"x": np.arange(6.0)}, path)
    code = f"""
import asyncio, sys
sys.modules["torch"] = None  # as if torch were not installed
import aionvme as nvme
path = {str(path)!r}
try:
    asyncio.run(nvme.load_safetensors(path))
except nvme.TorchNotInstalledError as e:
    assert isinstance(e, ModuleNotFoundError) and isinstance(e, nvme.AionvmeError), type(e).__mro__
    assert "like='numpy'" in str(e) and e.name == "torch", str(e)
    print("typed:", e)
else:
    raise SystemExit("no error")
try:
    nvme.sync_load(path)  # a plain safetensors file loads as torch tensors
except nvme.TorchNotInstalledError as e:
    assert "like='numpy'" in str(e), str(e)
else:
    raise SystemExit("no error from load")
got = nvme.sync_load_safetensors(path, like="numpy")
assert got["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
nvme.sync_save({{"a": got["x"], "n": 1}}, path + ".ckpt")  # numpy-only checkpoints need no torch
back = nvme.sync_load(path + ".ckpt")
assert back["n"] == 1 and back["a"].tolist() == got["x"].tolist()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "typed: torch is not installed" in out.stdout and out.stdout.rstrip().endswith("ok")


def test_blocking_twins_without_an_event_loop(tmp_path):
    path = tmp_path / "b.safetensors"
    tensors = {"w": torch.randn(300, 7), "i": torch.arange(5)}
    assert nvme.sync_save_safetensors(tensors, path, {"k": "v"}) is None
    got = nvme.sync_load_safetensors(path, keys=["w"], dtype=torch.float64)
    assert list(got) == ["w"] and torch.equal(got["w"], tensors["w"].double())
    assert st.load_file(path).keys() == {"w", "i"}
    with pytest.raises(FileNotFoundError):
        nvme.sync_load_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(nvme.TensorNotFoundError):
        nvme.sync_load_safetensors(path, keys=["nope"])


async def test_blocking_twins_from_a_thread_while_a_loop_runs(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {"w": torch.randn(1000)}
    await asyncio.to_thread(nvme.sync_save_safetensors, tensors, path)
    got = await asyncio.to_thread(nvme.sync_load_safetensors, path)
    assert torch.equal(got["w"], tensors["w"])
    # on the loop's own thread they refuse (they would stall it), and leave nothing behind
    with pytest.raises(RuntimeError, match=r"await aionvme\.load_safetensors"):
        nvme.sync_load_safetensors(path)
    with pytest.raises(RuntimeError, match=r"await aionvme\.save_safetensors"):
        nvme.sync_save_safetensors(tensors, tmp_path / "other.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
