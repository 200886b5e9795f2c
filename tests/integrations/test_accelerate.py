"""aionvme.integrations.accelerate: accelerate's disk offload with the weights read
ahead by aionvme, against accelerate's own, on small transformers models built here."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate", reason="the accelerate integration needs accelerate")

from accelerate.hooks import attach_align_device_hook, remove_hook_from_module  # noqa: E402
from accelerate.utils import OffloadedWeightsLoader, offload_state_dict  # noqa: E402

from aionvme.integrations.accelerate import (  # noqa: E402
    OffloadIndexError,
    WeightsMap,
    disk_offload,
    dispatch_model,
    weights_map_of,
)
from aionvme.offload import BudgetError, InferenceOnlyError  # noqa: E402


def _llama(tie: bool, layers: int = 12, dtype=None):
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    return m.to(dtype) if dtype is not None else m


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=96, n_layer=4, n_head=4)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _copy(model):
    m = type(model)(model.config).eval().to(next(model.parameters()).dtype)
    m.load_state_dict(model.state_dict())
    return m


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once


def _block_bytes(model) -> int:
    return max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.model.layers)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_logits_bitwise_accelerates_own_under_a_quarter_budget(tmp_path, tie):
    ref = _llama(tie)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    theirs = accelerate.disk_offload(_copy(ref), tmp_path / "theirs", execution_device="cpu")
    budget = _param_bytes(ref) // 4
    assert budget > 2 * _block_bytes(ref)  # room to read one block ahead
    ours = disk_offload(_copy(ref), tmp_path / "ours", execution_device="cpu", budget=budget, prefetch=1)
    w = weights_map_of(ours)
    try:
        with torch.inference_mode():
            want = theirs(ids).logits
            got = ours(ids).logits
            again = ours(ids).logits
        assert torch.equal(got, want) and torch.equal(again, want)
        st = w.stats()
        assert st["peak_memory_bytes"] <= budget  # measured: the store's memory and any copy
        assert st["peak_resident_bytes"] <= budget
        assert st["own_reads"] == 0  # every weight came from a block read ahead
        assert st["loads"] > st["units"]  # it streamed: blocks were read again on the second pass
        assert st["pinned_units"] < st["units"]
    finally:
        w.close()
    # the folder is accelerate's format: accelerate's own loader reads what disk_offload wrote
    loader = OffloadedWeightsLoader(save_folder=str(tmp_path / "ours"))
    for k, v in ref.state_dict().items():
        assert torch.equal(loader[k], v), k


def test_reads_a_folder_accelerate_wrote_and_each_weight_once_per_pass(tmp_path):
    ref = _gpt2()
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(4))
    folder = tmp_path / "acc"
    theirs = accelerate.disk_offload(_copy(ref), folder, execution_device="cpu")  # writes the folder
    stamp = {f: os.stat(folder / f).st_mtime_ns for f in os.listdir(folder)}
    ours = disk_offload(_copy(ref), folder, execution_device="cpu", budget="64M")  # the model fits
    w = weights_map_of(ours)
    try:
        with torch.inference_mode():
            want = theirs(ids).logits
            got = ours(ids).logits
            got2 = ours(ids).logits
        assert torch.equal(got, want) and torch.equal(got2, want)
        assert {f: os.stat(folder / f).st_mtime_ns for f in os.listdir(folder)} == stamp  # not rewritten
        st = w.stats()
        # GPT-2 ties wte and lm_head: accelerate's folder holds both, the tied weight is read once
        tied = ref.lm_head.weight.numel() * 4
        params = {n for n, _ in ref.named_parameters(remove_duplicate=False)}
        assert "lm_head.weight" in params and "transformer.wte.weight" in params
        param_dat = sum(os.path.getsize(folder / f"{n}.dat") for n in params)
        assert st["bytes_read"] == param_dat - tied  # two passes, the model fits: read once
        assert st["own_reads"] == 0
    finally:
        w.close()


def test_weights_map_matches_offloaded_weights_loader_for_every_dtype_and_shape(tmp_path):
    sd = {
        "a.weight": torch.randn(5, 7),
        "a.bf16": torch.randn(3, 1000).to(torch.bfloat16),
        "a.fp8": torch.randn(17).to(torch.float8_e4m3fn),
        "b.scalar": torch.tensor(3.5),
        "b.int": torch.arange(11, dtype=torch.int64),
        "b.bool": torch.tensor([True, False, True]),
        "b.half": torch.randn(2, 2, 2).half(),
        "c.empty": torch.empty(0, 4),
    }
    offload_state_dict(str(tmp_path), sd)
    theirs = OffloadedWeightsLoader(save_folder=str(tmp_path))
    ours = WeightsMap(tmp_path)
    assert sorted(ours) == sorted(theirs) and len(ours) == len(sd)
    for k in sd:
        t, o = theirs[k], ours[k]
        assert o.dtype == t.dtype and o.shape == t.shape, k
        assert torch.equal(o.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k  # bitwise
    assert ours.stats()["own_reads"] == len(sd)
    with pytest.raises(KeyError):
        ours["nope"]
    # the in-memory state dict takes priority, as in accelerate's loader
    kept = torch.zeros(5, 7)
    assert WeightsMap(tmp_path, state_dict={"a.weight": kept})["a.weight"] is kept


def test_safetensors_entries_of_an_offload_index(tmp_path):
    from safetensors.torch import save_file

    sd = {"x.w": torch.randn(64, 32), "x.b": torch.randn(32).to(torch.bfloat16)}
    f = tmp_path / "m.safetensors"
    save_file(sd, str(f))
    index = {
        "layer.w": {"safetensors_file": str(f), "weight_name": "x.w"},
        "layer.b": {"safetensors_file": str(f), "weight_name": "x.b", "dtype": "float32"},
    }
    theirs = OffloadedWeightsLoader(index=index)
    ours = WeightsMap(tmp_path, index=index)
    for k in index:
        assert torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype, k
    bad = {"layer.w": {"safetensors_file": str(f), "weight_name": "missing"}}
    with pytest.raises(OffloadIndexError, match="missing"):
        WeightsMap(tmp_path, index=bad)


def test_accelerates_own_hooks_with_the_weights_map_by_hand(tmp_path):
    ref = _llama(tie=False, layers=3)
    offload_state_dict(str(tmp_path), ref.state_dict())
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = ref(ids).logits
    model = _copy(ref)
    w = WeightsMap(tmp_path)
    params = {n for n, _ in model.named_parameters()}
    attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=w)
    w.read_ahead(model, budget=_param_bytes(ref) // 2, prefetch=1)  # after the hooks: the model is meta
    try:
        with torch.inference_mode():
            got = model(ids).logits
        assert torch.equal(got, want)
        assert w.stats()["own_reads"] == 0 and w.stats()["bytes_read"] >= _param_bytes(ref)
    finally:
        w.close()
    # accelerate's detach_hook puts the weights back from the map (each read on its own)
    remove_hook_from_module(model, recurse=True)
    assert w.stats()["own_reads"] == len(params)
    for n, p in model.named_parameters():
        assert torch.equal(p, ref.get_parameter(n)), n


def test_inference_only_and_budget_errors(tmp_path):
    ref = _llama(tie=False, layers=2)
    ours = disk_offload(_copy(ref), tmp_path / "o", execution_device="cpu", budget="16M")
    try:
        with pytest.raises(InferenceOnlyError):
            ours(torch.zeros(1, 4, dtype=torch.long))
        with torch.no_grad():
            assert torch.equal(
                ours(torch.zeros(1, 4, dtype=torch.long)).logits,
                ref(torch.zeros(1, 4, dtype=torch.long)).logits,
            )
    finally:
        weights_map_of(ours).close()
    with pytest.raises(BudgetError):
        disk_offload(_copy(ref), tmp_path / "o", execution_device="cpu", budget=_block_bytes(ref) // 2)


def test_a_damaged_offload_folder_raises_typed_errors(tmp_path):
    sd = {"w": torch.randn(100, 10), "v": torch.randn(10)}
    offload_state_dict(str(tmp_path), sd)
    os.truncate(tmp_path / "w.dat", 100)
    with pytest.raises(OffloadIndexError, match=r"w\.dat holds 100 bytes"):
        WeightsMap(tmp_path)
    os.unlink(tmp_path / "w.dat")
    with pytest.raises(FileNotFoundError) as ei:
        WeightsMap(tmp_path)
    assert ei.value.filename == str(tmp_path / "w.dat")
    (tmp_path / "index.json").write_text(json.dumps({"v": {"dtype": "float99", "shape": [10]}}))
    with pytest.raises(OffloadIndexError, match="float99"):
        WeightsMap(tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(OffloadIndexError, match="JSON") as ej:
        WeightsMap(tmp_path)
    assert isinstance(ej.value, ValueError)


def test_dispatch_model_reads_the_disk_modules_ahead(tmp_path):
    ref = _llama(tie=False, layers=8)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = ref(ids).logits
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "disk",
    }
    device_map.update({f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(8)})
    theirs = accelerate.dispatch_model(_copy(ref), device_map, offload_dir=str(tmp_path / "theirs"))
    model = _copy(ref)
    on_disk = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.startswith("lm_head") or any(n.startswith(f"model.layers.{i}.") for i in range(3, 8))
    )
    ours = dispatch_model(
        model, device_map, offload_dir=str(tmp_path / "ours"), budget=on_disk // 2, prefetch=1
    )
    w = weights_map_of(ours)
    try:
        with torch.inference_mode():
            assert torch.equal(theirs(ids).logits, want)
            assert torch.equal(ours(ids).logits, want)
        st = w.stats()
        assert st["own_reads"] == 0  # the disk modules' weights all came from blocks read ahead
        # one pass reads the modules on disk once, and then the first block of the next pass
        # ahead (the read-ahead is cyclic, as generation runs pass after pass): nothing else
        first = [p for n, p in model.named_parameters() if n.startswith("model.layers.3.")]
        ahead = sum(p.numel() * p.element_size() + 4096 for p in first)  # with each tensor's page rounding
        assert on_disk <= st["bytes_read"] <= on_disk + ahead and st["loads"] == st["units"] == 6
        assert st["peak_memory_bytes"] <= on_disk // 2
    finally:
        w.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_disk_offload_to_cuda_bitwise_accelerates_own(tmp_path):
    ref = _llama(tie=True)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    theirs = accelerate.disk_offload(_copy(ref), tmp_path / "f", execution_device="cuda")
    ours = disk_offload(_copy(ref), tmp_path / "f", execution_device="cuda", budget=_param_bytes(ref) // 4)
    w = weights_map_of(ours)
    try:
        with torch.inference_mode():
            want = theirs(ids).logits
            got = ours(ids.cuda()).logits
        assert got.device.type == "cuda" and torch.equal(got, want.to(got.device))
        assert w.stats()["own_reads"] == 0 and w.stats()["peak_memory_bytes"] <= _param_bytes(ref) // 4
    finally:
        w.close()
