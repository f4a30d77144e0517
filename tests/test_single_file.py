"""model.transformer_file: single files in ComfyUI's and the original layouts load as the folder.

The tiny Wan and CogVideoX written by tools/to_single_file.py in the layout ComfyUI and the original
releases use (bf16, plain fp8, ComfyUI's scaled fp8 in both its forms) load as the folder does and
give the folder's first-step loss (bf16 exactly, fp8 within the tolerance docs/models/wan.md
records); the files are what diffusers' single-file loader and ComfyUI's model definition expect; a
file of the other family, of another size, incomplete or cut short is refused before the cache pass.
"""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from conftest import comfyui_linears, fsdp_frozen_weights, one_rank_group, write_toml
from diffusers import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import data
import memory
import parallel
import ranks
from config import ConfigError, LoraConfig, ModelConfig, ParallelConfig, TrainConfig, load_config
from model import build_model, setup_adapter
from model_adapter import load_adapter
from tools.to_single_file import to_single_file

# case: (family, tiny model variant, model.type). CogVideoX 1.5-I2V: patch linear, ofs embedding,
# 1.5's rotary grid; Wan FLF2V: the image embedder and its position table (img_emb.emb_pos).
MODELS = {
    "wan": ("wan", "t2v", "t2v"),
    "cogvideox": ("cogvideox", "1.5-5b-i2v", "i2v"),
    "wan-flf2v": ("wan", "flf2v", "i2v"),
}
FP8_CASES = ["wan", "cogvideox"]
# Relative difference of the first-step loss, fp8 file against the folder, both read into bf16: at
# most 8.5e-4 measured on these models (Wan, scaled fp8; docs/models/wan.md, "Single files").
FP8_LOSS_RTOL = 2e-3


@pytest.fixture(scope="module")
def folders(tiny_models, wan_models):
    models = {"wan": wan_models, "cogvideox": tiny_models}
    return {case: models[family](variant) for case, (family, variant, _) in MODELS.items()}


def adapter_for(case, folder, transformer_file="", dtype="bf16"):
    return load_adapter(
        ModelConfig(
            path=str(folder),
            family=MODELS[case][0],
            type=MODELS[case][2],
            dtype=dtype,
            transformer_file=transformer_file,
        ),
        torch.device("cpu"),
    )


def tensors(transformer) -> dict[str, torch.Tensor]:
    return {**dict(transformer.named_buffers()), **dict(transformer.named_parameters())}


def differing(got: dict, expected: dict) -> list[str]:
    """The keys whose tensors differ in dtype or in value."""
    return [k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]


