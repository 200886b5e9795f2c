"""transformers models loaded through aionvme.

``from_pretrained(ModelClass, path, **kwargs)`` in place of
``ModelClass.from_pretrained(path, **kwargs)`` for a model saved on a local
disk (``save_pretrained``'s layout: ``config.json`` and ``model.safetensors``,
or shards named by ``model.safetensors.index.json``). The shards are read
concurrently, each with O_DIRECT into one page-aligned allocation
(:func:`aionvme.load_safetensors`), and handed to transformers through its own
``state_dict=`` argument: transformers builds the model, applies ``dtype``,
``device_map``, key renames and weight conversions, ties the tied weights and
loads the generation config exactly as it does from files. Nothing in
transformers is patched.

Only files inside the model directory are read: an index naming a file
outside it (an absolute path, ``..``) or a weight file that is a symbolic link
leading out of it raises :class:`UnsafeModelPathError` before anything is
read. The one exception is the Hugging Face cache's own layout, where the
files of ``snapshots/<revision>/`` are links into the repository's ``blobs/``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
from typing import Any

from .._runtime import background as _background
from ..exceptions import AionvmeError, os_error
from ..formats import SafetensorsError, load_safetensors

__all__ = [
    "UnsafeModelPathError",
    "from_pretrained",
    "from_pretrained_async",
    "load_state_dict",
    "weight_files",
]

SAFE_WEIGHTS_NAME = "model.safetensors"  # transformers.utils.SAFE_WEIGHTS_NAME
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"  # transformers.utils.SAFE_WEIGHTS_INDEX_NAME


class UnsafeModelPathError(AionvmeError, PermissionError):
    """A model directory names a weight file outside itself: its index names
    an absolute path or one through ``..``, or a weight file is a symbolic
    link whose target lies outside the directory. A ``PermissionError``
    (EACCES) whose ``filename`` is the offending name."""

    def __init__(self, filename: str, why: str) -> None:
        super().__init__(errno.EACCES, f"{os.strerror(errno.EACCES)} (refusing to read {why})", filename)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_unsafe, (self.filename, self.strerror))


def _rebuild_unsafe(filename: str, strerror: str) -> UnsafeModelPathError:
    exc = UnsafeModelPathError.__new__(UnsafeModelPathError)
    PermissionError.__init__(exc, errno.EACCES, strerror, filename)
    return exc


def _add_variant(name: str, variant: str | None) -> str:
    """transformers' naming of a variant: ``model.safetensors`` -> ``model.fp16.safetensors``."""
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _roots(directory: str) -> list[str]:
    """Where the weight files of ``directory`` may resolve to: the directory,
    and for a snapshot of the Hugging Face cache (``.../snapshots/<rev>``)
    the repository's ``blobs``."""
    real = os.path.realpath(directory)
    roots = [real]
    if os.path.basename(os.path.dirname(os.path.abspath(directory))) == "snapshots":
        roots.append(os.path.realpath(os.path.join(directory, "..", "..", "blobs")))
    return roots


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _checked(directory: str, name: object, source: str) -> str:
    """The real path of weight file ``name`` of ``directory`` (named by ``source``),
    or a typed error if it is not a plain name inside the directory."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise SafetensorsError(f"weight file name {name!r} is not a file name", source)
    shown = os.path.join(directory, name)
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] in ("..", "."):
        raise UnsafeModelPathError(name, f"{name!r}, named by {source}: it is outside {directory}")
    real = os.path.realpath(shown)
    roots = _roots(directory)
    if not any(_inside(real, r) for r in roots):
        raise UnsafeModelPathError(
            shown, f"{shown!r}: a symbolic link to {real!r}, outside the model directory {roots[0]}"
        )
    try:
        st = os.stat(real)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, shown, op="stat (weight file)") from None
    if not stat.S_ISREG(st.st_mode):
        raise SafetensorsError("a weight file must be a regular file", shown)
    return real


def _explicit_weights(directory: str) -> str | None:
    """``transformers_weights`` of ``config.json`` (a file name the config
    chooses), as transformers reads it; None when absent."""
    try:
        with open(os.path.join(directory, "config.json"), "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError):
        return None  # transformers reports a bad or missing config itself
    name = cfg.get("transformers_weights") if isinstance(cfg, dict) else None
    return name if isinstance(name, str) else None


def _index_files(index: str) -> list[object]:
    try:
        with open(index, "rb") as f:
            text = f.read()
    except OSError as e:
        raise os_error(e.errno or errno.EIO, index, op="open (index)") from None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"index is not valid JSON: {e}", index) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise SafetensorsError('index needs a "weight_map" object of tensor name -> shard file', index)
    return sorted(set(wm.values()), key=str)


def weight_files(path: str | os.PathLike[str], *, variant: str | None = None) -> list[str]:
    """The safetensors files ``from_pretrained`` would read for the model in
    directory ``path``, as real paths, checked to lie inside it.

    transformers' order: ``config.json``'s ``transformers_weights`` if set,
    else ``model.safetensors``, else the shards that
    ``model.safetensors.index.json`` names (sorted, each once).

    Raises
    ------
    FileNotFoundError, NotADirectoryError
        No such directory, or it holds no safetensors weights.
    UnsafeModelPathError
        A weight file outside the directory (see the module documentation).
    SafetensorsError
        An index that is not JSON or has no ``weight_map``.
    """
    directory = os.fsdecode(os.fspath(path))
    if not os.path.isdir(directory):
        code = errno.ENOTDIR if os.path.exists(directory) else errno.ENOENT
        raise os_error(code, directory, op="open (model directory)")
    explicit = _explicit_weights(directory)
    if explicit is not None:
        if not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise SafetensorsError(f"transformers_weights {explicit!r} is not a safetensors file", directory)
        candidates = [explicit]
    else:
        candidates = [
            _add_variant(SAFE_WEIGHTS_NAME, variant),
            _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant),
        ]
    for name in candidates:
        if not os.path.lexists(os.path.join(directory, name)):
            continue
        real = _checked(directory, name, "config.json" if explicit else directory)
        if not name.endswith(".json"):  # the index, variant or not: model.safetensors.index[.v].json
            return [real]
        return [_checked(directory, shard, name) for shard in _index_files(real)]
    raise FileNotFoundError(
        errno.ENOENT,
        f"no {' or '.join(candidates)} in the directory (aionvme loads safetensors weights; "
        "for .bin files use ModelClass.from_pretrained)",
        directory,
    )


async def load_state_dict(path: str | os.PathLike[str], *, variant: str | None = None) -> dict[str, Any]:
    """Every tensor of the model in directory ``path`` (see :func:`weight_files`),
    in host memory. The shards are read concurrently; a failure cancels the
    others and waits for them before it propagates. Tensors keep the files'
    dtypes; a truncated or malformed shard raises :class:`~aionvme.SafetensorsError`."""
    files = await asyncio.to_thread(weight_files, path, variant=variant)
    tasks = [asyncio.ensure_future(load_safetensors(f, device="cpu")) for f in files]
    try:
        parts = await asyncio.gather(*tasks)
    except BaseException:
        # no read may still be filling memory when the error propagates
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    state: dict[str, Any] = {}
    for f, part in zip(files, parts):
        for name, tensor in part.items():
            if name in state:
                raise SafetensorsError(f"tensor {name!r} is in two weight files", f)
            state[name] = tensor
    return state


_OURS = ("state_dict", "gguf_file", "use_safetensors", "subfolder", "variant")


def _model_kwargs(
    path: str | os.PathLike[str], kwargs: dict[str, Any]
) -> tuple[str, str | None, dict[str, Any]]:
    """(model directory, variant, what goes on to transformers)."""
    for bad in ("state_dict", "gguf_file"):
        if kwargs.get(bad) is not None:
            raise TypeError(
                f"{bad}= is not for aionvme's from_pretrained: it loads the weights of the directory"
            )
    dm = kwargs.get("device_map")
    if kwargs.get("offload_folder") is not None or (isinstance(dm, dict) and "disk" in dm.values()):
        # transformers builds its disk-offload index from the weight files, which it is not
        # given here (a forward pass of a model loaded so then fails on tied weights)
        raise ValueError(
            "disk offload (offload_folder=, device_map with 'disk') is not supported by aionvme's "
            "from_pretrained: use ModelClass.from_pretrained, or aionvme.integrations.accelerate"
        )
    if kwargs.get("use_safetensors") is False:
        raise ValueError("use_safetensors=False: aionvme loads safetensors weights only")
    directory = os.fsdecode(os.fspath(path))
    if kwargs.get("subfolder"):
        directory = os.path.join(directory, kwargs["subfolder"])
    rest = {k: v for k, v in kwargs.items() if k not in _OURS}
    rest.setdefault("config", directory)  # transformers reads it, splitting config kwargs off as usual
    if "generation_config" not in rest and os.path.isfile(os.path.join(directory, "generation_config.json")):
        # from_pretrained reads it from the directory with the kwargs it did not
        # use itself, which set the generation flags they name (output_attentions=...)
        from transformers import GenerationConfig

        flags: Any = GenerationConfig()  # type: ignore[no-untyped-call]
        ours = {k: v for k, v in rest.items() if k != "config" and hasattr(flags, k)}
        rest["generation_config"] = GenerationConfig.from_pretrained(directory, **ours)
    return directory, kwargs.get("variant"), rest


def _concrete(model_class: Any, rest: dict[str, Any]) -> Any:
    """The model class an ``AutoModel...`` class picks for the config, as its
    from_pretrained does (an Auto class cannot take ``state_dict=`` without a
    path); any other class as it is."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    from transformers import AutoConfig, PretrainedConfig

    config = rest["config"]
    if not isinstance(config, PretrainedConfig):
        config = AutoConfig.from_pretrained(config, trust_remote_code=rest.get("trust_remote_code"))
    try:
        found = mapping[type(config)]
    except KeyError:
        raise ValueError(
            f"{model_class.__name__} has no model class for {type(config).__name__} "
            "(remote code models: pass their class itself)"
        ) from None
    if isinstance(found, (list, tuple)):  # several: the one the config names, as transformers picks
        names = set(getattr(config, "architectures", None) or [])
        found = next((c for c in found if c.__name__ in names), found[0])
    return found


