"""LTX-2 with its sound: cached, trained, and rendered into the validation clips.

The cache pass encodes each window's soundtrack with the adapter, the loss adds the audio stream's
(logged apart, as the held-out loss is), and the validation clips carry the sound our loop denoises
exactly as LTX2Pipeline does, muxed into the mp4 and beside the clip in TensorBoard.

One training run (the synthetic clips with sound, one without among them, so batches mix) serves the
tests that read its outputs."""

import contextlib
import dataclasses
import json
import math
import shutil
from pathlib import Path

import av
import pytest
import torch
from conftest import LTX2_PROMPTS as PROMPTS
from conftest import (
    PIPELINE_GUIDANCE,
    ltx2_settings,
    one_rank_group,
    pipeline_guidance,
    prepare_run,
    read_metrics,
    run_ok,
    write_toml,
)
from diffusers import LTX2Pipeline
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import data
import lora
import render
import trainer
import validate
from config import ModelConfig, load_config
from families.ltx2 import TEXT_LENGTH
from model_adapter import RunSettings, load_adapter
from ranks import StopRun
from tools.make_synthetic_dataset import make_synthetic_dataset

STEPS = 40
SOUND = {"data.audio": True, "data.target_fps": 24}


@pytest.fixture(scope="module")
def sound_data(tmp_path_factory):
    """Six clips with a tone following the shape (mp4/AAC and mkv/Opus), the first replaced by one
    without sound."""
    root = tmp_path_factory.mktemp("ltx2_sound") / "shapes"
    make_synthetic_dataset(str(root), num_videos=6, frames=17, height=40, width=48, seed=0, audio=True)
    silent = root.parent / "silent"
    make_synthetic_dataset(str(silent), num_videos=1, frames=17, height=40, width=48, seed=1)
    shutil.copy(silent / "videos" / "00000.mp4", root / "videos" / "00000.mp4")
    return root


@pytest.fixture(scope="module")
def sound_run(ltx2_models, base_settings, sound_data, tmp_path_factory):
    """LoRA on LTX-2.0 with sound: validation (held-out loss and one clip) before step 1 and at the
    end."""
    out = tmp_path_factory.mktemp("ltx2_sound_run")
    settings = ltx2_settings(
        "2.0",
        ltx2_models,
        base_settings,
        sound_data,
        out / "run",
        **SOUND,
        **{
            "train.steps": STEPS,
            "train.learning_rate": 3e-3,
            "lora.rank": 8,
            "lora.lora_alpha": 4,
            "checkpoint.checkpointing_steps": STEPS,
            "validation.do_validation": True,
            "validation.validation_steps": STEPS,
        },
    )
    trainer.main(["--cfg", str(write_toml(out / "run.toml", settings))])
    return out / "run", load_config(str(out / "run.toml"))


@pytest.mark.slow
def test_sound_trains_and_both_held_out_losses_fall(sound_run):
    """The video and audio losses are logged, and both held-out losses fall.

    Every log step has the video and the audio loss (batches mix a clip without sound: the audio
    loss averages the clips with sound); the held-out loss falls for each stream."""
    run, _ = sound_run
    metrics = read_metrics(run)
    train = [m for m in metrics if "train/loss" in m]
    assert len(train) == STEPS and all(m["train/loss_video"] > 0 and m["train/loss_audio"] > 0 for m in train)
    held = {m["step"]: m for m in metrics if "val/loss" in m}
    assert sorted(held) == [0, STEPS]
    for name in ("val/loss", "val/loss_video", "val/loss_audio"):
        assert held[STEPS][name] < 0.9 * held[0][name], (name, held[0][name], held[STEPS][name])


