"""The model: the transformer as training builds it over its family's adapter, and its EMA.

The adapter (model_adapter.py) supplies the family's parts; the moving average (EMA) is of the
trainable weights.

Build order: frozen weights in model.dtype, LoRA in fp32 (fresh from run.seed, or from
lora.init_from), the sequence split (parallel.sp_size), activation checkpointing per block (its kept
inputs in host memory with train.activation_offload), DDP or fully_shard per block then the root
(under FSDP the base weights are read only then, each rank its shard), then train.optimizer over the
trainable parameters only (with, for fp16, the loss scale). trainer.py, the export command and the render
command all build it here, so a checkpoint's keys are the same wherever it is loaded.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import logging

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

import data
import lora
import memory
import parallel
import ranks
from config import Config, ConfigError, LoraConfig, ParallelConfig, TrainConfig, check_validation_files
from model_adapter import RunSettings, load_adapter
from weights import Weights

log = logging.getLogger("vidtrain")


# train.compile: dynamo keeps at most this many compiled variants of one code object (8 by default)
# and then runs it eagerly for good, and every block shares one forward. Training makes 4: the first
# block's input needs no gradient and the others' does, each for the first bucket's shape and again
# with dynamic sizes once a second bucket's differs (validation runs eagerly, validate.eager). 16
# leaves room for FSDP's and sequence parallelism's own guards; a run that recompiles every step
# still stops at it.
RECOMPILE_LIMIT = 16


def setup_adapter(cfg: Config, d: ranks.Dist):
    """The run's adapter, built with its settings and checked against the config before any clip.

    Every rank checks; a failure on any stops them all: the transformer's files, the heads against
    parallel.sp_size, the blocks against parallel.offload_blocks, validation's files, guidance,
    resolution, frame rate and reference images (the renderer checks them again, for renders without
    training), lora.target_modules and lora.init_from.
    """
    with ranks.all_or_none():
        adapter = load_adapter(cfg.model, d.device, RunSettings.of(cfg))
        if adapter.single_file is None:  # model.transformer_file's were checked with the adapter
            # read after the pass: missing files are named now
            Weights(adapter.path / adapter.transformer_folder)
        for heads in adapter.sequence_heads:
            parallel.check_heads(cfg.parallel.sp_size, heads, d.world)
        parallel.check_offload_blocks(cfg.parallel, adapter.block_count)
        check_streaming_with_sound(cfg.parallel, adapter)
        check_optimizer(cfg.train, cfg.lora, d.device)
        adapter.check_guidance(cfg.validation)
        if cfg.validation.do_validation:
            check_validation_files(cfg.validation)
            if cfg.validation.resolution:
                adapter.check_resolution(cfg.validation.resolution, "validation.resolution")
            adapter.clip_rate(cfg.validation.gen_fps)
            if adapter.vace:  # the frame the renderer fits them into (validate.ClipRenderer)
                frame = cfg.validation.resolution or (cfg.data.buckets or [cfg.data.train_resolution])[0]
                data.check_validation_references(cfg.validation, frame, adapter.spatial_ratio)
        if cfg.train.trainable_modules:
            check_trainable_modules(adapter, cfg.train.trainable_modules)
        if cfg.train.training_type == "lora":
            check_lora_targets(adapter, cfg.lora.target_modules)
            if cfg.lora.init_from:  # rank and alpha: ComfyUI's module names are mapped at the load
                info = lora.load_lora(cfg.lora.init_from, lambda module: module)[1]
                check_lora_matches(cfg.lora, info)
    return adapter


def check_streaming_with_sound(cfg: ParallelConfig, adapter) -> None:
    """parallel.offload_blocks with batches that may differ in sound: refused.

    build_model streams LoRA with its block then, which would put some blocks' LoRA on the host and
    others' on the GPU.
    """
    if adapter.GRAPH_VARIES and adapter.trains_sound and cfg.offload_blocks:
        raise ConfigError(
            f"parallel.offload_blocks = {cfg.offload_blocks} with data.audio = true: batches "
            "with and without sound keep LoRA's weights in their blocks' FSDP units, which would "
            "split them between host and GPU; set parallel.offload_blocks = 0 (every block on the "
            "host) or remove parallel.cpu_offload"
        )


def check_lora_targets(adapter, targets: list[str]) -> None:
    """lora.target_modules against the transformer's layers, by the injection's own rule.

    It runs on a copy built on the meta device from the config: no weights read, nothing allocated.
    """
    with torch.device("meta"):
        skeleton = adapter.TRANSFORMER.from_config(adapter.transformer_config)
    try:
        lora.inject_lora(skeleton, targets, 1, 1.0, 0.0, 0)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_trainable_modules(adapter, patterns: list[str]) -> None:
    """train.trainable_modules against the transformer's parameter names, on the meta device: a
    pattern that names none is refused with the closest names."""
    with torch.device("meta"):
        skeleton = adapter.TRANSFORMER.from_config(adapter.transformer_config)
    names = [name for name, _ in skeleton.named_parameters()]
    for pattern in patterns:
        if not any(lora.trainable(name, [pattern]) for name in names):
            raise ConfigError(
                f"train.trainable_modules: {pattern!r} names no parameter of "
                f"{type(skeleton).__name__} (a part of a name, or a glob over a whole name); the "
                f"closest: {lora.closest(pattern, names)}"
            )


def build_frozen(adapter, folder: str, train: TrainConfig, parallel_cfg: ParallelConfig, d: ranks.Dist):
    """Another frozen expert that sampling needs (Wan 2.2 A14B), spread like the trained one.

    Another expert the sampling needs (Wan 2.2 A14B), frozen in model.dtype: sharded like the
    trained one under FSDP, replicated otherwise (DDP has nothing to synchronise without trainable
    weights)."""

    def split(transformer):
        if adapter.sequence is not None:
            adapter.split_sequence(transformer, adapter.sequence)
        return transformer

    if parallel_cfg.strategy != "fsdp":
        return split(adapter.load_transformer(folder=folder).eval().requires_grad_(False))

    def shard(transformer):
        split(transformer)
        return parallel.wrap(
            transformer.requires_grad_(False),
            adapter.blocks(transformer),
            parallel_cfg,
            train.mixed_precision,
            train.gradient_accumulation_steps,
            d,
        )

    return adapter.load_transformer(folder=folder, shard=shard)


def build_model(
    adapter,
    train: TrainConfig,
    lora_cfg: LoraConfig,
    parallel_cfg: ParallelConfig,
    seed: int,
    d: ranks.Dist,
    lora_file: str = "",
):
    """The wrapped transformer in train mode.

    `lora_file` (the render command's --lora) injects the file's own rank, alpha and targets instead
    of the config's. Under FSDP the frozen weights stay on the meta device until after fully_shard,
    when each rank reads its shard (adapter.load_transformer); LoRA's are made whole on every rank
    first, so they are the same whatever the strategy."""
    fsdp = parallel_cfg.strategy == "fsdp"

    def prepare(transformer):
        # from_pretrained returns eval mode: training mode is what turns LoRA dropout on.
        transformer.train()
        lora_device = d.device if fsdp else None
        if lora_file:
            weights, info = lora.load_lora(lora_file, adapter.diffusers_key)
            # A ComfyUI file names its modules, not targets: each full name is a target.
            targets = info["target_modules"] or sorted({lora.module_of(key) for key in weights})
            lora.inject_lora(
                transformer,
                targets,
                info["rank"],
                info["alpha"],
                0.0,
                seed,
                lora_device,
                info["variant"],
                info["factor"],
            )
            lora.load_lora_into(transformer, weights)
        elif train.training_type == "lora":
            lora.inject_lora(
                transformer,
                lora_cfg.target_modules,
                lora_cfg.rank,
                lora_cfg.lora_alpha,
                lora_cfg.dropout,
                seed,
                lora_device,
                lora_cfg.variant,
                lora_cfg.lokr_factor,
            )
            if lora_cfg.init_from:
                weights, info = lora.load_lora(lora_cfg.init_from, adapter.diffusers_key)
                check_lora_matches(lora_cfg, info)
                lora.load_lora_into(transformer, weights)
        elif train.trainable_modules:  # sft of some modules: the rest frozen, in model.dtype
            for name, param in transformer.named_parameters():
                param.requires_grad_(trains(name))
        if parallel_cfg.sp_size > 1:
            for heads in adapter.sequence_heads:
                parallel.check_heads(parallel_cfg.sp_size, heads, d.world)
            adapter.split_sequence(transformer, parallel.new_split(d.sp, d.rank))
        if train.gradient_checkpointing:
            transformer.enable_gradient_checkpointing(
                memory.HostActivations(d.device).checkpoint if train.activation_offload else None
            )
        if train.compile:
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
            # Each block, not the whole model: its repeated blocks share one compiled graph, and the
            # checkpointing and FSDP units stay what they are (fully_shard comes after, as
            # torchtitan does).
            for block in adapter.blocks(transformer):
                block.compile()
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        total = sum(p.numel() for p in transformer.parameters())
        log.info("parameters: %d trainable of %d (%.3f%%)", trainable, total, 100 * trainable / total)
        # sft's fp32 weights are gathered in the autocast dtype (it casts them anyway), but for the
        # fp32 modules.
        compute_dtype_params = frozenset(
            name
            for name, p in transformer.named_parameters()
            if train.training_type == "sft" and p.requires_grad and not adapter.keeps_fp32(name)
        )
        # Batches with and without sound (data.audio on LTX-2): a rank whose batch has none leaves
        # the audio stream out of the graph, and FSDP2 reduce-scatters only the weights that got a
        # gradient: the ranks' collectives would differ (gloo stops, NCCL hangs). See
        # set_reduce_scatter_unused_params.
        varies = fsdp and adapter.GRAPH_VARIES and adapter.trains_sound
        # LoRA's weights, gradients and AdamW state stay on the GPU when the frozen base streams
        # from the host, in a unit of several modules per block (fully_shard of a list). FSDP2 ends
        # such a unit's backward otherwise when some of its modules never ran (the audio-video
        # cross-attentions without sound), and the ranks' collectives differ: with batches that
        # vary, LoRA streams with its block instead, as sft's does (check_streaming_with_sound
        # refuses parallel.offload_blocks then).
        resident = frozenset(
            name
            for name, p in transformer.named_parameters()
            if train.training_type == "lora" and p.requires_grad and not varies
        )
        wrapped = parallel.wrap(
            transformer,
            adapter.blocks(transformer),
            parallel_cfg,
            train.mixed_precision,
            train.gradient_accumulation_steps,
            d,
            compute_dtype_params,
            resident,
            adapter.GRAPH_VARIES,
        )
        if varies:
            # Each weight the backward skipped reduce-scatters a zero gradient in its unit's usual
            # place, so every rank issues the same collectives and the step's gradient is the other
            # ranks' (FSDP2's counterpart of DDP's find_unused_parameters). The units end their
            # backward in the same order on every rank too: LTX-2's blocks are reached through the
            # video stream, and the root unit's inputs need no gradient (it ends last). A run
            # without sound leaves the same weights out on every rank and needs none of it.
            wrapped.set_reduce_scatter_unused_params(True)
        return wrapped

    trainable_dtype = torch.float32 if train.training_type == "sft" else None
    # sft of some modules: only theirs in fp32
    trains = functools.partial(lora.trainable, patterns=train.trainable_modules)
    loading = {"trains": trains if train.trainable_modules and not lora_file else None}
    if fsdp:
        model = adapter.load_transformer(trainable_dtype, shard=prepare, **loading)
        lora.init_magnitudes(model)  # DoRA: the base's rows were read after the injection
        return model
    return prepare(adapter.load_transformer(trainable_dtype, **loading))


def check_lora_matches(cfg: LoraConfig, info: dict) -> None:
    """lora.init_from must describe the adapter the config trains: the same rank, alpha, targets and
    variant (LoKr: and factor)."""
    ours = {
        "rank": cfg.rank,
        "alpha": cfg.lora_alpha,
        "target_modules": sorted(cfg.target_modules),
        "variant": cfg.variant,
        "factor": cfg.lokr_factor if cfg.variant == "lokr" else info["factor"],
    }
    keys = {
        "rank": "lora.rank",
        "alpha": "lora.lora_alpha",
        "target_modules": "lora.target_modules",
        "variant": "lora.variant",
        "factor": "lora.lokr_factor",
    }
    if any(lora.is_glob(t) for t in cfg.target_modules):
        # an export names the modules a glob matched: load_lora_into checks the file's modules
        keys.pop("target_modules")
    for name, key in keys.items():
        # ComfyUI files name modules, not targets
        if info[name] is not None and info[name] != ours[name]:
            raise ConfigError(
                f"lora.init_from = {cfg.init_from} has {name} {info[name]!r}, but {key} = "
                f"{ours[name]!r}: set {key} to the file's value"
            )


# Constructor arguments vidtrain fixes: fused AdamW everywhere (see build_optimizer); prodigyopt's
# fsdp_in_use is for FSDP1's flat parameters (under FSDP2 prodigy steps whole weights: WholeWeights).
FIXED_ARGS = {"adamw": {"fused": True}, "prodigy": {"fsdp_in_use": False}}
# Defaults of ours: Muon's update scaled to AdamW's size (Moonshot's rule, torch's
# adjust_lr_fn="match_rms_adamw"), so that one train.learning_rate serves Muon and its AdamW half.
DEFAULT_ARGS = {"muon": {"adjust_lr_fn": "match_rms_adamw"}}


def optimizer_class(name: str) -> type:
    """The class of train.optimizer."""
    if name == "prodigy":
        import prodigyopt

        return prodigyopt.Prodigy
    if name == "adamw8bit":
        # imported on use: torchao takes seconds to import
        from torchao.optim import AdamW8bit

        return AdamW8bit
    return {"adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor, "muon": torch.optim.Muon}[name]


def optimizer_arguments(train: TrainConfig) -> dict:
    """train.optimizer's constructor arguments but the parameters: the train.* keys it takes, our
    fixed and default ones, and train.optimizer_args, checked against its signature."""
    cls = optimizer_class(train.optimizer)
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
    ours = {"lr": train.learning_rate, "weight_decay": train.weight_decay}
    if "betas" in names:  # the Adam family: Adafactor's eps is another thing (a pair of floors)
        ours |= {"betas": (train.adam_beta1, train.adam_beta2), "eps": train.adam_epsilon}
    fixed = FIXED_ARGS.get(train.optimizer, {})
    allowed = [n for n in names if n not in ours and n not in fixed]
    for key in train.optimizer_args:
        if key not in allowed:
            raise ConfigError(
                f"train.optimizer_args has {key!r}, which {train.optimizer} ({cls.__module__}."
                f"{cls.__qualname__}) does not take from there: allowed are {', '.join(allowed)}; "
                f"{', '.join(ours)} come from train.learning_rate, train.weight_decay"
                f"{' and train.adam_*' if 'betas' in ours else ''}"
            )
    return {**DEFAULT_ARGS.get(train.optimizer, {}), **train.optimizer_args, **ours, **fixed}


def check_optimizer(train: TrainConfig, lora_cfg: LoraConfig, device) -> None:
    """train.optimizer, its arguments and lora.plus_ratio, before any compute: the optimizer is
    built on a stand-in weight, so a value it refuses is named now, in its own words."""
    name = train.optimizer
    if name == "adamw8bit" and importlib.util.find_spec("torchao") is None:
        # optional: diffusers imports torchao in every run where it is installed, and on a machine
        # without Triton that import prints lines every user would read
        raise ConfigError(
            'train.optimizer = "adamw8bit" needs torchao, which is not installed: '
            "pip install 'torchao>=0.18,<0.19', or choose another train.optimizer"
        )
    kwargs = optimizer_arguments(train)
    if name == "adamw8bit" and device.type not in ("cuda", "cpu"):
        raise ConfigError(
            f'train.optimizer = "adamw8bit" runs on CUDA and CPU devices (torchao compiles its step '
            f"with inductor), not on {device.type}: choose another train.optimizer"
        )
    if name == "prodigy" and lora_cfg.plus_ratio and train.training_type == "lora":
        raise ConfigError(
            'lora.plus_ratio with train.optimizer = "prodigy": prodigyopt estimates one learning '
            "rate for all weights and refuses groups with others; set lora.plus_ratio = 0, or "
            "choose another train.optimizer"
        )
    if name == "prodigy" and train.learning_rate < 0.1:
        log.warning(
            "train.optimizer = prodigy with train.learning_rate = %g: prodigy's rate is a multiplier "
            "of its own estimate, 1.0 as a rule",
            train.learning_rate,
        )
    stand_in = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        optimizer_class(name)([stand_in], **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"train.optimizer = {name} refuses its arguments: {e}") from None


class Optimizers(tuple):
    """The run's optimizers, stepped as one: train.optimizer's, and with Muon the AdamW of the rest.

    DCP's state-dict helpers take such a tuple (an iterable of optimizers): a checkpoint keys each
    one's state by parameter names either way. Every group remembers its peak learning rate
    (initial_lr, as torch's schedulers name it), which set_lr scales."""

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: state for optimizer in self for p, state in optimizer.state.items()}

    def set_lr(self, factor: float) -> None:
        for group in self.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's: its step reads the tensor
                group["lr"].fill_(group["initial_lr"] * factor)
            else:
                group["lr"] = group["initial_lr"] * factor

    def step(self, skipped: torch.Tensor | None = None) -> None:
        """One update; none where `skipped` (0-dim bool, the same on every rank) is true.

        Fused AdamW skips on the device (found_inf); the others take no such flag, so the host reads
        it first: one wait for the device per step, which only fused AdamW avoids."""
        fused = [o for o in self if o.defaults.get("fused")]
        for optimizer in fused:
            if skipped is not None:
                optimizer.found_inf = skipped.float()
            optimizer.step()
        others = [o for o in self if not o.defaults.get("fused")]
        if others and (skipped is None or not skipped.item()):
            for optimizer in others:
                optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self:
            optimizer.zero_grad(set_to_none=set_to_none)


def build_optimizer(model, train: TrainConfig, plus_ratio: float = 0.0):
    """train.optimizer over the trainable parameters only; returns (parameters, Optimizers).

    AdamW is the fused implementation, on every device and strategy: one kernel per step on CPUs and
    GPUs, for plain and DTensor (FSDP2) parameters alike, and the only one that takes `found_inf`,
    so a step with a non-finite gradient is skipped on the device instead of by a host decision (see
    LossScaler). Fused and foreach AdamW round differently: using one everywhere keeps 1 process,
    DDP and FSDP within rounding of each other and a resumed run bitwise equal. It needs
    floating-point parameters on a CPU or an accelerator; trainable weights are fp32 (LoRA's, and
    sft's) by the house rules. Muon takes the 2-D weights only, the rest (biases, norms, convolutions)
    go to AdamW, as torch.optim.Muon's documentation says. `plus_ratio` (LoRA+): LoRA's B matrices
    in groups of their own at that multiple of the learning rate."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = train.optimizer == "muon"
    parts = {"main": [], "rest": []}
    for name, p in named:
        parts["main" if not muon or p.ndim == 2 else "rest"].append((name, p))

    def groups(named_part: list) -> list[dict]:
        b = [p for n, p in named_part if plus_ratio and ".lora_B." in f".{n}"]
        a = [p for n, p in named_part if not (plus_ratio and ".lora_B." in f".{n}")]
        lr = train.learning_rate
        return [
            {"params": ps, "lr": lr * scale, "initial_lr": lr * scale}
            for ps, scale in ((a, 1.0), (b, plus_ratio))
            if ps
        ]

    kwargs = optimizer_arguments(train)
    kwargs.pop("lr")
    cls = optimizer_class(train.optimizer)
    if train.optimizer in WHOLE_WEIGHT_STEPS and any(isinstance(p, DTensor) for _, p in named):
        cls = type(
            f"WholeWeight{cls.__name__}",
            (WholeWeights, cls),
            {"AT_ONCE": WHOLE_WEIGHT_STEPS[train.optimizer]},
        )
    optimizers = [cls(groups(parts["main"]), **kwargs)]
    if parts["rest"]:
        adamw = dataclasses.replace(train, optimizer="adamw", optimizer_args={})
        adamw_kwargs = optimizer_arguments(adamw)
        adamw_kwargs.pop("lr")
        optimizers.append(torch.optim.AdamW(groups(parts["rest"]), **adamw_kwargs))
    return [p for _, p in named], Optimizers(optimizers)


# Optimizers written for whole weights, which FSDP2's sharded ones would make wrong or stop (torch's
# Adafactor squares a column norm of sharded rows in place and scales by the weight's norm read on
# each rank; prodigyopt sums over the weights with .item(), each rank its own part, and flattens
# weights, which DTensor refuses for uneven shards). Under FSDP2 they step whole weights
# (WholeWeights); True: all weights in one step (prodigy's estimate sums over them all), False: one
# weight at a time (Adafactor's update of a weight reads that weight alone).
WHOLE_WEIGHT_STEPS = {"adafactor": False, "prodigy": True}


class WholeWeights:
    """The optimizer's own step over FSDP2's sharded weights, run on whole weights.

    Mixed in before an optimizer class (build_optimizer) whose weights are FSDP2's DTensors (it
    shards every weight of the model): each step gathers the weights and their
    gradients whole (one weight at a time, or all at once where AT_ONCE), runs the class's step on
    them, and keeps each rank's rows of the result. Every rank computes the same update from the
    same gathered values, so the update is the one process's, to the gradients' reduction order.
    The cost: the state is whole on every rank, as under DDP (Adafactor's: a row and a column vector
    per matrix; prodigy's: four times the trainable weights), held as plain tensors, which DCP saves
    once and loads at any world size; and the gathered weights and gradients for the step
    (bench/bench_memory.py counts both)."""

    AT_ONCE: bool

    @torch.no_grad()
    def step(self, closure=None):
        groups = [group["params"] for group in self.param_groups]
        stepped = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for part in [stepped] if self.AT_ONCE else [[each] for each in stepped]:
            whole = {p: self._gathered(p) for _, p in part}
            for group in self.param_groups:
                group["params"] = [whole[p] for owner, p in part if owner is group]
            super().step(closure)
            for group, params in zip(self.param_groups, groups):
                group["params"] = params
            for p, w in whole.items():
                self.state[p] = self.state.pop(w)
                # this rank's rows, cut here: every rank holds them all
                rows = distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(rows.to_local())

    def _gathered(self, p: DTensor) -> torch.Tensor:
        """The whole weight with its whole gradient, holding the weight's state."""
        w = p.full_tensor()
        w.grad = p.grad.full_tensor()
        if p in self.state:
            self.state[w] = self.state.pop(p)
        return w


class ProdigyCounters:
    """Prodigy's step count and learning-rate estimate, which prodigyopt keeps as Python numbers in
    its param_groups: a checkpoint holds them as float64 tensors (exact for a Python float or int);
    the rest of a group is the config's."""

    KEYS = ("d", "d_max", "d_numerator", "k")

    def __init__(self, optimizer: Optimizers):
        # its groups read when used: loading the optimizer's state replaces them
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return {
            f"{i}.{key}": torch.tensor(float(group[key]), dtype=torch.float64)
            for i, group in enumerate(self.optimizer.param_groups)
            for key in self.KEYS
        }

    def load_state_dict(self, state: dict) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            for key in self.KEYS:
                group[key] = type(group[key])(state[f"{i}.{key}"].item())


class LossScaler:
    """fp16's dynamic loss scale, decided from the global gradient norm and kept on the device.

    The scale follows torch.amp.GradScaler (2**16 at first, halved on a step with a non-finite
    gradient, doubled after 2000 finite steps in a row), with two differences. The overflow decision
    is the caller's, from the global gradient norm, which every rank computes alike (DDP's
    all-reduced gradients, the norm of FSDP2's DTensor gradients): every rank skips the same steps,
    where GradScaler's per-rank check of sharded gradients would let them disagree. And the scale is
    a device tensor that nothing reads on the host: GradScaler's state_dict holds Python floats (a
    host sync, and a pickle in checkpoints). Disabled (bf16, fp32) it changes nothing; its state is
    saved only when it is enabled."""

    GROWTH_INTERVAL = 2000

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.scale = torch.full((), 2.0**16, device=device)
        # finite steps since a change
        self.growth_tracker = torch.zeros((), dtype=torch.int64, device=device)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: list[torch.Tensor]) -> None:
        if self.enabled:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], self.scale.reciprocal())

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor) -> None:
        """found_inf: 0-dim bool, the same on every rank."""
        if not self.enabled:
            return
        grow = ~found_inf & (self.growth_tracker + 1 >= self.GROWTH_INTERVAL)
        self.scale = torch.where(found_inf, self.scale * 0.5, torch.where(grow, self.scale * 2.0, self.scale))
        self.growth_tracker = torch.where(found_inf | grow, 0, self.growth_tracker + 1)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"].to(self.scale.device)
        self.growth_tracker = state["growth_tracker"].to(self.growth_tracker.device)


