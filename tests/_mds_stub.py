"""Test helper: make ``import streaming`` work without torchvision.

mosaicml-streaming is installed --no-deps; its package __init__ imports its
vision datasets, which import torchvision. A stand-in module tree with the
few names it imports is put into sys.modules (tests only, never the library).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


def import_streaming() -> Any:
    if importlib.util.find_spec("streaming") is None:
        import pytest

        pytest.skip("mosaicml-streaming is not installed")
    if importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules:
        mods = {}
        for name in (
            "torchvision",
            "torchvision.datasets",
            "torchvision.transforms",
            "torchvision.transforms.functional",
        ):
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            m.__path__ = []
            mods[name] = m

        class VisionDataset:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

        class CIFAR10(VisionDataset):
            pass

        def to_tensor(x: Any) -> Any:
            raise NotImplementedError("torchvision stub")

        mods["torchvision.datasets"].VisionDataset = VisionDataset
        mods["torchvision.datasets"].CIFAR10 = CIFAR10
        mods["torchvision.transforms.functional"].to_tensor = to_tensor
        mods["torchvision"].datasets = mods["torchvision.datasets"]
        mods["torchvision"].transforms = mods["torchvision.transforms"]
        mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
        sys.modules.update(mods)
    import streaming

    return streaming