@pytest.mark.slow
def test_cached_sound_is_the_windows_mel_through_the_audio_vae(sound_run):
    """A clip's cached sound is its window's log-mel through the audio VAE.

    Each clip's audio entry is encode_mel of its window's log-mel (data.log_mel with the VAE's
    settings), every latent frame the VAE gives kept (1 + (mel frames - 1) // 4); the clip without
    sound has none."""
    _, cfg = sound_run
    with one_rank_group() as d:
        adapter, entries, train, held = prepare_run(cfg, d)
    items = {item.clip.video.name: item for item in train + held}
    silent, sounding = items.pop("00000.mp4"), items["00001.mkv"]
    assert load_file(entries.path(silent, "audio")) == {}
    cached = load_file(entries.path(sounding, "audio"))
    waveform = data.decode_audio(sounding, adapter.audio_sample_rate, adapter.audio_channels)
    c = adapter.audio_config
    mel = data.log_mel(waveform, c["sample_rate"], 1024, c["mel_hop_length"], c["mel_bins"])
    mean, logvar = adapter.encode_mel(mel[None])
    assert mean.shape[2] == 1 + (mel.shape[1] - 1) // 4
    torch.testing.assert_close(cached["audio_latent_mean"], mean[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(cached["audio_latent_logvar"], logvar[0], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_validation_clip_carries_its_sound(sound_run):
    """The validation clip carries its sound, in the mp4 and in TensorBoard.

    The step's mp4 holds an AAC stream PyAV decodes, at the vocoder's rate and as long as the
    rendered sound; TensorBoard's event reader finds it beside the clip."""
    run, cfg = sound_run
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    with av.open(str(run / "validation_res" / f"step_{STEPS}_prompt_0.mp4")) as container:
        (stream,) = container.streams.audio
        assert stream.codec_context.name == "aac" and stream.codec_context.channels == 2
        samples = sum(frame.samples for frame in container.decode(stream))
    assert stream.sample_rate == adapter.sound_rate
    # The pipeline's latent frames for 9 frames at 24 fps; the audio VAE's mel frames; the vocoder's
    # samples.
    latents = round(9 / 24 * adapter.audio_latents_per_second)
    vocoder = json.loads((adapter.path / "vocoder" / "config.json").read_text())
    rendered = (4 * (latents - 1) + 1) * math.prod(vocoder["upsample_factors"])
    # AAC ends on a whole 1024-sample frame
    assert rendered <= samples < rendered + 1024, (samples, rendered)
    events = EventAccumulator(str(run / "logs"), size_guidance={"audio": 0}).Reload()
    assert {"val/audio_0", "val/clip_0"} <= set(events.Tags()["audio"] + events.Tags()["images"])
    (first, *_), last = events.Audio("val/audio_0"), events.Audio("val/audio_0")[-1]
    assert last.step == STEPS and first.step == 0 and last.sample_rate == adapter.sound_rate


def test_audio_loss_reaches_the_audio_stream(ltx2_models):
    """With sound, the loss's gradient reaches the audio stream's LoRA; without, none of it does
    (the video trains alone); a clip without sound in a batch with sound adds no audio loss."""
    adapter_cfg = ModelConfig(family="ltx2", path=str(ltx2_models("2.0")), dtype="fp32")
    adapter = load_adapter(adapter_cfg, torch.device("cpu"))
    transformer = adapter.load_transformer()
    lora.inject_lora(transformer, ["to_q", "to_k", "to_v", "to_out.0"], 4, 4, 0.0, 0)
    gen = torch.Generator().manual_seed(0)
    mean, logvar = adapter.encode_audio(0.1 * torch.randn(2, 2, 6000, generator=gen))
    batch = {
        "latent_mean": torch.randn(2, 8, 2, 4, 4, generator=gen),
        "latent_logvar": torch.full((2, 8, 2, 4, 4), -4.0),
        "prompt_embeds": torch.randn(2, TEXT_LENGTH, 32, generator=gen),
    }
    sound = {**batch, "audio_latent_mean": mean, "audio_latent_logvar": logvar}

    def audio_grads(batch):
        transformer.zero_grad(set_to_none=True)
        adapter.train_loss(
            transformer, batch, [data.keyed_generator(0, 1, i) for i in range(2)]
        ).sum().backward()
        return [p.grad for n, p in transformer.named_parameters() if "lora_B" in n and "audio_attn1" in n]

    grads = audio_grads(sound)
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    assert adapter.losses[1].tolist()[1] == 2  # both clips' audio losses
    assert all(g is None or not g.any() for g in audio_grads(batch))
    assert adapter.losses[1].tolist() == [0, 0]
    mixed = {**sound, "audio_mask": torch.tensor([True, False])}
    with torch.no_grad():
        total = adapter.train_loss(transformer, mixed, [data.keyed_generator(0, 1, i) for i in range(2)])
        assert adapter.losses[1, 1] == 1  # the clip with sound's audio loss alone
        video_alone = load_adapter(adapter_cfg, torch.device("cpu"), RunSettings(audio_loss_weight=0.0))
        video = video_alone.train_loss(transformer, mixed, [data.keyed_generator(0, 1, i) for i in range(2)])
    # the clip without sound: its video loss alone
    assert total[0] > video[0] and total[1] == video[1]


@pytest.mark.slow
def test_our_sound_equals_the_pipelines(ltx2_models, base_settings, sound_data, sound_run, tmp_path):
    """Our loop's sound equals LTX2Pipeline's, with and without the LoRA.

    Our loop's audio, decoded by the audio VAE and the vocoder, equals LTX2Pipeline's within 1e-4 in
    fp32, without and with the LoRA the run with sound exported (load_lora_weights), which changes
    the sound, and with the pipeline's own guidance terms (the sound's scale, modality isolation,
    rescale), which change it."""
    settings = ltx2_settings("2.0", ltx2_models, base_settings, sound_data, tmp_path, **SOUND)
    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    adapter = load_adapter(cfg.model, torch.device("cpu"))
    lora_file = sound_run[0] / "lora" / "pytorch_lora_weights.safetensors"
    sounds = []
    for trained, v in (
        (None, cfg.validation),
        (lora_file, cfg.validation),
        (lora_file, dataclasses.replace(cfg.validation, **PIPELINE_GUIDANCE)),
    ):
        pipe = LTX2Pipeline.from_pretrained(str(ltx2_models("2.0")))
        pipe.set_progress_bar_config(disable=True)
        if trained:
            pipe.load_lora_weights(str(trained))
        with one_rank_group() as d:
            renderer = validate.ClipRenderer(adapter, v, cfg.data, str(tmp_path), d)
            model = render.load_model(cfg, adapter, d, None, str(trained) if trained else None).eval()
            _, ours = renderer.clip(model, 0, adapter.sampler(""), contextlib.nullcontext())
        theirs = pipe(
            prompt=PROMPTS[0],
            negative_prompt=v.negative_prompt,
            num_frames=9,
            height=32,
            width=32,
            num_inference_steps=v.num_inference_steps,
            **pipeline_guidance(v),
            generator=data.keyed_generator(v.seed, 0),
            output_type="pt",
        ).audio[0]
        assert ours.shape == theirs.shape and ours.shape[0] == 2
        assert (ours - theirs.float()).abs().max() <= 1e-4, (trained, v, (ours - theirs).abs().max())
        assert theirs.abs().max() > 1e-3  # a sound, not silence
        sounds.append(ours)
    assert (sounds[0] - sounds[1]).abs().max() > 1e-3  # the LoRA shows in the sound
    assert (sounds[1] - sounds[2]).abs().max() > 1e-3  # and the guidance terms


@pytest.fixture(scope="module")
def ddp_sound_run(ltx2_models, base_settings, sound_data, tmp_path_factory):
    """3 steps of LoRA (the default targets: every attention, the audio stream's and the audio-video
    cross-attentions too) on 2 DDP ranks of one clip each, over the clips with sound and the one
    without."""
    out = tmp_path_factory.mktemp("ltx2_sound_ddp")
    settings = ltx2_settings(
        "2.0",
        ltx2_models,
        base_settings,
        sound_data,
        out / "ddp",
        **SOUND,
        **{
            "parallel.strategy": "ddp",
            "train.batch_size": 1,
            "train.steps": 3,
            "train.log_every": 1,
            "checkpoint.checkpointing_steps": 3,
        },
    )
    run_ok(["--cfg", str(write_toml(out / "ddp.toml", settings))], nproc=2)
    return out, settings


@pytest.mark.slow
def test_ddp_trains_batches_with_and_without_sound(ddp_sound_run):
    """DDP trains batches with and without sound.

    2 DDP ranks over the clips with sound and the one without: a rank whose batch has no sound runs
    the video alone, so the audio stream's weights get no gradient there (DDP must look for them
    each step: with one graph assumed for the run, its second step stops)."""
    losses = [m for m in read_metrics(ddp_sound_run[0] / "ddp") if "train/loss" in m]
    assert len(losses) == 3 and all(m["train/loss_video"] > 0 for m in losses)


def assert_same_steps(ours: Path, theirs: Path) -> None:
    """Every logged step's losses (each stream's) and gradient norm agree within summation order."""
    ours, theirs = ([m for m in read_metrics(run) if "train/loss" in m] for run in (ours, theirs))
    assert len(ours) == len(theirs) > 0
    for key in ("train/loss", "train/loss_video", "train/loss_audio", "train/grad_norm"):
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in theirs], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_fsdp_trains_batches_with_and_without_sound(ddp_sound_run, tmp_path):
    """FSDP trains batches with and without sound, also streamed and with sequence parallelism.

    FSDP over the clips with sound and the one without: a rank whose batch has no sound leaves the
    audio stream without a gradient, yet must reduce-scatter what the other ranks do (without, the
    ranks' collectives differ and the run stops at its first mixed step). LoRA on every attention on
    2 ranks, its blocks streamed (parallel.cpu_offload: LoRA then streams with them, not in a unit
    of its own), trains as DDP does, step for step and in the exported weights; sft with sequence
    parallelism on 2 x 2 ranks (each pair shares a clip) as one process does with the same global
    batch (accumulation 2 x 1)."""
    out, ddp = ddp_sound_run
    settings = {
        **ddp,
        "run.output_dir": str(tmp_path / "lora"),
        "parallel.strategy": "fsdp",
        "parallel.cpu_offload": True,
    }  # LoRA streams from the host with its block
    run_ok(["--cfg", str(write_toml(tmp_path / "lora.toml", settings))], nproc=2)
    assert_same_steps(tmp_path / "lora", out / "ddp")
    ours, theirs = (
        load_file(run / "lora" / "pytorch_lora_weights.safetensors")
        for run in (tmp_path / "lora", out / "ddp")
    )
    assert {"audio_attn1", "audio_to_video_attn", "video_to_audio_attn"} <= {k.split(".")[3] for k in ours}
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)

    sft = {**ddp, "train.training_type": "sft", "train.steps": 2, "checkpoint.checkpointing_steps": 2}
    split = {
        **sft,
        "run.output_dir": str(tmp_path / "sft_sp"),
        "parallel.strategy": "fsdp",
        "parallel.sp_size": 2,
    }
    run_ok(["--cfg", str(write_toml(tmp_path / "sft_sp.toml", split))], nproc=4)
    trainer.main(
        [
            "--cfg",
            str(
                write_toml(
                    tmp_path / "sft.toml",
                    {**sft, "run.output_dir": str(tmp_path / "sft"), "train.gradient_accumulation_steps": 2},
                )
            ),
        ]
    )
    assert_same_steps(tmp_path / "sft_sp", tmp_path / "sft")


def test_offload_blocks_with_sound_is_refused(ltx2_models, base_settings, sound_data, tmp_path):
    """parallel.offload_blocks with sound is refused before the cache pass.

    With sound LoRA streams with its block (above): only some blocks on the host would split LoRA's
    weights and AdamW state between host and GPU, so parallel.offload_blocks is refused before the
    cache pass."""
    settings = ltx2_settings(
        "2.0",
        ltx2_models,
        base_settings,
        sound_data,
        tmp_path / "run",
        **SOUND,
        **{"parallel.strategy": "fsdp", "parallel.cpu_offload": True, "parallel.offload_blocks": 1},
    )
    cfg = load_config(str(write_toml(tmp_path / "run.toml", settings)))
    with one_rank_group() as d, pytest.raises(StopRun, match="offload_blocks = 1 with data.audio = true"):
        prepare_run(cfg, d)
