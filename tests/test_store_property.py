"""Property test: random programs of concurrent TieredStore calls (put, put(to="nvme"),
put_many, get, get_many, hold, evict, prefetch, delete on a few keys, each
round's calls running at once) against an in-memory model, on asyncio and
uvloop, with every policy, both admission rules, one or two directories, a
bounded or growing NVMe tier, persistent or not.

Within a round, writes of a key apply in call order, so a read may see the
key's value from before the round or after any of the round's writes of it,
never anything else (no torn or stale bytes). After each round every key
reads back exactly as the model says; at the end (after a reopen when
persistent) deleting every key must leave no byte used in any tier."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aionvme.store import StoreFullError, StoreKeyError, TieredStore

KEYS = ["a", "b", "c", "d"]
SIZES = [0, 1, 100, 4096, 5000, 12_000, 40_000, 70_000]  # the last one is larger than the host tier
HOST = 64 * 1024

keys = st.sampled_from(KEYS)
values = st.tuples(st.integers(0, 2**16), st.sampled_from(SIZES), st.sampled_from(["numpy", "torch"]))
ops = st.one_of(
    st.tuples(st.just("put"), keys, values),
    st.tuples(st.just("put_nvme"), keys, values),  # a swap-out: may overwrite the old value in place
    st.tuples(st.just("put_many"), st.lists(keys, min_size=1, max_size=3, unique=True), values),
    st.tuples(st.just("get"), keys, st.none()),
    st.tuples(st.just("get_many"), st.lists(keys, min_size=1, max_size=3), st.none()),
    st.tuples(st.just("hold"), keys, st.none()),
    st.tuples(st.just("evict"), keys, st.none()),
    st.tuples(st.just("prefetch"), keys, st.none()),
    st.tuples(st.just("delete"), keys, st.none()),
)
programs = st.lists(st.lists(ops, min_size=1, max_size=6), min_size=1, max_size=6)


def make_value(seed: int, size: int, kind: str):
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return raw if kind == "numpy" else torch.from_numpy(raw.copy())


def as_bytes(v) -> bytes:
    return (v.numpy() if isinstance(v, torch.Tensor) else v).tobytes()


def sig(spec) -> tuple[str, bytes] | None:
    if spec is None:
        return None
    seed, size, kind = spec
    return (kind, as_bytes(make_value(seed, size, kind)))


async def run_op(store: TieredStore, op: str, key, spec):
    """One call of a program; a read's values, else None."""
    if op == "put":
        await store.put(key, make_value(*spec))
    elif op == "put_nvme":
        await store.put(key, make_value(*spec), to="nvme")
    elif op == "put_many":
        await store.put_many({k: make_value(*spec) for k in key})
    elif op == "delete":
        await store.delete(key)
    elif op == "get":
        return [await store.get(key)]
    elif op == "get_many":
        return await store.get_many(key)
    elif op == "hold":
        async with store.hold(key) as t:
            first = as_bytes(t)
            await asyncio.sleep(0)  # others run while it is held
            assert as_bytes(t) == first, "a held value changed"
            return [t.clone() if isinstance(t, torch.Tensor) else t.copy()]
    elif op == "evict":
        await store.evict(key)
    elif op == "prefetch":
        await store.prefetch([key])
    return None


async def _round(store: TieredStore, model: dict, round_ops) -> None:
    # every state each key passes through this round, in write order
    states: dict[str, list] = {k: [model.get(k)] for k in KEYS}
    expect_delete_error = []
    for op, key, spec in round_ops:
        if op in ("put", "put_nvme"):
            states[key].append(spec)
        elif op == "put_many":
            for k in key:
                states[k].append(spec)
        elif op == "delete":
            expect_delete_error.append(states[key][-1] is None)
            states[key].append(None)

    def allowed(k: str) -> set:
        return {sig(s) for s in states[k]}

    results = await asyncio.gather(*(run_op(store, *o) for o in round_ops), return_exceptions=True)
    d = 0
    for (op, key, _spec), res in zip(round_ops, results):
        if op == "delete":
            if expect_delete_error[d]:
                assert isinstance(res, StoreKeyError), res
            else:
                assert res is None, res
            d += 1
            continue
        if isinstance(res, StoreKeyError):
            ks = key if isinstance(key, list) else [key]
            assert any(None in allowed(k) for k in ks), f"{op} {key}: unexpected KeyError"
            continue
        if op == "hold" and isinstance(res, StoreFullError):
            assert any(sp is not None and sp[1] > HOST for sp in states[key]), res
            continue
        assert not isinstance(res, BaseException), f"{op} {key}: {res!r}"
        if op in ("get", "get_many", "hold"):
            ks = key if isinstance(key, list) else [key]
            for k, v in zip(ks, res):
                kind = "torch" if isinstance(v, torch.Tensor) else "numpy"
                assert (kind, as_bytes(v)) in allowed(k), f"{op} {k}: torn or stale value"
    for k in KEYS:
        model[k] = states[k][-1]
        if model[k] is None:
            model.pop(k)


async def _check(store: TieredStore, model: dict) -> None:
    while store._tasks:  # background cleaning (a batch that ends starts the next), prefetches
        await asyncio.gather(*list(store._tasks), return_exceptions=True)
    assert len(store) == len(model)
    for k in KEYS:
        if k in model:
            v = await store.get(k)
            kind = "torch" if isinstance(v, torch.Tensor) else "numpy"
            assert (kind, as_bytes(v)) == sig(model[k]), k
            assert v.dtype in (np.uint8, torch.uint8) and tuple(v.shape) == (model[k][1],)
        else:
            assert k not in store
    st_ = store.stats()
    assert st_["host"]["used"] <= st_["host"]["capacity"]
    for e in store._index.values():
        assert e.idle(), e  # no reference, claim, load or write-out left