def first_step_loss(adapter, transformer) -> torch.Tensor:
    """The per-sample loss of step 1 on a batch of two clips (9x32x32) with the trainer's keyed
    draws, in the trainer's bf16 autocast."""
    shape = (2, adapter.latent_channels, 3, 32 // adapter.spatial_ratio, 32 // adapter.spatial_ratio)
    draw = data.keyed_generator(0, "batch")
    batch = {
        "latent_mean": torch.randn(shape, generator=draw),
        "latent_logvar": torch.full(shape, -4.0),
        "prompt_embeds": torch.randn(2, adapter.text_length, 32, generator=draw),
    }
    if adapter.type == "i2v" and adapter.FAMILY == "wan":  # the VAE condition and CLIP tokens
        config = adapter.transformer_config
        tokens = config["pos_embed_seq_len"] or 17
        batch |= {
            "image_latents": torch.randn(shape, generator=draw),
            "image_embeds": torch.randn(2, tokens, config["image_dim"], generator=draw),
        }
    elif adapter.type == "i2v":
        batch |= {
            "image_mean": torch.randn(2, shape[1], 1, *shape[3:], generator=draw),
            "image_logvar": torch.full((2, shape[1], 1, *shape[3:]), -4.0),
        }
    with torch.no_grad(), parallel.Compute(torch.device("cpu"), "bf16", ""):
        return adapter.train_loss(transformer, batch, [data.keyed_generator(42, 1, p) for p in range(2)])


def to_metadata_form(path, out, comfy_quant_tensors: bool):
    """The same scaled fp8 file in ComfyUI's newer form: X.weight_scale, the layers listed in the
    `_quantization_metadata` header entry (or in a X.comfy_quant tensor each), no `scaled_fp8`
    marker."""
    tensors_, layers = {}, {}
    for key, tensor in load_file(path).items():
        if key.endswith(".scale_weight"):
            layers[key.removesuffix(".scale_weight")] = {"format": "float8_e4m3fn"}
            tensors_[key.removesuffix("scale_weight") + "weight_scale"] = tensor
        elif not key.endswith("scaled_fp8"):
            tensors_[key] = tensor
    if comfy_quant_tensors:
        tensors_ |= {
            f"{layer}.comfy_quant": torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
            for layer, conf in layers.items()
        }
        save_file(tensors_, out)
    else:
        save_file(
            tensors_,
            out,
            metadata={"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})},
        )


def comfyui_wan_detection(shapes: dict) -> dict:
    """What ComfyUI's model detection makes of a Wan file's shapes (comfy/model_detection.py,
    detect_unet_config's "Wan 2.1" branch, at comfyanonymous/ComfyUI
    01c4fa4c746a16712ccabac3ce7ff71c48340214): an image-to-video model by img_emb.proj.0.bias, and
    FLF2V's position table's length from img_emb.emb_pos (flf_pos_embed_token_number)."""
    return {
        "dim": shapes["head.modulation"][-1],
        "out_dim": shapes["head.head.weight"][0] // 4,
        "ffn_dim": shapes["blocks.0.ffn.0.weight"][0],
        "num_layers": len({k.split(".")[1] for k in shapes if k.startswith("blocks.")}),
        "in_dim": shapes["patch_embedding.weight"][1],
        "model_type": "i2v" if "img_emb.proj.0.bias" in shapes else "t2v",
        "flf_pos_embed_token_number": shapes["img_emb.emb_pos"][1] if "img_emb.emb_pos" in shapes else None,
    }


def comfyui_wan_state_dict(c: dict, text_dim: int, image_dim: int) -> dict[str, tuple]:
    """The state dict's shapes of ComfyUI's native Wan (comfy/ldm/wan/model.py WanModel, at the
    commit above) for a detected config: patch, text and time embeddings, each WanAttentionBlock
    (self_attn and cross_attn q, k, v, o with RMSNorm norm_q, norm_k; i2v's k_img, v_img,
    norm_k_img; the affine norm3; ffn.0, ffn.2; modulation), the Head, and for i2v MLPProj img_emb
    (LayerNorm, Linear, Linear, LayerNorm; emb_pos [1, flf_pos_embed_token_number, in] with it).
    ComfyUI builds MLPProj for 1280 CLIP features, the published models' image_dim: the tiny
    model's is image_dim."""
    dim, ffn, i2v = c["dim"], c["ffn_dim"], c["model_type"] == "i2v"
    linears = {"text_embedding.0": (dim, text_dim), "text_embedding.2": (dim, dim)}
    linears |= {"time_embedding.0": (dim, 256), "time_embedding.2": (dim, dim)}
    linears |= {"time_projection.1": (6 * dim, dim), "head.head": (4 * c["out_dim"], dim)}
    norms = {}
    for i in range(c["num_layers"]):
        block = f"blocks.{i}"
        for attn in ("self_attn", "cross_attn"):
            linears |= {f"{block}.{attn}.{x}": (dim, dim) for x in "qkvo"}
            norms |= {f"{block}.{attn}.norm_q.weight": (dim,), f"{block}.{attn}.norm_k.weight": (dim,)}
        if i2v:
            linears |= {f"{block}.cross_attn.k_img": (dim, dim), f"{block}.cross_attn.v_img": (dim, dim)}
            norms[f"{block}.cross_attn.norm_k_img.weight"] = (dim,)
        linears |= {f"{block}.ffn.0": (ffn, dim), f"{block}.ffn.2": (dim, ffn)}
        norms |= {f"{block}.norm3.weight": (dim,), f"{block}.norm3.bias": (dim,)}
        norms[f"{block}.modulation"] = (1, 6, dim)
    if i2v:
        linears |= {"img_emb.proj.1": (image_dim, image_dim), "img_emb.proj.3": (dim, image_dim)}
        for norm, size in (("img_emb.proj.0", image_dim), ("img_emb.proj.4", dim)):
            norms |= {f"{norm}.weight": (size,), f"{norm}.bias": (size,)}
        if c["flf_pos_embed_token_number"] is not None:
            norms["img_emb.emb_pos"] = (1, c["flf_pos_embed_token_number"], image_dim)
    shapes = {f"{name}.weight": shape for name, shape in linears.items()}
    shapes |= {f"{name}.bias": shape[:1] for name, shape in linears.items()}
    shapes |= {"patch_embedding.weight": (dim, c["in_dim"], 1, 2, 2), "patch_embedding.bias": (dim,)}
    return shapes | norms | {"head.modulation": (1, 2, dim)}


@pytest.mark.parametrize("family", MODELS)
def test_a_bf16_file_trains_from_the_folders_weights(family, folders, tmp_path):
    """A bf16 file gives the folder's weights bit for bit, and its first-step loss exactly.

    Written with the ComfyUI prefix and read as two shards beside a copy of the folder without the
    transformer's weights: every weight and buffer is the folder's, bit for bit and dtype for dtype,
    so the first-step loss is the folder's exactly. A Wan file (T2V; FLF2V with its image embedder
    and position table) is ComfyUI's model's state dict, shape for shape, detected as its model;
    FLF2V's position table is the one name diffusers' single-file converter leaves unrenamed."""
    whole = tmp_path / "whole.safetensors"
    to_single_file(str(folders[family]), str(whole), prefix=True)
    weights = load_file(whole)
    assert all(k.startswith("model.diffusion_model.") for k in weights)
    if MODELS[family][0] == "wan":
        config = WanTransformer3DModel.load_config(folders[family] / "transformer")
        shapes = {k.removeprefix("model.diffusion_model."): tuple(v.shape) for k, v in weights.items()}
        detected = comfyui_wan_detection(shapes)
        assert (detected["model_type"], detected["flf_pos_embed_token_number"]) == (
            MODELS[family][2],
            config.get("pos_embed_seq_len"),
        )
        assert shapes == comfyui_wan_state_dict(detected, config["text_dim"], config["image_dim"])
        converted = convert_wan_transformer_to_diffusers(dict.fromkeys(weights))
        expected = WanTransformer3DModel.from_config(config).state_dict()
        assert set(converted) ^ set(expected) == (
            {"img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"}
            if config.get("pos_embed_seq_len")
            else set()
        )
    shards = [str(tmp_path / f"part-{i}.safetensors") for i in range(2)]
    keys = sorted(weights)
    for i, shard in enumerate(shards):
        save_file({k: weights[k] for k in keys[i::2]}, shard)
    configs_only = shutil.copytree(folders[family], tmp_path / "model")
    (configs_only / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    folder_adapter, file_adapter = (
        adapter_for(family, folders[family]),
        adapter_for(family, configs_only, shards),
    )
    theirs, ours = folder_adapter.load_transformer(), file_adapter.load_transformer()
    expected, got = tensors(theirs), tensors(ours)
    assert got.keys() == expected.keys()
    assert [
        k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])
    ] == []
    assert torch.equal(first_step_loss(file_adapter, ours), first_step_loss(folder_adapter, theirs))


@pytest.mark.parametrize("form", ["cast", "scaled"])
@pytest.mark.parametrize("family", FP8_CASES)
def test_an_fp8_file_dequantizes_as_comfyui_does(family, form, folders, tmp_path):
    """An fp8 file dequantizes as ComfyUI does.

    Each fp8 weight is read as weight.float() * scale (the scale 1 for a plain cast), computed here
    from safetensors' own reading of the file; the first-step loss is the folder's within
    FP8_LOSS_RTOL."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(folders[family]), str(path), fp8=True, scaled=form == "scaled")
    folder_adapter, file_adapter = (
        adapter_for(family, folders[family]),
        adapter_for(family, folders[family], str(path)),
    )
    ours = file_adapter.load_transformer()
    stored = load_file(path)
    fp8 = {k: v for k, v in stored.items() if v.dtype == torch.float8_e4m3fn and v.numel()}
    # the blocks' linears
    assert fp8 and fp8.keys() == {k for k, v in stored.items() if k.startswith("blocks.") and v.ndim == 2}
    assert ("scaled_fp8" in stored) == (form == "scaled")
    params = tensors(ours)
    for key, name in file_adapter.single_file.file_keys.items():
        if name in fp8:
            scale = stored.get(name.removesuffix("weight") + "scale_weight", torch.tensor(1.0)).float()
            assert (form == "cast") == (scale == 1.0)
            assert torch.equal(params[key], (fp8[name].float() * scale).to(params[key].dtype)), key
    reference = first_step_loss(folder_adapter, folder_adapter.load_transformer())
    loss = first_step_loss(file_adapter, ours)
    assert not torch.equal(loss, reference)
    torch.testing.assert_close(loss, reference, rtol=FP8_LOSS_RTOL, atol=0)


@pytest.mark.parametrize("comfy_quant_tensors", [False, True])
def test_the_newer_scaled_fp8_form_reads_as_the_old_one(comfy_quant_tensors, folders, tmp_path):
    """ComfyUI's newer scaled fp8 form reads as the old one.

    ComfyUI's newer form of the same file (X.weight_scale; the layers in the _quantization_metadata
    header entry, or in X.comfy_quant tensors) gives the same weights as the scaled_fp8 marker's
    form."""
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    to_single_file(str(folders["wan"]), str(old), fp8=True, scaled=True)
    to_metadata_form(old, new, comfy_quant_tensors)
    assert not [k for k in load_file(new) if k.endswith(("scale_weight", "scaled_fp8"))]
    expected = tensors(adapter_for("wan", folders["wan"], str(old)).load_transformer())
    got = tensors(adapter_for("wan", folders["wan"], str(new)).load_transformer())
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_fsdp_reads_each_ranks_rows_of_a_scaled_fp8_file(folders, tmp_path):
    """Under FSDP each rank reads and dequantizes its rows of a scaled fp8 file.

    Under FSDP (one rank) the rows are read and dequantized into the sharded parameters: the same
    weights as the plain load."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(folders["wan"]), str(path), fp8=True, scaled=True)
    adapter = adapter_for("wan", folders["wan"], str(path), dtype="fp32")
    plain = tensors(adapter.load_transformer())
    frozen = fsdp_frozen_weights(adapter)
    assert frozen.keys() == {k for k, v in plain.items() if isinstance(v, torch.nn.Parameter)}
    assert [k for k, v in frozen.items() if not torch.equal(v, plain[k])] == []


