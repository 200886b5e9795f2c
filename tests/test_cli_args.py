"""Bad command-line arguments: one line on stderr, exit status 2, before any
work (no scratch file made, no sweep run), through ``python3 -m aionvme``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aionvme

SRC = str(Path(aionvme.__file__).resolve().parents[1])


def _aionvme(*argv: str, extra_path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, SRC) if p)
    return subprocess.run(
        [sys.executable, "-m", "aionvme", *argv], capture_output=True, text=True, timeout=120, env=env
    )


def _one_line_error(r: subprocess.CompletedProcess[str], command: str, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"aionvme {command}: error: "), lines
    assert "Traceback" not in r.stderr and r.stdout == ""
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--size", "12Q"], ["--size", "'12Q' is not a size"]),
        (["--size", "-1"], ["--size", "'-1'"]),
        (["--size", "0"], ["--size", "at least 1"]),
        (["--request-size", "0"], ["--request-size"]),
        (["--bs", "x"], ["--bs"]),
        (["--iodepth", "0"], ["--iodepth", "at least 1"]),
        (["--ops", "many"], ["--ops", "not an integer"]),
        (["--repeat", "0"], ["--repeat"]),
        (["--queue-depth", "-3"], ["--queue-depth"]),
        (["--block-size", "5"], ["block_size", "multiple of 4096"]),
        (["-w", "nope"], ["unknown workload 'nope'"]),
        (["-w", "seqread", "-o", "pause=2"], ["-o pause", "seqread"]),
        (["-w", "seqread", "-o", "novalue"], ["KEY=VALUE"]),
        (["-w", "seqread", "--sweep", "nosuch=1,2"], ["unknown setting 'nosuch'"]),
        (["-w", "seqread", "--sweep", "block_size=3"], ["block_size"]),
        (["-w", "seqread", "--plot", "out.png"], ["--plot needs --sweep"]),
    ],
)
def test_bench_argument_errors(tmp_path, argv, needles):
    r = _aionvme("bench", "--dir", str(tmp_path), "--loop", "asyncio", *argv)
    _one_line_error(r, "bench", *needles)
    assert os.listdir(tmp_path) == []  # no work started


def test_bench_missing_directories(tmp_path):
    _one_line_error(_aionvme("bench", "--dir", str(tmp_path / "none")), "bench", "--dir", "does not exist")
    f = tmp_path / "a-file"
    f.write_bytes(b"")
    _one_line_error(_aionvme("bench", "--dir", str(f)), "bench", "is not a directory")
    r = _aionvme("bench", "--file", str(tmp_path / "none" / "x.bin"))
    _one_line_error(r, "bench", "--file", "does not exist")


def test_an_option_a_chosen_workload_reads_is_accepted(tmp_path):
    # -o pause is read by the formats workloads: with one of them chosen, it is no error
    # (the run is cut short by a bad --sweep value, checked after the options)
    r = _aionvme(
        "bench",
        "--dir",
        str(tmp_path),
        "-w",
        "safetensors,seqread",
        "-o",
        "pause=0",
        "--sweep",
        "queue_depth=x",
    )
    _one_line_error(r, "bench", "queue_depth")
    r = _aionvme("bench", "--dir", str(tmp_path), "-w", "safetensors", "-o", "pause=0", "-o", "bogus=1")
    _one_line_error(r, "bench", "-o bogus", "pause")


def test_plot_without_matplotlib_is_refused_before_the_sweep(tmp_path):
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    work = tmp_path / "work"
    work.mkdir()
    argv = ["--dir", str(work), "--loop", "asyncio", "-w", "seqread", "--size", "1M"]
    r = _aionvme("bench", *argv, "--sweep", "block_size=1M,2M", "--plot", "p.png", extra_path=str(fake))
    _one_line_error(r, "bench", "--plot needs matplotlib")
    assert os.listdir(work) == []
    r = _aionvme("tune", "--dir", str(work), "--quick", "--plot", "p.png", extra_path=str(fake))
    _one_line_error(r, "tune", "--plot needs matplotlib")
    assert os.listdir(work) == []


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--dir", "/nonexistent"], ["--dir /nonexistent", "does not exist"]),
        (["--size", "0"], ["--size"]),
        (["--size", "12Q"], ["--size", "'12Q'"]),
        (["--tensors", "0"], ["--tensors"]),
    ],
)
def test_demo_argument_errors(argv, needles):
    _one_line_error(_aionvme("demo", *argv), "demo", *needles)


def test_tune_size_errors(tmp_path):
    _one_line_error(_aionvme("tune", "--dir", str(tmp_path), "--size", "1X"), "tune", "--size")
    assert os.listdir(tmp_path) == []


def test_a_good_demo_still_runs(tmp_path):
    r = _aionvme("demo", "--dir", str(tmp_path), "--size", "8M", "--tensors", "4", "--loop", "asyncio")
    assert r.returncode == 0, r.stderr
    assert "verify   ok" in r.stdout


# -- the demo: bounded memory, and a check that can fail -------------------------------------


def _demo_args(tmp_path: Path, size: str = "24M", tensors: int = 3) -> argparse.Namespace:
    from aionvme.cli import demo

    p = argparse.ArgumentParser()
    demo.add_parser(p)
    args = p.parse_args(
        ["--dir", str(tmp_path), "--size", size, "--tensors", str(tensors), "--loop", "asyncio"]
    )
    args.parser = p
    return args


@pytest.mark.parametrize("fault", ["flip a byte", "read nothing", "read the wrong place"])
def test_the_demo_check_catches_a_bad_read(tmp_path, monkeypatch, capsys, fault):
    from aionvme.cli import demo

    monkeypatch.setattr(demo, "PIECE", 4 << 20)  # several pieces per tensor, buffers reused
    real = aionvme.File.pread
    victim = (8 << 20) + (4 << 20)  # the second piece of the second tensor

    async def faulty(self, buf, offset=0):
        if offset != victim:
            return await real(self, buf, offset)
        if fault == "read nothing":
            return len(buf)
        n = await real(self, buf, offset + (4096 if fault == "read the wrong place" else 0))
        if fault == "flip a byte":
            buf[12345] ^= 1
        return n

    monkeypatch.setattr(aionvme.File, "pread", faulty)
    assert demo.run(_demo_args(tmp_path, "24M", 3)) == 1
    assert "verify   FAILED: tensors [1] differ" in capsys.readouterr().out


def _peak_rss_mib() -> str:
    # VmHWM: this process's own peak. ru_maxrss is not: a child started by
    # vfork+exec inherits the high-water mark of its parent's memory
    # (kernel/exit setmax_mm_hiwater_rss at exec), here pytest's.
    return "[int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]"


def test_the_demo_memory_is_bounded(tmp_path):
    # 512 MiB moved: all at once it took 2 x 512 MiB of buffers; the pool keeps
    # DEPTH x PIECE = 256 MiB at most
    code = (
        "import sys; from aionvme.cli import main; "
        f"rc = main(['demo', '--dir', {str(tmp_path)!r}, '--size', '512M', '--loop', 'asyncio']); "
        f"print('peak_mib', {_peak_rss_mib()}); sys.exit(rc)"
    )
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "verify   ok" in r.stdout
    peak_mib = int(r.stdout.split("peak_mib")[1])
    assert peak_mib < 512, r.stdout  # all at once: 1 GiB of buffers for 512 MiB moved
