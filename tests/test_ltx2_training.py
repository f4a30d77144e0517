"""LTX-2 trains what Lightricks trains, held to their trainer's and core's formulas.

LTX-2 trains what Lightricks trains: ltx-trainer's timestep sampler (its shift unclamped),
ltx-core's audio-video cross-attention modulation (each stream's scale/shift from its own timesteps,
its gate from the other stream's sigma), the audio VAE in fp32, and the encoders' means as the clean
latents. The reference formulas are Lightricks/LTX-2's (packages/ltx-trainer, packages/ltx-core),
written with their files named, here and in conftest.py (ltx-core's cross-attention modulation,
which test_ltx2.py's pipeline runs use too)."""

import pytest
import torch
from conftest import (
    decode_mp4,
    ltx2_settings,
    ltx_core_cross_modulation,
    one_rank_group,
    prepare_run,
    write_toml,
)
from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline

import data
import validate
from config import ConfigError, DataConfig, ModelConfig, ValidationConfig, load_config
from families.ltx2 import TEXT_LENGTH, AudioStream, VideoStream, shifted_logit_normal
from model_adapter import RunSettings, check_config, load_adapter
from ranks import StopRun


def ltx_trainer_sigma(seq_length: int, generator: torch.Generator) -> torch.Tensor:
    """packages/ltx-trainer/src/ltx_trainer/timestep_samplers.py,
    ShiftedLogitNormalTimestepSampler.sample (std 1, eps 1e-3, uniform_prob 0.1) for a batch of one,
    its draws in its order (normal, uniform, choice), with _get_shift_for_sequence_length's line
    through (1024, 0.95) and (4096, 2.05), unclamped."""
    m = (2.05 - 0.95) / (4096 - 1024)
    mu = m * seq_length + (0.95 - m * 1024)
    logitnormal = torch.sigmoid(torch.randn((1,), generator=generator) + mu)
    p999, p005 = torch.sigmoid(torch.tensor(mu + 3.0902)), torch.sigmoid(torch.tensor(mu - 2.5758))
    raw = (logitnormal - p005) / (p999 - p005)
    stretched = torch.clamp(torch.where(raw >= 1e-3, raw, 2 * 1e-3 - raw), 0, 1)
    uniform = (1 - 1e-3) * torch.rand((1,), generator=generator) + 1e-3
    prob = torch.rand((1,), generator=generator)
    return torch.where(prob > 0.1, stretched, uniform)[0]