def _build(model_class: Any, path: Any, state: dict[str, Any], rest: dict[str, Any]) -> Any:
    out = _concrete(model_class, rest).from_pretrained(None, state_dict=state, **rest)
    model = out[0] if isinstance(out, tuple) else out
    model.config.name_or_path = os.fsdecode(os.fspath(path))  # as transformers records the path it loaded
    return out


def from_pretrained(model_class: Any, path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``model_class.from_pretrained(path, **kwargs)``, with the weights read by aionvme.

    Parameters
    ----------
    model_class : a transformers ``PreTrainedModel`` class
        ``LlamaForCausalLM``, ``AutoModelForCausalLM``, ...
    path : str or os.PathLike
        A local model directory in ``save_pretrained``'s layout (sharded or
        not; ``subfolder=`` and ``variant=`` as in transformers).
    **kwargs
        What ``from_pretrained`` takes: ``dtype``, ``device_map``,
        ``attn_implementation``, config overrides, ``output_loading_info``...

    Returns
    -------
    What ``model_class.from_pretrained(path, **kwargs)`` returns: the same
    model, state dict, config and generation config, tied weights tied.

    Notes
    -----
    The weights are read into host memory first (every shard at once), then
    transformers casts and places them. Blocks this thread; on a thread
    whose event loop runs, ``await from_pretrained_async(...)``.
    """
    directory, variant, rest = _model_kwargs(path, kwargs)
    state = _background.run(
        "from_pretrained", "from_pretrained_async", load_state_dict(directory, variant=variant)
    )
    return _build(model_class, path, state, rest)


async def from_pretrained_async(model_class: Any, path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """:func:`from_pretrained` for async code: the weights are awaited, then the
    model is built on a worker thread (it is CPU work), so the event loop keeps
    serving other tasks meanwhile."""
    directory, variant, rest = await asyncio.to_thread(_model_kwargs, path, kwargs)
    state = await load_state_dict(directory, variant=variant)
    return await asyncio.to_thread(_build, model_class, path, state, rest)
