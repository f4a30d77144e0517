"""Sequence parallelism (parallel.sp_size) trains to the same weights as one process.

Sequence parallelism (parallel.sp_size): 2 ranks sharing each sample, and 4 ranks as 2 data-parallel
groups of 2 under FSDP, train to the same weights as one process, for CogVideoX (rotary embeddings,
joint attention) and Wan (TI2V: per-token timesteps, an uneven split), with clipping engaged; their
held-out loss and rendered frames agree too. LTX-2's split (video tokens split, audio and text
replicated, the audio-video cross-attentions both ways) is held to one process inside the same 2
ranks: its losses and every weight's gradient; so is Wan FLF2V's (the two images' CLIP tokens
replicated with the text's). The split itself is checked inside the ranks: each
attends over its own slice of the tokens, the collectives' gradients are exact, Q, K and V travel in
V's dtype, under torch.compile the exchanges compile with the blocks, and Wan VACE's split gives
one process's loss and gradients."""

import json

import pytest
import torch
from conftest import one_rank_group, read_metrics, run_ok, run_worker, write_toml
from safetensors.torch import load_file

import model
import parallel
import ranks
from config import ConfigError, load_config
from model_adapter import load_adapter

RTOL, ATOL = 1e-5, 1e-6
MAX_GRAD_NORM = 1e-3  # below every step's gradient norm: clipping changes each update
# name: (settings, processes); the global batch is 4 in each.
RUNS = {
    "one_process": ({"train.batch_size": 4}, 1),
    "sp2": ({"train.batch_size": 4, "parallel.sp_size": 2}, 2),
    "dp2_sp2_fsdp": ({"train.batch_size": 2, "parallel.sp_size": 2, "parallel.strategy": "fsdp"}, 4),
}
# CogVideoX-5b's key set at 3 x 5 x 5 = 75 tokens; TI2V-5B at 3 tokens: both split unevenly
FAMILIES = {
    "cogvideox": lambda tiny_models, wan_models: {
        "model.path": str(tiny_models("5b")),
        "data.train_resolution": [9, 40, 40],
    },
    # Adam divides each gradient element by its own magnitude: an element at rounding level (the
    # tiny Wan's cross-attention Q and K) becomes a full step whose sign is the rounding's, which
    # one process and a split sum differently. An epsilon above those elements keeps the update
    # smooth in the gradient.
    "wan": lambda tiny_models, wan_models: {
        "model.path": str(wan_models("ti2v-5b")),
        "model.family": "wan",
        "model.type": "i2v",
        "train.learning_rate": 1e-2,
        "train.adam_epsilon": 1e-4,
    },
}


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory, base_settings, tiny_models, wan_models, tiny_data):
    root = tmp_path_factory.mktemp("sequence")
    outputs = {}
    for family, settings_of in FAMILIES.items():
        family_settings = {
            **base_settings,
            **settings_of(tiny_models, wan_models),
            "train.steps": 4,
            "train.gradient_checkpointing": True,
            "train.max_grad_norm": MAX_GRAD_NORM,
            "checkpoint.checkpointing_steps": 4,
            "validation.validation_steps": 4,
            "validation.prompts": ["a red circle moves right"],
            "validation.num_inference_steps": 2,
            "validation.save_frames": True,
        }
        if family == "wan":
            family_settings["validation.images"] = [str(tiny_data / "images" / "00000.png")]
        for name, (settings, nproc) in RUNS.items():
            outputs[family, name] = root / family / name
            cfg = write_toml(
                root / f"{family}-{name}.toml",
                {**family_settings, "run.output_dir": str(outputs[family, name]), **settings},
            )
            run_ok(["--cfg", str(cfg)], nproc=nproc)
    return outputs


def logged(output_dir, tag: str) -> dict[int, float]:
    return {m["step"]: m[tag] for m in read_metrics(output_dir) if tag in m}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", ["sp2", "dp2_sp2_fsdp"])
def test_same_weights_as_one_process(sp_runs, family, name):
    one, split = sp_runs[family, "one_process"], sp_runs[family, name]
    assert all(norm > MAX_GRAD_NORM for norm in logged(one, "train/grad_norm").values())
    for tag in ("train/loss", "train/grad_norm", "val/loss"):
        a, b = logged(one, tag), logged(split, tag)
        assert a.keys() == b.keys() and a
        torch.testing.assert_close(
            torch.tensor(list(b.values())), torch.tensor(list(a.values())), rtol=RTOL, atol=ATOL, msg=tag
        )
    ours, theirs = (load_file(run / "lora" / "pytorch_lora_weights.safetensors") for run in (split, one))
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=RTOL, atol=ATOL, msg=key)
    # The clips rendered through the split attention: the same frames, give or take a rounding step.
    for step in (0, 4):
        clip = f"validation_res/step_{step}_prompt_0.safetensors"
        frames = [load_file(run / clip)["frames"].int() for run in (one, split)]
        assert (frames[0] - frames[1]).abs().max() <= 1


