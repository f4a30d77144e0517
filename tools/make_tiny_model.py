"""Write a tiny random video model in the exact diffusers layout, with the published config key sets.

tokenizer/ text_encoder/ transformer/ vae/ scheduler/ model_index.json, loadable by the family's
diffusers pipeline (`CogVideoXPipeline.from_pretrained(DIR)`, or the image-to-video one), so tests
and the demo exercise the real loading code without any hub download. Sizes are shrunk; the
transformer's config.json carries exactly the keys the published checkpoint's file carries (a key
diffusers added later is absent, and the class fills its default, as it does for the real file).

    python tools/make_tiny_model.py --out DIR [--family cogvideox] [--variant 2b|5b|5b-i2v|1.5-5b|1.5-5b-i2v] [--seed N]
"""

import argparse
import json
import string
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLCogVideoX,
    CogVideoXDPMScheduler,
    CogVideoXImageToVideoPipeline,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
)
from transformers import T5Config, T5EncoderModel, T5Tokenizer

LATENT_CHANNELS = 4
TEXT_DIM = 32
TEXT_LENGTH = 16
WORDS = (
    "a red green blue yellow white purple orange cyan square circle triangle ball box "
    "moves left right up down slowly quickly across the on black background bounces "
    "drifts toward from to of and in video shape small large"
).split()
# The keys of every published CogVideoX transformer/config.json (../shared/reference/cogvideox.md).
COGVIDEOX_KEYS = {
    "activation_fn", "attention_bias", "attention_head_dim", "dropout", "flip_sin_to_cos", "freq_shift",
    "in_channels", "max_text_seq_length", "norm_elementwise_affine", "norm_eps", "num_attention_heads",
    "num_layers", "out_channels", "patch_size", "sample_frames", "sample_height", "sample_width",
    "spatial_interpolation_scale", "temporal_compression_ratio", "temporal_interpolation_scale",
    "text_embed_dim", "time_embed_dim", "timestep_activation_fn",
}
ROTARY = {"use_rotary_positional_embeddings": True}
# Per variant: its model type, the transformer settings beyond the common ones (each also a key of
# its published file), the VAE's scaling and the scheduler's SNR shift. The 1.5 rotary grid is
# capped by sample_height/width (in latents): 12 lets tests train at 32x32 and refuse 64x64.
COGVIDEOX_VARIANTS = {
    "2b": ("t2v", {}, 1.15258426, 3.0),
    "5b": ("t2v", ROTARY, 0.7, 1.0),
    "5b-i2v": ("i2v", {**ROTARY, "use_learned_positional_embeddings": True}, 0.7, 1.0),
    "1.5-5b": ("t2v", {**ROTARY, "use_learned_positional_embeddings": False, "patch_size_t": 2, "patch_bias": False,
                       "sample_height": 12, "sample_width": 12}, 0.7, 1.0),
    "1.5-5b-i2v": ("i2v", {**ROTARY, "use_learned_positional_embeddings": False, "patch_size_t": 2,
                           "patch_bias": False, "ofs_embed_dim": 32, "sample_height": 12, "sample_width": 12}, 0.7, 1.0),
}
# Added to diffusers with CogVideoX 1.5: absent from the 1.0 VAE configs.
VAE_KEYS_SINCE_15 = {"invert_scale_latents"}


def make_tokenizer() -> T5Tokenizer:
    """A unigram vocabulary of our prompt words plus single characters as a fallback."""
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    words = [(f"\u2581{w}", -1.0) for w in WORDS]
    chars = [(c, -5.0) for c in string.ascii_lowercase + string.digits + ".,'-"]
    chars += [(f"\u2581{c}", -4.0) for c in string.ascii_lowercase + string.digits]
    return T5Tokenizer(vocab=specials + words + chars + [("\u2581", -3.0)], extra_ids=0)


def make_transformer(model_type: str, settings: dict) -> CogVideoXTransformer3DModel:
    return CogVideoXTransformer3DModel(**{
        "num_attention_heads": 2, "attention_head_dim": 16,
        "in_channels": LATENT_CHANNELS * (2 if model_type == "i2v" else 1), "out_channels": LATENT_CHANNELS,
        "time_embed_dim": 32, "text_embed_dim": TEXT_DIM, "num_layers": 2, "sample_width": 8, "sample_height": 8,
        "sample_frames": 9, "patch_size": 2, "temporal_compression_ratio": 4, "max_text_seq_length": TEXT_LENGTH,
        **settings,
    })


def make_vae(scaling_factor: float, invert_scale_latents: bool) -> AutoencoderKLCogVideoX:
    # Three levels give the real 4x temporal compression (two levels only give 2x).
    return AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3,
        block_out_channels=(8, 16, 16),
        latent_channels=LATENT_CHANNELS,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        sample_height=32,
        sample_width=32,
        scaling_factor=scaling_factor,
        invert_scale_latents=invert_scale_latents,
    )


def make_scheduler(snr_shift_scale: float) -> CogVideoXDPMScheduler:
    """The CogVideoX schedulers' configuration (snr_shift_scale 3.0 for 2b, 1.0 for the 5B models)."""
    return CogVideoXDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=snr_shift_scale,
        steps_offset=0,
        timestep_spacing="trailing",
    )


def keep_keys(config_file: Path, keys: set[str]) -> None:
    """Rewrite a saved config.json with only `keys` (and diffusers' own _class_name, _diffusers_version)."""
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({k: v for k, v in config.items() if k.startswith("_") or k in keys},
                                      indent=2, sort_keys=True) + "\n")


def make_tiny_model(out: str, variant: str = "5b", seed: int = 0) -> None:
    model_type, settings, scaling_factor, snr_shift_scale = COGVIDEOX_VARIANTS[variant]
    is_15 = variant.startswith("1.5")
    tokenizer = make_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The T5 vocabulary must also cover the 100 <extra_id_*> tokens T5Tokenizer adds on load.
        text_encoder = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer) + 128, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        )
        transformer = make_transformer(model_type, settings)
        vae = make_vae(scaling_factor, invert_scale_latents=is_15 and model_type == "i2v")
    pipeline_cls = CogVideoXImageToVideoPipeline if model_type == "i2v" else CogVideoXPipeline
    pipe = pipeline_cls(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=make_scheduler(snr_shift_scale))
    pipe.save_pretrained(out)
    keep_keys(Path(out) / "transformer" / "config.json", COGVIDEOX_KEYS | settings.keys())
    if not is_15:
        vae_keys = set(json.loads((Path(out) / "vae" / "config.json").read_text())) - VAE_KEYS_SINCE_15
        keep_keys(Path(out) / "vae" / "config.json", vae_keys)
    # The class's defaults must rebuild what was saved: a dropped key held its default.
    loaded = CogVideoXTransformer3DModel.from_config(CogVideoXTransformer3DModel.load_config(out, subfolder="transformer"))
    assert {k: v for k, v in loaded.config.items() if not k.startswith("_")} == \
        {k: v for k, v in transformer.config.items() if not k.startswith("_")}, variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", choices=["cogvideox"], default="cogvideox")
    parser.add_argument("--variant", choices=list(COGVIDEOX_VARIANTS), default="5b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_tiny_model(args.out, args.variant, args.seed)
    print(f"wrote tiny {args.family} {args.variant} to {args.out}")


if __name__ == "__main__":
    main()
