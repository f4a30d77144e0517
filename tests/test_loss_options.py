"""Loss masks (data.loss_mask_column) and the flow families' timestep sampling and loss weighting
(train.timestep_sampling, train.loss_weighting), against hand-written losses and the formulas of
code we did not write (diffusers' SD3 training utilities, DiffSynth-Studio's weights)."""

import math

import numpy as np
import pytest
import torch
from conftest import one_rank_group, prepare_run, write_toml
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from PIL import Image

import model_adapter
from config import ConfigError, ModelConfig, load_config
from families.ltx2 import shifted_logit_normal
from model_adapter import BELL_MEAN, RunSettings, TimestepSampling, latent_weights, load_adapter
from tools.make_synthetic_dataset import make_synthetic_dataset

CPU = torch.device("cpu")


def generators(n: int, start: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(start + i) for i in range(n)]


# Loss masks.
def test_latent_weights_follow_the_frame_and_the_causal_vaes_frames():
    """White on the left half of a 9 x 32 x 48 clip is white on the left half of its 3 x 4 x 6
    latent grid (nearest-exact, as diffusion-pipe), a grey level its value; latent frame 0 is pixel
    frame 0, latent frame k the mean of pixel frames 4k - 3 to 4k."""
    frames = torch.zeros(9, 32, 48, 3, dtype=torch.uint8)
    frames[:, :, :24] = 255
    frames[5:, :, 24:] = 51  # grey 0.2 on the right from pixel frame 5: latent frame 2 only
    frames[1:3, :, :24] = 0  # pixel frames 1 and 2 black: latent frame 1 at half on the left
    weights = latent_weights(frames, 4, 8)
    assert weights.shape == (1, 3, 4, 6)
    expected = torch.zeros(3, 4, 6)
    expected[:, :, :3] = torch.tensor([1.0, 0.5, 1.0])[:, None, None]
    expected[2, :, 3:] = 0.2
    torch.testing.assert_close(weights[0], expected)


