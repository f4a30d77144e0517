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


# Condition randomisation (train.vace_*_p; docs/control.md, Wan VACE): VideoX-Fun's VACE trainer
# (scripts/wan2.2_vace_fun/train.py) draws, per batch, a frame of the clip as the reference and an
# inpainting condition in place of the control video. Their parts that need the VAE are drawn per
# clip when the cache pass encodes it and cached beside the clip's own condition; which condition a
# step trains on is drawn per step.

# VideoX-Fun's get_random_mask (videox_fun/data/utils.py:16-97): its kinds of mask over a clip of
# several frames and their chances, and those over one frame.
MASK_CHANCES = (0.05, 0.2, 0.2, 0.2, 0.05, 0.05, 0.05, 0.1, 0.05, 0.05)
ONE_FRAME_MASKS, ONE_FRAME_CHANCES = (0, 1, 7, 8), (0.2, 0.7, 0.05, 0.05)


def _randint(low: int, high: int, g: torch.Generator) -> int:
    """An integer in [low, high), as numpy's and torch's randint (high excluded)."""
    return int(torch.randint(low, high, (), generator=g))


def _block(h: int, w: int, g: torch.Generator) -> tuple[slice, slice]:
    """get_random_mask's rectangle (kinds 0 and 4): a centre anywhere, sides of a quarter to three
    quarters of the frame's, clipped at its edges."""
    center_x, center_y = _randint(0, w, g), _randint(0, h, g)
    size_x, size_y = _randint(w // 4, w // 4 * 3, g), _randint(h // 4, h // 4 * 3, g)
    return (
        slice(max(center_y - size_y // 2, 0), min(center_y + size_y // 2, h)),
        slice(max(center_x - size_x // 2, 0), min(center_x + size_x // 2, w)),
    )


def inpaint_mask(frames: int, height: int, width: int, g: torch.Generator) -> torch.Tensor:
    """A mask uint8 [F, H, W] (1: to generate) drawn as VideoX-Fun's get_random_mask draws one
    (videox_fun/data/utils.py:16-97, each kind in its order and at its chance), from the keyed
    generator g instead of numpy's, Python's and torch's global ones."""
    f, h, w = frames, height, width
    mask = torch.zeros(f, h, w, dtype=torch.uint8)
    kinds, chances = (range(10), MASK_CHANCES) if f != 1 else (ONE_FRAME_MASKS, ONE_FRAME_CHANCES)
    kind = kinds[int(torch.multinomial(torch.tensor(chances, dtype=torch.float64), 1, generator=g))]
    if kind == 0:  # a rectangle on every frame
        rows, columns = _block(h, w, g)
        mask[:, rows, columns] = 1
    elif kind == 1:  # everything
        mask[:] = 1
    elif kind == 2:  # every frame from frame k on, k from 1 to 4
        mask[_randint(1, 5, g) :] = 1
    elif kind == 3:  # all but the first and last k frames, k from 1 to 4
        k = _randint(1, 5, g)
        mask[k:-k] = 1
    elif kind == 4:  # a rectangle over a span of frames around the middle
        rows, columns = _block(h, w, g)
        before, after = _randint(0, f // 2, g), _randint(f // 2, f, g)
        mask[before:after, rows, columns] = 1
    elif kind == 5:  # noise
        mask = torch.randint(0, 2, (f, h, w), dtype=torch.uint8, generator=g)
    elif kind == 6:  # a small rectangle on each of up to half the frames
        count = _randint(1, max(f // 2, 1) + 1, g)  # random.randint includes its top
        for i in torch.randperm(f, generator=g)[:count].tolist():  # random.sample
            block_h, block_w = _randint(1, h // 4 + 1, g), _randint(1, w // 4 + 1, g)
            top, left = _randint(0, h - block_h + 1, g), _randint(0, w - block_w + 1, g)
            mask[i, top : top + block_h, left : left + block_w] = 1
    elif kind in (7, 8):  # an ellipse (7) or a circle (8), on the first frame alone
        center_x, center_y = _randint(0, w, g), _randint(0, h, g)
        a = _randint(min(w, h) // 8, min(w, h) // 4, g)
        b = _randint(min(h, w) // 8, min(h, w) // 4, g) if kind == 7 else a
        y, x = torch.meshgrid(
            torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
        )
        mask[0] = ((y - center_y) ** 2 / b**2 + (x - center_x) ** 2 / a**2 < 1).to(torch.uint8)
    else:  # whole frames, each with chance 1/2
        for i in range(f):
            if torch.rand((), generator=g) > 0.5:
                mask[i] = 1
    return mask


def inpaint_pixels(clip: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip float [3, F, H, W] in [-1, 1] with its masked pixels 0, as VideoX-Fun builds its
    mask_pixel_values (scripts/wan2.2_vace_fun/train.py:1352-1357: `pixel_values * (1 - mask)`,
    "Wan 2.1 use 0 for masked pixels"), and the mask as the VACE condition takes it, [3, F, H, W]
    (its 1831 tiles it over the channels)."""
    mask = mask.to(clip)[None].expand(3, -1, -1, -1)
    return clip * (1 - mask), mask


def reference_frame(frames: int, g: torch.Generator) -> int:
    """The frame of the clip taken as the reference: VideoX-Fun's --control_ref_image "random"
    (scripts/wan2.2_vace_fun/train.py:1249-1260, what its train.sh sets): the first with chance
    0.4, every other one alike."""
    chances = torch.tensor(
        [1.0] if frames == 1 else [0.4] + [0.6 / (frames - 1)] * (frames - 1), dtype=torch.float64
    )
    return int(torch.multinomial(chances, 1, generator=g))


def drawn_condition(batch: dict, generators, drop_p: float, frame_p: float, inpaint_p: float) -> dict:
    """The batch with the condition its samples train on this step: each sample's control
    condition replaced by its cached inpainting one (inpaint_control_latents) with chance
    inpaint_p; the batch's references replaced by each clip's cached frame
    (frame_reference_latents) with chance frame_p, or dropped with chance drop_p, one draw for the
    whole batch (its first sample's: the clips of a batch stack as many references).

    Each sample draws from a generator keyed by its own generator's key, so the latent sample, the
    timestep and the noise stay what they are without these draws."""
    draws = [
        torch.rand(2, generator=data.keyed_generator(g.initial_seed(), "vace_condition"), dtype=torch.float64)
        for g in generators
    ]
    batch = dict(batch)
    if inpaint_p:
        own, inpaint = batch["control_latents"], batch["inpaint_control_latents"]
        batch["control_latents"] = torch.stack(
            [inpaint[i] if float(u[1]) < inpaint_p else own[i] for i, u in enumerate(draws)]
        )
    u = float(draws[0][0])
    if u < frame_p:
        batch["reference_latents"] = batch["frame_reference_latents"]
    elif u < frame_p + drop_p:
        batch.pop("reference_latents", None)
    return batch
