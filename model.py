"""The model: the transformer as training builds it over its family's adapter, and its EMA.

The adapter (model_adapter.py) supplies the family's parts; the moving average (EMA) is of the
trainable weights.

Build order: frozen weights in model.dtype, LoRA in fp32 (fresh from run.seed, or from
lora.init_from), the sequence split (parallel.sp_size), activation checkpointing per block (its kept
inputs in host memory with train.activation_offload), DDP or fully_shard per block then the root
(under FSDP the base weights are read only then, each rank its shard), then AdamW over the trainable
parameters only (with, for fp16, the loss scale). trainer.py, the export command and the render
command all build it here, so a checkpoint's keys are the same wherever it is loaded.
"""

import contextlib
import functools
import logging

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import lora
import memory
import parallel
import ranks
from config import Config, ConfigError, LoraConfig, ParallelConfig, TrainConfig
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
    parallel.sp_size, the blocks against parallel.offload_blocks, validation's guidance, resolution
    and frame rate (the renderer checks them again, for renders without training),
    lora.target_modules and lora.init_from.
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
        adapter.check_guidance(cfg.validation)
        if cfg.validation.do_validation:
            if cfg.validation.resolution:
                adapter.check_resolution(cfg.validation.resolution, "validation.resolution")
            adapter.clip_rate(cfg.validation.gen_fps)
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
            targets = info["target_modules"] or sorted({key.rsplit(".lora_", 1)[0] for key in weights})
            lora.inject_lora(transformer, targets, info["rank"], info["alpha"], 0.0, seed, lora_device)
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
        return adapter.load_transformer(trainable_dtype, shard=prepare, **loading)
    return prepare(adapter.load_transformer(trainable_dtype, **loading))


def check_lora_matches(cfg: LoraConfig, info: dict) -> None:
    """lora.init_from must describe the adapter the config trains: the same rank, alpha and targets."""
    ours = {"rank": cfg.rank, "alpha": cfg.lora_alpha, "target_modules": sorted(cfg.target_modules)}
    keys = {"rank": "lora.rank", "alpha": "lora.lora_alpha", "target_modules": "lora.target_modules"}
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


def build_optimizer(model, train: TrainConfig):
    """AdamW over the trainable parameters only; returns (parameters, optimizer).

    The fused implementation, on every device and strategy: one kernel per step on CPUs and GPUs,
    for plain and DTensor (FSDP2) parameters alike, and the only one that takes `found_inf`, so a
    step with a non-finite gradient is skipped on the device instead of by a host decision (see
    LossScaler). Fused and foreach AdamW round differently: using one everywhere keeps 1 process,
    DDP and FSDP within rounding of each other and a resumed run bitwise equal. It needs
    floating-point parameters on a CPU or an accelerator; trainable weights are fp32 (LoRA's, and
    sft's) by the house rules."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=train.learning_rate,
        weight_decay=train.weight_decay,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_epsilon,
        fused=True,
    )
    return params, optimizer


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
