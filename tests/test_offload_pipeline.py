"""aionvme.offload.Optimizer's streaming pipeline: reads ahead and writes
behind under the budget (measured), buffers reused from step to step, an
error in the middle of a step leaving nothing in flight, and a parameter
whose state alone exceeds the budget split into pieces, and a budget that
cannot hold the largest chunk refused up front with the one that can."""

from __future__ import annotations

import re
import warnings

import pytest

torch = pytest.importorskip("torch")

from aionvme.offload import BudgetError, Optimizer  # noqa: E402


def _params(n: int, numel: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n)]


def _grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _step_both(opt, ours, mem, ref, steps: int) -> None:
    """The same gradients into both parameter sets, then a step of each optimizer, ``steps`` times."""
    for s in range(steps):
        _grads(ours, s)
        _grads(ref, s)
        opt.step()
        mem.step()


@pytest.mark.parametrize(("backend", "fused"), [("store", False), ("file", False), ("store", True)])
def test_reads_run_ahead_within_the_budget_and_buffers_are_reused(tmp_path, backend, fused):
    ours = _params(16, 64 << 10)  # 256 KiB each: state 512 KiB (+ a page for the step counters)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    budget = 3 << 20  # ~5 chunks' state of 512 KiB: everything streams
    kw = {"lr": 1e-3, "weight_decay": 0.1, "fused": fused}
    opt = Optimizer(torch.optim.AdamW, ours, tmp_path, budget=budget, backend=backend, **kw)
    mem = torch.optim.AdamW(ref, **kw)
    threads = torch.get_num_threads()
    try:
        allocs = []
        for s in range(4):
            _grads(ours, s)
            _grads(ref, s)
            opt.step()
            mem.step()
            allocs.append(opt.stats()["buffer_allocations"])
        for p, q in zip(ref, ours, strict=True):
            assert torch.equal(p, q)
        st = opt.stats()
        assert st["state_bytes"] > 2 * budget and st["resident_chunks"] == 0
        assert 0 < st["peak_memory_bytes"] <= budget and st["overdrafts"] == 0
        # more than one chunk was read ahead at once, while the step computed
        assert st["max_reads_in_flight"] >= 2
        # torch's thread setting is the caller's again after each step
        assert torch.get_num_threads() == threads
        # the buffers of the second step served the later ones: no allocation per step
        assert allocs[1] == allocs[2] == allocs[3]
        assert allocs[1] * (512 << 10) <= budget
        assert st["bytes_read"] == 3 * st["state_bytes"]  # every chunk, every step after the first
        sd = opt.state_dict()
        for i, p in enumerate(ref):
            for k, v in mem.state[p].items():
                assert torch.equal(sd["state"][i][k], v), (i, k)
    finally:
        opt.close()


def test_part_of_the_state_stays_resident_the_rest_streams(tmp_path):
    ours = _params(24, 16 << 10)  # 64 KiB each: state 128 KiB + a page
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    budget = 2 << 20  # less than the state (~3.1 MiB): half stays resident, half streams
    with Optimizer(torch.optim.Adam, ours, tmp_path, lr=1e-3, budget=budget, stream_room="1M") as opt:
        mem = torch.optim.Adam(ref, lr=1e-3)
        _step_both(opt, ours, mem, ref, 3)
        st = opt.stats()
        assert 0 < st["resident_chunks"] < st["chunks"]
        assert st["peak_memory_bytes"] <= budget and st["overdrafts"] == 0
        assert 0 < st["bytes_read"] < 2 * st["state_bytes"]
        for p, q in zip(ref, ours, strict=True):
            assert torch.equal(p, q)


class _Flaky(torch.optim.AdamW):
    """AdamW that fails on the chunk holding ``fail_on``."""

    fail_on = None

    def step(self, closure=None):
        if any(p is self.fail_on for g in self.param_groups for p in g["params"]):
            raise RuntimeError("boom")
        return super().step(closure)


