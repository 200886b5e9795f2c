"""accelerate's disk offload, read ahead through aionvme.

::

    from aionvme.integrations.accelerate import disk_offload
    model = disk_offload(model, "/nvme/offload", execution_device="cpu", budget="2G")   # was accelerate's
    with torch.inference_mode():
        logits = model(ids).logits              # bit for bit accelerate's own disk offload

accelerate's ``disk_offload`` puts an ``AlignDevicesHook`` on every module that
holds weights; before the module runs, the hook takes each weight from a
``weights_map`` (accelerate's ``OffloadedWeightsLoader``: one ``np.memmap``
read per weight, nothing ahead). Here the hooks are accelerate's own, attached
by accelerate's own ``attach_align_device_hook``; only the ``weights_map`` is
aionvme's (:class:`WeightsMap`). Its weights are read by
:class:`aionvme.offload.Streamer` (the engine of ``aionvme.offload.stream``):
block by block (a transformer layer with all its weights), the next
``prefetch`` blocks while the current one computes, through a
:class:`aionvme.TieredStore` whose host memory is ``budget`` (pinned when CUDA
is available, so the hook's copy to the GPU is a DMA).

The offload folder is accelerate's format (``index.json`` and one ``.dat``
file per weight), written by accelerate's own ``offload_state_dict`` when the
folder has no ``index.json``: a folder written by accelerate is read here, and
one written here is read by accelerate. Index entries that point into
safetensors files (``{"safetensors_file": ..., "weight_name": ...}``, what
``load_checkpoint_and_dispatch`` records) are read from those files.

accelerate is imported only by this module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..defaults import parse_size
from ..exceptions import AionvmeError
from ..file import open as nvme_open
from ..formats import SafetensorsError, read_header
from ..offload._index import Entry, WeightIndex
from ..offload._loop import LoopThread
from ..offload._stream import Streamer, start_streamer
from ..offload._units import default_groups

__all__ = [
    "OffloadIndexError",
    "WeightsMap",
    "disk_offload",
    "dispatch_model",
    "read_offload_index",
    "weights_map_of",
]

_ATTR = "_aionvme_weights_map"
INDEX_NAME = "index.json"


class OffloadIndexError(AionvmeError, ValueError):
    """An offload folder's ``index.json`` is unreadable or names weights its files do not hold."""

    def __init__(self, message: str, path: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


def _torch_dtype(name: str, path: str) -> str:
    """accelerate records numpy's dtype name, or (bf16, fp8: numpy lacks them) torch's;
    the bytes are the tensor's own either way (utils/offload.py offload_weight)."""
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise OffloadIndexError(f"dtype {name!r} has no torch dtype", path)
    return name


def read_offload_index(
    offload_dir: str | os.PathLike[str], index: Mapping[str, Any] | None = None
) -> WeightIndex:
    """Where each weight of an accelerate offload folder lives.

    ``index`` is accelerate's offload index (default: the folder's
    ``index.json``): per weight, ``{"dtype", "shape"}`` for a ``<name>.dat``
    file of raw bytes in the folder, or ``{"safetensors_file", "weight_name"}``
    for a tensor of a safetensors file.
    """
    folder = os.fspath(offload_dir)
    where = os.path.join(folder, INDEX_NAME)
    if index is None:
        try:
            with open(where, encoding="utf-8") as fh:
                index = json.load(fh)
        except ValueError as e:
            raise OffloadIndexError(f"not valid JSON: {e}", where) from None
    if not isinstance(index, Mapping):
        raise OffloadIndexError("the index is not an object of weight name -> entry", where)
    entries: dict[str, Entry] = {}
    sizes: dict[str, int] = {}
    headers: dict[str, Any] = {}
    loop: LoopThread | None = None
    try:
        for name, info in index.items():
            if not isinstance(info, Mapping):
                raise OffloadIndexError(f"entry {name!r} is not an object", where)
            st = info.get("safetensors_file")
            if st is not None:
                path = os.path.abspath(os.fspath(st))
                if path not in headers:
                    loop = loop or LoopThread("accelerate-index")
                    headers[path] = loop.run(read_header(path))
                    sizes[path] = headers[path].data_start + headers[path].data_len
                h = headers[path]
                key = info.get("weight_name", name)
                t = h.tensors.get(key)
                if t is None:
                    raise OffloadIndexError(f"{path} holds no tensor {key!r} (for {name!r})", where)
                if t.dtype.torch is None:
                    raise SafetensorsError(f"dtype {t.dtype.code} has no torch dtype", path, key)
                entries[name] = Entry(
                    name, path, h.data_start + t.begin, t.nbytes, t.dtype.torch, tuple(t.shape)
                )
                continue
            try:
                dtype = _torch_dtype(str(info["dtype"]), where)
                shape = tuple(int(d) for d in info["shape"])
            except (KeyError, TypeError, ValueError) as e:
                raise OffloadIndexError(f"entry {name!r} needs dtype and shape ({e})", where) from None
            path = os.path.join(folder, f"{name}.dat")
            nbytes = math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise FileNotFoundError(
                    2, f"the offload index names {name!r}, but its file is missing", path
                ) from None
            if size < nbytes:
                raise OffloadIndexError(
                    f"{path} holds {size} bytes, the index says {name!r} has {nbytes}", where
                )
            sizes[path] = size
            entries[name] = Entry(name, path, 0, nbytes, dtype, shape)
    finally:
        if loop is not None:
            loop.close()
    return WeightIndex(entries, sorted(sizes), sizes)


class WeightsMap(Mapping[str, torch.Tensor]):
    """A ``weights_map`` for accelerate's ``AlignDevicesHook``: weight name -> tensor.

    Made by :func:`disk_offload` (or by hand: ``WeightsMap(offload_dir)`` and
    :meth:`read_ahead`). While a block's forward runs, the hook gets the
    block's weights as views of the memory the block was read into (read
    ahead, while the blocks before it computed). A weight asked for outside
    its block's forward (or before :meth:`read_ahead`) is read on its own
    into memory of its own: accelerate's behaviour, at aionvme's speed.

    Parameters
    ----------
    offload_dir : str or os.PathLike
        An accelerate offload folder (``index.json`` + ``.dat`` files).
    index : mapping, optional
        accelerate's offload index, instead of the folder's ``index.json``.
    state_dict : dict, optional
        Weights kept in memory, which take priority (as in
        ``OffloadedWeightsLoader``).
    """

    def __init__(
        self,
        offload_dir: str | os.PathLike[str],
        index: Mapping[str, Any] | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.offload_dir = os.fspath(offload_dir)
        self.raw_index: dict[str, Any] = dict(index) if index is not None else {}
        self.index = read_offload_index(self.offload_dir, index)
        if index is None:
            with open(os.path.join(self.offload_dir, INDEX_NAME), encoding="utf-8") as fh:
                self.raw_index = dict(json.load(fh))
        self.state_dict: dict[str, torch.Tensor] = dict(state_dict or {})
        self._keys = list(self.state_dict) + [k for k in self.index.entries if k not in self.state_dict]
        self.streamer: Streamer | None = None
        self._slot_of: dict[str, tuple[int, int]] = {}  # weight name -> (unit id, slot)
        self.own_reads = 0  # weights read on their own (outside their block's forward)

    # -- Mapping --------------------------------------------------------------------------

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        e = self.index.entries.get(key)
        if e is None:
            raise KeyError(key)
        s = self.streamer
        where = self._slot_of.get(key)
        if s is not None and where is not None:
            uid, k = where
            loaded = s.loaded.get(uid)
            if loaded is not None and s.units[uid].active > 0:
                # resident and in use until the block's forward ends (the
                # streamer's post-forward hook runs after accelerate's, which
                # has then put the module's weights back on the meta device)
                return self._as_indexed(key, loaded[k])
        return self._as_indexed(key, self._read_one(e))

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index.entries

    def _as_indexed(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """An entry of a safetensors file may ask for another dtype (accelerate converts it)."""
        want = self.raw_index.get(key, {}).get("safetensors_file") and self.raw_index[key].get("dtype")
        return t.to(getattr(torch, want)) if want else t

    def _read_one(self, e: Entry) -> torch.Tensor:
        out = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        if e.nbytes:
            with nvme_open(e.path, "r") as f:
                f.sync_pread(out.view(-1).view(torch.uint8), e.offset)
        self.own_reads += 1
        return out

    # -- read-ahead ------------------------------------------------------------------------

    def read_ahead(
        self, model: nn.Module, *, budget: int | str = "1G", prefetch: int = 2, include_buffers: bool = True
    ) -> None:
        """Read the weights of ``model``'s blocks ahead of its forward, within ``budget`` bytes.

        ``model`` is the module whose forward is one pass (the one accelerate's
        hooks were attached to, its weights named as in this map). Blocks are
        the children of its largest ``ModuleList`` and one per other
        submodule (see :func:`aionvme.offload.stream`); a forward hook on
        each block tells the streamer when the block begins and ends, and the
        first pass records their order. Inference only: a forward with
        autograd on raises :class:`aionvme.offload.InferenceOnlyError`.
        ``include_buffers=False`` reads parameters only (accelerate's hooks
        with ``offload_buffers=False`` never ask for buffers).
        """
        if self.streamer is not None:
            raise ValueError("this weights map already reads ahead for a model; close() it first")
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        offloaded = {
            k: e
            for k, e in self.index.entries.items()
            if k not in self.state_dict and (include_buffers or k in params)
        }
        # only the tensors this map reads (a dispatched model keeps others on a device or in memory)
        names: dict[int, list[str]] = {}
        for n, t in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ):
            names.setdefault(id(t), []).append(n)
        groups = [
            (g, root, [t for t in ts if any(n in offloaded for n in names.get(id(t), ()))])
            for g, root, ts in default_groups(model)
        ]
        s = start_streamer(
            model,
            WeightIndex(offloaded, self.index.files, self.index.sizes),
            name="accelerate",
            budget=parse_size(budget),
            device=torch.device("cpu"),
            prefetch=prefetch,
            dtype=None,
            source=self.offload_dir,
            bind=False,
            groups=[g for g in groups if g[2]],
        )
        modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        for u in s.units:
            for k, slot in enumerate(u.slots):
                for m, attr in slot.buffer_refs:
                    prefix = modules.get(id(m), "")
                    self._slot_of[f"{prefix}.{attr}" if prefix else attr] = (u.id, k)
        self.streamer = s

    def stats(self) -> dict[str, Any]:
        """The streamer's counters (bytes read, waits, peak memory, ...) and ``own_reads``."""
        out: dict[str, Any] = dict(self.streamer.stats()) if self.streamer is not None else {}
        out["own_reads"] = self.own_reads
        return out

    def close(self) -> None:
        """Stop reading ahead: hooks of the streamer removed, its memory released. Idempotent;
        the map still answers (each weight read on its own)."""
        s, self.streamer = self.streamer, None
        self._slot_of.clear()
        if s is not None:
            s.close()


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    execution_device: torch.device | str | int | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
    *,
    budget: int | str = "1G",
    prefetch: int = 2,
) -> nn.Module:
    """accelerate's ``disk_offload``, with the weights read ahead by aionvme.

    The first five parameters are accelerate's (``accelerate.disk_offload``):
    the model's weights go to ``offload_dir`` (unless it already holds an
    ``index.json``), accelerate's ``AlignDevicesHook`` is attached to every
    module holding weights, and each forward brings them back on
    ``execution_device`` (default: the device of the model's first
    parameter).

    Parameters
    ----------
    budget : int or str
        Host memory for the weights read ahead and in use, e.g. ``"2G"``
        (pinned when CUDA is available). The largest block must fit.
    prefetch : int
        Blocks read ahead while one computes.

    Returns
    -------
    The model; :func:`weights_map_of` gives its :class:`WeightsMap`
    (``stats()``, ``close()``).

    Notes
    -----
    Inference only (run under ``torch.inference_mode()`` or
    ``torch.no_grad()``): the memory a block was read into is reused once
    it has run. accelerate's ``remove_hook_from_module(model, recurse=True)``
    removes accelerate's hooks; ``weights_map_of(model).close()`` removes
    aionvme's and frees its memory.
    """
    from accelerate.hooks import (  # type: ignore[import-untyped,unused-ignore]
        AlignDevicesHook,
        add_hook_to_module,
        attach_align_device_hook,
    )
    from accelerate.utils import offload_state_dict  # type: ignore[import-untyped,unused-ignore]

    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model is already offloaded by aionvme; close its weights map first")
    folder = os.fspath(offload_dir)
    if not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, INDEX_NAME)):
        offload_state_dict(folder, model.state_dict())
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    weights = WeightsMap(folder)
    weights.read_ahead(model, budget=budget, prefetch=prefetch, include_buffers=offload_buffers)
    try:
        add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
        attach_align_device_hook(
            model,
            execution_device=execution_device,
            offload=True,
            offload_buffers=offload_buffers,
            weights_map=weights,
            preload_module_classes=preload_module_classes,
        )
    except BaseException:
        weights.close()
        raise
    setattr(model, _ATTR, weights)
    return model