class EMA:
    """Exponential moving average of the trainable weights, in fp32 and sharded like them.

    DTensors under FSDP, keyed by the same FQNs as the model's state dict so checkpoints reshard."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.model, self.decay = model, decay
        named = [(n.removeprefix("module."), p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.weights = {n: p.detach().float().clone() for n, p in named}

    @torch.no_grad()
    def update(self) -> None:
        # One kernel launch per group of tensors, not one per parameter (fp32 weights: .float() is
        # no copy).
        torch._foreach_lerp_(
            list(self.weights.values()), [p.detach().float() for p in self.params], 1.0 - self.decay
        )

    def state_dict(self) -> dict:
        return dict(self.weights)

    def load_state_dict(self, state: dict) -> None:
        for name, average in self.weights.items():
            average.copy_(state[name])

    @torch.no_grad()
    def swap_in(self) -> None:
        """For good: the render and export commands."""
        parallel.reshard(self.model)
        for param, average in zip(self.params, self.weights.values()):
            param.copy_(average)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self):
        """The model holds the averaged weights inside the block, its own weights again after it.

        FSDP keeps gathered copies of the weights when reshard_after_forward is off, and a forward
        without a backward leaves them in place: resharding on both sides makes the next forward
        gather the weights that were just written, not the ones before."""
        online = [p.detach().clone() for p in self.params]
        self.swap_in()
        try:
            yield
        finally:
            parallel.reshard(self.model)
            for param, saved in zip(self.params, online):
                param.copy_(saved)


def model_state(model, trained_only: bool, **options) -> dict:
    """The model's state dict keyed by FQN; `trained_only` (LoRA, sft of train.trainable_modules):
    only its trainable weights.

    DCP's ignore_frozen_params keeps buffers, and 5B-I2V's learned positional embeddings are a
    persistent buffer of the frozen base (a 100 MB tensor in every checkpoint and export otherwise).
    """
    options = StateDictOptions(ignore_frozen_params=trained_only, **options)
    state = get_model_state_dict(model, options=options)
    if not trained_only:
        return state
    trainable = {name.removeprefix("module.") for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def trains_part(identity: dict) -> bool:
    """Whether a run (by ckpt.run_identity) trains part of the transformer: LoRA, or sft of
    train.trainable_modules. Its checkpoints hold only what trains."""
    return identity["training_type"] == "lora" or bool(identity.get("trainable_modules"))
