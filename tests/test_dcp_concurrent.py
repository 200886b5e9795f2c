"""Two saves into one checkpoint directory at once, and crashes mid-save.

The probe of issue 36: two processes, 20 saves each, into one directory.
aionvme.dcp.Writer locks the directory (flock on the directory itself) from
its plan to its commit: the second save raises CheckpointBusyError at once
(inside torch's CheckpointException), before any rank wrote anything; the
directory always holds one complete checkpoint whose files all exist.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import aionvme.dcp  # noqa: E402
from aionvme.dcp import CheckpointBusyError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SAVES = 20


def _state(who: int, i: int) -> dict[str, Any]:
    v = float(who * 1000 + i)
    return {"a": torch.full((512, 1024), v), "b": torch.full((3000,), v).double(), "id": [who, i]}


def _busy(exc: BaseException) -> CheckpointBusyError | None:
    """Our error, raised as it is or wrapped by DCP's CheckpointException."""
    if isinstance(exc, CheckpointBusyError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointBusyError):
            return inner
    return None


def _saver(who: int, d: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    done, busy = [], 0
    for i in range(SAVES):
        try:
            dcp.save(_state(who, i), storage_writer=aionvme.dcp.Writer(d))
            done.append(i)
        except BaseException as e:
            err = _busy(e)
            if err is None:
                raise
            assert err.filename == d and err.errno is not None
            busy += 1
    Path(out).write_text(json.dumps({"done": done, "busy": busy}))


def _check_loads(d: Path, allowed: set[tuple[int, int]]) -> tuple[int, int]:
    md = pickle.loads((d / ".metadata").read_bytes())
    names = {info.relative_path for info in md.storage_data.values()}
    missing = [n for n in names if not (d / n).exists()]
    assert not missing, f".metadata names files that do not exist: {missing}"
    got = {"a": torch.zeros(512, 1024), "b": torch.zeros(3000).double(), "id": [None, None]}
    dcp.load(got, storage_reader=aionvme.dcp.Reader(d))
    who, i = got["id"]
    assert (who, i) in allowed, (who, i)
    want = _state(who, i)
    assert torch.equal(got["a"], want["a"]) and torch.equal(got["b"], want["b"])
    return who, i


def test_two_processes_twenty_saves_each_into_one_directory(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "save", str(who), str(d), str(tmp_path / f"r{who}.json")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in (1, 2)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for e in errs]
    res = {who: json.loads((tmp_path / f"r{who}.json").read_text()) for who in (1, 2)}
    assert all(len(r["done"]) + r["busy"] == SAVES for r in res.values())
    allowed = {(who, i) for who, r in res.items() for i in r["done"]}
    _check_loads(d, allowed)
    # Nothing of the other saves is left behind: one data file per committed save.
    assert len(list(d.glob("*.distcp"))) == 1, sorted(os.listdir(d))


def test_a_second_save_into_a_directory_being_saved_raises_at_once(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    dcp.save(_state(1, 0), storage_writer=aionvme.dcp.Writer(d))
    first = aionvme.dcp.Writer(d)
    first.set_up_storage_writer(True)
    first.prepare_local_plan(dcp.SavePlan([]))  # takes the directory as a save does
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.save(_state(2, 0), storage_writer=aionvme.dcp.Writer(d))
    err = _busy(info.value)
    assert err is not None and isinstance(err, BlockingIOError) and err.filename == str(d)
    assert {p.name for p in d.glob("*.distcp")} == {
        info.relative_path for info in pickle.loads((d / ".metadata").read_bytes()).storage_data.values()
    }
    _check_loads(d, {(1, 0)})
    first.finish(dcp.metadata.Metadata({}), [])  # the holder commits (an empty checkpoint) and lets go
    dcp.save(_state(3, 0), storage_writer=aionvme.dcp.Writer(d))
    _check_loads(d, {(3, 0)})


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while the data is being written: the committed checkpoint
    still loads; the lock died with the process, so the next save goes on
    and removes what the killed one left."""
    d = tmp_path / "ckpt"
    dcp.save(_state(1, 0), storage_writer=aionvme.dcp.Writer(d))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, __file__, "hang", "2", str(d), ""], env=env, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"writing"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert len(list(d.glob("*.distcp"))) == 2  # the old file and the killed save's
    _check_loads(d, {(1, 0)})
    dcp.save(_state(3, 0), storage_writer=aionvme.dcp.Writer(d))
    _check_loads(d, {(3, 0)})
    assert len(list(d.glob("*.distcp"))) == 1


def _hang(d: str) -> None:
    """Save, stopping for good after the data file is written."""
    from aionvme.dcp import _writer

    real = _writer._write_file

    async def write_then_stop(*args: Any) -> None:
        await real(*args)
        print("writing", flush=True)
        time.sleep(600)

    _writer._write_file = write_then_stop  # type: ignore[assignment]
    warnings.filterwarnings("ignore")
    dcp.save(_state(2, 0), storage_writer=aionvme.dcp.Writer(d))


if __name__ == "__main__":
    if sys.argv[1] == "save":
        _saver(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        _hang(sys.argv[3])