def cached_batch(adapter, mask):
    """A cached batch of two clips on a 3 x 4 x 6 latent grid, posteriors all but
    exact (log-variance -30)."""
    c = adapter.latent_channels
    mean = torch.randn(2, c, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    return {
        "latent_mean": mean,
        "latent_logvar": torch.full_like(mean, -30.0),
        "prompt_embeds": torch.zeros(2, 1, 1),
        "loss_mask": mask,
    }


def recorded_prediction(adapter, family: str, calls: list):
    """Replace the transformer's call by zeros, recording the noisy latents and their noise level."""
    if family == "wan":

        def predict(transformer, x, t, *args):
            calls.append((x, t / 1000))
            return torch.zeros_like(x)

        adapter._predict = predict
    elif family == "ltx2":

        def predict(transformer, video, audio, embeds):
            calls.append((video.latents, video.sigma / 1000))
            return torch.zeros_like(video.latents), torch.zeros_like(audio.latents)

        adapter._predict = predict
    else:

        def predict(transformer, x_t, t, *args):
            calls.append((x_t, t))
            return torch.zeros_like(x_t)

        adapter.predict_v = predict


# Half of a 3 x 4 x 6 latent grid, a different half on the last frame: the left on latent frames 0
# and 1, the top on frame 2 (a mask flipped, transposed or on other frames misses it).
HALF = torch.zeros(3, 4, 6, dtype=torch.bool)
HALF[:2, :, :3] = True
HALF[2, :2] = True


def hand_losses(adapter, family: str, batch, x_t, level) -> torch.Tensor:
    """Each sample's squared error with a zero prediction, recovered from the noisy latents, on
    HALF of the latent grid alone, averaged by hand."""
    mean = batch["latent_mean"].expand(len(x_t), -1, -1, -1, -1)
    if family == "cogvideox":
        x0 = mean.permute(0, 2, 1, 3, 4) * adapter.vae_config["scaling_factor"]  # [B, F, C, h, w]
        a = adapter.alphas_cumprod[level].view(-1, 1, 1, 1, 1)
        noise = (x_t - a.sqrt() * x0) / (1 - a).sqrt()
        error = (a.sqrt() * noise - (1 - a).sqrt() * x0).pow(2).permute(0, 2, 1, 3, 4)
    else:
        x0 = adapter._normalise(mean)
        s = level.view(-1, 1, 1, 1, 1)
        if family == "ltx2":  # packed tokens [B, F h w, C] back to [B, C, F, h, w]
            x_t = x_t.view(len(x_t), 3, 4, 6, -1).permute(0, 4, 1, 2, 3)
        error = ((x_t - (1 - s) * x0) / s - x0).pow(2)
    return error[:, :, HALF].mean(dim=(1, 2))


@pytest.mark.parametrize("family", ["cogvideox", "wan", "ltx2"])
def test_a_half_white_loss_mask_gives_the_loss_of_that_half(family, family_models):
    """The training loss and the held-out loss of a batch whose loss mask is white on half of the
    latent grid (HALF) are the mean squared error over that half alone, computed by hand from the
    noisy latents the transformer was given (its prediction replaced by zeros); without the mask the
    loss differs."""
    variant = {"cogvideox": "2b", "wan": "t2v", "ltx2": "2.0"}[family]
    model = ModelConfig(family=family, path=str(family_models(family)(variant)), dtype="fp32")
    adapter = load_adapter(model, CPU)
    batch = cached_batch(adapter, HALF.float().expand(2, 1, -1, -1, -1))
    calls = []
    recorded_prediction(adapter, family, calls)
    masked = adapter.train_loss(None, batch, generators(2))
    x_t, level = calls[-1]
    torch.testing.assert_close(masked, hand_losses(adapter, family, batch, x_t, level), rtol=1e-4, atol=1e-6)
    unmasked = adapter.train_loss(None, {k: v for k, v in batch.items() if k != "loss_mask"}, generators(2))
    assert not torch.allclose(masked, unmasked, rtol=1e-3)
    # the held-out loss: one clip at two timesteps
    clip = {k: v[:1] for k, v in batch.items()}
    held_out = adapter.fixed_losses(None, clip, [300, 800], torch.Generator().manual_seed(1))
    x_t, level = calls[-1]
    torch.testing.assert_close(held_out, hand_losses(adapter, family, clip, x_t, level), rtol=1e-4, atol=1e-6)


def test_the_cache_holds_each_clips_loss_mask_on_its_latent_grid(base_settings, tmp_path):
    """data.loss_mask_column through the cache pass: a clip's mask image (white on the left) on its
    latent grid in every batch, a clip without one (an empty line) all white; the mask's file keys
    its entry."""
    root = tmp_path / "data"
    make_synthetic_dataset(str(root), num_videos=3, frames=9, height=32, width=32, seed=0)
    half = np.zeros((32, 32, 3), np.uint8)
    half[:, :16] = 255
    Image.fromarray(half).save(root / "half.png")
    (root / "loss_masks.txt").write_text("half.png\n\nhalf.png\n")
    settings = {
        **base_settings,
        "run.output_dir": str(tmp_path / "run"),
        "data.data_root": str(root),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.held_out": 1,
        "data.loss_mask_column": "loss_masks.txt",
    }
    cfg = load_config(str(write_toml(tmp_path / "run.toml", settings)))
    with one_rank_group() as d:
        _, entries, items, held_out = prepare_run(cfg, d)
    batch = entries.load_batch(items + held_out)
    weights, width = batch["loss_mask"], batch["latent_mean"].shape[-1]
    assert weights.shape == (3, 1, *batch["latent_mean"].shape[2:])
    assert weights[0, ..., : width // 2].eq(1).all() and weights[0, ..., width // 2 :].eq(0).all()
    assert weights[1].eq(1).all()
    assert entries.path(items[0], "loss_mask") != entries.path(items[1], "loss_mask")


# Timestep sampling and loss weighting.
@pytest.mark.parametrize(
    "sampling, settings",
    [
        ("logit_normal", {"logit_mean": 0.5, "logit_std": 0.8}),
        ("mode", {"mode_scale": 1.29}),
        ("uniform", {}),
    ],
)
def test_the_draws_follow_sd3s_formulas(sampling, settings):
    """20,000 draws from keyed generators have the quantiles of diffusers' SD3 sampler's (its
    compute_density_for_timestep_sampling, 200,000 draws); restricted to a Wan 2.2 expert's share
    [0.3, 0.9), they stay in it with the distribution conditioned on it."""
    ours = TimestepSampling(sampling, **settings)
    drawn = ours.draw(generators(20000))
    theirs = compute_density_for_timestep_sampling(
        sampling if sampling != "uniform" else "none",
        200000,
        logit_mean=settings.get("logit_mean"),
        logit_std=settings.get("logit_std"),
        mode_scale=settings.get("mode_scale"),
        generator=torch.Generator().manual_seed(0),
    )
    q = torch.linspace(0.05, 0.95, 19)
    torch.testing.assert_close(drawn.quantile(q), theirs.quantile(q), rtol=0, atol=0.015)
    share = ours.draw(generators(20000, 50000), 0.3, 0.9)
    assert share.min() >= 0.3 and share.max() <= 0.9
    inside = theirs[(theirs >= 0.3) & (theirs <= 0.9)]
    torch.testing.assert_close(share.quantile(q), inside.quantile(q), rtol=0, atol=0.015)


def test_sigmoid_is_the_logit_normal_at_mean_0():
    """ "sigmoid" (musubi-tuner's and sd-scripts', its scale train.logit_std): logit(s) has mean 0 and that standard
    deviation."""
    logits = torch.logit(TimestepSampling("sigmoid", logit_std=1.3).draw(generators(20000)).double())
    assert abs(float(logits.mean())) < 0.03 and abs(float(logits.std()) - 1.3) < 0.03


def test_the_loss_weights_are_diffsynths_bell_and_sd3s_cosmap():
    """ "cosmap" is diffusers' compute_loss_weighting_for_sd3; "bell" is DiffSynth-Studio's
    set_training_weight (its formula copied from diffsynth/diffusion/flow_match.py over its 1000
    unshifted training timesteps) up to the constant of its normalisation, with mean 1 over s."""
    s = torch.linspace(0, 1, 1001)[:-1]
    cosmap = TimestepSampling(weighting="cosmap").weight(s)
    torch.testing.assert_close(cosmap, compute_loss_weighting_for_sd3("cosmap", s))
    bell = TimestepSampling(weighting="bell").weight(s)
    x = s * 1000
    y = torch.exp(-2 * ((x - 1000 / 2) / 1000) ** 2)
    y_shifted = y - y.min()
    diffsynth = y_shifted * (1000 / y_shifted.sum())
    torch.testing.assert_close(bell / bell.sum(), diffsynth / diffsynth.sum(), rtol=1e-3, atol=1e-6)
    assert abs(float(bell.mean()) - 1) < 1e-2 and math.isclose(BELL_MEAN, 0.2490937, rel_tol=1e-6)


def test_the_families_default_draws_are_unchanged_and_the_weight_multiplies(family_models):
    """With train.timestep_sampling = "" Wan draws shift u / (1 + (shift - 1) u) and LTX-2
    ltx-trainer's shifted logit-normal, bit for bit; a named draw replaces both, and
    train.loss_weighting multiplies each sample's loss by the weight at its s."""
    wan = load_adapter(ModelConfig(family="wan", path=str(family_models("wan")("t2v")), dtype="fp32"), CPU)
    u = torch.stack([torch.rand((), generator=g) for g in generators(8)])
    assert torch.equal(wan._sigmas(generators(8)), wan.shift * u / (1 + (wan.shift - 1) * u))
    ltx2_folder = ModelConfig(family="ltx2", path=str(family_models("ltx2")("2.0")), dtype="fp32")
    ltx2 = load_adapter(ltx2_folder, CPU)
    expected = torch.stack([shifted_logit_normal(6144, g) for g in generators(8)])
    assert torch.equal(ltx2._sigmas(6144, generators(8)), expected)
    uniform = load_adapter(ltx2_folder, CPU, RunSettings(timesteps=TimestepSampling("uniform")))
    v = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators(8)])
    assert torch.equal(uniform._sigmas(6144, generators(8)), v.float())
    wan_folder = ModelConfig(family="wan", path=str(wan.path), dtype="fp32")
    plain, weighted = (
        load_adapter(wan_folder, CPU, RunSettings(timesteps=TimestepSampling("uniform", weighting=w)))
        for w in ("none", "bell")
    )
    calls = []
    for adapter in (plain, weighted):
        recorded_prediction(adapter, "wan", calls)
    batch = cached_batch(plain, torch.ones(2, 1, 3, 4, 6))
    unweighted = plain.train_loss(None, batch, generators(2))
    loss = weighted.train_loss(None, batch, generators(2))
    torch.testing.assert_close(loss, weighted.timestep_sampling.weight(calls[-1][1]) * unweighted)
    assert not torch.allclose(loss, unweighted)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"train.timestep_sampling": "uniform"},
            r"train.timestep_sampling is read by the wan, ltx2, kandinsky5 and hunyuanvideo15 families' training; cogvideox",
        ),
        (
            {"train.loss_weighting": "bell"},
            r"train.loss_weighting is read by the wan, ltx2, kandinsky5 and hunyuanvideo15 families' training; cogvideox",
        ),
        (
            {"train.logit_mean": 0.5},
            r'train.logit_mean shapes train.timestep_sampling = .logit_normal., and it is ""',
        ),
        (
            {"train.timestep_sampling": "mode", "train.mode_scale": 2.0},
            r"train.mode_scale between -1 and 1.75 \(got 2.0\)",
        ),
        (
            {"train.timestep_sampling": "sigmoid", "train.flow_shift": 3.0},
            r"train.flow_shift shifts the family's own timestep draw",
        ),
    ],
)
def test_cogvideox_refuses_the_flow_keys_and_bad_values_are_named(settings, message, base_settings, tmp_path):
    """CogVideoX (DDPM, integer timesteps) reads none of the flow families' keys: the registry's
    check names them; values out of range, or set beside a draw that does not read them, are named
    by the config check."""
    path = write_toml(tmp_path / "c.toml", {**base_settings, "run.output_dir": str(tmp_path), **settings})
    with pytest.raises(ConfigError, match=message):
        model_adapter.check_config(load_config(str(path)))