def test_an_error_in_the_middle_of_a_step_leaves_nothing_in_flight(tmp_path):
    ours = _params(12, 64 << 10, seed=1)
    budget = 2 << 20
    opt = Optimizer(_Flaky, ours, tmp_path, lr=1e-3, budget=budget)
    try:
        _grads(ours, 0)
        opt.step()
        held = opt.stats()["memory_bytes"]
        _grads(ours, 1)
        _Flaky.fail_on = ours[6]  # fails there, with reads ahead in flight
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        _Flaky.fail_on = None
        st = opt.stats()
        # every buffer came back (the conftest fixture checks that no request is in flight)
        assert st["buffers_in_use"] == 0
        assert held <= st["memory_bytes"] <= st["peak_memory_bytes"] <= budget
        allocs = st["buffer_allocations"]
        for s in (2, 3):
            _grads(ours, s)
            opt.step()  # and the next steps run, on the same buffers
        st = opt.stats()
        assert st["buffers_in_use"] == 0 and st["buffer_allocations"] == allocs
        assert st["peak_memory_bytes"] <= budget and st["overdrafts"] == 0
    finally:
        opt.close()


def _same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert st.keys() == b["state"][k].keys()
        for name, v in st.items():
            w = b["state"][k][name]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, name)


@pytest.mark.parametrize("master", [False, True])
def test_a_parameter_whose_state_exceeds_the_budget_is_split_into_pieces(tmp_path, master):
    dtype = torch.bfloat16 if master else torch.float32
    ours = [torch.nn.Parameter(torch.randn(256, 256).to(dtype)), *_params(4, 1024, seed=3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    budget = 128 << 10  # the matrix's state is 512 KiB (fp32 Adam) or 768 KiB (bf16 with masters)
    kw = {"lr": 1e-3, "weight_decay": 0.1}
    with Optimizer(torch.optim.AdamW, ours, tmp_path, budget=budget, master_weights=master, **kw) as opt:
        if master:  # the in-memory recipe: fp32 masters stepped, rounded into the parameters
            masters = [p.detach().float() for p in ref]
            mem = torch.optim.AdamW(masters, **kw)
        else:
            mem = torch.optim.AdamW(ref, **kw)
        for s in range(3):
            _grads(ours, s)
            _grads(ref, s)
            opt.step()
            if master:
                for m, p in zip(masters, ref, strict=True):
                    m.grad = p.grad.float()
                mem.step()
                for m, p in zip(masters, ref, strict=True):
                    p.data.copy_(m)
            else:
                mem.step()
        st = opt.stats()
        # pieces of the matrix stream through the budget like any chunk: never over it
        assert st["overdrafts"] == 0 and 0 < st["peak_memory_bytes"] <= budget
        assert st["chunks"] > 8 and st["state_bytes"] > 2 * budget
        for p, q in zip(ref, ours, strict=True):
            assert torch.equal(p, q)
        # state_dict joins the pieces: the in-memory optimizer's layout and values
        sd = opt.state_dict()
        if not master:
            _same_state(sd, mem.state_dict())
        else:
            full = sd["state"][0]
            assert full["master"].shape == (256, 256) and full["master"].dtype == torch.float32
            assert torch.equal(full["master"], masters[0]) and torch.equal(
                full["exp_avg"], mem.state[masters[0]]["exp_avg"]
            )
    # and load_state_dict splits it again: a new optimizer goes on from it, bit for bit
    if not master:
        more = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        with Optimizer(torch.optim.AdamW, more, tmp_path / "again", budget=budget, **kw) as opt2:
            opt2.load_state_dict(sd)
            _step_both(opt2, more, mem, ref, 2)
            for p, q in zip(ref, more, strict=True):
                assert torch.equal(p, q)
            _same_state(opt2.state_dict(), mem.state_dict())
            assert opt2.stats()["overdrafts"] == 0


def test_a_non_contiguous_parameter_larger_than_the_budget_is_refused_with_the_budget_that_works(tmp_path):
    # it cannot be cut into flat pieces: its state must fit whole, so the constructor says so
    ours = [torch.nn.Parameter(torch.randn(256, 256).t()), *_params(4, 1024, seed=3)]
    assert not ours[0].is_contiguous()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    with pytest.raises(BudgetError, match=r"\(256, 256\) float32 parameter \(not contiguous") as e:
        Optimizer(torch.optim.AdamW, ours, tmp_path, lr=1e-3, budget=128 << 10)
    assert isinstance(e.value, MemoryError)
    smallest = int(
        re.search(r"the smallest budget that works for these parameters is (\d+) bytes", str(e.value))[1]
    )
    assert smallest == 516 << 10  # exp_avg and exp_avg_sq of 256 KiB each, the step count, in pages
    with pytest.raises(BudgetError):
        Optimizer(torch.optim.AdamW, ours, tmp_path, lr=1e-3, budget=smallest - 4096)
    # the budget it names is enough: stepped within it, bit for bit the optimizer in memory
    with Optimizer(torch.optim.AdamW, ours, tmp_path, lr=1e-3, budget=smallest) as opt:
        mem = torch.optim.AdamW(ref, lr=1e-3)
        _step_both(opt, ours, mem, ref, 3)
        st = opt.stats()
        assert st["overdrafts"] == 0 and st["peak_memory_bytes"] <= smallest
        for p, q in zip(ref, ours, strict=True):
            assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("cls", "kw", "state"),
    # state bytes per element, and the small tensors (AdamW's step count) of 64 bytes each
    [(torch.optim.AdamW, {"lr": 1e-3}, (8, 1)), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, (4, 0))],
)
def test_a_budget_too_small_for_any_chunk_is_refused_before_any_io(tmp_path, cls, kw, state):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    with pytest.raises(BudgetError) as e:
        Optimizer(cls, model.parameters(), tmp_path / "a", budget="4K", **kw)
    msg = str(e.value)
    # the largest chunk is a whole weight (too small a budget to cut pieces from), measured for this optimizer
    need = int(re.search(r"float32 parameter: (\d+) bytes", msg)[1])
    assert need == -(-(256 * 256 * state[0] + 64 * state[1]) // 4096) * 4096
    assert not (tmp_path / "a").exists()  # refused before the state's directory was made
    smallest = int(re.search(r"is (\d+) bytes", msg)[1])
    assert 4096 < smallest < need  # large enough to cut the weights into pieces, far less than a whole one
    with pytest.raises(BudgetError):
        Optimizer(cls, model.parameters(), tmp_path / "b", budget=smallest - 4096, **kw)
    with Optimizer(cls, model.parameters(), tmp_path / "c", budget=smallest, **kw) as opt:
        for _ in range(2):
            model(torch.randn(4, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        st = opt.stats()
        assert st["overdrafts"] == 0 and 0 < st["peak_memory_bytes"] <= smallest


def test_sgd_without_momentum_keeps_no_state_and_fits_any_budget(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(2)])
    with Optimizer(torch.optim.SGD, model.parameters(), tmp_path, lr=0.1, budget="4K") as opt:
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        assert opt.stats()["overdrafts"] == 0


class _Growing(torch.optim.SGD):
    """SGD whose state grows at its second step (an extra per-element tensor):
    past the layout the budget was checked for."""

    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if st.get("calls", 0) >= 1 and "extra" not in st:
                    st["extra"] = torch.zeros_like(p)
                st["calls"] = st.get("calls", 0) + 1
        return out


def test_state_that_grows_past_the_checked_layout_is_warned_about_once(tmp_path):
    ps = [torch.nn.Parameter(torch.randn(64 << 10))]  # 256 KiB: momentum 256 KiB, then 512 KiB with "extra"
    with Optimizer(_Growing, ps, tmp_path, lr=0.1, momentum=0.9, budget=384 << 10, chunk_size="1M") as opt:
        ps[0].grad = torch.ones_like(ps[0])
        opt.step()
        with pytest.warns(RuntimeWarning, match="went over its budget"):
            opt.step()
        assert opt.stats()["overdrafts"] == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()  # once


def test_steps_after_an_error_at_the_first_chunk_of_the_first_step(tmp_path):
    ours = _params(12, 64 << 10, seed=4)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = Optimizer(_Flaky, ours, tmp_path, lr=1e-3, budget=2 << 20)
    mem = torch.optim.AdamW(ref, lr=1e-3)
    try:
        _grads(ours, 0)
        _Flaky.fail_on = ours[0]  # fails before any state exists: the next steps start it afresh
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        _Flaky.fail_on = None
        _step_both(opt, ours, mem, ref, 3)
        for p, q in zip(ref, ours, strict=True):
            assert torch.equal(p, q)
        assert opt.stats()["buffers_in_use"] == 0
    finally:
        _Flaky.fail_on = None
        opt.close()
