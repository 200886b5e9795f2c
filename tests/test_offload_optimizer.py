"""aionvme.offload.Optimizer: torch's optimizers with their state on NVMe,
compared bit for bit with the same optimizer run in memory."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")

from aionvme.offload import Optimizer  # noqa: E402


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    hidden = [m for _ in range(6) for m in (torch.nn.GELU(), torch.nn.Linear(32, 32))]
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), *hidden, torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


def _train(model, opt, steps: int, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and torch.equal(v, w), (k, name)
            else:
                assert v == w


@pytest.mark.parametrize(
    ("cls", "kwargs", "budget", "backend"),
    [
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": False}, 40 << 10, "store"),
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}, 50 << 10, "file"),
        (torch.optim.Adam, {"lr": 1e-3, "betas": (0.8, 0.95)}, 40 << 10, "file"),
        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, 20 << 10, "store"),
    ],
)
def test_bitwise_equal_to_the_optimizer_in_memory(tmp_path, cls, kwargs, budget, backend):
    ref_model = _net()
    model = copy.deepcopy(ref_model)
    ref = cls(_groups(ref_model), **kwargs)
    # A budget about half the state: most chunks are read and written every step.
    opt = Optimizer(cls, _groups(model), tmp_path, budget=budget, chunk_size="4K", backend=backend, **kwargs)
    try:
        _train(ref_model, ref, 3)
        _train(model, opt, 3)
        for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)
        st = opt.stats()
        assert st["chunks"] > 3
        assert st["bytes_written"] > 0 and st["bytes_read"] > 0
        assert st["resident_chunks"] < st["chunks"]
        assert st["state_bytes"] > budget
        assert st["peak_memory_bytes"] <= budget
        _assert_same_state(ref.state_dict(), opt.state_dict())
        assert len(opt.state) == 0  # nothing kept in memory between steps
    finally:
        opt.close()
    assert not any(f.startswith("optimizer-state") for f in os.listdir(tmp_path))


@pytest.mark.parametrize("backend", ["store", "file"])
def test_state_that_fits_stays_resident_and_does_no_io(tmp_path, backend):
    model = _net(1)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    with Optimizer(
        torch.optim.AdamW, model.parameters(), tmp_path, lr=1e-3, budget="16M", backend=backend
    ) as opt:
        _train(model, opt, 3)
        _train(ref_model, ref, 3)
        # nothing went to the device: the store's host tier (or the optimizer) kept it all
        assert opt.stats()["bytes_read"] == 0 and opt.stats()["bytes_written"] == 0
        if backend == "file":
            assert opt.stats()["resident_chunks"] == opt.stats()["chunks"]
        sd = opt.state_dict()
        _assert_same_state(ref.state_dict(), sd)
        before = {k: v["exp_avg"].clone() for k, v in sd["state"].items()}
        _train(model, opt, 1)
        # the state_dict is a snapshot: later steps do not change it
        assert all(torch.equal(before[k], sd["state"][k]["exp_avg"]) for k in before)


def test_load_state_dict_both_ways(tmp_path):
    ref_model = _net(2)
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(_groups(ref_model), lr=1e-3)
    _train(ref_model, ref, 2)
    model.load_state_dict(ref_model.state_dict())
    opt = Optimizer(torch.optim.AdamW, _groups(model), tmp_path, lr=1e-3, budget="40K", chunk_size="4K")
    try:
        opt.load_state_dict(ref.state_dict())
        assert opt.stats()["bytes_written"] > 0
        _train(ref_model, ref, 2, seed=9)
        _train(model, opt, 2, seed=9)
        for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)
        # ours -> a plain torch optimizer, which goes on identically
        plain_model = copy.deepcopy(model)
        plain = torch.optim.AdamW(_groups(plain_model), lr=1e-3)
        plain.load_state_dict(opt.state_dict())
        _train(plain_model, plain, 1, seed=11)
        _train(model, opt, 1, seed=11)
        for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)
    finally:
        opt.close()


def test_lr_scheduler_and_closure(tmp_path):
    model = _net(3)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    with Optimizer(
        torch.optim.AdamW, model.parameters(), tmp_path, lr=1e-2, budget="32K", chunk_size="4K"
    ) as opt:
        s1 = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
        s2 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        x, y = torch.randn(4, 16), torch.randn(4, 4)
        for _ in range(3):
            for m, o, s in ((ref_model, ref, s1), (model, opt, s2)):

                def closure(m=m, o=o):
                    o.zero_grad()
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    loss.backward()
                    return loss

                o.step(closure)
                s.step()
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 / 8
        for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)


def test_params_without_grad_are_left_alone(tmp_path):
    model = _net(4)
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    with Optimizer(
        torch.optim.AdamW, model.parameters(), tmp_path, lr=1e-3, budget="32K", chunk_size="4K"
    ) as opt:
        _train(ref_model, ref, 2)
        _train(model, opt, 2)
        _assert_same_state(ref.state_dict(), opt.state_dict())
        opt.close()
        with pytest.raises(RuntimeError, match="closed"):
            opt.step()


def test_bf16_parameters_and_foreach(tmp_path):
    ref_model = _net(6).to(torch.bfloat16)
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True)
    with Optimizer(
        torch.optim.AdamW, model.parameters(), tmp_path, lr=1e-2, foreach=True, budget="24K", chunk_size="2K"
    ) as opt:
        for m, o in ((ref_model, ref), (model, opt)):
            g = torch.Generator().manual_seed(2)
            for _ in range(2):
                x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
                m(x).float().square().mean().backward()
                o.step()
                o.zero_grad()
        assert opt.stats()["bytes_read"] > 0
        for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert q.dtype == torch.bfloat16 and torch.equal(p, q)
        _assert_same_state(ref.state_dict(), opt.state_dict())


def _mixed(seed: int) -> tuple[torch.nn.Module, torch.nn.Parameter]:
    """A bf16 net and one fp32 parameter next to it (master weights leave fp32 alone)."""
    model = _net(seed).to(torch.bfloat16)
    model.scale = torch.nn.Parameter(torch.full((4,), 1.5))
    return model, model.scale


def _mixed_step(model, scale, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    (model(x).float() * scale).square().mean().backward()


class _InMemoryMaster:
    """The mixed-precision recipe in memory: fp32 masters stepped by torch's
    optimizer, rounded into the bf16 parameters."""

    def __init__(self, model, **kwargs):
        self.params = list(model.parameters())
        self.masters = [p.detach().float() if p.dtype == torch.bfloat16 else p for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **kwargs)

    def step(self):
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("backend", ["store", "file"])
def test_master_weights_bitwise_equal_to_the_recipe_in_memory(tmp_path, backend):
    ref_model, ref_scale = _mixed(7)
    model = copy.deepcopy(ref_model)
    ref = _InMemoryMaster(ref_model, lr=1e-2, weight_decay=0.1)

    def make(params, path):
        return Optimizer(
            torch.optim.AdamW,
            params,
            path,
            lr=1e-2,
            weight_decay=0.1,
            budget="48K",
            chunk_size="1K",
            backend=backend,
            master_weights=True,
        )

    opt = make(model.parameters(), tmp_path / "a")
    try:
        for s in range(3):
            for m, o in ((ref_model, ref), (model, opt)):
                _mixed_step(m, m.scale, s)
                o.step()
                o.zero_grad()
        st = opt.stats()
        assert st["bytes_read"] > 0 and st["bytes_written"] > 0  # masters went through NVMe
        assert st["state_bytes"] > 48 << 10
        assert st["peak_memory_bytes"] <= 48 << 10
        # the update was not lost to bf16 rounding: masters differ from the params
        sd = opt.state_dict()
        ref_sd = ref.opt.state_dict()
        n_master = 0
        for i, (p, q, m) in enumerate(
            zip(ref_model.parameters(), model.parameters(), ref.masters, strict=True)
        ):
            assert q.dtype == p.dtype and torch.equal(p, q)
            ours = dict(sd["state"][i])
            if p.dtype == torch.bfloat16:
                master = ours.pop("master")
                assert master.dtype == torch.float32 and torch.equal(master, m)
                n_master += not torch.equal(master, q.float())
            else:
                assert "master" not in ours
            for k, v in ref_sd["state"][i].items():
                assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), (i, k)
            assert ours.keys() == ref_sd["state"][i].keys()
        assert n_master > 0
        # state_dict round trip into a fresh optimizer: fp32 stays fp32, and it goes on identically
        model2 = copy.deepcopy(model)
        opt2 = make(model2.parameters(), tmp_path / "b")
        try:
            opt2.load_state_dict(sd)
            back = opt2.state_dict()
            for i, v in sd["state"].items():
                for k, t in v.items():
                    assert back["state"][i][k].dtype == t.dtype and torch.equal(back["state"][i][k], t)
            for m, o in ((ref_model, ref), (model2, opt2)):
                _mixed_step(m, m.scale, 9)
                o.step()
                o.zero_grad()
            for p, q in zip(ref_model.parameters(), model2.parameters(), strict=True):
                assert torch.equal(p, q)
        finally:
            opt2.close()
    finally:
        opt.close()
