"""Elastic resume of aionvme.data.Loader: the states of every rank of a world
of size A, merged by merge_states, load at any world size B, and the rest of
the epoch is covered exactly once, in the epoch's shuffled order.

Real loaders read real datasets on disk; each rank's loader stops after its
own number of batches (ranks progress unevenly), the states are merged (also
through JSON, as a checkpoint would keep them), and the new world's loaders
read the rest. One test runs it in real processes over gloo.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aionvme.data import Loader, LoaderStateError, epoch_order, merge_states, rank_part, sync_write_dataset
from aionvme.exceptions import AionvmeError

SIZES = (5, 61)  # samples: fewer than most world sizes, and a prime no world size divides


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    out = {}
    for n in SIZES:
        d = tmp_path_factory.mktemp("elastic") / f"ds{n}"
        sync_write_dataset(d, ({"id": np.int64(i)} for i in range(n)))
        out[n] = d
    return out


def run_rank(path, rank, ws, bs, kw, state, stop):
    """One rank: load ``state`` (or start at kw's epoch), hand out ``stop`` batches
    (None: to the end of the epoch). Returns (epoch it read in, ids handed out, state)."""
    with Loader(path, batch_size=bs, rank=rank, world_size=ws, tensors="numpy", prefetch="1M", **kw) as ld:
        if state is not None:
            ld.load_state_dict(state)
        epoch, left = ld.epoch, ld.samples_per_epoch() - ld.state_dict()["position"]
        nbatches = left // bs if kw.get("drop_last") else -(-left // bs)
        ids: list[int] = []
        k = 0
        if stop is None or stop > 0:
            for k, b in enumerate(ld, 1):
                ids += b["id"].tolist()
                if k == stop:
                    break
        if stop is None:
            assert ld.epoch == epoch + 1  # the epoch ended for this rank
            assert k == nbatches  # samples_per_epoch() counted its part of the rest
        return epoch, ids, ld.state_dict()


def simulate(path, n, worlds, batch_sizes, stops, seed, shuffle, drop_last, epoch):
    """Run the phases: worlds[k] ranks with batch_sizes[k], rank r of phase k
    stopping after stops[k][r] batches (the last phase: to the end).
    Returns [(epoch, world, [ids of each rank], [rank finished the epoch])] per phase."""
    kw = dict(shuffle=shuffle, seed=seed, drop_last=drop_last)
    state = None
    phases = []
    for k, ws in enumerate(worlds):
        last = k == len(worlds) - 1
        got, states, epochs, done = [], [], set(), []
        for r in range(ws):
            if state is None:
                with Loader(
                    path, batch_size=1, rank=r, world_size=ws, tensors="numpy", prefetch="1M", **kw
                ) as ld:
                    ld.set_epoch(epoch)
                    start = ld.state_dict()
            else:
                start = state
            e, ids, st_ = run_rank(path, r, ws, batch_sizes[k], kw, start, None if last else stops[k][r])
            epochs.add(e)
            got.append(ids)
            states.append(st_)
            done.append(st_["epoch"] == e + 1)
        assert len(epochs) == 1  # every rank of a phase resumed into the same epoch
        phases.append((epochs.pop(), ws, got, done))
        if not last:
            merged = merge_states(states[::-1])  # any order
            state = json.loads(json.dumps(merged))  # kept in a JSON checkpoint
            assert state["rank"] is None and state["world_size"] is None
    return phases


def check_phases(n, phases, batch_sizes, seed, shuffle, drop_last):
    """The oracle: a list model of the epoch built from the ids actually handed out."""
    final_epoch, ws, final, _ = phases[-1]
    rest = epoch_order(n, seed, final_epoch, shuffle).tolist()
    done: set[int] = set()
    for k, (e, w, ids, finished) in enumerate(phases[:-1]):
        if e != final_epoch:  # an epoch before: the last phase in it saw every rank finish it
            assert all(finished) or phases[k + 1][0] == e
            continue
        flat = [i for r in ids for i in r]
        # a phase repeats only padding: fewer than its world size, and never with drop_last
        assert len(flat) - len(set(flat)) < (1 if drop_last else w)
        assert not set(flat) & done, "a sample handed out again after a resume"
        for r in range(w):
            part = rank_part(np.array(rest, np.int64), r, w, drop_last).tolist()
            assert ids[r] == part[: len(ids[r])]  # each rank reads its part of the list, in order
            if finished[r]:  # its whole part counts, the batch drop_last dropped included
                done |= set(part)
        done |= set(flat)
        rest = [i for i in rest if i not in done]
    after = [i for r in final for i in r]
    assert not set(after) & done, "a sample handed out again after the resume"
    # the new ranks split the rest in the epoch's order: rank r takes r, r + B, ...
    lens = {len(r) for r in final}
    assert len(lens) == 1
    length = lens.pop()
    inter = [final[r][j] for j in range(length) for r in range(ws)]
    if drop_last:
        assert inter == rest[: length * ws]
        assert len(after) == len(set(after))
        per = len(rest) // ws
        assert length == per - per % batch_sizes[-1]
        # cut by the last phase (< B samples) and its ranks' short last batches (< bs each)
        missing = set(range(n)) - done - set(after)
        assert len(missing) <= ws - 1 + ws * (batch_sizes[-1] - 1)
    else:
        assert inter == (np.resize(np.array(rest, np.int64), length * ws).tolist() if rest else [])
        assert length == -(-len(rest) // ws)
        assert done | set(after) == set(range(n)), "the epoch is not covered"


worlds_st = st.integers(1, 16)


def _property(datasets, data, nphases):
    n = data.draw(st.sampled_from(SIZES), label="samples")
    worlds = [data.draw(worlds_st, label=f"world{k}") for k in range(nphases)]
    batch_sizes = [data.draw(st.integers(1, 6), label=f"bs{k}") for k in range(nphases)]
    shuffle = data.draw(st.booleans(), label="shuffle")
    drop_last = data.draw(st.booleans(), label="drop_last")
    seed = data.draw(st.integers(0, 2**32), label="seed")
    epoch = data.draw(st.integers(0, 3), label="epoch")
    # stop points: up to a few batches past a rank's part (None = to the end of the epoch)
    stops = [
        data.draw(
            st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=w, max_size=w), label=f"stops{k}"
        )
        for k, w in enumerate(worlds[:-1])
    ]
    phases = simulate(datasets[n], n, worlds, batch_sizes, stops, seed, shuffle, drop_last, epoch)
    check_phases(n, phases, batch_sizes, seed, shuffle, drop_last)


@given(data=st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_resume_at_another_world_size_covers_the_rest_once(datasets, data):
    _property(datasets, data, 2)


@given(data=st.data())
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_resume_twice(datasets, data):
    """A -> B -> C: the second merge keeps the first phase."""
    _property(datasets, data, 3)


@pytest.mark.slow
@given(data=st.data())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_elastic_resume_soak(datasets, data):
    _property(datasets, data, data.draw(st.integers(2, 4)))


def _states(path, ws, stops, **kw):
    return [run_rank(path, r, ws, 2, kw, None, stops[r])[2] for r in range(ws)]


def test_another_world_size_needs_the_merged_state(datasets):
    path = datasets[61]
    states = _states(path, 4, [1, 2, 0, 3], shuffle=True, seed=3)
    with Loader(path, rank=0, world_size=2, shuffle=True, seed=3) as ld:
        with pytest.raises(LoaderStateError, match="merge_states") as e:
            ld.load_state_dict(states[0])
        assert isinstance(e.value, ValueError) and isinstance(e.value, AionvmeError)
        ld.load_state_dict(merge_states(states))
        assert len(ld) == -(-(61 - 2 - 4 - 0 - 6) // 2) == 25
        assert ld.state_dict()["resumed"] == [{"world_size": 4, "positions": [2, 4, 0, 6]}]
        rest = [i for b in ld for i in b["id"].tolist()]
        assert len(rest) == 25 and ld.epoch == 1
        # the next epoch is a whole one again, split at this world size
        assert ld.state_dict()["resumed"] == [] and len(ld) == 31
        first = next(iter(ld))["id"].tolist()
        assert first == rank_part(epoch_order(61, 3, 1, True), 0, 2, False)[:1].tolist()
    # the same world size still takes its own rank's state as before
    with Loader(path, rank=1, world_size=4, shuffle=True, seed=3) as ld:
        ld.load_state_dict(states[1])
        with pytest.raises(LoaderStateError, match="rank"):
            ld.load_state_dict(states[2])


def test_merge_refuses_what_it_cannot_merge(datasets):
    path = datasets[61]
    states = _states(path, 3, [1, 2, 0], shuffle=True, seed=3)
    for bad, match in (
        ([], "none"),
        (states[:2], r"missing \[2\]"),
        ([states[0], states[1], states[1]], r"given twice \[1\]"),
        ([*states[:2], {**states[2], "seed": 4}], "seed"),
        ([*states[:2], {**states[2], "samples": 62}], "samples"),
        ([*states[:2], {**states[2], "position": 99}], "position 99"),
        ([*states[:2], {**states[2], "epoch": 2}], "more than an epoch apart"),
        ([*states[:2], {**states[2], "epoch": 1, "position": 2}], "went on into epoch 1"),
        ([*states[:2], {**states[2], "version": 99}], "newer"),
        ([merge_states(states)], "merged state cannot be merged"),
        ([*states[:2], {**states[2], "resumed": [{"world_size": 2, "positions": [1]}]}], "malformed"),
        (
            [*states[:2], {**states[2], "resumed": [{"world_size": 2, "positions": [1, 1]}]}],
            "different merged",
        ),
        # hostile or mistyped fields: a typed error, never a silent int() nor a list of world_size items
        ([*states[:2], {**states[2], "position": 1.5}], r"position=1\.5"),
        ([*states[:2], {**states[2], "position": True}], "position=True"),
        ([*states[:2], {**states[2], "position": -1}], "position=-1"),
        ([{**s, "world_size": 10**12} for s in states], r"10\d+ ranks' states once, got 3: .* more"),
        ([*states[:2], {**states[2], "rank": "2"}], "rank='2'"),
    ):
        with pytest.raises(LoaderStateError, match=match):
            merge_states(bad)
    merged = merge_states(states)
    with (
        Loader(path, rank=0, world_size=2, shuffle=True, seed=4) as ld,
        pytest.raises(LoaderStateError, match="seed"),
    ):
        ld.load_state_dict(merged)
    with Loader(path, rank=0, world_size=2, shuffle=True, seed=3) as ld:
        with pytest.raises(LoaderStateError, match="past the"):
            ld.load_state_dict({**merged, "resumed": [{"world_size": 3, "positions": [1, 2, 99]}]})
        with pytest.raises(LoaderStateError, match="position 1 out of range"):
            ld.load_state_dict({**merged, "position": 1})
        for k, v in (("position", 0.0), ("epoch", None), ("epoch", "0")):
            with pytest.raises(LoaderStateError, match=f"{k}="):
                ld.load_state_dict({**merged, k: v})


def test_even_stops_resume_as_a_same_world_resume(datasets):
    """Every rank at the same position, resumed at the same world size through
    merge_states: the same samples as loading each rank's own state, except the
    padding (61 samples, 4 ranks: ranks 1-3 end with one repeat), which repeats
    the epoch's first samples there and the rest's first samples here."""
    path = datasets[61]
    kw = dict(shuffle=True, seed=9)
    states = _states(path, 4, [3, 3, 3, 3], **kw)
    seen = {i for r in range(4) for i in run_rank(path, r, 4, 2, kw, None, 3)[1]}
    merged = merge_states(states)
    for r in range(4):
        own = run_rank(path, r, 4, 5, kw, states[r], None)[1]
        via = run_rank(path, r, 4, 5, kw, merged, None)[1]
        if r == 0:
            assert own == via
        else:
            assert own[:-1] == via[:-1]
            assert own[-1] in seen and via[-1] not in seen


def _rank_main(path, port, rank, ws, stop, state_in, out):
    """One rank in a forked process: rank and world size from torch.distributed
    (gloo); hand out ``stop`` batches (0: none, -1: to the epoch's end), then
    all-gather every rank's state and merge them."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    ids: list[int] = []
    with Loader(path, batch_size=4, shuffle=True, seed=11, tensors="numpy", prefetch="1M") as ld:
        assert (ld.rank, ld.world_size) == (rank, ws)
        if state_in is not None:
            with open(state_in) as f:
                ld.load_state_dict(json.load(f))
        for k, b in enumerate(ld if stop else (), 1):
            ids += b["id"].tolist()
            if k == stop:
                break
        states = [None] * ws
        dist.all_gather_object(states, ld.state_dict())
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"ids": ids, "merged": merge_states(states)}, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(path, ws, stops, state_in, out):
    # fork: the children share this process's imported torch (a fresh interpreter
    # per rank spends seconds importing it on a loaded machine)
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(path, port, r, ws, stops[r], state_in, out)) for r in range(ws)
    ]
    for p in procs:
        p.start()
    return procs


