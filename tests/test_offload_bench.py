"""``aionvme bench -w offload``: the registered workload runs end to end on a
tiny model and reports both halves against their bounds."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from aionvme.bench import registry


async def test_offload_workload_reports_both_bounds(tmp_path):
    assert "offload" in registry.names()
    ctx = registry.Context(
        str(tmp_path), options={"model": "3M", "budget": "2200K", "params": "256K", "opt_budget": "2M"}
    )
    r = await registry.run("offload", ctx)
    assert r.skipped is None and r.verified, r.notes
    f = r.figures
    # the whole model was read (it does not fit the budget)
    hidden = r.params["hidden"]
    assert f["stream_read_MB"] >= 0.99 * r.params["layers"] * 4 * (hidden * hidden + hidden) / 1e6
    assert 0 < f["stream_peak_memory_MB"] <= 2200 * 1024 / 1e6  # the budget, measured
    assert 0 < f["optimizer_peak_memory_MB"] <= 2.1
    assert f["stream_bound_s"] > 0 and f["optimizer_io_bound_s"] > 0
    assert f["optimizer_io_MB"] > 0
    assert any("stream" in n and "bound" in n for n in r.notes)
    # each bound is max(its I/O, the same math in memory): the optimizer's counted its math too
    assert f["stream_bound_s"] == max(f["stream_read_s"], f["stream_compute_s"])
    assert f["optimizer_memory_step_s"] > 0
    assert f["optimizer_bound_s"] == max(f["optimizer_io_bound_s"], f["optimizer_memory_step_s"])
    # 256 KiB layers (the widest under a sixth of the budget): no target is claimed for them
    assert hidden == 256 and any("no target under 4 MiB layers" in n for n in r.notes)
    assert r.params["cold_cache"] is True
