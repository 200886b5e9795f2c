"""The layers stay visible: imports point down, no circles, no reach-ins.

Every module under src/aionvme is parsed with ``ast`` (nothing is imported),
and every part of the Cython engine (cython_ext/**/*.pyx, .pxi, .pxd) is read
for its ``import``/``cimport``/``from ... import`` lines:

- module-level imports between aionvme's modules form no cycle;
- the library never imports ``aionvme.cli`` or the top-level ``bench/`` scripts;
- the engine (its asyncio glue included) imports only C declarations
  (``cimport``), the standard library without asyncio, and the leaf
  ``aionvme.exceptions``: never the runtime or the public layer;
- the engine is imported by its own name (``from .._engine import X``), never
  as an attribute of its package (``from .. import _engine``, which reads as
  an import of the package's ``__init__``);
- outside the private runtime package (``aionvme._runtime``, whose modules
  share their internals), no module uses another module's underscore names:
  ``from .x import _y`` or ``x._y`` where ``_y`` is not itself a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = SRC / "aionvme"
CYTHON = SRC.parent / "cython_ext"

# Modules allowed to break a rule for a while (module -> rules), e.g. during a
# move. An entry whose module is clean fails the test, so the list only shrinks.
TEMPORARY_ALLOWLIST: dict[str, set[str]] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
# compiled or stub-only modules (the engine) are modules too
EXTRA = {".".join(p.relative_to(SRC).with_suffix("").parts) for p in PKG.rglob("*.pyi")}


def _is_module(name: str) -> bool:
    return name in MODULES or name in EXTRA


def _package_of(mod: str) -> str:
    return mod if MODULES[mod].name == "__init__.py" else mod.rpartition(".")[0]


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    base = _package_of(mod).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str, tree: ast.Module, top_level_only: bool) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of each import."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # also imports under module-level if/try blocks
        stack, nodes = list(tree.body), []
        while stack:
            n = stack.pop()
            nodes.append(n)
            if isinstance(n, (ast.If, ast.Try)):
                stack.extend(ast.iter_child_nodes(n))
    out: list[tuple[str, str | None, int]] = []
    for n in nodes:
        if isinstance(n, ast.Import):
            out.extend((a.name, None, n.lineno) for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            target = _resolve(mod, n)
            out.extend((target, a.name, n.lineno) for a in n.names)
    return out


def _edges(mod: str, tree: ast.Module) -> set[str]:
    """aionvme modules imported at module level (a ``from pkg import sub``
    of a submodule counts as an import of the submodule)."""
    out = set()
    for target, name, _ in _imports(mod, tree, top_level_only=True):
        if not target.startswith("aionvme"):
            continue
        if name is not None and _is_module(f"{target}.{name}"):
            out.add(f"{target}.{name}")
        elif _is_module(target):
            out.add(target)
    out.discard(mod)
    return {m for m in out if m in MODULES}


def _trees() -> dict[str, ast.Module]:
    return {mod: ast.parse(path.read_text(), str(path)) for mod, path in MODULES.items()}


def _violations() -> dict[str, dict[str, list[str]]]:
    """module -> rule -> what breaks it."""
    trees = _trees()
    found: dict[str, dict[str, list[str]]] = {}

    def add(mod: str, rule: str, what: str) -> None:
        found.setdefault(mod, {}).setdefault(rule, []).append(what)

    for mod, tree in trees.items():
        in_cli = mod.startswith("aionvme.cli") or mod == "aionvme.__main__"
        in_runtime = mod.startswith("aionvme._runtime")
        bound: dict[str, str] = {}  # local name -> aionvme module it is bound to
        for target, name, line in _imports(mod, tree, top_level_only=False):
            where = f"{MODULES[mod].relative_to(SRC)}:{line}"
            if target.startswith("aionvme") and not _is_module(target) and target != "aionvme":
                add(mod, "imports", f"{where} imports {target}, which does not exist")
            if not in_cli and (target == "aionvme.cli" or target.startswith("aionvme.cli.")):
                add(mod, "cli", f"{where} imports {target}")
            if target == "bench" or target.startswith("bench."):
                add(mod, "cli", f"{where} imports the bench/ scripts ({target})")
            if name is None or not target.startswith("aionvme"):
                continue
            sub = f"{target}.{name}"
            if _is_module(sub):
                bound[name] = sub
            elif name.startswith("_") and not name.startswith("__") and not in_runtime:
                add(mod, "private", f"{where} imports {sub}")
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.asname and a.name.startswith("aionvme"):
                        bound[a.asname] = a.name
        if in_runtime:
            continue
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id in bound
                and n.attr.startswith("_")
                and not n.attr.startswith("__")
                and not _is_module(f"{bound[n.value.id]}.{n.attr}")
            ):
                add(
                    mod,
                    "private",
                    f"{MODULES[mod].relative_to(SRC)}:{n.lineno} uses {bound[n.value.id]}.{n.attr}",
                )
    return found


def _allowed(mod: str, rule: str) -> bool:
    return rule in TEMPORARY_ALLOWLIST.get(mod, set())


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    trees = _trees()
    graph = {mod: _edges(mod, tree) for mod, tree in trees.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    # the checker itself: a circle of three and a self-contained DAG
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("rule", ["imports", "cli", "private"])
def test_layers(rule):
    broken = {
        mod: whats
        for mod, rules in _violations().items()
        for r, whats in rules.items()
        if r == rule and not _allowed(mod, r)
    }
    assert broken == {}


def test_runtime_does_not_import_public_modules():
    # _runtime sits under file/handle/gpu/memory/formats/compat: it may import
    # only the leaves (exceptions, defaults), the engine and itself.
    allowed = {"aionvme.exceptions", "aionvme.defaults", "aionvme._engine"}
    bad = []
    for mod, tree in _trees().items():
        if not mod.startswith("aionvme._runtime"):
            continue
        for target, name, line in _imports(mod, tree, top_level_only=False):
            full = f"{target}.{name}" if name and _is_module(f"{target}.{name}") else target
            if full.startswith("aionvme") and not full.startswith("aionvme._runtime") and full not in allowed:
                bad.append(f"{mod}:{line} imports {full}")
    assert bad == []


def test_allowlist_only_names_real_violations():
    found = _violations()
    stale = {
        mod: sorted(rules - set(found.get(mod, {})))
        for mod, rules in TEMPORARY_ALLOWLIST.items()
        if rules - set(found.get(mod, {}))
    }
    assert stale == {}, f"fixed: remove these from TEMPORARY_ALLOWLIST: {stale}"


def test_only_the_runtime_builds_engine_requests():
    # One road to the engine: outside aionvme._runtime nothing queues a
    # request itself (engine.read/write/readv/writev/fsync, gds_submit) or
    # drives one (Request, Engine.run): File, Handle, the path functions,
    # the formats and the DeepSpeed handle go through _runtime.transfer.
    queueing = {"read", "write", "readv", "writev", "fsync", "run"}
    bad = []
    for mod, tree in _trees().items():
        if mod.startswith("aionvme._runtime") or TEMPORARY_ALLOWLIST.get(mod):
            continue
        for n in ast.walk(tree):
            where = f"{MODULES[mod].relative_to(SRC)}:{getattr(n, 'lineno', 0)}"
            if isinstance(n, ast.Attribute) and n.attr in queueing:
                owner = n.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name in ("engine", "eng"):
                    bad.append(f"{where}: {name}.{n.attr}")
            if isinstance(n, ast.Attribute) and n.attr == "gds_submit":
                bad.append(f"{where}: gds_submit")
            if isinstance(n, ast.ImportFrom) and any(a.name in ("Request", "Engine") for a in n.names):
                bad.append(f"{where}: imports the engine's Request/Engine")
    assert bad == []


# -- the Cython engine ---------------------------------------------------------------------

# What the engine may import beside C declarations and the standard library:
# the leaf every layer imports (DESIGN.md: the engine never imports asyncio,
# and nothing above it).
ENGINE_MAY_IMPORT = {"aionvme.exceptions", "aionvme._engine"}
# C-level modules: Cython's own declarations and the engine's includes.
C_DECLARATIONS = ("cython", "cpython", "libc", "libcpp", "posix", "aionvme.includes")


def _source_imports(text: str) -> list[tuple[str, int]]:
    """(imported module, line) of each import/cimport statement in Cython
    source; strings (docstrings, verbatim C) and comments are skipped."""
    text = re.sub(r'("""|\'\'\')[\s\S]*?\1', lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        stmt = line.split("#", 1)[0].strip()
        m = re.match(r"from\s+([\w.]+)\s+c?import\b", stmt)
        if m:
            out.append((m.group(1), n))
            continue
        m = re.match(r"c?import\s+([\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*)\s*$", stmt)
        if m:
            out.extend((part.split()[0], n) for part in m.group(1).split(","))
    return out