@pytest.mark.parametrize("form", ["cast", "scaled", "e5m2"])
def test_fp8_storage_keeps_an_fp8_files_values_and_scale(form, folders, tmp_path):
    """fp8 storage keeps an fp8 file's values and scale as stored.

    model.storage_dtype = "fp8" on an fp8 file (a plain cast, ComfyUI's scaled fp8): each of its fp8
    weights keeps the file's bytes and its scale (1 for a cast), spread to every row in fp32,
    without FSDP and under it (one rank): rounded once, by the file's maker, not dequantized and
    quantized again. An e5m2 cast, which memory.py does not keep, is quantized once from its values
    at full precision."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(folders["wan"]), str(path), fp8=True, scaled=form == "scaled")
    if form == "e5m2":
        save_file(
            {
                k: v.to(torch.float8_e5m2) if v.dtype == torch.float8_e4m3fn else v
                for k, v in load_file(path).items()
            },
            path,
        )
    cfg = ModelConfig(path=str(folders["wan"]), family="wan", storage_dtype="fp8", transformer_file=str(path))
    adapter = load_adapter(cfg, torch.device("cpu"))
    whole = dict(adapter.load_transformer().named_parameters())
    train = TrainConfig(mixed_precision="no", gradient_checkpointing=False)
    with one_rank_group() as d:
        model = build_model(adapter, train, LoraConfig(rank=2), ParallelConfig(strategy="fsdp"), 0, d)
        sharded = {
            k: v.full_tensor()
            for k, v in model.named_parameters()
            if isinstance(v, torch.distributed.tensor.DTensor)
        }
        del model
    stored = load_file(path)
    fp8 = {key: name for key, name in adapter.single_file.file_keys.items() if stored[name].itemsize == 1}
    assert fp8
    for params in (whole, sharded):
        for key, name in fp8.items():
            if form == "e5m2":
                quantized, scale = memory.quantize(stored[name].float())
                assert torch.equal(params[key].view(torch.uint8), quantized.view(torch.uint8)), key
                assert torch.equal(params[f"{key}_scale"], scale), key
                continue
            scale = stored.get(name.removesuffix("weight") + "scale_weight", torch.tensor(1.0))
            assert params[key].dtype == torch.float8_e4m3fn and params[f"{key}_scale"].dtype == torch.float32
            assert torch.equal(params[key].view(torch.uint8), stored[name].view(torch.uint8)), key
            assert torch.equal(params[f"{key}_scale"], scale.float().expand(stored[name].shape[0], 1)), key


def test_wan_files_load_in_diffusers_single_file_loader(folders, tmp_path):
    """diffusers' single-file loader loads our Wan file to the folder's weights.

    diffusers' own reader of the original layout (from_single_file, its Wan converter) loads our
    file to the folder's weights, rounded to bf16 where the file stores bf16."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(folders["wan"]), str(path), prefix=True)
    theirs = WanTransformer3DModel.from_single_file(
        str(path), config=str(folders["wan"]), subfolder="transformer", torch_dtype=torch.float32
    ).state_dict()
    folder = WanTransformer3DModel.from_pretrained(folders["wan"], subfolder="transformer").state_dict()
    with safe_open(path, "pt") as f:
        stored = {k.removeprefix("model.diffusion_model."): f.get_slice(k).get_dtype() for k in f.keys()}
    assert theirs.keys() == folder.keys() and "BF16" in stored.values() and "F32" in stored.values()
    assert all(
        torch.equal(theirs[k], folder[k].to(torch.bfloat16).float()) or torch.equal(theirs[k], folder[k])
        for k in folder
    )


