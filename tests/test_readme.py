"""Every code block of README.md runs as written.

```python blocks run in a fresh interpreter, in an empty working directory
(examples use relative paths such as "w.bin"), with the environment of the
tests (PYTHONPATH included). In ```bash blocks, lines that start with
``python3 -m aionvme`` run the same way; ``pip install`` lines are listed as
skipped (CI runs them when it sets up); other shell lines are skipped with a
reason. A block right after ``<!-- readme-test: skip REASON -->`` is skipped
with that reason (for CUDA-only examples); one right after
``<!-- readme-test: needs MODULE [MODULE...] -->`` is skipped, with the reason,
where one of those modules is not installed (the README's test command does not
install them: DeepSpeed, say), and runs where they are. A python block that never
names torch and has no such marker claims to need only numpy: it runs a second time with torch hidden
(a path finder that never finds it: ``import torch`` fails and
``importlib.util.find_spec("torch")`` is None, as where torch is not installed).
The extractor and runner are tested on a small fixture README first.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT_S = 300

_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b\s*(?P<reason>.*?)\s*-->")
_NEEDS = re.compile(r"<!--\s*readme-test:\s*needs\s+(?P<modules>[\w. ]+?)\s*-->")
_PYTHON = {"python", "py", "python3", "pycon"}
_SHELL = {"bash", "sh", "shell", "console"}
PIP_REASON = "installs packages; CI runs these"


@dataclass(frozen=True)
class Case:
    """One runnable piece of a README: a python block or a shell command."""

    where: str  # "README.md:13"
    kind: str  # "python" or "shell"
    code: str
    skip: str | None = None
    needs: tuple[str, ...] = ()  # modules the block needs, beyond the test extra
    without_torch: bool = False  # run with torch hidden

    @property
    def numpy_only(self) -> bool:
        """A python block that never names torch, nor needs a module beyond the test extra
        (which may need torch itself), claims to need only numpy."""
        return self.kind == "python" and not self.needs and "torch" not in self.code


def _commands(lines: list[str]) -> list[tuple[int, str]]:
    """(index of first line, command) for each shell command; backslash continuations joined."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for i, line in enumerate(lines):
        if not pending:
            start = i
        stripped = line.strip()
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        cmd = " ".join(p for p in pending if p)
        pending = []
        if cmd and not cmd.startswith("#"):
            out.append((start, cmd))
    return out


def cases_from(markdown: str, name: str) -> list[Case]:
    """The runnable pieces of a markdown text, in order."""
    lines = markdown.splitlines()
    cases: list[Case] = []
    previous = ""  # the last non-blank line before a fence
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            if lines[i].strip():
                previous = lines[i]
            i += 1
            continue
        fence = m["fence"]
        words = m["info"].strip().split()
        lang = words[0].lower() if words else ""
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
        ):
            j += 1
        body = lines[i + 1 : j]
        marker = _SKIP.search(previous)
        skip = (marker["reason"] or "marked skip in the README") if marker else None
        needs_marker = _NEEDS.search(previous)
        needs = tuple(needs_marker["modules"].split()) if needs_marker else ()
        if lang in _PYTHON:
            code = textwrap.dedent("\n".join(body)) + "\n"
            cases.append(Case(f"{name}:{i + 1}", "python", code, skip, needs))
        elif lang in _SHELL:
            for k, cmd in _commands(body):
                why = skip
                if why is None and re.search(r"\bpip3?\b.*\binstall\b", cmd):
                    why = PIP_REASON
                elif why is None and not cmd.startswith("python3 -m aionvme"):
                    why = "a shell line that is not a `python3 -m aionvme` command"
                cases.append(Case(f"{name}:{i + 2 + k}", "shell", cmd, why, needs))
        previous = ""
        i = j + 1
    return cases


