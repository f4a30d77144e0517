"""Wan VACE's conditioning, packed as diffusers' WanVACEPipeline packs it.

Wan VACE's conditioning (docs/models/wan.md, VACE): the control video, its mask and the reference
images packed into the context the VACE blocks read, exactly as diffusers' WanVACEPipeline builds it
(preprocess_conditions, prepare_video_latents, prepare_masks), for the cache and for sampling alike.

The context has 96 channels per latent frame: the VAE latents of the control video where the mask is
0 (inactive: kept) and where it is 1 (reactive: to generate), normalised, then the mask itself, each
latent pixel's 8 x 8 mask pixels folded into channels. Reference images are latent frames in front
of the video: their latent in the inactive slot, zeros in the reactive one and in the mask."""

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.video_processor import VideoProcessor
from PIL import Image

import data

# The VACE blocks' module names in the original checkpoint's layout (ComfyUI's), beside the base
# blocks': diffusers' convert_wan_to_diffusers renames before_proj and after_proj to proj_in and
# proj_out.
PROJECTIONS = {"proj_in": "before_proj", "proj_out": "after_proj"}


def reference_canvas(image, height: int, width: int, spatial: int) -> torch.Tensor:
    """A reference image (PIL, or uint8 [H, W, 3]) -> [3, height, width] in [-1, 1] (fp32): as the
    pipeline's preprocess_conditions, its sides first cut to multiples of the VAE's spatial ratio,
    then resized to fit inside the frame with its aspect kept, centred on a white canvas."""
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    pixels = VideoProcessor(vae_scale_factor=spatial).preprocess(image, None, None).float()
    new_height, new_width = data.fitted_size(pixels.shape[-2:], (height, width), spatial)
    resized = F.interpolate(pixels, size=(new_height, new_width), mode="bilinear", align_corners=False)[0]
    top, left = (height - new_height) // 2, (width - new_width) // 2
    canvas = torch.ones(3, height, width)
    canvas[:, top : top + new_height, left : left + new_width] = resized
    return canvas


def pack_mask(mask: torch.Tensor, temporal: int, spatial: int, patch: int) -> torch.Tensor:
    """A mask [B, F, H, W] in [0, 1] -> [B, spatial^2, latent frames, h, w]: prepare_masks's
    folding, each latent pixel's spatial x spatial block into channels, then nearest-exact frames
    down to the latents'."""
    batch, frames, height, width = mask.shape
    latent_frames = (frames + temporal - 1) // temporal
    h, w = height // (spatial * patch) * patch, width // (spatial * patch) * patch
    folded = mask.reshape(batch, frames, h, spatial, w, spatial).permute(0, 3, 5, 1, 2, 4).flatten(1, 2)
    return F.interpolate(folded, size=(latent_frames, h, w), mode="nearest-exact")


@torch.no_grad()
def control_latents(
    encode, video: torch.Tensor, mask: torch.Tensor, temporal: int, spatial: int, patch: int
) -> torch.Tensor:
    """The VACE context of the video's own frames, without references.

    The context of the video's own frames [B, 96, latent frames, h, w] (fp32), without
    references.

    video [B, 3, F, H, W] in [-1, 1] (zeros where there is no control video), mask [B, 3, F, H, W]
    in [0, 1] (ones without one); encode(pixels) gives normalised latents (the VAE's mode). The
    pipeline splits the video by the thresholded mask, channel by channel, and packs the first
    channel unthresholded."""
    binary = torch.where(mask > 0.5, 1.0, 0.0).to(video)
    inactive, reactive = encode(video * (1 - binary)), encode(video * binary)
    packed = pack_mask(mask[:, 0].float(), temporal, spatial, patch)
    return torch.cat([inactive.float(), reactive.float(), packed], dim=1)


@torch.no_grad()
def reference_latents(encode, references: torch.Tensor) -> torch.Tensor:
    """Reference canvases [B, R, 3, H, W] in [-1, 1] -> their latents [B, C, R, h, w] (fp32) in the
    order they take in front of the video: the pipeline prepends each in turn, so the last given
    comes first."""
    latents = [encode(references[:, r, :, None]).float() for r in range(references.shape[1])]
    return torch.cat(latents[::-1], dim=2)


def context(control: torch.Tensor, references: torch.Tensor | None) -> torch.Tensor:
    """The VACE blocks' input [B, 96, R + latent frames, h, w]: each reference's latent frame (its
    latent, then zeros for the reactive latent and the mask) in front of the control latents."""
    if references is None:
        return control
    padding = references.new_zeros(
        references.shape[0], control.shape[1] - references.shape[1], *references.shape[2:]
    )
    return torch.cat([torch.cat([references, padding], dim=1), control], dim=2)


def comfy_key(module: str, in_block: dict) -> str | None:
    """vace_blocks.N.attn1.to_q -> vace_blocks.N.self_attn.q, proj_in -> before_proj (None
    elsewhere)."""
    parts = module.split(".", 2)
    if parts[0] != "vace_blocks" or len(parts) != 3 or not parts[1].isdigit():
        return None
    renamed = (in_block | PROJECTIONS).get(parts[2])
    return None if renamed is None else f"vace_blocks.{parts[1]}.{renamed}"