@pytest.mark.parametrize("tokens", [256, 1024, 4096, 6144, 24576])
def test_timestep_sampler_is_ltx_trainers(tokens):
    """Our timestep sampler equals ltx-trainer's, its shift unclamped.

    Our draw equals ltx-trainer's from the same generator at token counts below, inside and above
    the line's points: past 4096 the shift keeps growing (mu 2.78 at 121 x 512 x 768's 6,144 tokens,
    not 2.05)."""
    for seed in range(40):
        ours = shifted_logit_normal(tokens, torch.Generator().manual_seed(seed))
        theirs = ltx_trainer_sigma(tokens, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_cross_attention_modulation_is_ltx_cores(variant, ltx2_models):
    """Our cross-attention modulation is ltx-core's.

    Our forward's output equals diffusers' transformer given ltx-core's four cross-attention inputs:
    with a sigma per stream (training with sound), and with I2V's image tokens at timestep 0 (their
    scale/shift their own 0, not the audio's sigma); with one sigma for both it still equals the
    call LTX2Pipeline makes (use_cross_timestep), while with a sigma per stream that call differs.
    """
    adapter = load_adapter(
        ModelConfig(family="ltx2", path=str(ltx2_models(variant)), dtype="fp32"), torch.device("cpu")
    )
    transformer = adapter.load_transformer().eval()
    c = adapter.transformer_config
    gen = torch.Generator().manual_seed(0)
    video = torch.randn(2, 2 * 4 * 4, c["in_channels"], generator=gen)
    audio = torch.randn(2, 9, c["audio_in_channels"], generator=gen)
    embeds = torch.randn(2, TEXT_LENGTH, 16 + (8 if not c["use_prompt_embeddings"] else 16), generator=gen)
    video_text, audio_text = adapter._split_text(embeds)
    sigma, audio_sigma = torch.tensor([300.0, 800.0]), torch.tensor([900.0, 100.0])
    # I2V: the first frame's
    image_t = torch.cat([torch.zeros(2, 16), sigma[:, None].expand(2, 16)], dim=1)

    def diffusers_call(video_t, sigma, audio_sigma, cross_timestep=True):
        out = transformer(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=video_text,
            audio_encoder_hidden_states=audio_text,
            timestep=video_t,
            audio_timestep=audio_sigma,
            sigma=sigma,
            audio_sigma=audio_sigma,
            num_frames=2,
            height=4,
            width=4,
            fps=adapter.frame_rate,
            audio_num_frames=9,
            use_cross_timestep=cross_timestep,
            return_dict=False,
        )
        return torch.cat([x.flatten(1) for x in out], 1)

    with torch.no_grad():
        for video_t, audio_t in (
            (sigma, audio_sigma),
            (image_t, audio_sigma),
            (image_t, sigma),
            (sigma, sigma),
        ):
            ours = torch.cat(
                [
                    x.flatten(1)
                    for x in adapter._predict(
                        transformer,
                        VideoStream(video, video_t, sigma, (2, 4, 4)),
                        AudioStream(audio, audio_t, 9),
                        embeds,
                    )
                ],
                1,
            )
            with ltx_core_cross_modulation(transformer):
                theirs = diffusers_call(video_t, sigma, audio_t)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
            # scale/shift from the other stream's sigma
            pipelines = diffusers_call(video_t, sigma, audio_t)
            if video_t is sigma and audio_t is sigma:
                torch.testing.assert_close(ours, pipelines, rtol=0, atol=1e-5)
            else:
                assert (ours - pipelines).abs().max() > 1e-3, (variant, video_t, audio_t)


def test_audio_vae_encodes_in_fp32(ltx2_models):
    """The audio VAE encodes in fp32 whatever model.dtype is.

    With model.dtype bf16, the cached sound is the fp32 audio VAE's posterior of the mel
    spectrogram, as ltx-trainer's process_videos.py encodes it ("Audio VAE needs float32 for
    quality")."""
    path = ltx2_models("2.0")
    adapter = load_adapter(ModelConfig(family="ltx2", path=str(path), dtype="bf16"), torch.device("cpu"))
    waveforms = 0.1 * torch.randn(1, 2, 6000, generator=torch.Generator().manual_seed(0))
    mean, logvar = adapter.encode_audio(waveforms)
    vae = AutoencoderKLLTX2Audio.from_pretrained(path, subfolder="audio_vae", dtype=torch.float32).eval()
    with torch.no_grad():
        posterior = vae.encode(adapter.mel(waveforms)).latent_dist
    assert mean.dtype == logvar.dtype == torch.float32
    torch.testing.assert_close(mean, posterior.mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(logvar, posterior.logvar, rtol=0, atol=1e-6)


def test_training_takes_the_encoders_means(ltx2_models):
    """Training takes the encoders' means as the clean latents.

    The clean latents are the cached posteriors' means (ltx-trainer's, from ltx-core's encoders):
    the loss does not depend on the cached log-variances, of the video or of the sound."""
    adapter = load_adapter(
        ModelConfig(family="ltx2", path=str(ltx2_models("2.0")), dtype="fp32"), torch.device("cpu")
    )
    transformer = adapter.load_transformer().eval()
    gen = torch.Generator().manual_seed(0)
    batch = {
        "latent_mean": torch.randn(2, 8, 2, 4, 4, generator=gen),
        "audio_latent_mean": torch.randn(2, 2, 9, 4, generator=gen),
        "prompt_embeds": torch.randn(2, TEXT_LENGTH, 32, generator=gen),
    }
    losses = []
    with torch.no_grad():
        for logvar in (-8.0, 1.0):
            variances = {
                "latent_logvar": torch.full((2, 8, 2, 4, 4), logvar),
                "audio_latent_logvar": torch.full((2, 2, 9, 4), logvar),
            }
            losses.append(
                adapter.train_loss(
                    transformer, {**batch, **variances}, [data.keyed_generator(0, 1, i) for i in range(2)]
                )
            )
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["2.0", "2.5"])
def test_text_is_tokenized_as_ltx_core_tokenizes_it(variant, ltx2_models):
    """The cache's text is Gemma's over the tokens ltx-core gives it.

    ltx-core's LTXGemmaTokenizer (Lightricks/LTX-2 400fd31, packages/ltx-core/src/ltx_core/
    text_encoders/gemma/tokenizer.py:12-14 and :31-56; max_length 1024 and left padding:
    encoders/base_encoder.py:231-236) starts every prompt with <bos>, adding it where the tokenizer
    does not (Gemma 4: the tiny 2.5's, while the tiny 2.0's starts with it as Gemma 3's does): the
    layout written here is left padding, <bos>, then the stripped prompt's tokens, 1023 at most.
    LTX2Pipeline's _get_gemma_prompt_embeds gives the same tokens with Gemma 3 and none of the <bos>
    with Gemma 4, so validation follows the cache there, not the pipeline; the text entries of 2.5
    are keyed apart from those made without the <bos> (text_key)."""
    path = ltx2_models(variant)
    adapter = load_adapter(ModelConfig(family="ltx2", path=str(path), dtype="fp32"), torch.device("cpu"))
    text_encoder, tokenizer = adapter._text()
    assert (tokenizer("a").input_ids[0] == tokenizer.bos_token_id) == (variant == "2.0")
    assert adapter.text_key() == ({} if variant == "2.0" else {"bos": "ltx-core"})
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs["input_ids"], kwargs["attention_mask"]))

    hook = text_encoder.register_forward_pre_hook(record, with_kwargs=True)
    prompts = ["  a red ball rolls.  ", "x" * 1100]  # the second longer than 1024 tokens
    try:
        adapter.encode_text(prompts)
        pipe = LTX2Pipeline.from_pretrained(
            path, transformer=None, vae=None, audio_vae=None, vocoder=None, connectors=None
        )
        pipe.text_encoder = text_encoder
        pipe._get_gemma_prompt_embeds(prompts, device=torch.device("cpu"))
    finally:
        hook.remove()
    (ids, mask), (pipeline_ids, _) = seen
    for i, prompt in enumerate(prompts):
        text = tokenizer(prompt.strip(), add_special_tokens=False).input_ids[:1023]
        pad = TEXT_LENGTH - 1 - len(text)
        assert ids[i].tolist() == [tokenizer.pad_token_id] * pad + [tokenizer.bos_token_id] + text
        assert mask[i].tolist() == [0] * pad + [1] * (1 + len(text))
    assert torch.equal(pipeline_ids, ids) == (variant == "2.0")


