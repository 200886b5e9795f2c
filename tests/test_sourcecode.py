"""The typed surface and the style are checked with the tests (uvloop's
test_sourcecode.py): strict mypy, ruff, cython-lint, and stubtest keeping
_engine.pyi true to the compiled extension."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")


def test_mypy_strict():
    _need("mypy")
    r = _run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def test_stubs_match_the_extension():
    _need("mypy")
    r = _run(
        sys.executable,
        "-m",
        "mypy.stubtest",
        "aionvme._engine",
        "--allowlist",
        "tests/stubtest_allowlist.txt",
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff():
    _need("ruff")
    dirs = [d for d in ("src", "tests", "bench") if (ROOT / d).is_dir()]  # bench/ may not exist yet
    r = _run(sys.executable, "-m", "ruff", "check", "--no-cache", *dirs)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *dirs)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cython_lint():
    _need("cython_lint")
    code = "import sys; from cython_lint.cython_lint import main; sys.exit(main())"
    r = _run(sys.executable, "-c", code, "--max-line-length", "120", "cython_ext")
    assert r.returncode == 0, r.stdout + r.stderr


def test_library_code_has_no_print_assert_or_exit():
    bad = []
    for path in (ROOT / "src" / "aionvme").rglob("*.py"):
        if "cli" in path.parts or path.name == "__main__.py":
            continue  # the command-line tool prints and exits by design
        for i, line in enumerate(path.read_text().splitlines(), 1):
            s = line.strip()
            if s.startswith(("print(", "assert ", "sys.exit(", "exit(")):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {s}")
    assert not bad, "\n".join(bad)
