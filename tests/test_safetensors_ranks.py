"""load_safetensors_sharded(..., rank=, world_size=): each rank reads only the
tensors it owns, of a transformers-style sharded checkpoint written with the
real safetensors package."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import aionvme as nvme  # noqa: E402
from aionvme.formats import _safetensors  # noqa: E402


def _checkpoint(d: Path) -> dict[str, Any]:
    """Three shards and model.safetensors.index.json, as transformers'
    save_pretrained writes them; returns every tensor by name."""
    g = torch.Generator().manual_seed(0)
    sizes = [(300, 40), (7,), (1000, 33), (1,), (64, 64), (5, 5, 5), (2000, 10), (0, 3), (333,), (90, 90)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    tensors = {}
    for i, shp in enumerate(sizes * 2):
        dt = dtypes[i % len(dtypes)]
        t = torch.randn(*shp, generator=g)
        tensors[f"model.layers.{i}.w"] = (t * 100).to(dt) if dt == torch.int64 else t.to(dt)
    names = list(tensors)
    shards = [names[0:6], names[6:13], names[13:]]
    weight_map, total = {}, 0
    for k, part in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        st.save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return tensors


@pytest.mark.parametrize("world", [1, 2, 3, 5])
async def test_each_rank_reads_only_its_own_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int
):
    tensors = _checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    read: list[str] = []
    real_load = _safetensors._load

    async def spy(path: Any, *, keys: Any, **kw: Any) -> Any:
        read.extend(keys)
        return await real_load(path, keys=keys, **kw)

    monkeypatch.setattr(_safetensors, "_load", spy)
    per_rank = []
    for rank in range(world):
        read.clear()
        got = await nvme.load_safetensors_sharded(index, rank=rank, world_size=world)
        assert sorted(read) == sorted(got), "a rank read tensors it does not own"
        per_rank.append(got)
    seen: dict[str, int] = {}
    for rank, got in enumerate(per_rank):
        for name, t in got.items():
            assert name not in seen, f"{name} owned by ranks {seen[name]} and {rank}"
            seen[name] = rank
            assert torch.equal(t, tensors[name]), name
    assert set(seen) == set(tensors)
    total = sum(t.nbytes for t in tensors.values())
    biggest = max(t.nbytes for t in tensors.values())
    for got in per_rank:
        share = sum(t.nbytes for t in got.values())
        assert abs(share - total / world) <= biggest, (share, total / world)
    # the same split as a fresh reader of the safetensors files computes
    want = {}
    for n, f in json.loads(index.read_text())["weight_map"].items():
        with st.safe_open(str(tmp_path / f), "pt") as fh:
            assert torch.equal(fh.get_tensor(n), per_rank[seen[n]][n])
        want[n] = f
    assert set(want) == set(seen)


async def test_rank_and_keys_and_bad_arguments(tmp_path: Path) -> None:
    tensors = _checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    mine = await nvme.load_safetensors_sharded(index, rank=1, world_size=2)
    some = list(mine)[:2] + [n for n in tensors if n not in mine][:2]
    got = await nvme.load_safetensors_sharded(index, rank=1, world_size=2, keys=some)
    assert sorted(got) == sorted(some[:2])
    for bad in ({"rank": 2, "world_size": 2}, {"rank": -1, "world_size": 2}, {"rank": 0}, {"world_size": 0}):
        with pytest.raises(ValueError):
            await nvme.load_safetensors_sharded(index, **bad)
    with pytest.raises(TypeError):
        await nvme.load_safetensors_sharded(index, rank=0.0, world_size=2)  # type: ignore[arg-type]


def test_rank_owners_splits_bytes_evenly_and_contiguously() -> None:
    sizes = [(f"t{i}", n) for i, n in enumerate([100, 5, 5, 300, 0, 40, 40, 10, 500])]
    for world in (1, 2, 3, 4, 9, 20):
        owners = _safetensors.rank_owners(sizes, world)
        ranks = [owners[n] for n, _ in sizes]
        assert ranks == sorted(ranks)  # contiguous runs, in storage order
        assert set(owners) == {n for n, _ in sizes}
    assert _safetensors.rank_owners([("a", 0), ("b", 0), ("c", 0)], 2) == {"a": 0, "b": 1, "c": 0}
