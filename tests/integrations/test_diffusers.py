"""aionvme.integrations.diffusers: group offloading to disk with diffusers' call shape,
against diffusers' own, on small models built here."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers", reason="the diffusers integration is tested against diffusers")

from diffusers.hooks import apply_group_offloading as diffusers_apply  # noqa: E402

from aionvme.integrations.diffusers import (  # noqa: E402
    INDEX_NAME,
    apply_group_offloading,
    remove_group_offloading,
    stats,
)
from aionvme.offload import InferenceOnlyError  # noqa: E402


def _unet():
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 64, 64),
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    ).eval()


def _pixart():
    # (not DiT: its forward calls transformer_blocks[0].norm1.emb after the loop over the blocks,
    # when block 0 is offloaded; diffusers' own group offload gives wrong outputs there)
    torch.manual_seed(3)
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=4,
        cross_attention_dim=32,
        sample_size=8,
        patch_size=2,
        caption_channels=24,
        norm_num_groups=4,
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    ).eval()


def _inputs(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "unet":
        return (torch.randn(2, 3, 16, 16, generator=g), torch.tensor([10, 500])), {}
    return (torch.randn(2, 4, 8, 8, generator=g),), {
        "encoder_hidden_states": torch.randn(2, 5, 24, generator=g),
        "timestep": torch.tensor([3, 7]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def _files(folder):
    return {
        f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")
    }


@pytest.mark.parametrize(("kind", "per_group"), [("unet", 1), ("unet", 2), ("pixart", 1)])
def test_outputs_bitwise_diffusers_own_each_byte_read_once(tmp_path, kind, per_group):
    make = _unet if kind == "unet" else _pixart
    args, kw = _inputs(kind)
    theirs = make()
    diffusers_apply(
        theirs,
        onload_device="cpu",
        offload_type="block_level",
        num_blocks_per_group=per_group,
        offload_to_disk_path=str(tmp_path / "theirs"),
    )
    ours = make()
    tensor_bytes = sum(t.numel() * t.element_size() for t in (*ours.parameters(), *ours.buffers()))
    with torch.no_grad():
        in_memory = ours(*args, **kw).sample
    state = {k: v.clone() for k, v in (*ours.named_parameters(), *ours.named_buffers())}
    apply_group_offloading(
        ours,
        onload_device="cpu",
        offload_type="block_level",
        num_blocks_per_group=per_group,
        offload_to_disk_path=str(tmp_path / "ours"),
    )
    files = _files(tmp_path / "ours")
    try:
        # the group files are plain safetensors: the reference reader loads them, padding and all
        from safetensors.torch import load_file

        loaded = {}
        for f in files:
            loaded.update(load_file(str(tmp_path / "ours" / f)))
        assert {k for k in loaded if not k.startswith("__aionvme_pad_")} == set(state)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        with torch.no_grad():
            want = theirs(*args, **kw).sample
            got = ours(*args, **kw).sample
            first = stats(ours)
            again = ours(*args, **kw).sample
        # bit for bit the model in memory; diffusers' own is where its 8-byte aligned weights happen
        # to give the same sums (it is ~1e-6 off on larger UNets): then the two are equal
        assert torch.equal(got, in_memory) and torch.equal(again, in_memory)
        assert torch.allclose(want, in_memory, rtol=0, atol=1e-5)
        if per_group == 1 and kind == "unet":
            assert torch.equal(got, want)
        # one pass read every group's file once: the tensors, their headers, nothing twice
        assert tensor_bytes <= first["bytes_read"] <= sum(files.values())
        assert first["bytes_read"] > sum(files.values()) - 4096 * len(files)
        st = stats(ours)
        assert st["peak_memory_bytes"] <= st["budget"]
        if per_group == 1:  # the default budget (the rest, a group, one read ahead) is less than the model
            assert st["budget"] < tensor_bytes and st["store_evictions"] > 0
    finally:
        remove_group_offloading(ours)


def test_group_files_are_kept_and_reused(tmp_path):
    args, kw = _inputs("unet")
    ref = _unet()
    with torch.no_grad():
        want = ref(*args, **kw).sample
    a = _unet()
    apply_group_offloading(a, "cpu", num_blocks_per_group=1, offload_to_disk_path=tmp_path)
    remove_group_offloading(a)
    stamp = {f: os.stat(tmp_path / f).st_mtime_ns for f in os.listdir(tmp_path)}
    assert INDEX_NAME in stamp
    b = _unet()
    apply_group_offloading(b, "cpu", num_blocks_per_group=1, offload_to_disk_path=tmp_path, budget="64M")
    try:
        with torch.no_grad():
            assert torch.equal(b(*args, **kw).sample, want)
            assert torch.equal(b(*args, **kw).sample, want)
        assert {f: os.stat(tmp_path / f).st_mtime_ns for f in os.listdir(tmp_path)} == stamp
        st = stats(b)
        assert st["pinned_units"] == st["units"]  # the budget holds it all: the second pass read nothing
        assert st["bytes_read"] <= sum(_files(tmp_path).values())
    finally:
        remove_group_offloading(b)


def test_unsupported_arguments_and_grad_mode(tmp_path):
    m = _unet()
    with pytest.raises(NotImplementedError, match="leaf_level"):
        apply_group_offloading(m, "cpu", offload_type="leaf_level", offload_to_disk_path=tmp_path)
    with pytest.raises(ValueError, match="offload_to_disk_path"):
        apply_group_offloading(m, "cpu", num_blocks_per_group=1)
    with pytest.raises(ValueError, match="num_blocks_per_group"):
        apply_group_offloading(m, "cpu", offload_to_disk_path=tmp_path)
    apply_group_offloading(m, "cpu", num_blocks_per_group=1, offload_to_disk_path=tmp_path)
    try:
        with pytest.raises(ValueError, match="already applied"):
            apply_group_offloading(m, "cpu", num_blocks_per_group=1, offload_to_disk_path=tmp_path)
        args, kw = _inputs("unet")
        with pytest.raises(InferenceOnlyError):
            m(*args, **kw)
    finally:
        remove_group_offloading(m)


def test_the_rest_of_the_model_is_read_once_for_all_passes(tmp_path):
    # The rest group is led by the model itself; the streamer began the pass after acquiring
    # it, so it never entered the recorded schedule, was never pinned and was read every pass.
    from aionvme.offload import streamer_of

    m = _unet()
    args, kw = _inputs("unet")
    apply_group_offloading(m, "cpu", num_blocks_per_group=1, offload_to_disk_path=tmp_path)
    try:
        with torch.no_grad():
            for _ in range(3):
                m(*args, **kw)
        s = streamer_of(m)
        reads = [name for name, kind, _, _ in s.timeline if kind == "io"]
        assert reads.count("<rest>") == 1
        assert reads.count("up_blocks.1") == 3  # the blocks do stream: the budget is less than the model
    finally:
        remove_group_offloading(m)