def comfyui_wan_vace_state_dict(c: dict) -> dict[str, tuple[int, ...]]:
    """The state dict (key: shape) of ComfyUI's native Wan VACE model for a diffusers VACE config.

    Written from comfy/ldm/wan/model.py at comfyanonymous/ComfyUI
    01c4fa4c746a16712ccabac3ce7ff71c48340214: VaceWanModel is a t2v WanModel (patch_embedding
    Conv3d, text_embedding.0 and .2, time_embedding.0 and .2, time_projection.1, `blocks` of
    WanAttentionBlock, head.head and head.modulation [1, 2, dim]) with vace_patch_embedding (Conv3d)
    and `vace_blocks` of VaceWanAttentionBlock: a WanAttentionBlock with after_proj, and before_proj
    on block 0. A WanAttentionBlock, with qk_norm and cross_attn_norm as comfy/model_detection.py
    sets them for every Wan: self_attn and cross_attn q, k, v, o (Linear) and norm_q, norm_k
    (RMSNorm: weight), norm3 (affine LayerNorm), ffn.0 and ffn.2, modulation [1, 6, dim]; norm1 and
    norm2 have no weights. model_detection tells VACE by vace_patch_embedding.weight and counts the
    vace_blocks."""
    dim, ffn, patch = c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"], tuple(c["patch_size"])

    def linear(name, fan_in, fan_out):
        return {f"{name}.weight": (fan_out, fan_in), f"{name}.bias": (fan_out,)}

    block = {"modulation": (1, 6, dim), "norm3.weight": (dim,), "norm3.bias": (dim,)}
    for attention in ("self_attn", "cross_attn"):
        for x in "qkvo":
            block |= linear(f"{attention}.{x}", dim, dim)
        block |= {f"{attention}.norm_q.weight": (dim,), f"{attention}.norm_k.weight": (dim,)}
    block |= linear("ffn.0", dim, ffn) | linear("ffn.2", ffn, dim)
    keys = {f"blocks.{i}.{k}": shape for i in range(c["num_layers"]) for k, shape in block.items()}
    for i in range(len(c["vace_layers"])):
        vace = block | linear("after_proj", dim, dim) | (linear("before_proj", dim, dim) if i == 0 else {})
        keys |= {f"vace_blocks.{i}.{k}": shape for k, shape in vace.items()}
    for name, channels in (
        ("patch_embedding", c["in_channels"]),
        ("vace_patch_embedding", c["vace_in_channels"]),
    ):
        keys |= {f"{name}.weight": (dim, channels, *patch), f"{name}.bias": (dim,)}
    keys |= linear("text_embedding.0", c["text_dim"], dim) | linear("text_embedding.2", dim, dim)
    keys |= linear("time_embedding.0", c["freq_dim"], dim) | linear("time_embedding.2", dim, dim)
    keys |= linear("time_projection.1", dim, 6 * dim)
    out = c["out_channels"] * patch[0] * patch[1] * patch[2]
    return keys | linear("head.head", dim, out) | {"head.modulation": (1, 2, dim)}


