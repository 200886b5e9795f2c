"""The write figures ``aionvme tune`` prints are measured as bench's seqwrite
measures its own: durable (the fsync inside the timed span), and the
fresh-file write that seqwrite and the demo do is measured next to the
sweep's in-place one."""

from __future__ import annotations

import os

from aionvme.bench import run_loop, tune
from aionvme.bench.tune import Knobs, TuneFile
from aionvme.file import File


def _trace(monkeypatch) -> list[str]:
    """Record the tune module's timers starting and stopping, and every File.fsync, in order."""
    events: list[str] = []

    class Traced(tune.Timer):
        def __enter__(self):
            events.append("start")
            return super().__enter__()

        def __exit__(self, *exc):
            events.append("stop")
            return super().__exit__(*exc)

    real = File.fsync

    def fsync(self, *args, **kwargs):
        events.append("fsync")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tune, "Timer", Traced)
    monkeypatch.setattr(File, "fsync", fsync)
    return events


def test_tune_times_each_write_pass_with_its_fsync(tmp_path, monkeypatch):
    events = _trace(monkeypatch)
    tf = TuneFile(str(tmp_path / "t.bin"), 8 << 20)
    try:
        read, write = run_loop(tf.measure(Knobs(1 << 20, 8, 0)), "asyncio")
        # the read pass, then the write pass whose clock stops after the fsync
        assert events == ["start", "stop", "start", "fsync", "stop"]
        assert read.nbytes == write.nbytes == tf.size and write.gb_s > 0
        del events[:]
        fresh = run_loop(tf.measure_fresh(Knobs(1 << 20, 8, 0)), "asyncio")
        assert events == ["start", "fsync", "stop"]
        assert fresh.nbytes == tf.size and fresh.label == "tune-write-fresh"
        assert sorted(os.listdir(tmp_path)) == ["t.bin"]  # the fresh file is gone
    finally:
        tf.close()
