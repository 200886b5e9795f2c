"""aionvme.integrations.lightning against real Lightning: a tiny LightningModule
fit on CPU with our CheckpointIO and with TorchCheckpointIO, checkpoints
compared bitwise, resumed, and a save killed or starved of space midway."""

from __future__ import annotations

import collections
import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning", reason="needs lightning (pip install -c constraints.txt lightning)")

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

import aionvme as nvme
from aionvme.integrations import lightning as L
from faults.faultkit import SHUTDOWN_NOLOGFLUSH, child_env, make_loopfs


class Tiny(pl.LightningModule):
    """Linear + BatchNorm (buffers, an OrderedDict _metadata version), AdamW and a step LR."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)
        )

    def training_step(self, batch: Any, _: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer(root: Path, plugin: Any, epochs: int) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        plugins=[plugin],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", filename="{epoch}", save_top_k=-1)],
    )


def _fit(root: Path, plugin: Any, epochs: int, ckpt_path: str | None = None) -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    _trainer(root, plugin, epochs).fit(model, ckpt_path=ckpt_path)
    return model


def _same(a: Any, b: Any, where: str = "") -> None:
    """a and b are the same checkpoint: same types, tensors bitwise (and of the
    same class, dtype, device, requires_grad), OrderedDict _metadata kept."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert a.requires_grad == b.requires_grad, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _without_paths(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint less the callbacks' state, which names the run's own directory."""
    return {k: v for k, v in ckpt.items() if k != "callbacks"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three epochs straight with TorchCheckpointIO, with ours and with our async
    variant; then ours resumed from its own epoch-0 checkpoint, TorchCheckpointIO
    from its own, and ours from TorchCheckpointIO's (a run switching plugins)."""
    root = tmp_path_factory.mktemp("lightning")
    out: dict[str, Any] = {"root": root}
    out["torch"] = _fit(root / "torch", TorchCheckpointIO(), epochs=3)
    out["ours"] = _fit(root / "ours", L.CheckpointIO(), epochs=3)
    out["async"] = _fit(root / "async", L.AsyncCheckpointIO(), epochs=3)
    for name, plugin, src in (
        ("ours_resumed", L.CheckpointIO(), "ours"),
        ("torch_resumed", TorchCheckpointIO(), "torch"),
        ("switched", L.CheckpointIO(), "torch"),
    ):
        (root / name).mkdir()
        out[name] = _fit(root / name, plugin, 3, str(root / src / "ckpt" / "epoch=0.ckpt"))
    return out


def _same_params(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_fit_saves_the_checkpoint_torch_checkpoint_io_saves(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for run in ("ours", "async"):
        for name in ("epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"):
            mine = root / run / "ckpt" / name
            with open(mine, "rb") as f:  # a safetensors file: 8-byte header length, then JSON
                assert f.read(9)[8:9] == b"{"
            got = L.CheckpointIO().load_checkpoint(mine)
            ref = torch.load(root / "torch" / "ckpt" / name, map_location="cpu", weights_only=True)
            _same(_without_paths(got), _without_paths(ref))
            assert list(got["callbacks"]) == list(ref["callbacks"])
            assert isinstance(got["state_dict"], collections.OrderedDict) and got["state_dict"]._metadata
        _same_params(runs[run], runs["torch"])


def test_resume_gives_the_state_torch_checkpoint_io_gives(runs: dict[str, Any]) -> None:
    # resumed from epoch 0 to epoch 3: the state of three epochs straight, bitwise
    _same_params(runs["ours_resumed"], runs["torch_resumed"])
    _same_params(runs["ours_resumed"], runs["torch"])
    root = runs["root"]
    got = L.CheckpointIO().load_checkpoint(root / "ours_resumed" / "ckpt" / "epoch=2.ckpt")
    ref = torch.load(root / "torch_resumed" / "ckpt" / "epoch=2.ckpt", weights_only=True)
    _same(_without_paths(got), _without_paths(ref))


def test_loads_what_torch_checkpoint_io_wrote_and_resumes_from_it(runs: dict[str, Any]) -> None:
    root = runs["root"]
    old = root / "torch" / "ckpt" / "epoch=0.ckpt"
    _same(L.CheckpointIO().load_checkpoint(old), TorchCheckpointIO().load_checkpoint(old))
    _same_params(runs["switched"], runs["torch"])
    with open(root / "switched" / "ckpt" / "epoch=2.ckpt", "rb") as f:
        assert f.read(9)[8:9] == b"{", "the resumed run saves in aionvme's format"


def test_async_variant_snapshots_before_it_returns(tmp_path: Path) -> None:
    plugin = L.AsyncCheckpointIO()
    # the snapshot is taken before save_checkpoint returns: changing the tensor after it changes nothing
    t = torch.arange(1 << 20, dtype=torch.float32)
    plugin.save_checkpoint({"t": t}, tmp_path / "snap.ckpt")
    t.zero_()
    assert torch.equal(
        plugin.load_checkpoint(tmp_path / "snap.ckpt")["t"], torch.arange(1 << 20, dtype=torch.float32)
    )
    plugin.teardown()


def test_async_variant_reports_a_failed_write(tmp_path: Path) -> None:
    plugin = L.AsyncCheckpointIO()
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        if os.access(tmp_path / "ro", os.W_OK):  # root: make the write fail another way
            os.chmod(tmp_path / "ro", 0o700)
            (tmp_path / "ro" / "x.ckpt").mkdir()  # a directory where the file goes: rename fails
            (tmp_path / "ro" / "x.ckpt" / "inside").write_bytes(b"")
        plugin.save_checkpoint({"w": torch.ones(4)}, tmp_path / "ro" / "x.ckpt")
        with pytest.raises(OSError):
            plugin.teardown()
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_structure_types_ties_and_views_survive(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float64)
    p = torch.nn.Parameter(torch.randn(3, 4))
    sd = collections.OrderedDict(a=base, view=base[2:8].view(2, 3), p=p)
    sd._metadata = {"": {"version": 3}}  # type: ignore[attr-defined]
    ckpt = {
        "sd": sd,
        "tied": [p, p],
        "bf16": torch.randn(5).to(torch.bfloat16),
        "ints": torch.arange(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "plain": {1: "one", "t": (1, 2.5, None, True)},
    }
    io = L.CheckpointIO()
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    got = io.load_checkpoint(tmp_path / "a.ckpt")
    torch.save(ckpt, tmp_path / "b.pt")
    _same(got, torch.load(tmp_path / "b.pt"))
    assert got["sd"]["view"].untyped_storage().data_ptr() == got["sd"]["a"].untyped_storage().data_ptr()
    assert got["tied"][0] is got["tied"][1] and type(got["sd"]["p"]) is torch.nn.Parameter


class Opaque:  # not a tensor nor a container: weights_only refuses it, as torch.load does
    def __init__(self, v: int) -> None:
        self.v = v


def test_weights_only_allows_what_torch_load_allows(tmp_path: Path) -> None:
    io = L.CheckpointIO()
    io.save_checkpoint({"obj": Opaque(3), "w": torch.ones(2)}, tmp_path / "o.ckpt")
    torch.save({"obj": Opaque(3), "w": torch.ones(2)}, tmp_path / "o.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "o.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        io.load_checkpoint(tmp_path / "o.ckpt")
    got = io.load_checkpoint(tmp_path / "o.ckpt", weights_only=False)
    assert got["obj"].v == 3 and torch.equal(got["w"], torch.ones(2))


def test_map_location_forms(tmp_path: Path) -> None:
    io = L.CheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "m.ckpt")
    seen = []

    def where(storage: Any, loc: str) -> Any:
        seen.append(loc)
        return storage

    for ml in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, where):
        got = io.load_checkpoint(tmp_path / "m.ckpt", map_location=ml)
        assert got["w"].device.type == "cpu" and torch.equal(got["w"], torch.ones(3))
    assert seen == ["cpu"]
    meta = io.load_checkpoint(tmp_path / "m.ckpt", map_location="meta")
    assert meta["w"].device.type == "meta"


def test_remove_checkpoint(tmp_path: Path) -> None:
    io = L.CheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "sub" / "r.ckpt")  # makes the directory
    io.remove_checkpoint(tmp_path / "sub" / "r.ckpt")
    assert not (tmp_path / "sub" / "r.ckpt").exists()
    io.remove_checkpoint(tmp_path / "sub" / "r.ckpt")  # absent: nothing to do
    (tmp_path / "dirckpt" / "inner").mkdir(parents=True)
    (tmp_path / "dirckpt" / "inner" / "x").write_bytes(b"x")
    io.remove_checkpoint(tmp_path / "dirckpt")
    assert not (tmp_path / "dirckpt").exists()


def test_bad_input_is_a_typed_error(tmp_path: Path) -> None:
    io = L.CheckpointIO()
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError):
        io.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(nvme.UnsupportedOperation):
        io.save_checkpoint({}, "s3://bucket/x.ckpt")
    # a truncated checkpoint: typed, before anything is unpickled
    io.save_checkpoint({"w": torch.ones(1 << 16)}, tmp_path / "t.ckpt")
    size = os.path.getsize(tmp_path / "t.ckpt")
    os.truncate(tmp_path / "t.ckpt", size - 100)
    with pytest.raises(nvme.SafetensorsError):
        io.load_checkpoint(tmp_path / "t.ckpt")
    # a pickle naming a storage the file lacks
    tree = L.pack({"w": torch.ones(4)})
    tree["storages"] = []
    nvme.sync_save(tree, tmp_path / "s.ckpt")
    with pytest.raises(L.LightningCheckpointError, match="missing"):
        io.load_checkpoint(tmp_path / "s.ckpt")
    # a storage of the wrong size, or not bytes at all
    for wrong in (torch.zeros(15, dtype=torch.uint8), np.zeros(16, dtype=np.uint8)):
        tree = L.pack({"w": torch.ones(4)})
        tree["storages"] = [wrong]
        nvme.sync_save(tree, tmp_path / "s.ckpt")
        with pytest.raises(L.LightningCheckpointError, match="storage 0"):
            io.load_checkpoint(tmp_path / "s.ckpt")


_KILLED_WRITER = """
import sys, types, abc, torch
# Only the plugin's save path runs here: stand-ins for Lightning's two base
# classes spare the child the seconds of importing Lightning.
for name in ("lightning", "lightning.fabric", "lightning.fabric.plugins", "lightning.fabric.plugins.io"):
    sys.modules[name] = types.ModuleType(name)
base = types.ModuleType("lightning.fabric.plugins.io.checkpoint_io")
base.CheckpointIO = abc.ABC
sys.modules[base.__name__] = base
torch_io = types.ModuleType("lightning.fabric.plugins.io.torch_io")
torch_io.TorchCheckpointIO = object
sys.modules[torch_io.__name__] = torch_io
sys.modules["lightning_fabric"] = None  # the other import path: absent
from aionvme.integrations.lightning import CheckpointIO
io, path = CheckpointIO(), sys.argv[1]
step = 0
while True:
    step += 1
    w = torch.full((3 << 20,), float(step))   # 12 MiB: a save takes a while
    io.save_checkpoint({"step": step, "w": w, "b": torch.full((7,), float(step))}, path)
    print(step, flush=True)
"""


def test_a_save_killed_midway_leaves_a_whole_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while the next save is being written (its temporary file is
    there): the checkpoint's path holds the last complete one."""
    path = tmp_path / "last.ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "1"  # one save committed
        temps: list[str] = []
        while not temps and child.poll() is None:
            temps = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert temps, "the child was killed while a save was being written"
    got = L.CheckpointIO().load_checkpoint(path)
    step = got["step"]
    assert step >= 1
    assert torch.equal(got["w"], torch.full((3 << 20,), float(step)))
    assert torch.equal(got["b"], torch.full((7,), float(step)))


@pytest.fixture
def ext4(tmp_path: Path) -> Any:
    """A fresh 32 MiB ext4 on a loop device (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root (loop devices, mounts)")
    fs = make_loopfs(tmp_path, "ext4", 32 << 20)
    try:
        yield fs
    finally:
        fs.cleanup()


def test_no_space_keeps_the_previous_checkpoint(ext4: Any) -> None:
    io = L.CheckpointIO()
    target = ext4.mnt / "c.ckpt"
    io.save_checkpoint({"w": torch.full((1 << 20,), 1.0)}, target)  # 4 MiB
    with pytest.raises(OSError) as e:
        io.save_checkpoint({"w": torch.full((16 << 20,), 2.0)}, target)  # 64 MiB on 32 MiB
    assert e.value.errno == errno.ENOSPC
    assert torch.equal(io.load_checkpoint(target)["w"], torch.full((1 << 20,), 1.0))
    assert sorted(os.listdir(ext4.mnt)) == ["c.ckpt", "lost+found"], "no temporary file left"


def test_a_saved_checkpoint_survives_a_crash(ext4: Any) -> None:
    io = L.CheckpointIO()
    target = ext4.mnt / "c.ckpt"
    io.save_checkpoint({"w": torch.full((1 << 20,), 1.0), "step": 1}, target)
    io.save_checkpoint({"w": torch.full((1 << 20,), 2.0), "step": 2}, target)
    ext4.shutdown(SHUTDOWN_NOLOGFLUSH)  # what was not on disk is lost, like pulling the plug
    ext4.remount()
    got = io.load_checkpoint(target)
    assert got["step"] == 2 and torch.equal(got["w"], torch.full((1 << 20,), 2.0))


def test_both_lightning_import_paths_accept_it() -> None:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as Fabric

    assert isinstance(L.CheckpointIO(), Fabric)
    lf = pytest.importorskip(
        "lightning_fabric.plugins.io.checkpoint_io", reason="pytorch_lightning not installed"
    )
    assert isinstance(L.CheckpointIO(), lf.CheckpointIO)
    assert isinstance(L.AsyncCheckpointIO(), lf.CheckpointIO)


def test_pytorch_lightning_trainer_takes_it_and_saves_through_it(tmp_path: Path) -> None:
    ptl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning not installed")
    plugin = L.CheckpointIO()
    trainer = ptl.Trainer(plugins=[plugin], logger=False, enable_progress_bar=False, accelerator="cpu")
    assert trainer.strategy.checkpoint_io is plugin
    trainer.strategy.save_checkpoint({"w": torch.ones(3), "step": 1}, tmp_path / "p.ckpt")
    with open(tmp_path / "p.ckpt", "rb") as f:
        assert f.read(9)[8:9] == b"{"
    assert trainer.strategy.load_checkpoint(tmp_path / "p.ckpt")["step"] == 1
