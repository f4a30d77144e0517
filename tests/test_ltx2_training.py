"""LTX-2 trains what Lightricks trains: ltx-trainer's timestep sampler (its shift unclamped), ltx-core's
audio-video cross-attention modulation (each stream's scale/shift from its own timesteps, its gate from the
other stream's sigma), the audio VAE in fp32, and the encoders' means as the clean latents. The reference
formulas are Lightricks/LTX-2's (packages/ltx-trainer, packages/ltx-core), written here with their files
named."""

import pytest
import torch
from diffusers import AutoencoderKLLTX2Audio

import data
from config import ModelConfig
from families.ltx2 import TEXT_LENGTH, shifted_logit_normal
from model import load_adapter
from test_ltx2 import ltx2_models  # noqa: F401 (a fixture)

def ltx_trainer_sigma(seq_length: int, generator: torch.Generator) -> torch.Tensor:
    """packages/ltx-trainer/src/ltx_trainer/timestep_samplers.py, ShiftedLogitNormalTimestepSampler.sample
    (std 1, eps 1e-3, uniform_prob 0.1) for a batch of one, its draws in its order (normal, uniform, choice),
    with _get_shift_for_sequence_length's line through (1024, 0.95) and (4096, 2.05), unclamped."""
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
    """Our draw equals ltx-trainer's from the same generator at token counts below, inside and above the
    line's points: past 4096 the shift keeps growing (mu 2.78 at 121 x 512 x 768's 6,144 tokens, not 2.05)."""
    for seed in range(40):
        ours = shifted_logit_normal(tokens, torch.Generator().manual_seed(seed))
        theirs = ltx_trainer_sigma(tokens, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_audio_vae_encodes_in_fp32(ltx2_models):  # noqa: F811
    """With model.dtype bf16, the cached sound is the fp32 audio VAE's posterior of the mel spectrogram, as
    ltx-trainer's process_videos.py encodes it ("Audio VAE needs float32 for quality")."""
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


def test_training_takes_the_encoders_means(ltx2_models):  # noqa: F811
    """The clean latents are the cached posteriors' means (ltx-trainer's, from ltx-core's encoders): the
    loss does not depend on the cached log-variances, of the video or of the sound."""
    adapter = load_adapter(ModelConfig(family="ltx2", path=str(ltx2_models("2.0")), dtype="fp32"),
                           torch.device("cpu"))
    transformer = adapter.load_transformer().eval()
    gen = torch.Generator().manual_seed(0)
    batch = {"latent_mean": torch.randn(2, 8, 2, 4, 4, generator=gen),
             "audio_latent_mean": torch.randn(2, 2, 9, 4, generator=gen),
             "prompt_embeds": torch.randn(2, TEXT_LENGTH, 32, generator=gen)}
    losses = []
    with torch.no_grad():
        for logvar in (-8.0, 1.0):
            variances = {"latent_logvar": torch.full((2, 8, 2, 4, 4), logvar),
                         "audio_latent_logvar": torch.full((2, 2, 9, 4), logvar)}
            losses.append(adapter.train_loss(transformer, {**batch, **variances},
                                             [data.keyed_generator(0, 1, i) for i in range(2)]))
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)