def test_a_wan_vace_file_holds_comfyuis_keys_and_loads_as_the_folder(wan_models, tmp_path):
    """A Wan VACE single file: ComfyUI's key set, read as the folder by us and by diffusers.

    tools/to_single_file.py writes a VACE folder's transformer with exactly the keys and shapes of
    ComfyUI's native VACE model (the layout of its wan2.1_vace_*.safetensors files:
    vace_patch_embedding, vace_blocks.N.before_proj/after_proj beside the blocks' original names);
    model.transformer_file reads it to the folder's weights rounded to bf16 (fp32 where the file
    keeps fp32), and diffusers' single-file loader (its Wan converter) to the same tensors. Its fp8
    form stores the context blocks' linears in fp8 too, read back as ComfyUI dequantizes them."""
    folder = wan_models("vace")
    path, fp8_path = tmp_path / "vace.safetensors", tmp_path / "vace_fp8.safetensors"
    to_single_file(str(folder), str(path))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    with safe_open(path, "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored == comfyui_wan_vace_state_dict(config)

    def vace_adapter(transformer_file="", dtype="fp32"):
        return load_adapter(
            ModelConfig(
                path=str(folder), family="wan", type="vace", dtype=dtype, transformer_file=transformer_file
            ),
            torch.device("cpu"),
        )

    ours = tensors(vace_adapter(str(path)).load_transformer())
    theirs = WanVACETransformer3DModel.from_single_file(
        str(path), config=str(folder), subfolder="transformer", torch_dtype=torch.float32
    ).state_dict()
    folder_weights = tensors(vace_adapter().load_transformer())
    assert theirs.keys() <= ours.keys() and differing(ours, theirs) == []
    assert all(
        torch.equal(ours[k], folder_weights[k].to(torch.bfloat16).float())
        or torch.equal(ours[k], folder_weights[k])
        for k in folder_weights
    )
    assert not all(torch.equal(ours[k], folder_weights[k]) for k in folder_weights)  # bf16 rounded

    to_single_file(str(folder), str(fp8_path), fp8=True, scaled=True)
    fp8 = {k: v for k, v in load_file(fp8_path).items() if v.dtype == torch.float8_e4m3fn and v.numel()}
    assert {k for k in fp8 if k.startswith("vace_blocks.")} == {
        k for k, shape in stored.items() if k.startswith("vace_blocks.") and len(shape) == 2
    }
    stored_fp8 = load_file(fp8_path)
    read = tensors(vace_adapter(str(fp8_path)).load_transformer())
    for name in ("vace_blocks.0.before_proj.weight", "vace_blocks.1.self_attn.q.weight"):
        key = name.replace("before_proj", "proj_in").replace("self_attn.q", "attn1.to_q")
        scale = stored_fp8[name.removesuffix("weight") + "scale_weight"].float()
        assert torch.equal(read[key], fp8[name].float() * scale), key


def comfyui_detection(keys) -> dict:
    """What ComfyUI's model detection makes of a CogVideoX file's positions
    (comfy/model_detection.py, detect_unet_config's CogVideoX branch, at comfyanonymous/ComfyUI
    3e4d15a4f70f5de24f426d9681d8505d42bf19d7): with patch_embed.pos_embedding, learned positions and
    no rotary embeddings; without it, rotary ones. Its model (comfy/ldm/cogvideo/model.py there)
    adds sincos positions whenever it has no rotary embeddings."""
    learned = "patch_embed.pos_embedding" in keys
    return {"use_learned_positional_embeddings": learned, "use_rotary_positional_embeddings": not learned}


def comfyui_keys(config: dict) -> set[str]:
    """The state dict of ComfyUI's native CogVideoX (comfy/ldm/cogvideo/model.py, as test_variants
    reads it): weight and bias of every Linear (1.5's patch linear too: patch_bias concerns 1.0's
    Conv2d), the affine LayerNorms (norm1.norm, norm2.norm, norm_q, norm_k in each block;
    norm_final, norm_out.norm), a Conv2d patch embedding on 1.0 and the positions, a persistent
    buffer with learned ones."""
    linears = comfyui_linears(config)
    keys = {f"{name}.{leaf}" for name in linears for leaf in ("weight", "bias")}
    norms = [
        f"blocks.{i}.{n}"
        for i in range(config["num_layers"])
        for n in ("norm1.norm", "norm2.norm", "norm_q", "norm_k")
    ]
    keys |= {
        f"{name}.{leaf}" for name in norms + ["norm_final", "norm_out.norm"] for leaf in ("weight", "bias")
    }
    if not config["patch_size_t"]:
        keys |= {"patch_embed.proj.weight", "patch_embed.proj.bias"}
    return keys | ({"patch_embed.pos_embedding"} if config["use_learned_positional_embeddings"] else set())


@pytest.mark.parametrize("variant", ["2b", "1.5-5b-i2v"])
def test_cogvideox_files_hold_comfyuis_state_dict(variant, tiny_models, tmp_path):
    """Our CogVideoX file holds ComfyUI's state dict, and ComfyUI detects the right model.

    ComfyUI detects the model the file is (2b: sincos positions, from the table we write; 1.5:
    rotary ones) and its model's state dict is the file's; our reader takes the file back to the
    folder's weights (model.dtype bf16, as the file's), accepting 2b's table."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(tiny_models(variant)), str(path))
    cfg = ModelConfig(path=str(tiny_models(variant)), type="i2v" if "i2v" in variant else "t2v")
    adapter = load_adapter(cfg, torch.device("cpu"))
    stored = load_file(path)
    detected, config = comfyui_detection(stored), adapter.transformer_config
    assert detected["use_rotary_positional_embeddings"] == config["use_rotary_positional_embeddings"]
    assert set(stored) == comfyui_keys({**config, **detected})
    folder = tensors(adapter.load_transformer())
    file_cfg = dataclasses.replace(cfg, transformer_file=str(path))
    read = tensors(load_adapter(file_cfg, torch.device("cpu")).load_transformer())
    assert read.keys() == folder.keys()
    assert differing(read, folder) == []
    if variant == "2b":  # diffusers' own table, the one its non-persistent buffer holds
        torch.testing.assert_close(
            stored["patch_embed.pos_embedding"].float(),
            folder["patch_embed.pos_embedding"].float(),
            rtol=2**-8,
            atol=0,
        )


def other_size(folder, out):
    """The same model with twice the attention heads: what a 14B file is to a 1.3B folder."""
    shutil.copytree(folder, out)
    config = WanTransformer3DModel.load_config(out / "transformer")
    WanTransformer3DModel.from_config({**config, "num_attention_heads": 4}).save_pretrained(
        out / "transformer"
    )
    return out


def test_wrong_files_are_named_before_the_cache_pass(folders, base_settings, tmp_path):
    """Wrong files are named before the cache pass.

    The other family's file, another size's, one with a weight missing, one cut short: each refused
    when the adapter loads (which cache.py does first), naming the file and the first differing key.
    """
    wan, cog = tmp_path / "wan.safetensors", tmp_path / "cog.safetensors"
    to_single_file(str(folders["wan"]), str(wan), fp8=True, scaled=True)
    to_single_file(str(folders["cogvideox"]), str(cog))
    cases = {
        "other family": (
            "cogvideox",
            cog,
            wan,
            f"model.transformer_file = {wan} holds a wan transformer (it holds "
            "head.modulation), not a cogvideox one",
        ),
        "other size": (
            "wan",
            wan,
            tmp_path / "big.safetensors",
            "head.modulation is [1, 2, 64] there, but "
            f"{folders['wan']}/transformer/config.json makes it [1, 2, 32] (scale_shift_table)",
        ),
        "missing": ("wan", wan, tmp_path / "missing.safetensors", "lacks 1 weights of WanTransformer3DModel"),
        "truncated": ("wan", wan, tmp_path / "cut.safetensors", "is truncated:"),
    }
    to_single_file(str(other_size(folders["wan"], tmp_path / "big")), str(tmp_path / "big.safetensors"))
    save_file(
        {k: v for k, v in load_file(wan).items() if k != "head.head.bias"}, tmp_path / "missing.safetensors"
    )
    (tmp_path / "cut.safetensors").write_bytes(wan.read_bytes()[:-100])
    for name, (family, _, path, message) in cases.items():
        with pytest.raises(ConfigError) as refused:
            adapter_for(family, folders[family], str(path))
        assert message in str(refused.value), (name, str(refused.value))
    # The trainer's setup step (the session's CogVideoX-2b): stopped before the cache pass.
    to_single_file(base_settings["model.path"], str(tmp_path / "2b.safetensors"))
    (tmp_path / "2b-cut.safetensors").write_bytes((tmp_path / "2b.safetensors").read_bytes()[:-100])
    cfg = load_config(
        str(
            write_toml(
                tmp_path / "cut.toml",
                {
                    **base_settings,
                    "run.output_dir": str(tmp_path / "run"),
                    "data.cache_dir": str(tmp_path / "cache"),
                    "model.transformer_file": str(tmp_path / "2b-cut.safetensors"),
                },
            )
        )
    )
    with (
        one_rank_group() as d,
        pytest.raises(ranks.StopRun, match=f"{tmp_path / '2b-cut.safetensors'} is truncated:"),
    ):
        setup_adapter(cfg, d)
    assert not (tmp_path / "cache").exists()


def test_scaled_fp8_files_missing_a_scale_or_their_marker_are_refused(folders, tmp_path):
    """Scaled fp8 files missing a scale or their marker are refused.

    ComfyUI's old scaled fp8 layout: a file with one .scale_weight missing (that layer would be read
    1 / scale, thousands of times, too large) and a file without the scaled_fp8 marker (every scale
    would be dropped) are refused when the adapter loads, naming the file and the key; so is a file
    of the new layout whose metadata leaves out a layer that has its .weight_scale."""
    path = tmp_path / "model.safetensors"
    to_single_file(str(folders["wan"]), str(path), fp8=True, scaled=True)
    stored = load_file(path)
    scale = sorted(k for k in stored if k.endswith(".scale_weight"))[0]
    save_file({k: v for k, v in stored.items() if k != scale}, tmp_path / "one-scale-missing.safetensors")
    save_file({k: v for k, v in stored.items() if k != "scaled_fp8"}, tmp_path / "no-marker.safetensors")
    layer = scale.removesuffix(".scale_weight")
    to_metadata_form(path, tmp_path / "new.safetensors", comfy_quant_tensors=False)
    with safe_open(tmp_path / "new.safetensors", "pt") as f:
        listed = json.loads(f.metadata()["_quantization_metadata"])
    del listed["layers"][layer]
    save_file(
        load_file(tmp_path / "new.safetensors"),
        tmp_path / "unlisted.safetensors",
        metadata={"_quantization_metadata": json.dumps(listed)},
    )
    cases = {
        "one-scale-missing": f"layer {layer} is quantized as float8_e4m3fn but the file lacks its "
        f"scale, {scale}",
        "no-marker": "holds fp8 scales (blocks.0.cross_attn.k.scale_weight, ...) that neither ComfyUI's "
        "scaled_fp8 key nor its quantization metadata",
        "unlisted": f"holds fp8 scales ({layer}.weight_scale, ...) that neither",
    }
    for name, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            adapter_for("wan", folders["wan"], str(tmp_path / f"{name}.safetensors"))


def test_files_vidtrain_cannot_read_are_named_for_what_they_are(folders, ltx2_models, tmp_path):
    """Files vidtrain cannot read are named for what they are.

    model.transformer_file given a folder, a diffusers folder's transformer file (under its own name
    and under another), a PyTorch pickle, a GGUF file (refused by its first bytes: a header length
    read from them would be gigabytes) or a file whose JSON header is not safetensors': each message
    says which it is."""
    wan = folders["wan"]
    diffusers_file = wan / "transformer" / "diffusion_pytorch_model.safetensors"
    shutil.copy(
        ltx2_models("2.0") / "transformer" / "diffusion_pytorch_model.safetensors",
        tmp_path / "ltx2.safetensors",
    )
    torch.save(load_file(diffusers_file), tmp_path / "model.ckpt")
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    header = json.dumps({"weight": {"dtype": "BF16", "shape": [2]}}).encode()
    (tmp_path / "odd.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    layout = "is in diffusers' layout (a diffusers folder's transformer/diffusion_pytorch_model.safetensors)"
    cases = [
        ("wan", wan, wan / "transformer", "is a folder; it takes a single .safetensors file"),
        ("wan", wan, diffusers_file, layout),
        ("ltx2", ltx2_models("2.0"), tmp_path / "ltx2.safetensors", layout),
        ("wan", wan, tmp_path / "model.ckpt", "is a PyTorch pickle (torch.save's format"),
        ("wan", wan, tmp_path / "model.gguf", "is a GGUF file (llama.cpp's format"),
        ("wan", wan, tmp_path / "odd.safetensors", "its header's entry 'weight' is not a tensor's"),
    ]
    for family, folder, path, message in cases:
        with pytest.raises(ConfigError, match=re.escape(f"model.transformer_file = {path}")) as refused:
            cfg = ModelConfig(path=str(folder), family=family, transformer_file=str(path))
            load_adapter(cfg, torch.device("cpu"))
        assert message in str(refused.value), (path.name, str(refused.value))


# How diffusers' scripts/convert_ltx2_to_diffusers.py (huggingface/diffusers
# 58eb52c0803ea9af3abec60841c2a093bdf1f951) reads Lightricks' files (ltx-2-19b-dev.safetensors,
# LTX-2.3's): get_model_state_dict_from_combined_ckpt takes the keys under model.diffusion_model.,
# split_transformer_and_connector_state_dict sets the connectors apart, convert_ltx2_transformer
# replaces LTX_2_0_ (2.3: LTX_2_3_) TRANSFORMER_KEYS_RENAME_DICT's substrings in order, then
# convert_ltx2_transformer_adaln_single renames a leading adaln_single. / audio_adaln_single.
LTX2_RENAMES = {
    "patchify_proj": "proj_in",
    "audio_patchify_proj": "audio_proj_in",
    "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
    "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
    "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
    "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate",
    "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
    "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
}
LTX2_3_RENAMES = {
    **LTX2_RENAMES,
    "audio_prompt_adaln_single": "audio_prompt_adaln",
    "prompt_adaln_single": "prompt_adaln",
}
LTX2_CONNECTOR_PREFIXES = (
    "video_embeddings_connector",
    "audio_embeddings_connector",
    "transformer_1d_blocks",
    "text_embedding_projection",
    "connectors.",
    "video_connector",
    "audio_connector",
    "text_proj_in",
)
# LTX_2_0_ / LTX_2_3_CONNECTORS_KEYS_RENAME_DICT: how the script renames the connectors of
# Lightricks' files (the model.diffusion_model. prefix taken off first, as by
# get_model_state_dict_from_combined_ckpt), substrings replaced in order.
LTX2_CONNECTORS_RENAMES = {
    "connectors.": "",
    "video_embeddings_connector": "video_connector",
    "audio_embeddings_connector": "audio_connector",
    "transformer_1d_blocks": "transformer_blocks",
    "text_embedding_projection.aggregate_embed": "text_proj_in",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
}
LTX2_3_CONNECTORS_RENAMES = {
    **{k: v for k, v in LTX2_CONNECTORS_RENAMES.items() if not k.startswith("text_embedding")},
    "text_embedding_projection.audio_aggregate_embed": "audio_text_proj_in",
    "text_embedding_projection.video_aggregate_embed": "video_text_proj_in",
}
# The keys ltx-core's text encoder takes from a Lightricks file (Lightricks/LTX-2
# 400fd31, packages/ltx-core/src/ltx_core/text_encoders/gemma/encoders/encoder_configurator.py,
# EMBEDDINGS_PROCESSOR_KEY_OPS): the projection outside the prefix, the connectors under it, as
# ComfyUI's LTXAV model (comfy/ldm/lightricks/av_model.py) holds them beside the transformer.
LTX_CORE_CONNECTOR_PREFIXES = (
    "text_embedding_projection.aggregate_embed.",
    "text_embedding_projection.video_aggregate_embed.",
    "text_embedding_projection.audio_aggregate_embed.",
    "model.diffusion_model.video_embeddings_connector.",
    "model.diffusion_model.audio_embeddings_connector.",
)


def diffusers_ltx2_transformer(combined: dict, version: str) -> dict:
    """The transformer's state dict diffusers' conversion script makes of a Lightricks file."""
    renames = LTX2_3_RENAMES if version == "2.3" else LTX2_RENAMES
    state, starts = {}, {"adaln_single.": "time_embed.", "audio_adaln_single.": "audio_time_embed."}
    for key, tensor in combined.items():
        prefix, _, key = key.partition("model.diffusion_model.")
        if prefix or not key or key.startswith(LTX2_CONNECTOR_PREFIXES):
            continue
        for original, new in renames.items():
            key = key.replace(original, new)
        for original, new in starts.items():
            if key.startswith(original) and (".weight" in key or ".bias" in key):
                key = new + key.removeprefix(original)
        state[key] = tensor
    return state


def lightricks_file(folder, out):
    """The tiny model as Lightricks lay theirs out: the transformer and the text connectors as
    tools/to_single_file.py --prefix writes them, the VAEs and the vocoder added under vae.,
    audio_vae. and vocoder. (their own names there do not matter: nothing reads them)."""
    to_single_file(str(folder), str(out), prefix=True)
    combined = load_file(out)
    for part in ("vae", "audio_vae", "vocoder"):
        part_file = folder / part / "diffusion_pytorch_model.safetensors"
        combined |= {f"{part}.{k}": v for k, v in load_file(part_file).items()}
    save_file(combined, out)
    return combined


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_lightricks_single_files_give_ltx2s_transformer(version, ltx2_models, tmp_path):
    """Lightricks' single files give LTX-2's transformer, bit for bit.

    A file laid out as ltx-2-19b-dev.safetensors (LTX-2.3's as 2.3's): diffusers' conversion script
    turns its transformer part into the folder's state dict, and model.transformer_file reads the
    transformer from it, skipping the connectors, VAEs and vocoder, to the folder's weights (bf16,
    as the file's), bit for bit."""
    folder, path = ltx2_models(version), tmp_path / "ltx-2-19b-dev.safetensors"
    combined = lightricks_file(folder, path)
    assert any(k.startswith("model.diffusion_model.video_embeddings_connector.") for k in combined)
    expected = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    converted = diffusers_ltx2_transformer(combined, version)
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[k], expected[k].to(torch.bfloat16)) for k in expected)
    cfg = ModelConfig(path=str(folder), family="ltx2", dtype="bf16")
    theirs = tensors(load_adapter(cfg, torch.device("cpu")).load_transformer())
    file_cfg = dataclasses.replace(cfg, transformer_file=str(path))
    ours = tensors(load_adapter(file_cfg, torch.device("cpu")).load_transformer())
    assert ours.keys() == theirs.keys()
    assert differing(ours, theirs) == []


