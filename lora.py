"""Hand-written LoRA: injection by module name, merge on a copy, the file layouts read and written.

`LoRALinear` subclasses `nn.Linear` and shares the base layer's `weight` and `bias`
Parameters, so base checkpoints keep their keys and load unchanged. Numerics follow
PEFT (same forward, same scale alpha / rank), and exports use the key layouts of
diffusers (`pytorch_lora_weights.safetensors`) and PEFT (`adapter_model.safetensors`),
so the trained adapter loads with `pipe.load_lora_weights` or `PeftModel.from_pretrained`, and of
ComfyUI. Its variants (lora.variant): PEFT's DoRA (`DoRALinear`) and LyCORIS' LoKr (`LoKrLinear`).
"""

import difflib
import fnmatch
import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn
from torch.distributed.tensor import DTensor

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

    W and b are the base layer's own Parameters. The variants subclass it (DoRALinear,
    LoKrLinear): their own trainable tensors (`parts`, named as the makers name them), output
    (`add_delta`) and merge (`delta_weight`, `merged_weight`)."""

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
        self._share(base, rank, alpha, dropout)
        # LoRA weights are trainable, hence fp32 whatever the frozen base dtype. skip_init avoids
        # nn.Linear's own init, which would draw from the global RNG.
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, dtype=torch.float32)
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False, dtype=torch.float32)
        # Initialise on the CPU so the values do not depend on the device, then move.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_A.to(device or base.weight.device)
        self.lora_B.to(device or base.weight.device)
        # the trainable tensors, by their names under the layer (PEFT's)
        self.parts = ("lora_A.weight", "lora_B.weight")

    def _share(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        """Take over the base layer's weight and bias, and set what every variant has."""
        # nn.Linear.__init__ would allocate and randomly fill a weight we throw away
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        # model.storage_dtype = "fp8": the scale goes with its weight
        if isinstance(base, memory.Fp8Linear):
            self.weight_scale, self.compute_dtype = base.weight_scale, base.compute_dtype
        self.rank, self.alpha, self.scale, self.dropout = rank, alpha, alpha / rank, dropout
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

    @staticmethod
    def _adapter_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Under autocast the adapter runs in the autocast dtype; otherwise in its weights' (fp32),
        and the sum is rounded once to the output dtype, as PEFT does."""
        return x if torch.is_autocast_enabled(x.device.type) else x.to(weight.dtype)

    def add_delta(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output `base` of input x, plus the adapter's path."""
        lora_in = self._adapter_input(x, self.lora_A.weight)
        return (base + self.lora_B(self.lora_A(self._dropout(lora_in))) * self.scale).to(base.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """What the adapter adds to W, in fp32: scale * B @ A."""
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The adapter merged into a copy of its weight: W + delta_weight, computed in fp32.

        Returned as a new tensor in W's dtype (the compute dtype of an fp8 W)."""
        weight = memory.weight(self)
        return (weight.float() + self.delta_weight()).to(weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an FSDP2 parameter (a DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class DoRALinear(LoRALinear):
    """PEFT's DoRA (LoraConfig(use_dora=True)): a LoRA whose merged rows are rescaled to a trained
    magnitude, W' = m / ||W + s B A||_row * (W + s B A).

    The norm is detached from the graph, as PEFT does after the DoRA paper's section 4.3
    (peft/tuners/lora/dora.py, DoraLinearLayer.forward), and m starts at ||W||_row, so the layer
    starts as the base. No dropout: config.py refuses it (PEFT's would recompute the base output
    on the dropped input)."""

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        *,
        generator: torch.Generator,
        device: torch.device | None = None,
    ):
        super().__init__(base, rank, alpha, generator=generator, device=device)
        device = device or base.weight.device
        self.lora_magnitude_vector = nn.Parameter(torch.zeros(self.out_features, device=device))
        self.parts += ("lora_magnitude_vector",)
        # Under FSDP the base weight is still on the meta device here: init_magnitudes fills m once
        # each rank has read its rows. A loaded file's m (load_lora_into) replaces this start.
        self.magnitude_from_base = True
        if not base.weight.is_meta:
            self.init_magnitude()

    @torch.no_grad()
    def init_magnitude(self) -> None:
        """m = ||W||_row, on this rank's rows under FSDP (W and m are split by rows alike)."""
        weight = _local(self.weight)
        if weight.dtype == memory.FP8:
            weight = memory.dequantize(weight, _local(self.weight_scale), torch.float32)
        norms = torch.linalg.vector_norm(weight.float(), dim=1)
        magnitude = _local(self.lora_magnitude_vector)
        magnitude.copy_(norms.to(magnitude.device))
        self.magnitude_from_base = False

    def add_delta(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # PEFT's sum: base + (m / norm - 1) * (base without bias) + m / norm * s * B(A(x)). The norm
        # in fp32 also under autocast, which would round B @ A to its dtype.
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            norm = torch.linalg.vector_norm(memory.weight(self).float() + self.delta_weight(), dim=1)
        factor = self.lora_magnitude_vector / norm
        plain = base if self.bias is None else base - self.bias
        lora_out = self.lora_B(self.lora_A(self._adapter_input(x, self.lora_A.weight))) * self.scale
        return (base + (factor - 1) * plain + factor * lora_out).to(base.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        weight = memory.weight(self)
        merged = weight.float() + self.delta_weight()
        factor = self.lora_magnitude_vector.float() / torch.linalg.vector_norm(merged, dim=1)
        return (factor[:, None] * merged).to(weight.dtype)


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of a dimension into m <= n, m * n = dimension (lycoris/functional/general.py).

    A positive `factor` that divides it is one side; otherwise m is the largest divisor up to the
    square root, and up to `factor` when that is positive (LyCORIS' loop, read for what it returns)."""
    if factor > 0 and dimension % factor == 0:
        return min(factor, dimension // factor), max(factor, dimension // factor)
    limit = math.isqrt(dimension) if factor < 0 else min(factor, math.isqrt(dimension))
    m = max(d for d in range(1, limit + 1) if dimension % d == 0)
    return m, dimension // m


class LoKrLinear(LoRALinear):
    """LyCORIS' LoKr on a linear layer: W' = W + scale * kron(w1, w2).

    As lycoris/modules/lokr.py LokrModule.__init__ builds it (decompose_both off, no Tucker):
    out = a * c and in = b * d by `factorization`; w1 [a, b] full; w2 [c, d] = w2_a @ w2_b of rank r
    when r < max(c, d) / 2, at scale alpha / r, else a full w2 at scale 1. w1 and w2_a start
    Kaiming-uniform, w2_b (or w2) at zero. Named lokr_w1, lokr_w2_a, lokr_w2_b (lokr_w2), as LyCORIS
    writes them and ComfyUI reads them. No dropout (LyCORIS' LoKr has none)."""

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        factor: int = -1,
        *,
        generator: torch.Generator,
        device: torch.device | None = None,
    ):
        self._share(base, rank, alpha, 0.0)
        self.factor = factor
        (a, c), (b, d) = factorization(self.out_features, factor), factorization(self.in_features, factor)
        self.shape_in = (b, d)
        device = device or base.weight.device

        def kaiming(*shape):
            t = torch.empty(shape)
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
            return nn.Parameter(t.to(device))

        self.lokr_w1 = kaiming(a, b)
        if rank < max(c, d) / 2:
            self.lokr_w2_a = kaiming(c, rank)
            self.lokr_w2_b = nn.Parameter(torch.zeros(rank, d, device=device))
            self.parts = ("lokr_w1", "lokr_w2_a", "lokr_w2_b")
        else:
            self.lokr_w2 = nn.Parameter(torch.zeros(c, d, device=device))
            self.parts = ("lokr_w1", "lokr_w2")
            self.scale = 1.0

    def _w2(self) -> torch.Tensor:
        return self.lokr_w2 if "lokr_w2" in self.parts else self.lokr_w2_a @ self.lokr_w2_b

    def add_delta(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x kron(w1, w2)^T without the [out, in] matrix: x as [..., b, d], then w1 X w2^T
        h = self._adapter_input(x, self.lokr_w1).unflatten(-1, self.shape_in)
        if "lokr_w2" in self.parts:
            h = h @ self.lokr_w2.T
        else:
            h = h @ self.lokr_w2_b.T @ self.lokr_w2_a.T
        return (base + (self.lokr_w1 @ h).flatten(-2) * self.scale).to(base.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        return self.scale * torch.kron(self.lokr_w1.float(), self._w2().float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, factor={self.factor}, parts={self.parts}"


# lora.variant's layer classes
VARIANTS = {"lora": LoRALinear, "dora": DoRALinear, "lokr": LoKrLinear}
# An adapter weight's key: its module, then the part (a layer's `parts`).
PART = re.compile(r"(.+?)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector|lokr_w1|lokr_w2(?:_a|_b)?)")


def module_of(key: str) -> str:
    """The module an adapter weight's key names: `blocks.0.attn1.to_q` of `....to_q.lora_A.weight`."""
    return PART.fullmatch(key).group(1)


def _lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _lora_keys(model: nn.Module) -> list[str]:
    return [f"{name}.{part}" for name, m in _lora_modules(model).items() for part in m.parts]


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
    variant: str = "lora",
    factor: int = -1,
) -> list[str]:
    """Replace every targeted nn.Linear by a LoRALinear (or the `variant`'s), freeze the rest.

    Returns the names, sorted. The LoRA weights go to `device`, by default their base layer's (FSDP
    loading names the real one while the base is still on the meta device). `factor`: LoKr's."""
    if _lora_modules(model):
        raise ValueError("inject_lora: the model already has LoRA layers")
    if dropout and variant != "lora":
        raise ValueError(f"lora.dropout = {dropout}: only lora.variant = 'lora' has dropout")
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
    options = {"lora": {"dropout": dropout}, "dora": {}, "lokr": {"factor": factor}}[variant]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = VARIANTS[variant](
            getattr(parent, child), rank, alpha, generator=generator, device=device, **options
        )
        setattr(parent, child, layer)
    trainable = set(_lora_keys(model))
    for pname, param in model.named_parameters():
        param.requires_grad_(pname in trainable)
    return names


def init_magnitudes(model: nn.Module) -> None:
    """DoRA under FSDP: m = ||W||_row of each layer whose m is neither set nor loaded, once the
    ranks have read their rows of the base weights (model.build_model)."""
    for module in _lora_modules(model).values():
        if isinstance(module, DoRALinear) and module.magnitude_from_base:
            module.init_magnitude()


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


def _adapter_config(
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float,
    variant: str = "lora",
    factor: int = -1,
) -> dict:
    """The LoraConfig fields that define the adapter; diffusers calls LoraConfig(**these) on load.

    LoKr adds its own two (`variant`, `lokr_factor`), which LoraConfig refuses: diffusers and PEFT
    have no loader for LyCORIS' LoKr, and stop there rather than load it as something else."""
    config = {
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(target_modules),
        "lora_dropout": dropout,
        "bias": "none",
        "use_rslora": False,  # rsLoRA would scale by alpha / sqrt(r)
        "use_dora": variant == "dora",
    }
    return config | ({"variant": "lokr", "lokr_factor": factor} if variant == "lokr" else {})


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
    variant: str = "lora",
    factor: int = -1,
) -> None:
    """Write diffusers' pytorch_lora_weights.safetensors as the pipeline's save_lora_weights does.

    The tensors and header that `CogVideoXPipeline.save_lora_weights(...,
    transformer_lora_adapter_metadata=config)` writes, with `metadata` (a Wan 2.2 A14B expert's
    name, an IC-LoRA's reference_downscale_factor) in the header too. DoRA's m is PEFT's
    `lora_magnitude_vector` with use_dora in the config; LoKr's file is this trainer's own."""
    config = _adapter_config(rank, alpha, target_modules, dropout, variant, factor)
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
    variant: str = "lora",
) -> None:
    """Write PEFT's adapter_model.safetensors and adapter_config.json (LoRA or DoRA).

    `PeftModel.from_pretrained(base, directory)` loads them."""
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None}
    config |= _adapter_config(rank, alpha, target_modules, dropout, variant)
    tensors = {PEFT_PREFIX + k: v for k, v in lora_sd.items()}
    _save_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors, {"format": "pt"})
    with faults.written(Path(directory) / "adapter_config.json", EXPORT_FIX) as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True))


def load_lora(path: str, from_comfy=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a LoRA in diffusers', PEFT's or ComfyUI's layout, keyed by model FQN, with its settings.

    Diffusers' layout is ours: `transformer.` keys with `lora_adapter_metadata`; PEFT's is
    `adapter_model.safetensors` beside `adapter_config.json`, or their folder; ComfyUI's needs
    `from_comfy`, the family's map of original module names to ours (a list of ours for a fused
    module, save_comfy's slices). Returns the state dict keyed by
    model FQN and {rank, alpha, target_modules} (target_modules None from ComfyUI's layout, which
    names modules, not targets: the model's own keys then decide), variant and factor (LoKr's)."""
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
    # Files trained elsewhere may use variants we cannot represent; refuse rather than misload.
    unsupported = sorted(k for k in ("use_rslora", "rank_pattern", "alpha_pattern") if config.get(k))
    if unsupported or isinstance(config["target_modules"], str):
        what = unsupported or ["target_modules as a regular expression"]
        raise ValueError(
            f"{path}: its config sets {what}; only LoRA, DoRA and LoKr with one rank, alpha and a target "
            "list are supported"
        )
    lora_sd = {k.removeprefix(prefix): v for k, v in lora_sd.items()}
    wrong_rank = [k for k, v in lora_sd.items() if k.endswith("lora_A.weight") and v.shape[0] != config["r"]]
    if wrong_rank:
        raise ValueError(f"{path}: its config says rank {config['r']} but {wrong_rank[:3]} disagree")
    info = {
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "target_modules": sorted(config["target_modules"]),
        "variant": "dora" if config.get("use_dora") else config.get("variant", "lora"),
        "factor": config.get("lokr_factor", -1),
    }
    return lora_sd, info


def _from_comfy(
    path: str, tensors: dict[str, torch.Tensor], from_comfy
) -> tuple[dict[str, torch.Tensor], dict]:
    other = next((k for k in sorted(tensors) if k.endswith(".dora_scale") or ".lokr_" in k), None)
    if other:
        raise ValueError(
            f"{path} is a DoRA or LoKr in ComfyUI's layout ({other}): give its run's "
            "lora/pytorch_lora_weights.safetensors instead, which holds the same adapter and its settings "
            "(ComfyUI's layout is read for plain LoRA only)"
        )
    modules = {k.removeprefix(COMFY_PREFIX).rsplit(".", 2)[0] for k in tensors if k.endswith("lora_A.weight")}
    ours = {m: from_comfy(m) if from_comfy else None for m in modules}
    unknown = sorted(m for m, name in ours.items() if name is None)
    if unknown:
        raise ValueError(
            f"{path} is in ComfyUI's layout, but {unknown[:3]} name no module this model family "
            "maps (only the transformer blocks' projections are read)"
        )
    # A fused module (a list of ours, save_comfy's slices) holds their ranks side by side, and its
    # alpha counts them all.
    ours = {m: name if isinstance(name, list) else [name] for m, name in ours.items()}
    alphas = {
        float(tensors[f"{COMFY_PREFIX}{m}.alpha"]) / len(ours[m])
        for m in modules
        if f"{COMFY_PREFIX}{m}.alpha" in tensors
    }
    ranks = {tensors[f"{COMFY_PREFIX}{m}.lora_A.weight"].shape[0] // len(ours[m]) for m in modules}
    # the scale is baked into lora_B: alpha = rank
    if not any(k.endswith(".alpha") for k in tensors):
        alphas = {float(r) for r in ranks}
    if len(alphas) > 1 or len(ranks) > 1 or len(alphas) == 0:
        raise ValueError(
            f"{path}: ranks {sorted(ranks)} and alphas {sorted(alphas)}: only one rank and one alpha "
            "(an .alpha per module) are supported"
        )
    lora_sd = {}
    for m in modules:
        down, up = (tensors[f"{COMFY_PREFIX}{m}.lora_{part}.weight"] for part in "AB")
        rank, out = down.shape[0] // len(ours[m]), up.shape[0] // len(ours[m])
        for i, name in enumerate(ours[m]):
            lora_sd[f"{name}.lora_A.weight"] = down[i * rank : (i + 1) * rank].contiguous()
            lora_sd[f"{name}.lora_B.weight"] = up[
                i * out : (i + 1) * out, i * rank : (i + 1) * rank
            ].contiguous()
    info = {
        "rank": ranks.pop(),
        "alpha": alphas.pop(),
        "target_modules": None,
        "variant": "lora",
        "factor": -1,
    }
    return lora_sd, info


def save_comfy(
    path: str, lora_sd: dict, alpha: float, to_comfy, alpha_keys: bool = True, metadata=None
) -> None:
    """Write a LoRA, DoRA or LoKr in ComfyUI's native layout.

    ComfyUI's native layout: diffusion_model.<original module>.lora_A/lora_B.weight and a 0-dim
    .alpha per module (ComfyUI scales by alpha / rank), with no lora_adapter_metadata (diffusers'
    converter of such files bakes alpha in, and would apply it twice with the metadata). `to_comfy`
    maps our module names; to (name, index, count) for one of `count` slices of a module the
    original fuses (HunyuanVideo 1.5's qkv: _fused). Without alpha_keys (a family whose diffusers loader refuses them,
    LTX-2's) alpha / rank is baked into lora_B instead, which ComfyUI, reading no .alpha, applies at
    scale 1. `metadata`: the family's strings (Adapter.lora_metadata). DoRA's m is `.dora_scale`,
    [out, 1] as LyCORIS writes it (ComfyUI's weight_decompose broadcasts a 1-D one wrongly,
    Comfy-Org/ComfyUI#12938); LoKr's factors keep LyCORIS' names, always with their .alpha (no
    diffusers loader reads LoKr), which ComfyUI applies as LyCORIS does (alpha / rank, or 1 with a
    full lokr_w2; comfy/weight_adapter/lokr.py)."""
    tensors, slices = {}, {}
    for key, value in lora_sd.items():
        module, part = PART.fullmatch(key).groups()
        name = to_comfy(module)
        if isinstance(name, tuple):  # a slice of a fused module, written with its others below
            name, index, count = name
            slices.setdefault((COMFY_PREFIX + name, count), {}).setdefault(part, {})[index] = value
            continue
        name = COMFY_PREFIX + name
        if part == "lora_magnitude_vector":
            tensors[f"{name}.dora_scale"] = value[:, None]
            continue
        if alpha_keys or part.startswith("lokr"):
            tensors[f"{name}.alpha"] = torch.tensor(float(alpha))
        elif part == "lora_B.weight":
            value = value * (alpha / value.shape[1])
        tensors[f"{name}.{part}"] = value
    for (name, count), parts in slices.items():
        tensors |= _fused(name, count, parts, alpha, alpha_keys)
    _save_safetensors(path, tensors, {**(metadata or {}), "format": "pt"})


def _fused(name: str, count: int, parts: dict, alpha: float, alpha_keys: bool) -> dict[str, torch.Tensor]:
    """One fused module's LoRA (an original checkpoint's qkv, to_comfy's (name, index, count)) from
    its `count` slices' (ours, each [out, rank] x [rank, in]): lora_A stacked [count x rank, in],
    lora_B block-diagonal [count x out, count x rank], so that B A is the slices' updates stacked;
    alpha x count, as ComfyUI scales by alpha / (count x rank) (musubi-tuner's
    convert_hunyuan_video_1_5_lora_to_comfy.py fuses qkv so); DoRA's m stacked."""
    if any(part.startswith("lokr") for part in parts):
        raise ValueError(f"{name}: a LoKr's Kronecker factors do not fuse into one module")
    # a slice not trained (lora.target_modules naming to_q alone) adds nothing: zeros
    ordered = {
        part: [slices.get(i, torch.zeros_like(next(iter(slices.values())))) for i in range(count)]
        for part, slices in parts.items()
    }
    down, up = torch.cat(ordered["lora_A.weight"]), torch.block_diag(*ordered["lora_B.weight"])
    tensors = {f"{name}.lora_A.weight": down}
    if alpha_keys:
        tensors[f"{name}.alpha"] = torch.tensor(float(alpha * count))
    else:
        up = up * (alpha / ordered["lora_A.weight"][0].shape[0])
    tensors[f"{name}.lora_B.weight"] = up
    if "lora_magnitude_vector" in ordered:
        tensors[f"{name}.dora_scale"] = torch.cat(ordered["lora_magnitude_vector"])[:, None]
    return tensors


@torch.no_grad()
def load_lora_into(model: nn.Module, lora_sd: dict[str, torch.Tensor]) -> None:
    """Copy LoRA weights into an injected model; the keys and shapes must match exactly."""
    params = {k: model.get_parameter(k) for k in _lora_keys(model)}
    for module in _lora_modules(model).values():
        if isinstance(module, DoRALinear):  # its m is the file's, not ||W||
            module.magnitude_from_base = False
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
