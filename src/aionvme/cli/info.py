"""``aionvme info [PATH] [--json]``: what this machine offers (like DeepSpeed's
ds_report): kernel AIO, io_uring and the engine that would serve, O_DIRECT
support and alignment where PATH lives, limits, cuFile, GPUs, versions."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from aionvme.bench.render import human_bytes

OK, WARN, NOTE = "ok", "warn", "-"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="directory to probe for O_DIRECT (default: cwd)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _limit(n: int | None) -> str:
    return "unlimited" if n is None else human_bytes(n)


def rows(d: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(section, item, value, status) lines of the report."""
    out: list[tuple[str, str, str, str]] = []
    aio = d["kernel_aio"]
    if aio["available"]:
        out.append(("kernel", "kernel AIO", "available (io_setup works)", OK))
    else:
        out.append(("kernel", "kernel AIO", f"unavailable: {aio['error']}", WARN))
        if aio["hint"]:
            out.append(("kernel", "", aio["hint"], NOTE))
    eng = d["engine"]
    out.append(
        ("kernel", "engine", f"{eng['engine']}: {eng['reason']}", OK if eng["engine"] != "none" else WARN)
    )
    ur = d["io_uring"]
    state = "available" if ur["available"] else f"unavailable ({ur['error']})"
    out.append(
        (
            "kernel",
            "io_uring",
            f"{state}; kernel.io_uring_disabled={ur['io_uring_disabled']}",
            OK if ur["available"] else NOTE,
        )
    )

    p = d["path"]
    out.append(("path", "directory", p["path"], NOTE))
    if "filesystem" in p:
        out.append(("path", "filesystem", p["filesystem"], NOTE))
    if "error" in p:
        out.append(("path", "probe", p["error"], WARN))
    if "o_direct" in p:
        if p["o_direct"]:
            out.append(("path", "O_DIRECT", "yes", OK))
        else:
            out.append(("path", "O_DIRECT", f"no: {p['how']}", WARN))
        st = p["statx_dioalign"]
        src = "statx STATX_DIOALIGN" if st else "not reported by statx: aionvme assumes 4096"
        out.append(
            ("path", "alignment", f"offset {p['offset_align']} B, memory {p['mem_align']} B ({src})", NOTE)
        )
        out.append(
            (
                "path",
                "4 KiB round trip",
                "ok" if p["roundtrip_ok"] else "MISMATCH",
                OK if p["roundtrip_ok"] else WARN,
            )
        )

    lim = d["limits"]
    if lim["aio_max_nr"] is not None:
        free = lim["aio_free"]
        status = OK if free is None or free >= 1024 else WARN
        out.append(
            (
                "limits",
                "fs.aio-max-nr",
                f"{lim['aio_nr']} of {lim['aio_max_nr']} in use ({free} free)",
                status,
            )
        )
    soft = lim["memlock_soft"]
    out.append(
        (
            "limits",
            "RLIMIT_MEMLOCK",
            f"{_limit(soft)} (hard {_limit(lim['memlock_hard'])})"
            + ("; not enforced: CAP_IPC_LOCK" if lim["cap_ipc_lock"] else "; bounds page-locked buffers"),
            NOTE,
        )
    )

    g = d["gpu"]
    if g.get("details"):
        for dev in g["details"]:
            desc = f"{dev['name']}, compute {dev['capability']}, {dev['memory_gib']} GiB ({g['source']})"
            out.append(("gpu", f"cuda:{dev['index']}", desc, OK))
    else:
        devices = ", ".join(g["devices"]) if g["devices"] else "none"
        out.append(("gpu", "CUDA devices", f"{devices} ({g['source']})", OK if g["cuda"] else NOTE))
    cf = d["cufile"]
    lib = cf["library"] or "libcufile.so.0 not found"
    if cf.get("version"):
        lib += f" (cuFile {cf['version']})"
    out.append(("gpu", "cuFile", lib, OK if cf["available"] else NOTE))
    mode = cf.get("mode")
    label = {"gds": "GDS", "compat": "compat"}.get(mode or "", "unavailable")
    out.append(("gpu", "cuFile mode", f"{label}: {cf['reason']}", OK if mode == "gds" else NOTE))
    for line in cf.get("log") or []:
        out.append(("gpu", "", f"cuFile log: {line}", NOTE))
    t = d.get("gpu_transfers") or {}
    if t:
        path = {
            "auto": "GDS where cuFile does GPUDirect DMA, else pinned bounce buffers",
            "gds": "cuFile only",
            "bounce": "pinned bounce buffers only",
        }.get(t.get("gpu_path", ""), "")
        out.append(("gpu", "CUDA tensors", f"gpu_path={t.get('gpu_path')}: {path}", NOTE))
        budget = t.get("memlock_budget")
        out.append(
            (
                "gpu",
                "pinned pool",
                f"{human_bytes(d['defaults'].get('pinned_pool', 0))} in "
                f"{human_bytes(d['defaults'].get('gpu_block_size', 0))} buffers; "
                + (
                    "page-locking unbounded"
                    if budget is None
                    else f"{human_bytes(budget)} may be page-locked"
                ),
                NOTE,
            )
        )
        if t.get("last_refusal"):
            out.append(("gpu", "last refusal", str(t["last_refusal"]), WARN))

    for name, ver in d["versions"].items():
        out.append(("versions", name, ver or "not installed", NOTE))
    s = d["defaults"]
    knobs = ", ".join(f"{k}={v}" for k, v in s.items())
    out.append(("defaults", "aionvme.defaults", knobs, NOTE))
    return out


def _print_plain(table: list[tuple[str, str, str, str]]) -> None:
    width = max(len(r[1]) for r in table)
    section = None
    for sec, item, value, status in table:
        if sec != section:
            print(f"\n{sec}")
            section = sec
        mark = {OK: "[ok]  ", WARN: "[warn]", NOTE: "      "}[status]
        print(f"  {mark} {item:<{width}}  {value}")


def _print_rich(table: list[tuple[str, str, str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="aionvme info", show_lines=False)
    t.add_column("section", style="bold")
    t.add_column("item")
    t.add_column("value", overflow="fold")
    t.add_column("", justify="center")
    section = None
    for sec, item, value, status in table:
        mark = {OK: "[green]OK[/green]", WARN: "[yellow]WARN[/yellow]", NOTE: ""}[status]
        t.add_row(sec if sec != section else "", item, value, mark)
        section = sec
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    from aionvme.diagnostics import info

    if args.path is not None and not os.path.isdir(args.path):
        print(f"aionvme info: {args.path} is not a directory")
        return 2
    d = info(args.path, init_cuda=True)  # a process of its own: CUDA may start
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    table = rows(d)
    try:
        import rich  # noqa: F401
    except ImportError:
        _print_plain(table)
    else:
        _print_rich(table)
    return 0