WORKER = r"""
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import parallel
from config import ModelConfig
from families.ltx2 import AudioStream, VideoStream
from model_adapter import load_adapter

dist.init_process_group("gloo")
rank = dist.get_rank()
split = parallel.new_split(2, rank)
report = {}

# The primitives on 5 tokens (3 + 2): the whole sequence's heads and back; gather; their gradients are
# the adjoints (for a linear map f, <f(x), y> = <x, f*(y)> summed over ranks).
whole = torch.randn(2, 4, 5, 3, generator=torch.Generator().manual_seed(0))  # [B, heads, tokens, D]
mine = split.local(whole, 2).clone().requires_grad_()
report["lengths"] = split.lengths
swapped = split.seq_to_heads(mine, 2, 1)
report["seq_to_heads"] = torch.equal(swapped, whole.chunk(2, 1)[rank])
back = split.heads_to_seq(swapped, 2, 1)
report["round_trip"] = torch.equal(back, mine)
gathered = split.gather(mine, 2)
report["gather"] = torch.equal(gathered, whole)
probe = torch.randn(gathered.shape, generator=torch.Generator().manual_seed(1 + rank))
(gathered * probe).sum().backward()
inner = torch.stack([(gathered * probe).sum(), (mine * mine.grad).sum()]).detach()
dist.all_reduce(inner)
report["adjoint"] = torch.allclose(inner[0], inner[1], rtol=1e-5)

# A transformer forward with the sequence split: every attention layer sees this rank's tokens only,
# and the output equals the unsplit model's.
adapter = load_adapter(ModelConfig(path=sys.argv[2], dtype="fp32"), torch.device("cpu"))
reference = adapter.load_transformer()
model = adapter.load_transformer()
seen = []
for block in adapter.blocks(model):
    block.attn1.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]),
                                          with_kwargs=True)
adapter.split_sequence(model, split)
x0 = torch.randn(1, 3, 4, 10, 10, generator=torch.Generator().manual_seed(2))  # [B, F, C, h, w]: 75 tokens
embeds = torch.randn(1, adapter.text_length, 32, generator=torch.Generator().manual_seed(3))
rotary = adapter.rotary_embeddings(3, 10, 10)
with torch.no_grad():
    outputs = [adapter.predict_v(m, x0, torch.tensor([500]), embeds, rotary) for m in (reference, model)]
report["tokens_seen"] = sorted(set(seen))
report["forward_equal"] = torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)

# The exchange's dtype: under CUDA's autocast the Q and K norms return fp32 beside a bf16 V (CPU's keeps
# them bf16, so hooks make them fp32 here); Q, K and V must travel in V's dtype.
exchanged, seq_to_heads = [], split.seq_to_heads
split.seq_to_heads = lambda x, *dims: exchanged.append(str(x.dtype)) or seq_to_heads(x, *dims)
hooks = [m.register_forward_hook(lambda m, args, out: out.float()) for name, m in model.named_modules()
         if name.endswith(("norm_q", "norm_k"))]
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    adapter.predict_v(model, x0, torch.tensor([500]), embeds, rotary)
report["exchanged"] = sorted(set(exchanged))
del split.seq_to_heads
for hook in hooks:
    hook.remove()

# Under torch.compile (aot_eager: dynamo and AOTAutograd as inductor sees them, without its codegen), the
# exchanges are traced into each block's graph (torch.distributed.nn's all_to_all raised under dynamo and
# sent every block back to eager), and forward and backward still equal the unsplit eager model's.
from torch._dynamo.utils import counters
for block in adapter.blocks(model):
    block.compile(backend="aot_eager")
results = []
for m in (reference, model):
    x = x0.clone().requires_grad_()
    out = adapter.predict_v(m, x, torch.tensor([500]), embeds, rotary)
    out.square().sum().backward()
    results.append((out.detach(), x.grad))
dist.all_reduce(results[1][1])  # each rank's gradient is the group's sum for its own tokens: sp times the sample's
report["compiled_equal"] = (torch.allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
                            and torch.allclose(results[0][1], results[1][1] / 2, rtol=1e-5, atol=1e-6))
report["dynamo"] = {"graph_breaks": sum(counters["graph_break"].values()),
                    "unsupported": sum(counters["unimplemented"].values()), "frames": dict(counters["frames"])}

# LTX-2 (sys.argv[4]: the tiny 2.0, split rotary embeddings; sys.argv[5]: 2.3, gated attention and STG's
# processor): train_loss and the gradient of every weight, split 14 + 13 video tokens, equal one process's,
# and so does 2.3's STG forward (validation's guidance), which the perturbation changes.
# T2V with the audio latents (both streams, the audio-video cross-attentions both ways), T2V video-only
# (no audio tokens: isolate_modalities), I2V with audio (per-token timestep embeddings) and IC-LoRA with audio
# (a reference at 1/3 of the clip's height and width, model.reference_downscale_factor = 3: its 3 tokens after
# the clip's 27, 30 split 15 + 15, the reference's with the rest; every sample's first frame clean,
# train.first_frame_conditioning_p = 1).
def ltx2_batch(adapter, audio):
    c, g = adapter.transformer_config, torch.Generator().manual_seed(4)
    text = 2 * c["caption_channels"] if c["use_prompt_embeddings"] else c["cross_attention_dim"] + c["audio_cross_attention_dim"]
    batch = {"latent_mean": torch.randn(2, adapter.latent_channels, 3, 3, 3, generator=g),  # 27 tokens
             "latent_logvar": torch.randn(2, adapter.latent_channels, 3, 3, 3, generator=g) - 3,
             "prompt_embeds": torch.randn(2, adapter.text_length, text, generator=g)}
    if audio:  # 5 audio tokens
        features = adapter.audio_config["latent_channels"], 5, adapter.audio_config["mel_bins"] // 4
        batch |= {"audio_latent_mean": torch.randn(2, *features, generator=g),
                  "audio_latent_logvar": torch.randn(2, *features, generator=g) - 3}
    if adapter.takes_control:  # the control clip's latents at 1/3 of its size: IC-LoRA's reference
        batch["control_latent_mean"] = torch.randn(2, adapter.latent_channels, 3, 1, 1, generator=g)
    return batch

report["ltx2"] = {}
for folder, kind, audio in ((sys.argv[4], "t2v", True), (sys.argv[4], "t2v", False), (sys.argv[5], "i2v", True),
                            (sys.argv[4], "ic", True)):
    downscale = 3 if kind == "ic" else 1
    adapter = load_adapter(ModelConfig(path=folder, family="ltx2", type=kind, dtype="fp32",
                                       reference_downscale_factor=downscale), torch.device("cpu"))
    adapter.first_frame_p = 0.0 if kind == "t2v" else 1.0
    batch, results, seen, stg = ltx2_batch(adapter, audio), [], {}, []
    for split_it in (False, True):
        model = adapter.load_transformer().requires_grad_(True)
        if split_it:
            for block in adapter.blocks(model):
                for name in ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn"):
                    def record(m, args, kwargs, name=name):
                        inputs = kwargs.get("encoder_hidden_states")
                        queries = args[0] if args else kwargs["hidden_states"]
                        seen[name] = [queries.shape[1], None if inputs is None else inputs.shape[1]]
                    getattr(block, name).register_forward_pre_hook(record, with_kwargs=True)
            adapter.split_sequence(model, split)
        loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(5 + i) for i in range(2)])
        loss.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if split_it:
            for grad in grads.values():  # the group's sum: sp times the sample's
                dist.all_reduce(grad)
                grad /= 2
        parts = {name: (total / max(count, 1)).item() for name, (total, count) in zip(adapter.LOSS_PARTS, adapter.losses)}
        results.append((loss.detach(), parts, grads))
        if adapter.transformer_config["perturbed_attn"]:  # validation's STG forward (LTX-2.3), as guide runs it
            c, g = adapter.transformer_config, torch.Generator().manual_seed(6)
            t = torch.tensor([700.0])
            inputs = (VideoStream(torch.randn(1, 27, c["in_channels"], generator=g), t, t, (3, 3, 3)),
                      AudioStream(torch.randn(1, 5, c["audio_in_channels"], generator=g), t, 5),
                      batch["prompt_embeds"][:1])
            with torch.no_grad():
                stg.append([torch.cat([x.flatten() for x in adapter._predict(model, *inputs, stg_blocks=blocks)])
                            for blocks in ([0, 1], None)])
    (loss, parts, grads), (split_loss, split_parts, split_grads) = results
    if stg:
        report["ltx2_stg"] = {"equal": torch.allclose(stg[1][0], stg[0][0], rtol=1e-5, atol=1e-6),
                              "perturbs": (stg[0][0] - stg[0][1]).abs().max().item()}
    report["ltx2"][f"{kind}{'_audio' if audio else ''}"] = {
        "loss_equal": torch.allclose(split_loss, loss, rtol=1e-5, atol=1e-6), "parts": [parts, split_parts],
        "grads": len(grads), "same_grads": grads.keys() == split_grads.keys(),
        "grads_differ": [n for n in grads if not torch.allclose(split_grads[n], grads[n], rtol=1e-5, atol=1e-6)],
        "seen": seen}

# train_loss and every weight's gradient of one process against the split's (the group's gradient
# sum over sp); watch(model) hooks the model that is split. Returns the comparison and the gradients.
def split_against_one(adapter, batch, seed, watch):
    results = []
    for split_it in (False, True):
        model = adapter.load_transformer().requires_grad_(True)
        if split_it:
            watch(model)
            adapter.split_sequence(model, split)
        loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(seed + i) for i in range(2)])
        loss.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if split_it:
            for grad in grads.values():  # the group's sum: sp times the sample's
                dist.all_reduce(grad)
                grad /= 2
        results.append((loss.detach(), grads))
    (loss, grads), (split_loss, split_grads) = results
    return {"loss_equal": torch.allclose(split_loss, loss, rtol=1e-5, atol=1e-6),
            "same_grads": grads.keys() == split_grads.keys(),
            "grads_differ": [n for n in grads if not torch.allclose(split_grads[n], grads[n], rtol=1e-5, atol=1e-6)]}, grads

# Wan VACE (sys.argv[6]): train_loss and every weight's gradient, the VACE patch embedding's
# included, equal one process's with the context split with the video: 3 latent frames and 2
# reference frames of 3 x 3 tokens, 45 split 23 + 22, in the context blocks as in the base blocks.
adapter = load_adapter(ModelConfig(path=sys.argv[6], family="wan", type="vace", dtype="fp32"), torch.device("cpu"))
g = torch.Generator().manual_seed(7)
batch = {"latent_mean": torch.randn(2, 16, 3, 6, 6, generator=g),
         "latent_logvar": torch.randn(2, 16, 3, 6, 6, generator=g) - 3,
         "prompt_embeds": torch.randn(2, 512, 32, generator=g),
         "control_latents": torch.randn(2, 96, 3, 6, 6, generator=g),
         "reference_latents": torch.randn(2, 16, 2, 6, 6, generator=g)}
seen = {}
def watch_vace(model):
    for kind in ("vace_blocks", "blocks"):
        for block in getattr(model, kind):
            block.attn1.register_forward_pre_hook(
                lambda m, args, kwargs, kind=kind: seen.setdefault(kind, set()).add(args[0].shape[1]), with_kwargs=True)
found, grads = split_against_one(adapter, batch, 5, watch_vace)
report["vace"] = {**found, "grads": sorted(grads), "seen": {kind: sorted(lengths) for kind, lengths in seen.items()}}

# Wan FLF2V (sys.argv[7]): the video tokens split (27: 14 + 13); the two images' CLIP tokens (2 x 17) sit
# with the text's (512) as the cross-attention's keys, whole on every rank. train_loss and every weight's
# gradient (the image embedder's position table among them) equal one process's.
adapter = load_adapter(ModelConfig(path=sys.argv[7], family="wan", type="i2v", dtype="fp32"), torch.device("cpu"))
c, g = adapter.transformer_config, torch.Generator().manual_seed(7)
latents = (2, adapter.latent_channels, 3, 6, 6)
batch = {"latent_mean": torch.randn(latents, generator=g), "latent_logvar": torch.randn(latents, generator=g) - 3,
         "prompt_embeds": torch.randn(2, adapter.text_length, c["text_dim"], generator=g),
         "image_latents": torch.randn(latents, generator=g),
         "image_embeds": torch.randn(2, c["pos_embed_seq_len"], c["image_dim"], generator=g)}
seen = {}
def watch_flf2v(model):
    for block in adapter.blocks(model):
        for name in ("attn1", "attn2"):
            def record(m, args, name=name):
                seen[name] = [args[0].shape[1], None if args[1] is None else args[1].shape[1]]
            getattr(block, name).register_forward_pre_hook(record)
found, grads = split_against_one(adapter, batch, 8, watch_flf2v)
report["wan_flf2v"] = {**found, "pos_embed_grad": "condition_embedder.image_embedder.pos_embed" in grads, "seen": seen}

with open(f"{sys.argv[3]}/rank{rank}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_split_inside_the_ranks(tiny_models, ltx2_models, wan_models, tmp_path):
    result = run_worker(
        WORKER,
        tmp_path,
        tiny_models("5b"),
        tmp_path,
        ltx2_models("2.0"),
        ltx2_models("2.3"),
        wan_models("vace"),
        wan_models("flf2v"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["lengths"] == [3, 2]
        assert report["seq_to_heads"] and report["round_trip"] and report["gather"] and report["adjoint"]
        assert report["tokens_seen"] == [[38, 37][rank]], report  # 75 video tokens, split 38 + 37
        assert report["forward_equal"]
        assert report["exchanged"] == ["torch.bfloat16"], report["exchanged"]
        dynamo = report["dynamo"]
        assert (
            dynamo["graph_breaks"] == dynamo["unsupported"] == 0
            and dynamo["frames"]["ok"] == dynamo["frames"]["total"]
        ), dynamo
        assert report["compiled_equal"]
        vace = report["vace"]
        assert vace["loss_equal"] and vace["same_grads"] and not vace["grads_differ"], vace
        assert (
            "vace_patch_embedding.weight" in vace["grads"] and "vace_blocks.0.proj_in.weight" in vace["grads"]
        )
        assert vace["seen"] == {"vace_blocks": [[23, 22][rank]], "blocks": [[23, 22][rank]]}
        assert report["ltx2"].keys() == {"t2v_audio", "t2v", "i2v_audio", "ic_audio"}
        assert report["ltx2_stg"]["equal"] and report["ltx2_stg"]["perturbs"] > 1e-3, report["ltx2_stg"]
        for case, ltx2 in report["ltx2"].items():
            assert ltx2["loss_equal"] and ltx2["same_grads"] and not ltx2["grads_differ"], (case, ltx2)
            (one, split), audio = ltx2["parts"], case.endswith("audio")
            assert one["loss_video"] == pytest.approx(split["loss_video"], rel=1e-5)
            assert one["loss_audio"] == pytest.approx(split["loss_audio"], rel=1e-5, abs=1e-6)
            assert (one["loss_audio"] > 0) == audio
            # each rank's video attention sees its 14 or 13 tokens (IC-LoRA: 15 of 30, the clip's
            # and the reference's split together), and the audio attention all 5 (1: video-only)
            tokens, sound = [15, 15][rank] if case.startswith("ic") else [14, 13][rank], 5 if audio else 1
            expected = {
                "attn1": [tokens, None],
                "audio_attn1": [sound, None],
                "audio_to_video_attn": [tokens, sound],
                "video_to_audio_attn": [sound, tokens],
            }
            assert ltx2["seen"] == (
                expected if audio else {k: v for k, v in expected.items() if "_to_" not in k}
            ), case
        flf2v = report["wan_flf2v"]
        assert flf2v["loss_equal"] and flf2v["same_grads"] and not flf2v["grads_differ"], flf2v
        assert flf2v["pos_embed_grad"]
        # this rank's video tokens; every image token (2 x 17) and text token (512) as keys
        assert flf2v["seen"] == {"attn1": [[14, 13][rank], None], "attn2": [[14, 13][rank], 2 * 17 + 512]}


def test_errors_name_the_valid_sizes(write_config):
    with pytest.raises(
        ConfigError, match=r"does not divide this model's 30 attention heads: use one of \[1, 2, 3, 6\]"
    ):
        parallel.check_heads(4, 30, 12)
    with pytest.raises(ConfigError, match="lora.dropout > 0 needs parallel.sp_size = 1"):
        load_config(str(write_config("dropout", **{"lora.dropout": 0.1, "parallel.sp_size": 2})))
    with pytest.raises(ConfigError, match="parallel.sp_size must be at least 1"):
        load_config(str(write_config("zero", **{"parallel.sp_size": 0})))


def test_ltx2_takes_sequence_parallelism(write_config, ltx2_models, monkeypatch):
    """LTX-2 takes sequence parallelism, its audio heads checked as the video's, before the cache pass.

    The config accepts LTX-2 with sp (it refused it before the split was built); the video-to-audio
    attention splits the audio heads, so their count is checked as the video's is, by the setup step
    (the family's sequence_heads), before any clip is read."""
    cfg = load_config(
        str(
            write_config(
                "ltx2",
                **{
                    "model.family": "ltx2",
                    "model.path": str(ltx2_models("2.0")),
                    "parallel.sp_size": 2,
                    "parallel.strategy": "fsdp",
                    "data.audio": True,
                    "data.target_fps": 24,
                },
            )
        )
    )
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    adapter.transformer_config["audio_num_attention_heads"] = 3
    monkeypatch.setattr(model, "load_adapter", lambda *args: adapter)
    with (
        one_rank_group() as d,
        pytest.raises(ranks.StopRun, match=r"does not divide this model's 3 attention heads"),
    ):
        model.setup_adapter(cfg, d)