def execute(case: Case, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run a case in an empty working directory under tmp_path."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = dict(os.environ)
    if case.kind == "python":
        script = tmp_path / "readme_block.py"  # outside the working directory
        script.write_text(case.code)
        argv = [sys.executable, str(script)]
        if case.without_torch:
            argv = [sys.executable, "-c", _WITHOUT_TORCH, str(script)]
    else:
        # the same interpreter as the tests, for "python3"
        cmd = re.sub(r"^python3\b", shlex.quote(sys.executable), case.code)
        argv = ["bash", "-c", cmd]
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


# Runs the script named by argv[1] as __main__ where torch cannot be imported, as where it is not
# installed: the path finder is wrapped so that it never finds torch, so `import torch` raises
# ModuleNotFoundError, importlib.util.find_spec("torch") is None and "torch" is not in sys.modules.
_WITHOUT_TORCH = """
import importlib.machinery, runpy, sys

class _PathFinderWithoutTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [
    _PathFinderWithoutTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path
]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def check(case: Case, tmp_path: Path) -> None:
    if case.skip is not None:
        pytest.skip(case.skip)
    absent = missing(case.needs)
    if absent:
        pytest.skip(f"needs {', '.join(absent)}, which the README's test command does not install")
    r = execute(case, tmp_path)
    if r.returncode != 0:
        pytest.fail(
            f"{case.where} ({case.kind}) exited with {r.returncode}:\n{case.code}\n"
            f"--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-5000:]}",
            pytrace=False,
        )


# -- the extractor and runner, on a fixture README ---------------------------------------------

FIXTURE = """# demo

Some text.

```python
import aionvme as nvme, numpy as np

a = np.arange(1000, dtype=np.uint16)
nvme.sync_save_safetensors({"a": a}, "w.safetensors")   # a relative path: the working directory
assert nvme.sync_load_safetensors("w.safetensors", like="numpy")["a"].tolist() == a.tolist()
```

<!-- readme-test: skip needs a CUDA device -->
```python
raise SystemExit("a skipped block must not run")
```

```bash
python3 -m pip install aionvme          # the package
python3 -m aionvme info \\
    --json
ls -l
```

```text
not code
```

````python
print("four backticks: ```")
````
"""


def test_the_extractor_finds_every_block_of_a_fixture_readme():
    cases = cases_from(FIXTURE, "FIXTURE.md")
    assert [(c.where, c.kind, c.skip) for c in cases] == [
        ("FIXTURE.md:5", "python", None),
        ("FIXTURE.md:14", "python", "needs a CUDA device"),
        ("FIXTURE.md:19", "shell", PIP_REASON),
        ("FIXTURE.md:20", "shell", None),
        ("FIXTURE.md:22", "shell", "a shell line that is not a `python3 -m aionvme` command"),
        ("FIXTURE.md:29", "python", None),
    ]
    assert cases[3].code == "python3 -m aionvme info --json"
    assert cases[5].code == 'print("four backticks: ```")\n'


def test_the_runner_runs_fixture_blocks_in_a_temp_directory(tmp_path):
    cases = {c.where: c for c in cases_from(FIXTURE, "FIXTURE.md")}
    check(cases["FIXTURE.md:5"], tmp_path)
    assert (tmp_path / "work" / "w.safetensors").exists()  # the relative path landed in the working dir
    check(cases["FIXTURE.md:20"], tmp_path)  # python3 -m aionvme info --json
    with pytest.raises(pytest.skip.Exception, match="needs a CUDA device"):
        check(cases["FIXTURE.md:14"], tmp_path)
    with pytest.raises(pytest.skip.Exception, match="installs packages; CI runs these"):
        check(cases["FIXTURE.md:19"], tmp_path)


def test_the_runner_reports_a_failing_block(tmp_path):
    bad = cases_from("```python\nprint('about to fail')\nundefined_name\n```\n", "BAD.md")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)BAD\.md:1.*NameError: name 'undefined_name'"):
        check(bad[0], tmp_path)
    shell = cases_from("```bash\npython3 -m aionvme no-such-command\n```\n", "BAD.md")
    with pytest.raises(pytest.fail.Exception, match=r"BAD\.md:2"):
        check(shell[0], tmp_path)


# -- the real README --------------------------------------------------------------------------------


def _readme_params() -> list[object]:
    if not README.exists():
        return []
    params = []
    for c in cases_from(README.read_text(), "README.md"):
        marks = []
        if c.kind == "shell":
            marks.append(pytest.mark.slow)  # aionvme bench/demo take minutes at their default sizes
        params.append(pytest.param(c, id=f"{c.where}-{c.kind}", marks=marks))
        if c.numpy_only:
            bare = dataclasses.replace(c, without_torch=True)
            params.append(pytest.param(bare, id=f"{c.where}-{c.kind}-without-torch", marks=marks))
    return params


@pytest.mark.parametrize("case", _readme_params())
def test_readme_block_runs_as_written(case, tmp_path):
    check(case, tmp_path)


def test_a_needs_marker_skips_only_where_the_module_is_missing(tmp_path):
    md = (
        "<!-- readme-test: needs no_such_module_aionvme -->\n```python\nraise SystemExit(1)\n```\n\n"
        "<!-- readme-test: needs json -->\n```python\nimport json\n```\n"
    )
    absent, present = cases_from(md, "NEEDS.md")
    assert absent.needs == ("no_such_module_aionvme",) and present.needs == ("json",)
    with pytest.raises(pytest.skip.Exception, match="needs no_such_module_aionvme"):
        check(absent, tmp_path)
    check(present, tmp_path)


def test_a_block_run_without_torch_cannot_import_it(tmp_path):
    (numpy_only,) = cases_from("```python\nimport numpy\n```\n", "BARE.md")
    assert numpy_only.numpy_only
    probe = dataclasses.replace(
        numpy_only,
        code=(
            "import importlib.util, sys\n"
            "assert importlib.util.find_spec('torch') is None and 'torch' not in sys.modules\n"
            "try:\n    import torch\nexcept ModuleNotFoundError:\n    sys.exit(0)\nsys.exit(3)\n"
        ),
        without_torch=True,
    )
    check(probe, tmp_path)
    uses_torch = dataclasses.replace(probe, code="import torch\n")
    with pytest.raises(pytest.fail.Exception, match="ModuleNotFoundError"):
        check(uses_torch, tmp_path)