async def _program(dirs, prog, policy, admit, nvme_cap, persist) -> None:
    kw = dict(host=HOST, policy=policy, admit=admit, nvme=nvme_cap, persist=persist, stripe="16K")
    model: dict = {}
    store = TieredStore(dirs, **kw)
    try:
        for round_ops in prog:
            await _round(store, model, round_ops)
            await _check(store, model)
        if persist:
            await store.close()
            store = TieredStore(dirs, **kw)
            await _check(store, model)
        for k in list(model):
            await store.delete(k)
        await asyncio.sleep(0.01)  # prefetches nobody awaited
        st_ = store.stats()
        assert st_["host"]["used"] == 0 and st_["nvme"]["used"] == 0, st_
    finally:
        await store.close()


def _await_chain(task: asyncio.Task) -> str:
    """Where a task waits: each coroutine it awaits, innermost last, with its
    line (a task's own stack shows only its outermost frame)."""
    out = []
    c = task.get_coro()
    while c is not None and len(out) < 40:
        fr = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None)
        name = getattr(c, "__qualname__", type(c).__name__)
        out.append(f"{name}:{fr.f_lineno}" if fr is not None else name)
        c = getattr(c, "cr_await", None) or getattr(c, "gi_yieldfrom", None)
    return " > ".join(out)


async def _guarded(coro, limit: float = 30.0):
    """A hang fails the example (and hypothesis shrinks it) instead of the whole run."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait([task], timeout=limit)
    if not done:
        stacks = "\n".join(_await_chain(t) for t in asyncio.all_tasks() if not t.done())
        task.cancel()
        raise AssertionError(f"program hung for {limit} s; tasks:\n{stacks}")
    return task.result()


EXAMPLES = int(os.environ.get("AIONVME_PROPERTY_EXAMPLES", "25"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prog=programs,
    policy=st.sampled_from(["lru", "lfu", "s3fifo"]),
    admit=st.sampled_from(["always", "second-touch"]),
    ndirs=st.sampled_from([1, 2]),
    nvme_cap=st.sampled_from([None, 1 << 20]),
    persist=st.booleans(),
    loop=st.sampled_from(["asyncio", "uvloop"]),
    phased=st.booleans(),
)
def test_concurrent_programs_match_a_model(
    tmp_path_factory, prog, policy, admit, ndirs, nvme_cap, persist, loop, phased
):
    base = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    try:
        dirs = [os.path.join(base, f"d{i}") for i in range(ndirs)]
        coro = _guarded(_program(dirs, prog, policy, admit, nvme_cap, persist))
        with _phase_min(4096 if phased else None):
            uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def _phase_min(n: int | None):
    """Place values of n bytes or more at their memory's phase (see
    aionvme.store._nvme): these programs' values (up to 70,000 bytes) are
    all below the real threshold, 256 KiB."""
    from aionvme.store import _nvme

    old = _nvme.PHASE_MIN
    _nvme.PHASE_MIN = old if n is None else n
    try:
        yield
    finally:
        _nvme.PHASE_MIN = old


@pytest.mark.parametrize("phased", [False, True])
@pytest.mark.parametrize("persist", [False, True])
async def test_many_coroutines_on_few_keys(tmp_path, persist, phased):
    """A fixed storm: 200 calls at once on three keys, on the conftest's two loops
    (phased: values of 4 KiB or more placed at their memory's phase, in a
    growing NVMe tier)."""
    rng = np.random.default_rng(7)
    prog = []
    for _ in range(4):
        rnd = []
        for _ in range(50):
            op = ["put", "get", "get", "evict", "prefetch", "hold", "delete", "get_many", "put_nvme"][
                rng.integers(0, 9)
            ]
            k = KEYS[rng.integers(0, 3)]
            spec = (
                int(rng.integers(0, 1000)),
                int(rng.choice(SIZES)),
                ["numpy", "torch"][rng.integers(0, 2)],
            )
            rnd.append((op, [k, KEYS[(KEYS.index(k) + 1) % 3]] if op == "get_many" else k, spec))
        prog.append(rnd)
    model: dict = {}
    with _phase_min(4096 if phased else None):
        async with TieredStore(tmp_path, host=HOST, persist=persist, nvme=None if phased else "4M") as store:
            for rnd in prog:
                await _round(store, model, rnd)
                await _check(store, model)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * 4096), st.integers(0, 1000)), max_size=60))
def test_extent_allocator_matches_a_page_model(steps):
    from aionvme.store import ExtentAllocator

    pages = 64
    a = ExtentAllocator(pages * 4096)
    used = [False] * pages
    live: list[tuple[int, int]] = []
    for do_alloc, n, pick in steps:
        if do_alloc or not live:
            off = a.alloc(n)
            k = -(-n // 4096)
            runs = [i for i in range(pages - k + 1) if not any(used[i : i + k])]
            if off is None:
                assert not runs, "a free run was not found"
                continue
            p = off // 4096
            assert off % 4096 == 0 and p in runs, "allocated over used pages"
            used[p : p + k] = [True] * k
            live.append((off, n))
        else:
            off, n = live.pop(pick % len(live))
            a.free(off, n)
            p, k = off // 4096, -(-n // 4096)
            used[p : p + k] = [False] * k
        free = a.extents()
        assert sum(ln for _, ln in free) == a.free_bytes == used.count(False) * 4096
        for (o1, l1), (o2, _l2) in itertools.pairwise(free):
            assert o1 + l1 < o2, "free extents not coalesced"