def weights_map_of(model: nn.Module) -> WeightsMap:
    """The :class:`WeightsMap` of a model offloaded by :func:`disk_offload`."""
    w = getattr(model, _ATTR, None)
    if not isinstance(w, WeightsMap):
        raise ValueError("this model is not offloaded by aionvme.integrations.accelerate.disk_offload")
    return w


def dispatch_model(
    model: nn.Module,
    device_map: dict[str, str | int | torch.device],
    main_device: str | int | torch.device | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: dict[str, Any] | None = None,
    offload_buffers: bool = False,
    *,
    budget: int | str = "1G",
    prefetch: int = 2,
    **kwargs: Any,
) -> nn.Module:
    """accelerate's ``dispatch_model``, with the modules on ``"disk"`` read ahead by aionvme.

    Same arguments as ``accelerate.dispatch_model`` (``skip_keys``,
    ``preload_module_classes``, ``force_hooks`` pass through ``kwargs``), and
    ``budget``/``prefetch`` as in :func:`disk_offload`. accelerate dispatches
    the model as usual; then every ``AlignDevicesHook`` that reads from the
    ``OffloadedWeightsLoader`` accelerate made reads from a :class:`WeightsMap`
    over the same folder, index and in-memory weights instead.

    Notes
    -----
    ``dispatch_model`` has no ``weights_map`` argument: its loader is swapped
    in the hooks it attached (each hook's ``weights_map`` is accelerate's
    ``PrefixedDataset`` over the loader; its ``dataset`` attribute is
    replaced). That is the one place this integration changes an accelerate
    object after the fact.
    """
    import accelerate  # type: ignore[import-untyped,unused-ignore]
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset  # type: ignore[import-untyped,unused-ignore]

    accelerate.dispatch_model(
        model,
        device_map,
        main_device=main_device,
        state_dict=state_dict,
        offload_dir=offload_dir,
        offload_index=offload_index,
        offload_buffers=offload_buffers,
        **kwargs,
    )
    views = [
        h.weights_map
        for h in _align_hooks(model)
        if isinstance(h.weights_map, PrefixedDataset)
        and isinstance(h.weights_map.dataset, OffloadedWeightsLoader)
    ]
    loaders = {id(v.dataset): v.dataset for v in views}
    if not loaders:
        return model  # nothing on disk: accelerate's own dispatch is all there is
    if len(loaders) > 1:
        raise ValueError("the dispatched model's hooks read from several weight loaders; expected one")
    (loader,) = loaders.values()
    folder = loader.save_folder if loader.save_folder is not None else offload_dir or "."
    weights = WeightsMap(folder, index=loader.index, state_dict=loader.state_dict)
    weights.read_ahead(model, budget=budget, prefetch=prefetch, include_buffers=offload_buffers)
    for v in views:
        v.dataset = weights
    setattr(model, _ATTR, weights)
    return model


def _align_hooks(model: nn.Module) -> list[Any]:
    """Every AlignDevicesHook accelerate attached to the model's modules."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook  # type: ignore[import-untyped,unused-ignore]

    out = []
    for m in model.modules():
        h = getattr(m, "_hf_hook", None)
        for x in h.hooks if isinstance(h, SequentialHook) else [h]:
            if isinstance(x, AlignDevicesHook):
                out.append(x)
    return out