def _engine_import_violations(imports: list[tuple[str, str, int]]) -> list[str]:
    bad = []
    for where, target, line in imports:
        top = target.split(".")[0]
        if any(target == c or target.startswith(c + ".") for c in C_DECLARATIONS):
            continue
        if top == "asyncio":
            bad.append(f"{where}:{line} imports {target}: the engine never imports asyncio")
        elif top == "aionvme" and target not in ENGINE_MAY_IMPORT:
            bad.append(f"{where}:{line} imports {target}: the engine imports nothing above it")
    return bad


def _cython_imports() -> list[tuple[str, str, int]]:
    out = []
    for path in sorted(CYTHON.rglob("*")):
        if path.suffix in (".pyx", ".pxi", ".pxd"):
            where = str(path.relative_to(CYTHON.parent))
            out.extend((where, target, line) for target, line in _source_imports(path.read_text()))
    return out


def test_engine_imports_point_down():
    imports = _cython_imports()
    # the reader sees the engine's imports at all (cimports and Python imports)
    assert {"libc.stdint", "aionvme.includes.linux", "os", "aionvme.exceptions"} <= {t for _, t, _ in imports}
    assert _engine_import_violations(imports) == []


def test_engine_import_checker_finds_violations():
    src = """
cimport cython
from libc.stdint cimport int64_t
import os, sys as _sys
\"\"\"import asyncio (a docstring)\"\"\"
# from aionvme import file (a comment)
import asyncio
from aionvme._runtime import reactor
from aionvme import exceptions
from aionvme.includes.linux cimport *
"""
    found = _source_imports(src)
    assert [t for t, _ in found] == [
        "cython",
        "libc.stdint",
        "os",
        "sys",
        "asyncio",
        "aionvme._runtime",
        "aionvme",
        "aionvme.includes.linux",
    ]
    bad = _engine_import_violations([("x.pyx", t, n) for t, n in found])
    assert [b.split()[2] for b in bad] == ["asyncio:", "aionvme._runtime:", "aionvme:"]


def test_the_engine_is_imported_by_its_own_name():
    # ``from .. import _engine`` (or ``from aionvme import _engine``) names the
    # package: drawn as an import of its __init__, an arrow back up.
    bad = []
    for mod, tree in _trees().items():
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.ImportFrom)
                and _resolve(mod, n) == "aionvme"
                and any(a.name == "_engine" for a in n.names)
            ):
                bad.append(f"{MODULES[mod].relative_to(SRC)}:{n.lineno}")
    assert bad == []
