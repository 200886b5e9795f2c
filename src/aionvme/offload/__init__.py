"""Models bigger than memory: layer-streamed inference and optimizer state on NVMe.

::

    import aionvme as nvme
    model = nvme.offload.stream(model, "/nvme/model", budget="2G", prefetch=2)
    out = model(inputs)                  # same outputs as the model held in memory

    opt = nvme.offload.Optimizer(torch.optim.AdamW, model.parameters(), "/nvme/optim", lr=1e-4, budget="1G")
    loss.backward(); opt.step(); opt.zero_grad()

torch is imported when :func:`stream` or :class:`Optimizer` is first used, not
by ``import aionvme``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._planner import BudgetError, InferenceOnlyError, StateLostError

if TYPE_CHECKING:
    from ._optimizer import Optimizer
    from ._stream import Streamer, stream, streamer_of

__all__ = [
    "BudgetError",
    "InferenceOnlyError",
    "Optimizer",
    "StateLostError",
    "Streamer",
    "stream",
    "streamer_of",
]

_LAZY = {
    "stream": "_stream",
    "streamer_of": "_stream",
    "Streamer": "_stream",
    "Optimizer": "_optimizer",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'aionvme.offload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
