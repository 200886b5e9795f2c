"""Property tests (hypothesis) for the loader's order: deterministic epochs,
disjoint equal rank parts, and exact resume from a state_dict in a new loader."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aionvme.data import Loader, sync_write_dataset
from aionvme.data._order import epoch_order, rank_part, rank_size

N = 61  # samples in the on-disk dataset (prime: no world size divides it)


@given(n=st.integers(0, 500), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000), shuffle=st.booleans())
@settings(max_examples=200, deadline=None)
def test_epoch_order_is_a_deterministic_permutation(n, seed, epoch, shuffle):
    a = epoch_order(n, seed, epoch, shuffle)
    assert sorted(a.tolist()) == list(range(n))
    assert np.array_equal(a, epoch_order(n, seed, epoch, shuffle))
    if not shuffle:
        assert a.tolist() == list(range(n))
    elif n >= 30:
        assert not np.array_equal(a, epoch_order(n, seed, epoch + 1, shuffle))  # P(equal) = 1/30!


@given(n=st.integers(1, 400), ws=st.integers(1, 9), drop_last=st.booleans(), seed=st.integers(0, 99))
@settings(max_examples=200, deadline=None)
def test_rank_parts_are_equal_and_disjoint(n, ws, drop_last, seed):
    order = epoch_order(n, seed, 0, True)
    parts = [rank_part(order, r, ws, drop_last) for r in range(ws)]
    per = rank_size(n, ws, drop_last)
    assert all(len(p) == per for p in parts)
    if drop_last:
        ids = [i for p in parts for i in p.tolist()]
        assert len(ids) == len(set(ids))  # disjoint
        assert len(ids) == n - n % ws
    else:
        ids = [i for p in parts for i in p.tolist()]
        assert set(ids) == set(range(n))  # every sample is seen
        # padding repeats the epoch's first samples, each at most once more than the others
        counts = np.bincount(ids, minlength=n)
        assert counts.max() - counts.min() <= 1 or n < ws
    # the parts interleave back into the (padded or cut) epoch order
    inter = np.stack(parts, axis=1).reshape(-1) if per else np.zeros(0, np.int64)
    assert np.array_equal(inter, np.resize(order, per * ws))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("order") / "ds"
    sync_write_dataset(d, ({"id": np.int64(i)} for i in range(N)))
    return d


def _ids(loader, limit=None):
    out = []
    for k, b in enumerate(loader):
        out.append(b["id"].tolist())
        if limit is not None and k + 1 == limit:
            break
    return out


@given(
    bs=st.integers(1, 20),
    bs2=st.integers(1, 20),
    stop=st.integers(0, 8),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
    ws=st.integers(1, 4),
    data=st.data(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_resume_gives_exactly_the_rest(dataset, bs, bs2, stop, seed, shuffle, ws, data, drop_last, epoch):
    check_resume(dataset, bs, bs2, stop, seed, shuffle, ws, data, drop_last, epoch)


@pytest.mark.slow
@given(
    bs=st.integers(1, 20),
    bs2=st.integers(1, 20),
    stop=st.integers(0, 20),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
    ws=st.integers(1, 8),
    data=st.data(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_resume_gives_exactly_the_rest_soak(
    dataset, bs, bs2, stop, seed, shuffle, ws, data, drop_last, epoch
):
    check_resume(dataset, bs, bs2, stop, seed, shuffle, ws, data, drop_last, epoch)


def check_resume(dataset, bs, bs2, stop, seed, shuffle, ws, data, drop_last, epoch):
    rank = data.draw(st.integers(0, ws - 1))
    kw = dict(shuffle=shuffle, seed=seed, rank=rank, world_size=ws, drop_last=drop_last, prefetch="1M")
    with Loader(dataset, batch_size=bs, **kw) as full:
        full.set_epoch(epoch)
        want = [i for b in _ids(full) for i in b]
    # the epoch is this rank's part, batched
    part = rank_part(epoch_order(N, seed, epoch, shuffle), rank, ws, drop_last).tolist()
    if drop_last:
        part = part[: len(part) - len(part) % bs]
    assert want == part
    with Loader(dataset, batch_size=bs, **kw) as first:
        first.set_epoch(epoch)
        head = [i for b in _ids(first, limit=stop) for i in b] if stop else []
        state = first.state_dict()
    with Loader(dataset, batch_size=bs2, **kw) as second:  # a new process, maybe another batch size
        second.load_state_dict(state)
        rest = [i for b in _ids(second) for i in b]
    done = len(head)
    if state["epoch"] == epoch + 1:  # the head took the whole epoch: the next one follows, from its start
        assert head == want and state["position"] == 0
        full_part = rank_part(epoch_order(N, seed, epoch + 1, shuffle), rank, ws, drop_last).tolist()
        done = 0
    else:
        assert head == want[:done] and state["position"] == done
        full_part = rank_part(epoch_order(N, seed, epoch, shuffle), rank, ws, drop_last).tolist()
    tail = full_part[done:]
    rest_want = tail[: len(tail) - len(tail) % bs2] if drop_last else tail
    assert rest == rest_want
