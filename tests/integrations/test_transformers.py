"""aionvme.integrations.transformers against real transformers: tiny models built
here, saved with save_pretrained (sharded and single-file), loaded through
aionvme and through ModelClass.from_pretrained, compared bitwise; hostile
directories raise typed errors."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs transformers (the test extra)")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import aionvme as nvme
from aionvme.integrations import transformers as T


def _llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(1)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, make, shard in (
        ("llama_sharded", _llama, "40KB"),
        ("llama_single", _llama, "10GB"),
        ("llama_untied", lambda: _llama(tied=False), "40KB"),
        ("gpt2_sharded", _gpt2, "30KB"),
    ):
        make().save_pretrained(root / name, max_shard_size=shard)
        out[name] = root / name
    assert (out["llama_sharded"] / "model.safetensors.index.json").exists()
    assert (out["llama_single"] / "model.safetensors").exists()
    return out


def _same_model(got: Any, ref: Any) -> None:
    a, b = got.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    for (n, p), (m, q) in zip(got.named_parameters(), ref.named_parameters()):
        assert n == m and p.dtype == q.dtype and p.requires_grad == q.requires_grad
    assert got.config.to_dict() == ref.config.to_dict()
    assert got.generation_config.to_dict() == ref.generation_config.to_dict()
    assert got.training == ref.training
    ids = torch.arange(12).reshape(2, 6) % got.config.vocab_size
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("name", ["llama_sharded", "llama_single", "llama_untied", "gpt2_sharded"])
def test_same_model_as_from_pretrained(saved: dict[str, Path], name: str) -> None:
    cls = GPT2LMHeadModel if name.startswith("gpt2") else LlamaForCausalLM
    got = T.from_pretrained(cls, saved[name])
    ref = cls.from_pretrained(saved[name])
    _same_model(got, ref)
    emb, head = got.get_input_embeddings().weight, got.get_output_embeddings().weight
    assert (emb is head) == (ref.get_input_embeddings().weight is ref.get_output_embeddings().weight)
    assert (emb is head) == (name != "llama_untied")


def test_auto_classes(saved: dict[str, Path]) -> None:
    from transformers import AutoModel, AutoModelForCausalLM

    got = T.from_pretrained(AutoModelForCausalLM, saved["gpt2_sharded"])
    ref = AutoModelForCausalLM.from_pretrained(saved["gpt2_sharded"])
    assert type(got) is type(ref) is GPT2LMHeadModel
    _same_model(got, ref)
    base, ref_base = (
        T.from_pretrained(AutoModel, saved["llama_sharded"]),
        AutoModel.from_pretrained(saved["llama_sharded"]),
    )
    assert type(base) is type(ref_base) and base.config.to_dict() == ref_base.config.to_dict()
    a, b = base.state_dict(), ref_base.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_and_config_kwargs_are_honoured(saved: dict[str, Path], tmp_path: Path) -> None:
    d = saved["llama_sharded"]
    kw: dict[str, Any] = {"dtype": torch.float16, "output_attentions": True, "attn_implementation": "eager"}
    got, ref = T.from_pretrained(LlamaForCausalLM, d, **kw), LlamaForCausalLM.from_pretrained(d, **kw)
    assert got.dtype == torch.float16 and got.config.output_attentions
    _same_model(got, ref)
    # a bf16 model under dtype="auto" (the default) stays bf16, as transformers keeps it
    _llama().to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    got = T.from_pretrained(LlamaForCausalLM, tmp_path / "bf16")
    assert got.dtype == torch.bfloat16
    _same_model(got, LlamaForCausalLM.from_pretrained(tmp_path / "bf16"))
    # output_loading_info: the same report
    g, ginfo = T.from_pretrained(LlamaForCausalLM, d, output_loading_info=True)
    r, rinfo = LlamaForCausalLM.from_pretrained(d, output_loading_info=True)
    assert ginfo == rinfo


def test_subfolder_variant_and_the_hub_cache_layout(tmp_path: Path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path / "repo" / "sub", variant="fp16x", max_shard_size="40KB")
    got = T.from_pretrained(LlamaForCausalLM, tmp_path / "repo", subfolder="sub", variant="fp16x")
    _same_model(got, LlamaForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub", variant="fp16x"))
    # the Hugging Face cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    model.save_pretrained(tmp_path / "plain")
    snap = tmp_path / "models--x--y" / "snapshots" / "abc123"
    blobs = tmp_path / "models--x--y" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(os.listdir(tmp_path / "plain"))):
        shutil.move(tmp_path / "plain" / f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f)
    _same_model(T.from_pretrained(LlamaForCausalLM, snap), LlamaForCausalLM.from_pretrained(snap))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _index(d: Path) -> dict[str, Any]:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _write_index(d: Path, doc: dict[str, Any]) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(doc))


def test_an_index_naming_a_file_outside_the_directory(saved: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(saved["llama_sharded"], tmp_path / "m")
    shutil.copy(saved["llama_single"] / "model.safetensors", tmp_path / "outside.safetensors")
    for name in (
        "../outside.safetensors",
        str(tmp_path / "outside.safetensors"),
        "sub/../../outside.safetensors",
    ):
        doc = _index(d)
        first = next(iter(doc["weight_map"]))
        doc["weight_map"][first] = name
        _write_index(d, doc)
        with pytest.raises(T.UnsafeModelPathError) as e:
            T.from_pretrained(LlamaForCausalLM, d)
        assert isinstance(e.value, PermissionError) and isinstance(e.value, nvme.AionvmeError)
        assert name in str(e.value)


def test_a_weight_file_that_links_out_of_the_directory(saved: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(saved["llama_sharded"], tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shutil.move(shard, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", shard)
    with pytest.raises(T.UnsafeModelPathError, match="symbolic link"):
        T.from_pretrained(LlamaForCausalLM, d)
    single = _copy(saved["llama_single"], tmp_path / "s")
    shutil.move(single / "model.safetensors", tmp_path / "elsewhere2.safetensors")
    os.symlink(tmp_path / "elsewhere2.safetensors", single / "model.safetensors")
    with pytest.raises(T.UnsafeModelPathError):
        T.from_pretrained(LlamaForCausalLM, single)
    # a link that stays inside the directory is fine
    inside = _copy(saved["llama_single"], tmp_path / "i")
    os.rename(inside / "model.safetensors", inside / "weights.bin.safetensors")
    os.symlink("weights.bin.safetensors", inside / "model.safetensors")
    _same_model(T.from_pretrained(LlamaForCausalLM, inside), LlamaForCausalLM.from_pretrained(inside))


def test_truncated_or_malformed_weights(saved: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(saved["llama_sharded"], tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 7)
    with pytest.raises(nvme.SafetensorsError):
        T.from_pretrained(LlamaForCausalLM, d)
    d2 = _copy(saved["llama_sharded"], tmp_path / "m2")
    (d2 / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(nvme.SafetensorsError, match="JSON"):
        T.from_pretrained(LlamaForCausalLM, d2)
    _write_index(d2, {"metadata": {}})
    with pytest.raises(nvme.SafetensorsError, match="weight_map"):
        T.from_pretrained(LlamaForCausalLM, d2)
    d3 = _copy(saved["llama_sharded"], tmp_path / "m3")
    doc = _index(d3)
    doc["weight_map"][next(iter(doc["weight_map"]))] = "missing.safetensors"
    _write_index(d3, doc)
    with pytest.raises(FileNotFoundError):
        T.from_pretrained(LlamaForCausalLM, d3)
    d4 = _copy(saved["llama_single"], tmp_path / "m4")
    os.remove(d4 / "model.safetensors")
    os.mkfifo(d4 / "model.safetensors")  # would block a plain open() for ever
    with pytest.raises(nvme.SafetensorsError, match="regular file"):
        T.from_pretrained(LlamaForCausalLM, d4)


def test_missing_directory_or_weights_and_bad_arguments(saved: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        T.from_pretrained(LlamaForCausalLM, tmp_path / "nope")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        T.from_pretrained(LlamaForCausalLM, tmp_path / "file")
    empty = _copy(saved["llama_single"], tmp_path / "e")
    os.remove(empty / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        T.from_pretrained(LlamaForCausalLM, empty)
    with pytest.raises(TypeError, match="state_dict"):
        T.from_pretrained(LlamaForCausalLM, saved["llama_single"], state_dict={})
    with pytest.raises(ValueError, match="safetensors"):
        T.from_pretrained(LlamaForCausalLM, saved["llama_single"], use_safetensors=False)
    with pytest.raises(ValueError, match="disk offload"):
        T.from_pretrained(LlamaForCausalLM, saved["llama_single"], device_map="auto", offload_folder=tmp_path)
    with pytest.raises(ValueError, match="disk offload"):
        T.from_pretrained(LlamaForCausalLM, saved["llama_single"], device_map={"": "disk"})


async def test_async_form_and_the_blocking_form_on_a_loop(saved: dict[str, Path]) -> None:
    got = await T.from_pretrained_async(LlamaForCausalLM, saved["llama_sharded"])
    _same_model(got, LlamaForCausalLM.from_pretrained(saved["llama_sharded"]))
    with pytest.raises(nvme.BlockingCallError, match="from_pretrained_async"):
        T.from_pretrained(LlamaForCausalLM, saved["llama_sharded"])
    state = await T.load_state_dict(saved["llama_sharded"])
    assert set(state) == set(_index(saved["llama_sharded"])["weight_map"])
    await asyncio.sleep(0)
