"""Layer-streamed inference (aionvme.offload.stream) on real transformers
checkpoints and on files written by aionvme.save_safetensors."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import aionvme as nvme  # noqa: E402
from aionvme.offload import BudgetError, InferenceOnlyError, stream, streamer_of  # noqa: E402
from aionvme.offload._planner import Ledger, plan_residency, upcoming  # noqa: E402


def _llama(tie: bool = False, layers: int = 8, seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return cfg, transformers.LlamaForCausalLM(cfg).eval()


def _model_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    cfg, ref = _llama()
    d = tmp_path_factory.mktemp("llama")
    ref.save_pretrained(d, max_shard_size="400KB")
    return cfg, ref, d


def _empty_like(cfg):
    from accelerate import init_empty_weights

    with init_empty_weights():
        m = transformers.LlamaForCausalLM(cfg)
    return m.eval()


def test_sharded_llama_under_a_quarter_budget(llama_dir):
    cfg, ref, d = llama_dir
    assert (d / "model.safetensors.index.json").exists()
    shards = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1
    size = _model_bytes(ref)
    budget = size // 4
    model = stream(_empty_like(cfg), d, budget=budget, prefetch=2)
    s = streamer_of(model)
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = ref(ids).logits
            for _ in range(2):
                got = model(ids).logits
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        st = s.stats()
        assert st["peak_resident_bytes"] <= budget
        # measured at every hook: the store's host tier (the weights' only copy
        # in memory) plus anything outside it
        assert 0 < st["peak_memory_bytes"] <= budget
        assert st["store_host_bytes"] <= budget
        assert st["store_evictions"] > 0  # blocks left memory through the store's eviction
        assert st["model_bytes"] > 3 * budget
        assert st["passes"] == 2
        # Nothing fits twice: every pass reads (at least) the blocks not pinned.
        assert st["bytes_read"] >= 2 * (st["model_bytes"] - budget)
        assert st["units"] == cfg.num_hidden_layers + 3  # embed, layers, norm, lm_head
        kinds = {k for _, k, _, _ in s.timeline}
        assert {"io", "compute", "wait"} <= kinds
    finally:
        s.close()


def test_weights_go_through_the_store_without_a_copy_on_disk(llama_dir, tmp_path, monkeypatch):
    cfg, ref, d = llama_dir
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # the store's scratch directory goes under tmp_path
    model = stream(_empty_like(cfg), d, budget=_model_bytes(ref) // 3, prefetch=1)
    s = streamer_of(model)
    try:
        (scratch,) = tmp_path.iterdir()
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (1, 4)))
        # the store's slab stays empty: its NVMe tier is the checkpoint itself
        assert sum(f.stat().st_size for f in scratch.iterdir()) == 0
        assert s.stats()["bytes_read"] > 0
    finally:
        s.close()
    assert list(tmp_path.iterdir()) == []
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before


def test_a_model_that_fits_reads_nothing_on_the_second_pass(llama_dir):
    cfg, ref, d = llama_dir
    model = stream(_empty_like(cfg), d, budget="64M", prefetch=1)
    s = streamer_of(model)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 8))
        with torch.no_grad():
            first = model(ids).logits
            read_once = s.stats()["bytes_read"]
            assert read_once >= _model_bytes(ref)
            second = model(ids).logits
            torch.testing.assert_close(second, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert s.stats()["bytes_read"] == read_once
        assert torch.equal(first, second)
        assert s.stats()["pinned_units"] == s.stats()["units"]
    finally:
        s.close()


def test_pinned_blocks_are_not_read_again(llama_dir):
    cfg, ref, d = llama_dir
    budget = _model_bytes(ref) * 3 // 5
    model = stream(_empty_like(cfg), d, budget=budget, prefetch=1)
    s = streamer_of(model)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 8))
        with torch.no_grad():
            model(ids)
            after_first = s.stats()["bytes_read"]
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        units = list(s.iter_units())
        pinned = [n for n, _, p in units if p]
        streamed = sum(b for _, b, p in units if not p)
        assert pinned and len(pinned) < len(units)
        # the second pass reads at most the blocks that are not pinned (exact
        # lengths, where the planner counts whole pages; released blocks the
        # store's host tier still holds are hits)
        assert 0 < s.stats()["bytes_read"] - after_first <= streamed
        assert s.stats()["peak_resident_bytes"] <= budget
        assert 0 < s.stats()["peak_memory_bytes"] <= budget
    finally:
        s.close()


def test_tied_embeddings_are_read_once_per_load(tmp_path):
    cfg, ref = _llama(tie=True, layers=4, seed=3)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    d = tmp_path / "tied"
    ref.save_pretrained(d, max_shard_size="200KB")
    model = stream(_empty_like(cfg), d, budget=_model_bytes(ref) // 2, prefetch=1)
    s = streamer_of(model)
    try:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        names = [n for n, _, _ in s.iter_units()]
        assert any("embed_tokens" in n and "lm_head" in n for n in names)
        ids = torch.randint(0, cfg.vocab_size, (1, 12))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert s.stats()["peak_resident_bytes"] <= s.budget
    finally:
        s.close()


def test_model_with_weights_present_and_dtype_conversion(llama_dir):
    cfg, ref, d = llama_dir
    twin = copy.deepcopy(ref)
    model = stream(twin, d, budget="1M", prefetch=2, dtype=torch.float64)
    s = streamer_of(model)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 8))
        with torch.no_grad():
            got = model(ids).logits
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.float(), ref(ids).logits, rtol=1e-4, atol=1e-4)
        assert s.stats()["peak_resident_bytes"] <= s.budget
        assert 0 < s.stats()["peak_memory_bytes"] <= s.budget  # float64 copies counted
    finally:
        s.close()
    # after close the weights are placeholders: the memory is given back
    assert all(p.untyped_storage().nbytes() <= 8 for p in model.parameters())


def test_sequential_saved_with_aionvme(tmp_path):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8),
    ).eval()  # fmt: skip
    path = tmp_path / "seq.safetensors"
    asyncio.run(nvme.save_safetensors(ref.state_dict(), path))
    with torch.device("meta"):
        empty = copy.deepcopy(ref).to("meta")
    x = torch.randn(4, 32)
    # A Sequential has no ModuleList: each child with weights is a unit.
    model = stream(empty, path, budget=300_000, prefetch=1)
    s = streamer_of(model)
    try:
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(model(x), ref(x))
        assert s.stats()["units"] == 4
        assert s.stats()["peak_resident_bytes"] <= 300_000
    finally:
        s.close()


def test_a_forward_with_autograd_on_says_streaming_is_inference_only(tmp_path):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).eval()
    path = tmp_path / "m.safetensors"
    asyncio.run(nvme.save_safetensors(ref.state_dict(), path))
    with torch.device("meta"):
        empty = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).eval()
    model = stream(empty, path, budget="256K", prefetch=1)
    s = streamer_of(model)
    x = torch.randn(2, 64)
    try:
        # a training loop's forward (then backward) is refused where it starts, with the library's error
        with pytest.raises(InferenceOnlyError, match=r"inference only.*torch.inference_mode\(\)") as e:
            model(x).sum().backward()
        assert isinstance(e.value, RuntimeError) and isinstance(e.value, nvme.AionvmeError)
        with pytest.raises(InferenceOnlyError):
            model[1](x)  # a block run on its own, too
        st = s.stats()
        assert st["passes"] == st["loads"] == st["hits"] == st["misses"] == 0  # refused before any block ran
        # and the same model runs under no_grad / inference_mode as before
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
        with torch.inference_mode():
            torch.testing.assert_close(model(x), ref(x))
    finally:
        s.close()


def test_errors_are_typed(tmp_path, llama_dir):
    cfg, ref, d = llama_dir
    twin = copy.deepcopy(ref)
    with pytest.raises(BudgetError):
        stream(twin, d, budget=10_000)
    # a refused model is left as it was, weights and all
    assert all(torch.equal(p, q) for p, q in zip(twin.parameters(), ref.parameters(), strict=True))
    with pytest.raises(FileNotFoundError):
        stream(_empty_like(cfg), tmp_path / "nope.safetensors", budget="1M")
    other = torch.nn.Linear(3, 3, device="meta")
    with pytest.raises(nvme.TensorNotFoundError):
        stream(other, d, budget="1M")
    with torch.device("meta"):  # rotary inv_freq: a buffer no checkpoint holds
        all_meta = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="init_empty_weights"):
        stream(all_meta, d, budget="8M")
    model = stream(_empty_like(cfg), d, budget="8M")
    with pytest.raises(ValueError, match="already streamed"):
        stream(model, d, budget="8M")
    streamer_of(model).close()
    with pytest.raises(ValueError, match="not streamed"):
        streamer_of(model)
    assert os.path.isdir(d)


def test_planner_pins_what_fits_and_leaves_room_to_stream():
    sizes = [10, 40, 40, 40, 40, 10]
    sched = [0, 1, 2, 3, 4, 5, 0]  # unit 0 runs twice (tied embedding/head)
    p = plan_residency(sizes, sched, budget=200, prefetch=2)
    assert p.pinned == frozenset(range(6))
    p = plan_residency(sizes, sched, budget=140, prefetch=2)
    assert 0 in p.pinned  # used twice: pinned first
    streamed = [sizes[u] for u in range(6) if u not in p.pinned]
    pinned = sum(sizes[u] for u in p.pinned)
    assert pinned + sum(sorted(streamed, reverse=True)[:3]) <= 140
    with pytest.raises(BudgetError):
        plan_residency(sizes, sched, budget=39, prefetch=0)
    assert upcoming([0, 1, 2, 3], 3, 3) == [3, 0, 1]
    led = Ledger(100)
    led.reserve(1, 60)
    assert not led.fits(41)
    with pytest.raises(BudgetError):
        led.reserve(2, 41)
    led.release(1)
    assert led.used == 0 and led.peak == 60


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (device='cuda' is unverified here)"
)
def test_stream_to_cuda(llama_dir):  # pragma: no cover - no GPU on the CI machine
    cfg, ref, d = llama_dir
    model = stream(_empty_like(cfg), d, budget=_model_bytes(ref) // 4, device="cuda", prefetch=2)
    s = streamer_of(model)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 8))
        with torch.no_grad():
            got = model(ids.cuda()).logits.cpu()
        torch.testing.assert_close(got, ref(ids).logits, rtol=1e-4, atol=1e-4)
        assert s.stats()["peak_resident_bytes"] <= s.budget
    finally:
        s.close()
