"""aionvme.dcp crash consistency: a save of step N+1 interrupted by a
filesystem shutdown that drops everything not yet in the journal (like pulling
the plug), over step N's directory or into a new one. After unmount and mount,
step N's directory loads, with torch's reader and ours, as exactly step N, or
(once the new metadata was committed) exactly step N+1."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import aionvme  # noqa: E402
import aionvme.dcp  # noqa: E402
from aionvme.dcp import _writer  # noqa: E402

from .faultkit import SHUTDOWN_NOLOGFLUSH  # noqa: E402


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"layer{i}": torch.randn(256 + i, 1000 + 3 * i, generator=g) for i in range(6)},
        "step": step,
        "tag": f"step-{step}",
    }


def _save(sd: Any, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=aionvme.dcp.Writer(path))


def _which(path: Path) -> int:
    """The step the checkpoint in ``path`` holds, checked with both readers."""
    found = set()
    for reader in (aionvme.dcp.Reader(path), dcp.FileSystemReader(path)):
        got: dict[str, Any] = {
            "model": {k: torch.zeros_like(v) for k, v in _state(0)["model"].items()},
            "step": None,
            "tag": None,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(got, storage_reader=reader)
        step = got["step"]
        want = _state(step)
        assert got["tag"] == want["tag"]
        for k, v in want["model"].items():
            assert torch.equal(got["model"][k], v), f"torn checkpoint: {k} is not step {step}'s"
        found.add(step)
    assert len(found) == 1
    return found.pop()


@pytest.mark.parametrize("where", ["data", "before-commit", "after-commit", "new-directory"])
def test_shutdown_during_a_save_leaves_a_loadable_checkpoint(
    shutdown_fs: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    fs = shutdown_fs
    ck = fs.mnt / "ck"
    _save(_state(1), ck)
    target = fs.mnt / "ck2" if where == "new-directory" else ck

    if where in ("data", "new-directory"):

        class CrashingFile(aionvme.File):
            async def pwrite_many(self, items: Any) -> int:  # type: ignore[override]
                batch = list(items)
                half = len(batch) // 2
                n = await super().pwrite_many(batch[:half])
                await self.fsync()  # half of the new file is on the device for sure
                fs.shutdown(SHUTDOWN_NOLOGFLUSH)
                return n + await super().pwrite_many(batch[half:])

        monkeypatch.setattr(_writer, "File", CrashingFile)
    elif where == "before-commit":
        real_replace = os.replace

        def replace(src: Any, dst: Any, **dir_fds: Any) -> None:
            if str(dst).endswith(".metadata"):
                fs.shutdown(SHUTDOWN_NOLOGFLUSH)
            real_replace(src, dst, **dir_fds)

        monkeypatch.setattr(os, "replace", replace)
    else:

        def crash_before_cleanup(self: Any, referenced: Any) -> None:
            fs.shutdown(SHUTDOWN_NOLOGFLUSH)

        monkeypatch.setattr(_writer.Writer, "_remove_stale", crash_before_cleanup)

    if where == "after-commit":
        _save(_state(2), target)
    else:
        with pytest.raises(dcp.api.CheckpointException) as ei:
            _save(_state(2), target)
        err = next(iter(ei.value.failures.values()))[0]
        assert isinstance(err, OSError), repr(err)
    monkeypatch.undo()
    fs.remount()
    assert _which(ck) == (2 if where == "after-commit" else 1)
    if where == "new-directory":
        assert not (target / ".metadata").exists()
