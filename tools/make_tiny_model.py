"""Write a tiny random CogVideoX in the exact diffusers layout.

tokenizer/ text_encoder/ transformer/ vae/ scheduler/ model_index.json, loadable by
`CogVideoXPipeline.from_pretrained(DIR)` (or the image-to-video pipeline), so tests
and the demo exercise the real loading code without any hub download.

    python tools/make_tiny_model.py --out DIR [--type t2v|i2v] [--version 1.0|1.5] [--seed N]
"""

import argparse
import string

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


def make_tokenizer() -> T5Tokenizer:
    """A unigram vocabulary of our prompt words plus single characters as a fallback."""
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    words = [(f"\u2581{w}", -1.0) for w in WORDS]
    chars = [(c, -5.0) for c in string.ascii_lowercase + string.digits + ".,'-"]
    chars += [(f"\u2581{c}", -4.0) for c in string.ascii_lowercase + string.digits]
    return T5Tokenizer(vocab=specials + words + chars + [("\u2581", -3.0)], extra_ids=0)


def make_transformer(model_type: str, version: str) -> CogVideoXTransformer3DModel:
    is_15 = version == "1.5"
    return CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=LATENT_CHANNELS * (2 if model_type == "i2v" else 1),
        out_channels=LATENT_CHANNELS,
        time_embed_dim=32,
        ofs_embed_dim=32 if (is_15 and model_type == "i2v") else None,
        text_embed_dim=TEXT_DIM,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=9,
        patch_size=2,
        patch_size_t=2 if is_15 else None,
        temporal_compression_ratio=4,
        max_text_seq_length=TEXT_LENGTH,
        use_rotary_positional_embeddings=True,
    )


def make_vae(model_type: str, version: str) -> AutoencoderKLCogVideoX:
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
        scaling_factor=0.7,
        invert_scale_latents=(version == "1.5" and model_type == "i2v"),
    )


def make_scheduler() -> CogVideoXDPMScheduler:
    """The CogVideoX-5b scheduler configuration."""
    return CogVideoXDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=1.0,
        steps_offset=0,
        timestep_spacing="trailing",
    )


def make_tiny_model(out: str, model_type: str = "t2v", version: str = "1.0", seed: int = 0) -> None:
    tokenizer = make_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The T5 vocabulary must also cover the 100 <extra_id_*> tokens T5Tokenizer adds on load.
        text_encoder = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer) + 128, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        )
        transformer = make_transformer(model_type, version)
        vae = make_vae(model_type, version)
    pipeline_cls = CogVideoXImageToVideoPipeline if model_type == "i2v" else CogVideoXPipeline
    pipe = pipeline_cls(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=make_scheduler()
    )
    pipe.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--type", choices=["t2v", "i2v"], default="t2v")
    parser.add_argument("--version", choices=["1.0", "1.5"], default="1.0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_tiny_model(args.out, args.type, args.version, args.seed)
    print(f"wrote tiny CogVideoX {args.version} {args.type} to {args.out}")


if __name__ == "__main__":
    main()
