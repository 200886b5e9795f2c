"""Sequential writes (a fresh 1 GiB file + fsync), aionvme against DeepSpeed and fio, alternated.

    python3 bench/suites/seqwrite_alternated.py                    # 1 GiB, 10 rounds
    python3 bench/suites/seqwrite_alternated.py --rounds 20 --dir /nvme

Issue 17's target is 1.1x DeepSpeed's best configuration. On the VM of bench/README.md one
writer's rate moves by a fifth between runs a minute apart, so one run of each, or the best
of several DeepSpeed points against one run of ours, decides nothing. Here every round runs,
in a random order, each after an ``os.sync()`` and a pause of ``--pause`` seconds (this disk
writes faster after a pause, and a writer right after another pays for its write-back):
aionvme's ``seqwrite`` workload (uvloop, in its own process, as a user would run it);
DeepSpeed's ``aio_handle`` with a page-locked buffer at each point of the quick grid
(``peers.DS_GRIDS["quick"]``, each point a writer of its own, in its own process); and
fio libaio at ``--fio-point`` (the best point of compare.py's sweep here: bs 64M QD 16).

Printed: per round, MB/s of each writer; then aionvme's ratio, paired within rounds
(geometric mean, the 95% interval of that mean, the range), to DeepSpeed's best
configuration (the point with the highest median over all rounds, taken in the same round),
to the best of DeepSpeed's points in each round (stricter: a maximum of three noisy runs),
and to fio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from aionvme.bench import peers
from aionvme.bench.peers import fio, fio_unavailable
from aionvme.defaults import parse_size

CHILD = r"""
import json, sys
from aionvme.bench import run_loop, seqwrite
r = run_loop(seqwrite(sys.argv[1], int(sys.argv[2])), "uvloop")
if not r.verified:
    sys.exit("aionvme seqwrite: data mismatch")
print(json.dumps({"mb_s": r.nbytes / r.wall_s / 1e6}))
"""


def _summary(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    logs = [math.log(x) for x in ratios]
    mean = statistics.mean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return (
        f"{math.exp(mean):.3f}x (95% {math.exp(mean - half):.3f}-{math.exp(mean + half):.3f}; "
        f"range {min(ratios):.2f}-{max(ratios):.2f}; {len(ratios)} rounds)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds of quiet before each writer (1)")
    ap.add_argument("--dir", default=None, help="where the files go (default: a local temp dir)")
    ap.add_argument("--fio-point", default="64M:16", help="fio libaio's bs:iodepth (64M:16)")
    ap.add_argument("--seed", type=int, default=None, help="the order's random seed")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    bs, qd = a.fio_point.split(":")
    if parse_size(bs) > size:  # fio refuses a block larger than the file
        bs = a.size
    why_ds = peers.deepspeed_unavailable()
    if why_ds:
        print(f"DeepSpeed is left out: {why_ds}")
    why_fio = fio_unavailable()
    if why_fio:
        print(f"fio is left out: {why_fio}")
    rng = random.Random(a.seed)
    d = tempfile.mkdtemp(prefix="aionvme-seqwrite-", dir=a.dir)
    path = os.path.join(d, "write.bin")
    rounds: list[dict[str, float]] = []

    def ours() -> dict[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, path, str(size)], capture_output=True, text=True, check=True
        ).stdout
        return {"aionvme": json.loads(out.strip().splitlines()[-1])["mb_s"]}

    def deepspeed(point: peers.DSPoint) -> Callable[[], dict[str, float]]:
        def one() -> dict[str, float]:
            got = peers.deepspeed_sweep(path, "write", [point], ("locked",), size=size)
            row = {}
            for r in got:
                if r.skipped is not None or not r.verified:
                    # said, not dropped: a round without this point is left out of its ratios
                    why = r.skipped or "the file it wrote did not hold its pattern"
                    print(f"deepspeed bs={point[0] >> 20}M qd={point[1]} iop={point[2]}: {why}", flush=True)
                    continue
                row[f"deepspeed {peers.point_label(r)}"] = r.nbytes / r.wall_s / 1e6
            return row

        return one

    def fio_point() -> dict[str, float]:
        r = fio(path, "write", bs, int(qd), "libaio", size, end_fsync=1)
        return {f"fio libaio bs={bs} qd={qd}": r.nbytes / r.wall_s / 1e6}

    # each DeepSpeed point on its own, after its own sync and pause, like every other writer
    writers = [ours] + ([deepspeed(p) for p in peers.DS_GRIDS["quick"]] if not why_ds else [])
    writers += [fio_point] if not why_fio else []
    try:
        for i in range(a.rounds):
            row: dict[str, float] = {}
            for w in rng.sample(writers, len(writers)):
                if os.path.exists(path):
                    os.unlink(path)
                os.sync()
                time.sleep(a.pause)
                row.update(w())
            rounds.append(row)
            print(f"round {i + 1}: " + "; ".join(f"{k} {v:,.0f} MB/s" for k, v in row.items()), flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(d)
    ds_keys = sorted({k for r in rounds for k in r if k.startswith("deepspeed")})
    print()
    print(f"aionvme: median {statistics.median(r['aionvme'] for r in rounds):,.0f} MB/s")
    if ds_keys:
        med = {k: statistics.median(r[k] for r in rounds if k in r) for k in ds_keys}
        for k in ds_keys:
            print(f"{k}: median {med[k]:,.0f} MB/s")
        top = max(ds_keys, key=med.__getitem__)
        at_best = [r["aionvme"] / r[top] for r in rounds if top in r]
        best_of = [r["aionvme"] / max(r[k] for k in ds_keys if k in r) for r in rounds if top in r]
        print(f"aionvme / DeepSpeed's best configuration ({top}): {_summary(at_best)}")
        print(f"aionvme / the best of DeepSpeed's {len(ds_keys)} points in each round: {_summary(best_of)}")
    fk = sorted({k for r in rounds for k in r if k.startswith("fio")})
    if fk:
        # fio's deep point is this disk's ceiling: a writer at 1.0x of it cannot go faster
        print(f"aionvme / {fk[0]}: {_summary([r['aionvme'] / r[fk[0]] for r in rounds if fk[0] in r])}")
        if ds_keys:
            on = [r[top] / r[fk[0]] for r in rounds if top in r and fk[0] in r]
            print(f"DeepSpeed's best configuration / {fk[0]}: {_summary(on)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
