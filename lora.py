"""Hand-written LoRA: injection by module name, merge on a copy, the file layouts read and written.

`LoRALinear` subclasses `nn.Linear` and shares the base layer's `weight` and `bias`
Parameters, so base checkpoints keep their keys and load unchanged. Numerics follow
PEFT (same forward, same scale alpha / rank), and exports use the key layouts of
diffusers (`pytorch_lora_weights.safetensors`) and PEFT (`adapter_model.safetensors`),
so the trained adapter loads with `pipe.load_lora_weights` or `PeftModel.from_pretrained`.
"""

import difflib
import fnmatch
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

import faults
import memory

# diffusers' safetensors header key (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY).
# Without it diffusers assumes alpha = rank and applies the adapter at the wrong strength.
METADATA_KEY = "lora_adapter_metadata"
DIFFUSERS_PREFIX = "transformer."
PEFT_PREFIX = "base_model.model."
COMFY_PREFIX = "diffusion_model."


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update: y = x W^T + b + (alpha / rank) * B(A(dropout(x))).

    W and b are the base layer's own Parameters."""

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        *,
        generator: torch.Generator,
        device: torch.device | None = None,
    ):
        # nn.Linear.__init__ would allocate and randomly fill a weight we throw away
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        # model.storage_dtype = "fp8": the scale goes with its weight
        if isinstance(base, memory.Fp8Linear):
            self.weight_scale, self.compute_dtype = base.weight_scale, base.compute_dtype
        self.rank, self.alpha, self.scale, self.dropout = rank, alpha, alpha / rank, dropout
        # LoRA weights are trainable, hence fp32 whatever the frozen base dtype. skip_init avoids
        # nn.Linear's own init, which would draw from the global RNG.
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, dtype=torch.float32)
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False, dtype=torch.float32)
        # Initialise on the CPU so the values do not depend on the device, then move.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_A.to(device or base.weight.device)
        self.lora_B.to(device or base.weight.device)
        # Dropout masks come from this generator, never the global RNG, so a run is reproducible
        # from its seed; the trainer sets it per step with `set_dropout_generator`. Activation
        # checkpointing restores only the global RNG for its recompute, which would then draw a
        # different mask here (wrong gradients) unless the caller restores this generator's state.
        self.dropout_generator: torch.Generator | None = None

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout == 0.0 or not self.training:
            return x
        if self.dropout_generator is None:
            raise RuntimeError(
                f"LoRA dropout {self.dropout} needs a generator: call "
                "lora.set_dropout_generator(model, torch.Generator(device).manual_seed(...)) before training"
            )
        # Drawn where x is, so the generator must be on x's device (bernoulli_ refuses another): a
        # CPU mask would cost a blocking host-to-device copy per layer.
        keep = torch.empty_like(x).bernoulli_(1.0 - self.dropout, generator=self.dropout_generator)
        return x * keep / (1.0 - self.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_delta(memory.linear(self, x), x)

    def add_delta(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output `base` of input x, plus the adapter's path.

        Under autocast both paths run in the autocast dtype; otherwise the LoRA path runs in fp32
        (its weights' dtype) and the sum is rounded once to the output dtype, as PEFT does."""
        lora_in = x if torch.is_autocast_enabled(x.device.type) else x.to(self.lora_A.weight.dtype)
        return (base + self.lora_B(self.lora_A(self._dropout(lora_in))) * self.scale).to(base.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """Merge a LoRA into a copy of its weight: W + scale * B @ A, computed in fp32.

        W + scale * B @ A, computed in fp32 and returned as a new tensor in W's dtype (the compute
        dtype of an fp8 W)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        weight = memory.weight(self)
        return (weight.float() + self.scale * delta).to(weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}"


def _lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _lora_keys(model: nn.Module) -> list[str]:
    return [f"{name}.{part}.weight" for name in _lora_modules(model) for part in ("lora_A", "lora_B")]


def is_glob(pattern: str) -> bool:
    """Whether a name pattern is an fnmatch glob (`*`, `?` or `[`), not a plain name."""
    return any(c in pattern for c in "*?[")


def closest(pattern: str, names, count: int = 3) -> list[str]:
    """The `count` names most like a pattern that matched none, for its error message."""
    return difflib.get_close_matches(pattern, sorted(names), n=count, cutoff=0.0)


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of targets: the full name, or its last dotted components; a glob
    (fnmatch, `*` crossing dots: "vace_blocks.*.attn1.to_q") must match the full name."""
    if is_glob(target):
        return fnmatch.fnmatchcase(name, target)
    return name == target or name.endswith("." + target)


def trainable(name: str, patterns: list[str]) -> bool:
    """train.trainable_modules' rule for a parameter name: it contains a pattern (VideoX-Fun's
    --trainable_modules rule: "vace" names every VACE block and the VACE patch embedding), or
    matches one as a glob over the whole name ("vace_blocks.*.attn1.*")."""
    return any(fnmatch.fnmatchcase(name, p) if is_glob(p) else p in name for p in patterns)


def exported_targets(target_modules: list[str], modules) -> list[str]:
    """The target_modules an exported file names: the config's, but with a glob, the module names
    the adapter has (`modules`). PEFT's LoraConfig, which diffusers' load_lora_weights builds from
    the file's header, reads a list as names or dotted suffixes, never as globs."""
    if any(is_glob(t) for t in target_modules):
        return sorted(modules)
    return target_modules


def inject_lora(
    model: nn.Module,
    target_modules: list[str],
    rank: int,
    alpha: float,
    dropout: float,
    seed: int,
    device: torch.device | None = None,
) -> list[str]:
    """Replace every targeted nn.Linear by a LoRALinear, freeze the rest; return the names.

    The names come sorted. The LoRA weights go to `device`, by default their base layer's (FSDP
    loading names the real one while the base is still on the meta device)."""
    if _lora_modules(model):
        raise ValueError("inject_lora: the model already has LoRA layers")
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unmatched = [t for t in target_modules if not any(_matches(n, t) for n in linears)]
    if unmatched:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(
            f"lora.target_modules: {unmatched} match no nn.Linear in {type(model).__name__} "
            "(a target must equal a module name or its last dotted parts, or match a whole name as "
            f'a glob such as "vace_blocks.*.attn1.to_q"; closest to {unmatched[0]!r}: '
            f"{closest(unmatched[0], linears)}; Linear names end in {suffixes})"
        )
    names = sorted(n for n in linears if any(_matches(n, t) for t in target_modules))
    # One generator walked in sorted-name order: every rank draws identical weights.
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(
            parent,
            child,
            LoRALinear(getattr(parent, child), rank, alpha, dropout, generator=generator, device=device),
        )
    trainable = set(_lora_keys(model))
    for pname, param in model.named_parameters():
        param.requires_grad_(pname in trainable)
    return names


def set_dropout_generator(model: nn.Module, generator: torch.Generator | None) -> None:
    for module in _lora_modules(model).values():
        module.dropout_generator = generator


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights keyed by FQN, as fp32 copies detached from the live parameters."""
    return {k: model.get_parameter(k).detach().float().clone() for k in _lora_keys(model)}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the base state dict with every LoRA layer merged in; live parameters are untouched."""
    lora_keys = set(_lora_keys(model))
    merged = {f"{name}.weight": m.merged_weight() for name, m in _lora_modules(model).items()}
    return {
        k: merged[k] if k in merged else v.detach().clone()
        for k, v in model.state_dict().items()
        if k not in lora_keys
    }


# What to do when an exported file cannot be written (a full disk): faults.written names the file.
EXPORT_FIX = (
    "free space (or write elsewhere: python ckpt.py export --out DIR), then export again; launching a "
    "finished run again exports it"
)


def _adapter_config(rank: int, alpha: float, target_modules: list[str], dropout: float) -> dict:
    """The LoraConfig fields that define the adapter; diffusers calls LoraConfig(**these) on load."""
    return {
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(target_modules),
        "lora_dropout": dropout,
        "bias": "none",
        "use_rslora": False,  # rsLoRA would scale by alpha / sqrt(r)
        "use_dora": False,
    }


def _save_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write safetensors deterministically and atomically.

    safetensors with the header's keys sorted (the library writes them in hash order, so the same
    weights would give different bytes from run to run), written to a temporary file and renamed, so
    a crash never leaves a truncated file at `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    blob = save(tensors, metadata=metadata)
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    # Same characters in another order: the same length, so the data offsets stay valid.
    ordered = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    with faults.written(Path(path), EXPORT_FIX) as tmp:
        tmp.write_bytes(blob[:8] + ordered.ljust(length) + blob[8 + length :])


def save_lora(
    path: str,
    lora_sd: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float = 0.0,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write diffusers' pytorch_lora_weights.safetensors as the pipeline's save_lora_weights does.

    The tensors and header that `CogVideoXPipeline.save_lora_weights(...,
    transformer_lora_adapter_metadata=config)` writes, with `metadata` (a Wan 2.2 A14B expert's
    name, an IC-LoRA's reference_downscale_factor) in the header too."""
    config = _adapter_config(rank, alpha, target_modules, dropout)
    packed = {DIFFUSERS_PREFIX + k: v for k, v in config.items()}
    metadata = {
        **(metadata or {}),
        "format": "pt",
        METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True),
    }
    _save_safetensors(path, {DIFFUSERS_PREFIX + k: v for k, v in lora_sd.items()}, metadata)


def save_peft_adapter(
    directory: str,
    lora_sd: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float = 0.0,
) -> None:
    """Write PEFT's adapter_model.safetensors and adapter_config.json.

    `PeftModel.from_pretrained(base, directory)` loads them."""
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None}
    config |= _adapter_config(rank, alpha, target_modules, dropout)
    tensors = {PEFT_PREFIX + k: v for k, v in lora_sd.items()}
    _save_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors, {"format": "pt"})
    with faults.written(Path(directory) / "adapter_config.json", EXPORT_FIX) as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True))


def load_lora(path: str, from_comfy=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a LoRA in diffusers', PEFT's or ComfyUI's layout, keyed by model FQN, with its settings.

    Diffusers' layout is ours: `transformer.` keys with `lora_adapter_metadata`; PEFT's is
    `adapter_model.safetensors` beside `adapter_config.json`, or their folder; ComfyUI's needs
    `from_comfy`, the family's map of original module names to ours. Returns the state dict keyed by
    model FQN and {rank, alpha, target_modules} (target_modules None from ComfyUI's layout, which
    names modules, not targets: the model's own keys then decide)."""
    if os.path.isdir(path):
        names = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
        found = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
        if not found:
            raise ValueError(f"{path} holds neither of {' and '.join(names)}")
        path = found[0]
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist")
    with safe_open(path, framework="pt") as f:
        header = f.metadata() or {}
        lora_sd = {k: f.get_tensor(k) for k in f.keys()}
    if lora_sd and all(k.startswith(COMFY_PREFIX) for k in lora_sd):
        return _from_comfy(path, lora_sd, from_comfy)
    if lora_sd and all(k.startswith(PEFT_PREFIX) for k in lora_sd):
        config_path = os.path.join(os.path.dirname(path), "adapter_config.json")
        if not os.path.isfile(config_path):
            raise ValueError(
                f"{path} is in PEFT's layout but {config_path}, which holds its rank and alpha, is missing"
            )
        with open(config_path) as f:
            config = json.load(f)
        prefix = PEFT_PREFIX
    elif METADATA_KEY in header:
        packed = json.loads(header[METADATA_KEY])
        config = {
            k.removeprefix(DIFFUSERS_PREFIX): v for k, v in packed.items() if k.startswith(DIFFUSERS_PREFIX)
        }
        prefix = DIFFUSERS_PREFIX
    else:
        raise ValueError(
            f"{path}: no '{METADATA_KEY}' in the safetensors header, so LoRA alpha is unknown "
            "(diffusers would silently assume alpha = rank); re-export it with lora.save_lora"
        )
    others = [k for k in lora_sd if not k.startswith(prefix)]
    if others or not {"r", "lora_alpha", "target_modules"} <= config.keys():
        raise ValueError(
            f"{path}: not a transformer LoRA (keys outside '{prefix}': {others[:3]}; "
            f"config keys: {sorted(config)})"
        )
    # Files trained elsewhere may use variants LoRALinear cannot represent; refuse rather than
    # misload.
    unsupported = sorted(
        k for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern") if config.get(k)
    )
    if unsupported or isinstance(config["target_modules"], str):
        what = unsupported or ["target_modules as a regular expression"]
        raise ValueError(
            f"{path}: its config sets {what}; only plain LoRA with one rank, alpha and a target list is supported"
        )
    lora_sd = {k.removeprefix(prefix): v for k, v in lora_sd.items()}
    wrong_rank = [k for k, v in lora_sd.items() if k.endswith("lora_A.weight") and v.shape[0] != config["r"]]
    if wrong_rank:
        raise ValueError(f"{path}: its config says rank {config['r']} but {wrong_rank[:3]} disagree")
    info = {
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "target_modules": sorted(config["target_modules"]),
    }
    return lora_sd, info


def _from_comfy(
    path: str, tensors: dict[str, torch.Tensor], from_comfy
) -> tuple[dict[str, torch.Tensor], dict]:
    modules = {k.removeprefix(COMFY_PREFIX).rsplit(".", 2)[0] for k in tensors if k.endswith("lora_A.weight")}
    ours = {m: from_comfy(m) if from_comfy else None for m in modules}
    unknown = sorted(m for m, name in ours.items() if name is None)
    if unknown:
        raise ValueError(
            f"{path} is in ComfyUI's layout, but {unknown[:3]} name no module this model family "
            "maps (only the transformer blocks' projections are read)"
        )
    alphas = {
        float(tensors[f"{COMFY_PREFIX}{m}.alpha"]) for m in modules if f"{COMFY_PREFIX}{m}.alpha" in tensors
    }
    ranks = {tensors[f"{COMFY_PREFIX}{m}.lora_A.weight"].shape[0] for m in modules}
    # the scale is baked into lora_B: alpha = rank
    if not any(k.endswith(".alpha") for k in tensors):
        alphas = {float(r) for r in ranks}
    if len(alphas) > 1 or len(ranks) > 1 or len(alphas) == 0:
        raise ValueError(
            f"{path}: ranks {sorted(ranks)} and alphas {sorted(alphas)}: only one rank and one alpha "
            "(an .alpha per module) are supported"
        )
    lora_sd = {
        f"{ours[m]}.lora_{part}.weight": tensors[f"{COMFY_PREFIX}{m}.lora_{part}.weight"]
        for m in modules
        for part in "AB"
    }
    return lora_sd, {"rank": ranks.pop(), "alpha": alphas.pop(), "target_modules": None}


def save_comfy(
    path: str, lora_sd: dict, alpha: float, to_comfy, alpha_keys: bool = True, metadata=None
) -> None:
    """Write a LoRA in ComfyUI's native layout.

    ComfyUI's native layout: diffusion_model.<original module>.lora_A/lora_B.weight and a 0-dim
    .alpha per module (ComfyUI scales by alpha / rank), with no lora_adapter_metadata (diffusers'
    converter of such files bakes alpha in, and would apply it twice with the metadata). `to_comfy`
    maps our module names. Without alpha_keys (a family whose diffusers loader refuses them,
    LTX-2's) alpha / rank is baked into lora_B instead, which ComfyUI, reading no .alpha, applies at
    scale 1. `metadata`: the family's strings (Adapter.lora_metadata)."""
    tensors = {}
    for key, value in lora_sd.items():
        module, part = key.rsplit(".lora_", 1)
        if alpha_keys:
            tensors[f"{COMFY_PREFIX}{to_comfy(module)}.alpha"] = torch.tensor(float(alpha))
        elif part.startswith("B"):
            value = value * (alpha / value.shape[1])
        tensors[f"{COMFY_PREFIX}{to_comfy(module)}.lora_{part}"] = value
    _save_safetensors(path, tensors, {**(metadata or {}), "format": "pt"})


@torch.no_grad()
def load_lora_into(model: nn.Module, lora_sd: dict[str, torch.Tensor]) -> None:
    """Copy LoRA weights into an injected model; the keys and shapes must match exactly."""
    params = {k: model.get_parameter(k) for k in _lora_keys(model)}
    missing = sorted(params.keys() - lora_sd.keys())
    unexpected = sorted(lora_sd.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(
            f"LoRA weights do not fit the model: {len(missing)} missing (first: {missing[:3]}), "
            f"{len(unexpected)} unexpected (first: {unexpected[:3]}); check lora.target_modules"
        )
    for key, param in params.items():
        if lora_sd[key].shape != param.shape:  # copy_ would broadcast some mismatches silently
            raise ValueError(
                f"LoRA weight {key}: shape {tuple(lora_sd[key].shape)}, model has {tuple(param.shape)}"
            )
        param.copy_(lora_sd[key])
