"""Validation: the held-out loss at fixed timesteps and fixed noise.

The training loss of uniform-t v-prediction is dominated by which t were drawn and looks flat; the
held-out loss measures every held-out clip at the same timesteps with the same noise every time, so
successive values are comparable.
"""

import math

import torch
import torch.distributed as dist

import data
import parallel
from config import ValidationConfig


@torch.no_grad()
def held_out_loss(adapter, model, cache, clips: list, cfg: ValidationConfig, seed: int, d: parallel.Dist, autocast):
    """val/loss and val/loss_t{t}. Clip i is measured on rank i % world; every rank makes the same
    number of forward calls (FSDP needs it), the padding ones weighted 0."""
    if not clips:
        return {}
    timesteps = torch.tensor(cfg.loss_timesteps, device=d.device)
    sums = torch.zeros(len(timesteps), device=d.device)
    was_training = model.training
    model.eval()
    for j in range(math.ceil(len(clips) / d.world)):
        index = j * d.world + d.rank
        weight = 1.0 if index < len(clips) else 0.0
        batch = cache.load_batch([clips[min(index, len(clips) - 1)]])
        x0 = adapter.clean_latents(batch["latent_mean"].to(d.device), batch["latent_logvar"].to(d.device), None)
        x0 = x0.expand(len(timesteps), -1, -1, -1, -1)
        noise = torch.randn(x0.shape[1:], generator=data.keyed_generator(seed, "held_out", index)).to(d.device)
        embeds = batch["prompt_embeds"].to(d.device).expand(len(timesteps), -1, -1)
        with autocast:
            sums += weight * adapter.loss(model, x0, embeds, timesteps, noise.expand_as(x0))
    model.train(was_training)
    dist.all_reduce(sums)
    losses = (sums / len(clips)).tolist()
    return {"val/loss": sum(losses) / len(losses), **{f"val/loss_t{t}": v for t, v in zip(cfg.loss_timesteps, losses)}}