@pytest.mark.parametrize("version", ["2.0", "2.3", "2.5"])
def test_ltx2_single_files_carry_the_text_connectors(version, ltx2_models, tmp_path):
    """LTX-2 single files carry the folder's text connectors under Lightricks' names.

    ComfyUI's LTXAV model loads video_embeddings_connector.* and audio_embeddings_connector.* from
    the same file as the transformer, and ltx-core's text encoder those and the text projection:
    a file without them samples from uninitialised weights. Every connector key is one ltx-core
    takes, and diffusers' conversion script turns them into the folder's connectors, bit for bit
    (bf16, as written), with --prefix and without (2.5's connectors are named as 2.3's)."""
    folder = ltx2_models(version)
    expected = load_file(folder / "connectors" / "diffusion_pytorch_model.safetensors")
    renames = LTX2_CONNECTORS_RENAMES if version == "2.0" else LTX2_3_CONNECTORS_RENAMES
    for prefix in (True, False):
        path = tmp_path / f"ltx2-{prefix}.safetensors"
        to_single_file(str(folder), str(path), prefix=prefix)
        written = load_file(path)
        connectors = {
            k: v
            for k, v in written.items()
            if k.removeprefix("model.diffusion_model.").startswith(LTX2_CONNECTOR_PREFIXES)
        }
        if prefix:
            assert [k for k in connectors if not k.startswith(LTX_CORE_CONNECTOR_PREFIXES)] == []
        converted = {}
        for key, tensor in connectors.items():
            key = key.removeprefix("model.diffusion_model.")
            for original, new in renames.items():
                key = key.replace(original, new)
            converted[key] = tensor
        assert converted.keys() == expected.keys(), (prefix, sorted(converted.keys() ^ expected.keys())[:4])
        assert all(torch.equal(converted[k], expected[k].to(torch.bfloat16)) for k in expected)