def _results(procs, out, ws):
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    got = []
    for r in range(ws):
        with open(f"{out}.{r}.json") as f:
            got.append(json.load(f))
    merged = [g["merged"] for g in got]
    assert all(m == merged[0] for m in merged)  # every rank merged the same state
    return [g["ids"] for g in got], merged[0]


def test_four_processes_stop_and_resume_with_two_and_with_three(datasets, tmp_path):
    """Real ranks over gloo: 4 stop unevenly mid-epoch, their states are all-gathered
    and merged; 2 ranks, and separately 3, read the rest: each sample once."""
    pytest.importorskip("torch", reason="torch.distributed (gloo) runs the ranks")
    path = datasets[61]
    out = str(tmp_path / "four")
    before, merged = _results(_launch(path, 4, [2, 1, 3, 0], None, out), out, 4)
    assert [len(x) for x in before] == [8, 4, 12, 0]
    with open(tmp_path / "merged.json", "w") as f:
        json.dump(merged, f)
    seen = {i for x in before for i in x}
    assert len(seen) == 24
    running = {
        ws: _launch(path, ws, [-1] * ws, str(tmp_path / "merged.json"), str(tmp_path / f"w{ws}"))
        for ws in (2, 3)
    }
    for ws, procs in running.items():
        after, _ = _results(procs, str(tmp_path / f"w{ws}"), ws)
        flat = [i for x in after for i in x]
        rest = 61 - 24
        assert len(flat) == -(-rest // ws) * ws  # padding: fewer than ws repeats
        assert not set(flat) & seen
        assert seen | set(flat) == set(range(61))


@pytest.mark.slow
def test_bench_elastic_smoke(tmp_path):
    """bench/suites/bench_data_elastic.py runs and checks what it claims (tiny size)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), *sys.path]))
    script = str(root / "bench" / "suites" / "bench_data_elastic.py")
    cmd = [sys.executable, script, "--size", "128M", "--repeat", "1", "--to-world", "3", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path, timeout=300)
    rows = json.loads(out.read_text())
    assert [r["tool"].split()[0] for r in rows] == ["fio", "aionvme", "aionvme"]
    assert all(r["ok"] and r["MB_s"] > 0 for r in rows)
    assert 0 < rows[1]["samples"] < 1024
