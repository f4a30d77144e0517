"""The final export: the trained weights in the layouts diffusers, PEFT and ComfyUI load.

The trained weights (and EMA's beside them) as diffusers and PEFT load them, a LoRA also in
ComfyUI's layout where the family has one, or the whole transformer for sft. Written at the end of
training (trainer.py) and by `python ckpt.py export` (ckpt_commands.py) for any checkpoint."""

import logging
from pathlib import Path

import faults
import lora
import ranks
from config import LoraConfig
from model import model_state

log = logging.getLogger("vidtrain")


def export(
    model,
    training_type: str,
    lora_cfg: LoraConfig,
    adapter,
    out_dir: str,
    d: ranks.Dist,
    ema=None,
    name: str = "",
):
    """Export the final weights, and the EMA weights beside them when EMA is on.

    The final weights, and the EMA weights beside them (lora_ema/, transformer_ema/) when EMA is on.
    `name` names the ComfyUI file (default: out_dir's name, the run's)."""
    name = name or Path(out_dir).resolve().name
    _export_weights(model, training_type, lora_cfg, adapter, Path(out_dir), "", d, name)
    if ema is not None:
        with ema.swapped_in():
            _export_weights(model, training_type, lora_cfg, adapter, Path(out_dir), "_ema", d, name)


def _export_weights(
    model, training_type, lora_cfg: LoraConfig, adapter, out: Path, suffix: str, d, name: str
):
    """Gather only the exported weights to rank 0 and write them.

    The LoRA in diffusers' and PEFT's layouts, or the full transformer with save_pretrained."""
    state = model_state(model, training_type, full_state_dict=True, cpu_offload=True)
    if not d.is_main:
        return
    if training_type == "lora":
        folder = out / f"lora{suffix}"
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: v.float() for k, v in state.items()}
        args = (weights, lora_cfg.rank, lora_cfg.lora_alpha, lora_cfg.target_modules)
        lora.save_lora(
            str(folder / "pytorch_lora_weights.safetensors"),
            *args,
            metadata=({"expert": adapter.expert} if adapter.expert else {}) | adapter.lora_metadata(),
        )
        lora.save_peft_adapter(str(folder), *args)
        log.info(
            "LoRA written to %s%s",
            folder / "pytorch_lora_weights.safetensors",
            f" (the {adapter.expert} expert, {adapter.transformer_folder}/)" if adapter.expert else "",
        )
        _export_comfy(weights, lora_cfg.lora_alpha, adapter, folder, name)
    else:
        with faults.written(out / f"transformer{suffix}", lora.EXPORT_FIX) as tmp:
            adapter.transformer_from_state_dict(state).save_pretrained(tmp)
        log.info("transformer written to %s", out / f"transformer{suffix}")


def _export_comfy(weights: dict, alpha: float, adapter, folder: Path, name: str) -> None:
    """Write the LoRA in the key layout ComfyUI's native loader reads.

    lora/comfy/<name>[_<expert>].safetensors in the key layout ComfyUI's native loader reads: Wan's
    original checkpoint's, CogVideoX's ComfyUI model's (comfy/ldm/cogvideo/model.py)."""
    if not adapter.COMFY:
        return
    modules = {key.rsplit(".lora_", 1)[0] for key in weights}
    unmapped = sorted(m for m in modules if adapter.comfy_key(m) is None)
    if unmapped:
        log.warning(
            "no ComfyUI file: %s lie outside the blocks, where the layout carries no alpha", unmapped[:3]
        )
        return
    name += f"_{adapter.expert}" if adapter.expert else ""
    lora.save_comfy(
        str(folder / "comfy" / f"{name}.safetensors"),
        weights,
        alpha,
        adapter.comfy_key,
        adapter.COMFY_ALPHA,
        adapter.lora_metadata(),
    )
    log.info("ComfyUI LoRA written to %s", folder / "comfy" / f"{name}.safetensors")