def test_image_to_video_trains_on_the_clips_own_first_frame_as_ltx_trainer(ltx2_models, write_config):
    """I2V trains on the clip's own first latent frame, with ltx-trainer's probability.

    ltx-trainer's first_frame condition (Lightricks/LTX-2 400fd31, packages/ltx-trainer/src/
    ltx_trainer/training_strategies/flexible.py:409 passes clean_latents=latents to
    _apply_intrinsic_condition, :464-521: one Bernoulli draw per sample below `probability`, the
    drawn samples' first latent frame's tokens m * clean + (1 - m) * noisy, timesteps (1 - m) t,
    loss mask & (m == 0)), written out here: the clip's own clean first latent frame (no H.264, no
    image entry: a cached image_latents is not read), at timestep 0, outside the masked mean
    (_compute_modality_loss). By default every sample (IntrinsicConditionBase.probability = 1.0,
    flexible.py:38-43); train.first_frame_conditioning_p = 0.5 (its configs/i2v_lora.yaml:130)
    conditions the samples whose keyed draw after the noise falls below it. The held-out loss
    conditions every sample. The key is refused for text-to-video, data.image_column for LTX-2's
    I2V (it reads no image)."""
    adapter = load_adapter(
        ModelConfig(family="ltx2", type="i2v", path=str(ltx2_models("2.0")), dtype="fp32"),
        torch.device("cpu"),
    )
    assert adapter.first_frame_p == 1.0 and "image" not in adapter.ENCODERS
    transformer = adapter.load_transformer().eval()
    gen, n, tokens, frame = torch.Generator().manual_seed(2), 4, 32, 16  # 2 latent frames of 4 x 4
    batch = {
        "latent_mean": torch.randn(n, 8, 2, 4, 4, generator=gen),
        "latent_logvar": torch.full((n, 8, 2, 4, 4), -4.0),
        # what the cache held before: the image's latent frame after H.264, not the clip's
        "image_latents": torch.randn(n, 8, 1, 4, 4, generator=gen),
        "prompt_embeds": torch.randn(n, TEXT_LENGTH, 32, generator=gen),
    }
    seen = {}

    def record(module, args, kwargs, output):
        seen.update(kwargs, output=output[0].float().view(n, -1, 8))

    hook = transformer.register_forward_hook(record, with_kwargs=True)
    x0 = adapter._pack(adapter._normalise(batch["latent_mean"]))
    try:
        for p in (1.0, 0.5):
            adapter.first_frame_p = p
            with torch.no_grad():
                losses = adapter.train_loss(
                    transformer, batch, [data.keyed_generator(0, 5, i) for i in range(n)]
                )
            draws = [data.keyed_generator(0, 5, i) for i in range(n)]
            sigmas = torch.stack([shifted_logit_normal(tokens, g) for g in draws])
            [shifted_logit_normal(1, g) for g in draws]  # the audio's s and noise: no sound
            noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in draws])
            [torch.randn((0, 128), generator=g) for g in draws]
            applied = torch.stack([torch.rand((), generator=g) for g in draws]) < p
            assert bool(applied.all()) if p == 1 else 0 < applied.sum() < n, applied
            mask = torch.zeros(n, tokens)
            mask[:, :frame] = 1.0
            mask = mask * applied.view(-1, 1)
            m, s = mask.unsqueeze(-1), sigmas.view(-1, 1, 1)
            noisy = m * x0 + (1 - m) * ((1 - s) * x0 + s * noise)
            torch.testing.assert_close(seen["hidden_states"], noisy, rtol=0, atol=1e-6)
            torch.testing.assert_close(
                seen["timestep"], (1 - mask) * 1000 * sigmas[:, None], rtol=0, atol=1e-4
            )
            loss_mask = (mask == 0).unsqueeze(-1).float()
            errors = (seen["output"] - (noise - x0)).pow(2)
            expected = (errors * loss_mask).mean(dim=(1, 2)) / loss_mask.mean(dim=(1, 2))
            torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
        with torch.no_grad():
            adapter.fixed_losses(transformer, {k: v[:1] for k, v in batch.items()}, [500, 900], gen)
        assert torch.equal(seen["hidden_states"][:, :frame], x0[:1, :frame].expand(2, -1, -1))
    finally:
        hook.remove()
    ltx2 = {"model.family": "ltx2", "model.path": "/nowhere"}  # the config alone
    for settings, message in (
        (
            {**ltx2, "train.first_frame_conditioning_p": 0.5},
            r"train.first_frame_conditioning_p = 0.5 shapes image-to-video and IC-LoRA training "
            r'\(model.type = "i2v" or "ic"\), and model.type is "t2v": remove it, or set model.type = '
            r'"i2v" or "ic"',
        ),
        (
            {**ltx2, "model.type": "i2v", "data.image_column": "images.txt"},
            r"data.image_column = images.txt: LTX-2's image-to-video trains on each clip's own first "
            r"latent frame, as ltx-trainer's first_frame condition, and reads no image: remove "
            r"data.image_column",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            check_config(load_config(str(write_config("i2v", **settings))))


def test_clips_play_at_the_rate_their_sound_was_made_for(ltx2_models, base_settings, ltx2_data, tmp_path):
    """validation.gen_fps = 0 (the default): the mp4 is written at the rate the sound was generated
    for (data.target_fps, else 24), so the frames last as long as their sound; another gen_fps is
    refused before the cache pass, and by the render command (renders without training)."""
    clip = torch.zeros(17, 32, 32, 3, dtype=torch.uint8)
    # data.target_fps, as training and the render command hand it over
    for target_fps in (0, 30):
        adapter = load_adapter(
            ModelConfig(family="ltx2", path=str(ltx2_models("2.0"))),
            torch.device("cpu"),
            RunSettings(frame_rate=target_fps),
        )
        with one_rank_group() as d:
            renderer = validate.ClipRenderer(
                adapter,
                ValidationConfig(resolution=[17, 32, 32]),
                DataConfig(),
                str(tmp_path / str(target_fps)),
                d,
            )
            _, rate = decode_mp4(renderer.save([clip], ["step_1_prompt_0"])[0])
        assert rate == (target_fps or 24)
        state = adapter.sampling_start(adapter.sampler(""), 2, (17, 32, 32), torch.Generator().manual_seed(0))
        # one latent
        assert abs(state.audio_frames / adapter.audio_latents_per_second - 17 / rate) <= 0.5 / 25
        with pytest.raises(
            ConfigError, match=r"validation.gen_fps = 15, but LTX-2 generates each clip's sound"
        ):
            validate.ClipRenderer(
                adapter,
                ValidationConfig(gen_fps=15, resolution=[17, 32, 32]),
                DataConfig(),
                str(tmp_path),
                None,
            )
    settings = ltx2_settings(
        "2.0",
        ltx2_models,
        base_settings,
        ltx2_data,
        tmp_path,
        **{"data.target_fps": 24, "validation.gen_fps": 15, "validation.do_validation": True},
    )
    cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    with one_rank_group() as d, pytest.raises(StopRun, match=r"validation.gen_fps = 15, but LTX-2 generates"):
        prepare_run(cfg, d)
