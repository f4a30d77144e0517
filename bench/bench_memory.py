"""Peak memory per rank of one training step, estimated on the CPU: no weights, no GPU.

    python bench/bench_memory.py --cfg FILE.toml [--arch NAME] [--world 8] [--sp 1 2 4 8]
                                 [--layers N] [overrides]
    python bench/bench_memory.py --cfg FILE.toml --check [--arch NAME] [--layers 2] [overrides]
    python bench/bench_memory.py --cfg FILE.toml --fit GB [--ram GB] [--arch NAME] [overrides]

The transformer (model.path's config, or --arch's published one) is built on fake tensors (shapes
and dtypes, no storage) by model.build_model (frozen weights in model.dtype and keep-in-fp32 modules
in fp32, LoRA, activation checkpointing), with model.build_optimizer's AdamW state in place (the
state of train.optimizer is counted from its code: optimizer_state_bytes) and model.EMA. One step (the adapter's train_loss under autocast, backward, clipping, AdamW, EMA) runs
under a dispatch mode that adds up the bytes of every storage an op creates, while it lives.
Autocast follows CUDA's policy (norms, softmax, pow, exp, sums in fp32, emulated) and AdamW runs
foreach, as on a GPU. --check runs the same build and two steps on real tensors in a fresh process
and compares with the second one's peak (VmHWM after resetting it, CPU autocast policy;
torch.cuda.max_memory_allocated where CUDA is).
- ddp: the whole model on every rank; gradients are DDP's buckets, resident throughout.
- fsdp, modelled (no fake collectives here): weights, gradients, AdamW and EMA / shards (world /
  dp_replicate); in flight the root's weights, 3 blocks gathered in the compute dtype (computing,
  prefetched, its all-gather buffer) and one block's unsharded gradients with an fp32 reduce-scatter
  buffer; activations without autocast's weight copies; optimizer temporaries / shards. Adafactor's
  and prodigy's state whole on every rank, and their step's gathered weights and gradients (one
  weight, or all for prodigy) in flight: model.WholeWeights.
- sp, modelled (no fake collectives here) rather than run through parallel.py: each rank holds 1/sp
  of a sample's video tokens (the latent width split, rounded up to whole patches) and all text
  tokens, as Ulysses attention does; parallel.py splits the tokens at the first block and gathers
  the last block's output, so the patch embedding, the output layers and the loss on the whole
  sample are undercounted.
- sound (LTX-2, data.audio): the batch holds the audio VAE's latents of the clip's seconds (the
  adapter's audio rate at its published frame rate: 126 frames for 121 at 24 fps), every rank all of
  them.
- control (LTX-2 IC-LoRA, model.type = "ic"): the batch holds the control clip's latents, which the
  adapter appends as tokens: twice the video tokens in training and in the validation render, or
  1 + 1/k^2 times with model.reference_downscale_factor = k.
- text masks (HunyuanVideo 1.5, Kandinsky 5, whose steps read them: the batch's longest prompt,
  diffusers' reordering of the texts, one unpadded forward per sample): real tensors, every prompt at
  its full length (text_length tokens), the worst case, what a card must hold; what the step
  computes from them alone runs for real (HostValues), so the step runs as on such prompts. Shorter
  prompts need less.
- --fit, one process: block streaming, fp8 storage and activation offload added up from the step's
  parts, with a validation render and the cache pass run on fake tensors too (bench/one_gpu.py).
  Two text encoders (HunyuanVideo 1.5's Qwen2.5-VL and ByT5, Kandinsky 5's Qwen2.5-VL and CLIP) are
  loaded together and run through the adapter's own encode_text, every prompt at its full length
  and with a quoted text for ByT5 (FullLengthTokenizer).
Not counted: the CUDA context (~0.5-1 GB), the caching allocator's reserve and fragmentation, NCCL
buffers, cuDNN/cuBLAS/attention workspaces, SP's all-to-all buffers, data loading, and validation and
the cache pass but with --fit (LTX-2's audio VAE and vocoder not even then; an I2V image encoder,
CLIP's or SigLIP's, neither).
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only
from transformers import AutoConfig, BatchEncoding, CLIPTextModel, T5EncoderModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import one_gpu  # noqa: E402
from published import families, make_adapter, meta_transformer  # noqa: E402

import model as vidtrain_model  # noqa: E402
from config import ConfigError, ParallelConfig, load_config  # noqa: E402
from parallel import AUTOCAST_DTYPES  # noqa: E402
from ranks import Dist, pinned_bytes  # noqa: E402
from weights import resolved_config  # noqa: E402

GIB = 2**30
# The second text encoder's class by its config's model_type, as the families load it: HunyuanVideo
# 1.5's ByT5 (encoder only), Kandinsky 5's CLIP text model.
SECOND_TEXT_ENCODERS = {"t5": T5EncoderModel, "clip_text_model": CLIPTextModel}
# HostValues: the largest output of real tensors alone that is computed for real
HOST_NUMEL = 2**20
# Ops CUDA's autocast runs in fp32 and the CPU's does not (aten/src/ATen/autocast_mode.h,
# AT_FORALL_FP32*).
CUDA_FP32_OPS = [
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "exp",
    "log",
    "rsqrt",
    "reciprocal",
    "softplus",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "softmax.int",
    "log_softmax.int",
    "sum",
    "sum.dim_IntList",
]


def materialize(module, fake_mode, device) -> None:
    """Replace every meta tensor by a fake one, or by a real, filled one.

    Filled, so that its pages are resident."""
    made = {}
    with fake_mode or contextlib.nullcontext():
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0, 0.02),
                        requires_grad=p.requires_grad,
                    )
                m._parameters[name] = made.get(id(p))
            for name, b in m._buffers.items():
                m._buffers[name] = None if b is None else torch.zeros(b.shape, dtype=b.dtype, device=device)


def trained_in(transformer, trains, dtype):
    """train.trainable_modules: the weights `trains` picks in the trainable dtype, as
    weights.load_transformer makes them; the rest stay frozen in model.dtype."""
    for name, param in transformer.named_parameters():
        if trains is not None and trains(name):
            param.data = param.data.to(dtype)
    return transformer


def build(cfg, family, adapter, fake_mode, device, foreach: bool):
    """model.build_model's model (one process), AdamW with its state in place, and EMA."""
    loader = SimpleNamespace(
        blocks=adapter.blocks,
        keeps_fp32=adapter.keeps_fp32,
        GRAPH_VARIES=adapter.GRAPH_VARIES,
        load_transformer=lambda dtype=None, trains=None: trained_in(
            meta_transformer(
                adapter,
                adapter.transformer_config,
                adapter.dtype if trains else dtype or adapter.dtype,
            ),
            trains,
            dtype,
        ),
    )
    # Activation offload is modelled (the tracker's "input" tag and its copies), not run: its host
    # copies would count as device memory here.
    train = dataclasses.replace(cfg.train, activation_offload=False)
    model = vidtrain_model.build_model(
        loader, train, cfg.lora, ParallelConfig(), cfg.run.seed, Dist(0, 1, 0, device)
    )
    materialize(model, fake_mode, device)
    with fake_mode or contextlib.nullcontext():
        # AdamW's step, whatever train.optimizer: estimate() counts the chosen one's state
        # (optimizer_state_bytes); prodigyopt reads values on the host and torchao compiles, which
        # fake tensors cannot serve.
        adamw = dataclasses.replace(cfg.train, optimizer="adamw", optimizer_args={})
        params, optimizer = vidtrain_model.build_optimizer(model, adamw)
        optimizer.param_groups[0]["foreach"] = foreach
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema = vidtrain_model.EMA(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    return model, params, optimizer, ema


def shapes(cfg, adapter, sp: int) -> dict:
    """One rank's micro-batch shapes (latent and text) and its token counts.

    Latent and text shapes of one rank's micro-batch (the latent width split sp ways) and token
    counts."""
    (frames, height, width), c = cfg.data.train_resolution, adapter.transformer_config
    patch = c["patch_size"][-1] if isinstance(c["patch_size"], (list, tuple)) else c["patch_size"]
    f, h, w = (
        (frames - 1) // adapter.temporal_ratio + 1,
        height // adapter.spatial_ratio,
        width // adapter.spatial_ratio,
    )
    w_rank, grid = -(-w // patch // sp) * patch, -(-f // (c.get("patch_size_t") or 1)) * (h // patch)
    s = {
        "latent": (cfg.train.batch_size, adapter.latent_channels, f, h, w_rank),
        "text": text_shapes(adapter, cfg.train.batch_size),
        "video_tokens": grid * (w // patch),
        "rank_tokens": grid * (w_rank // patch),
        "audio_tokens": 0,
    }
    # IC-LoRA: the control's tokens beside the clip's, as many, or 1/k^2 as many at 1/k of its
    # height and width (model.reference_downscale_factor; cached_batch)
    # (each rank's: 1/k of its latent width, as the adapter expects beside the rank's clip latents)
    if adapter.takes_control:
        k = getattr(adapter, "reference_downscale", 1)
        ref_grid = -(-f // (c.get("patch_size_t") or 1)) * (h // k // patch)
        s["control"] = (cfg.train.batch_size, adapter.latent_channels, f, h // k, w_rank // k)
        s["video_tokens"] += ref_grid * (w // k // patch)
        s["rank_tokens"] += ref_grid * (w_rank // k // patch)
    if hasattr(adapter, "audio_latents_per_second") and cfg.data.audio:
        # The clip's soundtrack, as the audio cache holds it: [B, C', L, M'] for the frames' seconds
        # (every rank's whole: sp replicates the audio tokens).
        a = adapter.audio_config
        s["audio_tokens"] = round(frames / adapter.published_fps * adapter.audio_latents_per_second)
        s["audio"] = (cfg.train.batch_size, a["latent_channels"], s["audio_tokens"], a["mel_bins"] // 4)
    return s


def text_shapes(adapter, batch_size: int) -> dict[str, tuple]:
    """The batch's text embeddings' shapes, by their names in the batch (model_adapter.padded_text):
    one encoder's prompt_embeds, or several encoders' by name."""
    lengths, widths = adapter.text_length, adapter.text_width
    if not isinstance(lengths, dict):
        return {"prompt_embeds": (batch_size, lengths, widths)}
    return {name: (batch_size, length, widths[name]) for name, length in lengths.items()}


def cached_batch(adapter, s: dict, new) -> dict:
    """A cached batch of shapes s: latents, text, I2V's image latents, a control clip's, the
    soundtrack's latents."""
    batch = {
        "latent_mean": new(s["latent"]),
        "latent_logvar": new(s["latent"]),
        **{name: new(shape) for name, shape in s["text"].items()},
    }
    if isinstance(adapter.text_length, dict):
        # several encoders' embeddings come with their masks: real ones (HostValues), every prompt at
        # its full length
        with unset_fake_temporarily():
            for name, shape in s["text"].items():
                batch[f"{name}_mask"] = torch.ones(shape[:2], dtype=torch.bool)
    if adapter.type == "i2v":
        batch["image_mean"] = batch["image_logvar"] = new((*s["latent"][:2], 1, *s["latent"][3:]))
    if adapter.vace:  # Wan VACE: the context its blocks read (no reference frames)
        c = adapter.transformer_config
        batch["control_latents"] = new((s["latent"][0], c["vace_in_channels"], *s["latent"][2:]))
    # its control entry: the adapter appends its tokens, in training and sampling alike
    elif adapter.takes_control:
        batch["control_latent_mean"], batch["control_latent_logvar"] = new(s["control"]), new(s["control"])
    if "audio" in s:
        batch["audio_latent_mean"], batch["audio_latent_logvar"] = new(s["audio"]), new(s["audio"])
    return batch


def train_step(cfg, adapter, model, params, optimizer, ema, s: dict, device, tracker=None) -> None:
    """One training step as trainer.py runs it on a cached batch.

    One step as trainer.py runs it on a cached batch: loss under autocast, backward, clip, AdamW,
    EMA."""
    t, new = cfg.train, lambda shape: torch.randn(shape, device=device).to(adapter.dtype)
    batch = cached_batch(adapter, s, new)
    generators = [torch.Generator().manual_seed(i) for i in range(t.batch_size)]
    with torch.autocast(
        device.type, dtype=AUTOCAST_DTYPES[t.mixed_precision], enabled=t.mixed_precision != "no"
    ):
        loss = adapter.train_loss(model, batch, generators).mean()
    if tracker:
        tracker.forward = False
    loss.backward()
    if tracker:
        tracker.phase = "opt"
    torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm, foreach=optimizer.param_groups[0]["foreach"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update()


class Tracker(TorchDispatchMode):
    """Counts the bytes of every storage an op creates, by kind, while it lives.

    Bytes of every storage an op creates, by kind, while it lives: act, input (an activation that is
    a transformer block's input, which checkpointing keeps and train.activation_offload moves to the
    host), cast (autocast's copy of a weight), grad (retagged once accumulated), opt (made in the
    optimizer step); the peak of each sum a strategy needs, and the gradients at each peak. Storages
    that exist before are not counted."""

    SUMS = {
        "single": ("act", "input", "cast", "grad", "opt"),
        "offload": ("act", "cast", "grad", "opt"),
        "ddp": ("act", "input", "cast", "opt"),
        "fsdp": ("act", "input"),
        "opt": ("opt",),
    }

    def __init__(self, existing):
        super().__init__()
        self.existing, self.phase, self.forward = list(existing), "act", True
        self.sizes = {id(t.untyped_storage()): None for t in self.existing}
        self.now, self.peak = (
            dict.fromkeys(("act", "input", "cast", "grad", "opt"), 0),
            dict.fromkeys(self.SUMS, 0),
        )
        self.grads_at_peak = dict.fromkeys(self.SUMS, 0)
        self.inputs = []  # bytes of each block's inputs, in call order
        # What memory.HostActivations copies to the host: each block call's tensor arguments, a
        # tensor once (a later call keeps the device tensor); per call, the bytes of those copies.
        self.copied, self.copies = set(), []

    def watch_blocks(self, blocks) -> None:
        """Retag each block's activation inputs "input" in the forward.

        Not in checkpointing's recompute: the first block's inputs in the positions of what it
        returns, then every block's outputs but the last's."""

        def tag(tensors) -> None:
            fresh = [t for t in tensors if (self.sizes.get(id(t.untyped_storage())) or [None])[0] == "act"]
            for t in fresh:
                self.retag(t, "input")
            self.inputs.append(sum(t.untyped_storage().nbytes() for t in fresh))

        def after(block, args, kwargs, output):
            outputs = [
                t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)
            ]
            if self.forward and block is blocks[0]:
                tag([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)][: len(outputs)])
            if self.forward and block is not blocks[-1]:
                tag(outputs)

        def before(block, args):
            if self.forward:
                fresh = [t for t in args if isinstance(t, torch.Tensor) and self.copy(t)]
                self.copies.append([t.numel() * t.element_size() for t in fresh])

        for block in blocks:
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after, with_kwargs=True)

    def copy(self, t: torch.Tensor) -> bool:
        """Whether activation offload copies t out, as HostActivations.pack decides.

        Its first checkpointed call copies it: the same storage, view and version."""
        key = (id(t.untyped_storage()), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        fresh = key not in self.copied
        self.copied.add(key)
        return fresh

    def add(self, t: torch.Tensor, kind: str) -> None:
        st = t.untyped_storage()
        if id(st) not in self.sizes:
            self.sizes[id(st)] = [kind, st.nbytes()]
            self.now[kind] += st.nbytes()
            weakref.finalize(st, self.free, id(st))

    def free(self, key: int) -> None:
        kind, n = self.sizes.pop(key)
        self.now[kind] -= n

    def retag(self, t: torch.Tensor, kind: str) -> None:
        self.add(t, kind)
        entry = self.sizes[id(t.untyped_storage())]
        if entry is not None and entry[0] != kind:
            self.now[entry[0]] -= entry[1]
            self.now[kind] += entry[1]
            entry[0] = kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        weight_copy = (
            func is torch.ops.aten._to_copy.default
            and self.sizes.get(id(args[0].untyped_storage()), 0) is None
        )
        kind = "cast" if self.phase == "act" and weight_copy else self.phase
        tree_map_only(torch.Tensor, lambda t: self.add(t, kind), out)
        for name, kinds in self.SUMS.items():
            total = sum(self.now[k] for k in kinds)
            if total > self.peak[name]:
                self.peak[name], self.grads_at_peak[name] = total, self.now["grad"]
        return out


class HostValues(TorchDispatchMode):
    """Real values for the small tensors computed from real ones alone: the batch's text masks.

    The bench's masks are real tensors (every prompt at its full length); an op whose tensor inputs
    are all real, or a factory, runs for real on the host where its output is small (HOST_NUMEL
    elements at most: a mask, a length, positions) and on fake tensors otherwise, so a length read
    from a mask (.item(), int(), a boolean index) has its value and the step runs as it would on
    those prompts. A boolean index that is real becomes its nonzero() positions (as ATen's own
    indexing does), so the indexed fake tensor's result has a known shape. Sits over FakeTensorMode,
    under the Tracker, which counts these tensors like every other."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            try:
                out = func(*args, **kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException):
                out = None  # nonzero(), item() of a real tensor: as small as it is
            fake = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
            if out is None or fake and max(t.numel() for t in fake) <= HOST_NUMEL:
                with _disable_current_modes():
                    return func(*args, **kwargs)
            return out
        if func is torch.ops.aten.index.Tensor and any(real_mask(i) for i in args[1]):
            with _disable_current_modes():
                positions = [j for i in args[1] for j in (i.nonzero().unbind(1) if real_mask(i) else [i])]
            return func(args[0], positions)
        return func(*args, **kwargs)


def real_mask(index) -> bool:
    return (
        isinstance(index, torch.Tensor)
        and not (isinstance(index, FakeTensor) or index.is_meta)
        and index.dtype in (torch.bool, torch.uint8)
    )


@contextlib.contextmanager
def cuda_autocast_policy():
    """CPU autocast with CUDA's fp32 ops: from bf16/fp16 inputs they run, and return, in fp32."""
    lib, skip = (
        torch.library.Library("aten", "IMPL"),
        torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU),
    )

    def fp32(op):
        def kernel(*args, **kwargs):
            up = lambda a: (
                a.float() if isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) else a
            )
            with torch._C._ExcludeDispatchKeyGuard(skip):
                return op(*map(up, args), **{k: up(v) for k, v in kwargs.items()})

        return kernel

    for name in CUDA_FP32_OPS:
        base, _, overload = name.partition(".")
        lib.impl(name, fp32(getattr(getattr(torch.ops.aten, base), overload or "default")), "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


def nbytes(tensors, dtype=None) -> int:
    return sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors)


def optimizer_state_bytes(params: list, train) -> int:
    """train.optimizer's state for these weights once it has stepped, from each one's code.

    AdamW: two moments. Adafactor: a row and a column vector per matrix, a whole-size vector for a
    1-D weight (torch/optim/_adafactor.py). Muon: a momentum per 2-D weight, AdamW's two moments for
    the rest. Prodigy: two moments, the start point and a running sum (prodigyopt, slice_p 1).
    AdamW8bit: two moments of 1 byte, an fp32 scale per block (256 values) and the 256 fp32 values
    of the code table each, fp32 moments for a
    tensor under 4096 values or not whole blocks (torchao/optim/adam.py, _new_buffer; it decides on
    each rank's shard, which this whole-tensor count divides later)."""
    total = 0
    for p in params:
        n, size = p.numel(), p.element_size()
        if train.optimizer == "adafactor":
            total += size * (n // p.shape[-1] + n // p.shape[-2]) if p.ndim >= 2 else size * n
        elif train.optimizer == "muon":
            total += size * n if p.ndim == 2 else 2 * size * n
        elif train.optimizer == "prodigy":
            total += 4 * size * n
        elif train.optimizer == "adamw8bit":
            block = train.optimizer_args.get("block_size", 256)
            total += 2 * (n + 4 * (n // block) + 4 * 256) if n >= 4096 and n % block == 0 else 2 * size * n
        else:
            total += 2 * size * n
    return total


def estimate(cfg, family, adapter, sp: int = 1, world: int = 1, gpu: bool = True) -> dict:
    """This rank's parts of memory, in bytes.

    Frozen, weights, adamw, ema, grads, activations, in_flight, total."""
    fake, cpu, s = FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"), shapes(cfg, adapter, sp)
    model, params, optimizer, ema = build(cfg, family, adapter, fake, cpu, foreach=gpu)
    moments, averages = (
        [v for st in optimizer.state.values() for v in st.values()],
        list(ema.weights.values()) if ema else [],
    )
    tracker = Tracker([*model.parameters(), *model.buffers(), *moments, *averages])
    tracker.watch_blocks(adapter.blocks(model))
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, "grad"))
    with fake, HostValues(), cuda_autocast_policy() if gpu else contextlib.nullcontext(), tracker:
        train_step(cfg, adapter, model, params, optimizer, ema, s, cpu, tracker)
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    state = {
        "frozen": nbytes(frozen),
        "weights": nbytes(params),
        "adamw": optimizer_state_bytes(params, cfg.train),
        "ema": nbytes(averages),
    }
    parts = {"grads": nbytes(params), "activations": tracker.peak["ddp"], "in_flight": 0, "shards": 1}
    if world == 1:
        parts |= {
            "grads": tracker.grads_at_peak["single"],
            "activations": tracker.peak["single"] - tracker.grads_at_peak["single"],
            **block_parts(cfg, adapter, model, tracker),
        }
    elif cfg.parallel.strategy == "fsdp":
        shards, blocks = world // cfg.parallel.dp_replicate, adapter.blocks(model)
        # FSDP's param_dtype (None: each weight's own)
        compute = AUTOCAST_DTYPES[cfg.train.mixed_precision]
        gathered = [nbytes(b.parameters(), compute) for b in blocks]
        block_grads = max(sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks)
        in_flight = (
            nbytes(model.parameters(), compute)
            - sum(gathered)
            + 3 * max(gathered)
            + block_grads * ((compute or torch.float32).itemsize + 4)
        )
        # Adafactor and prodigy step whole weights under FSDP2 (model.WholeWeights): their state is
        # whole on every rank, and the step gathers the weights and gradients it takes at once
        at_once = vidtrain_model.WHOLE_WEIGHT_STEPS.get(cfg.train.optimizer)
        step_gathered = (
            0 if at_once is None else 2 * (nbytes(params) if at_once else max(nbytes([p]) for p in params))
        )
        forward = tracker.peak["fsdp"] >= tracker.peak["opt"] / shards + step_gathered - in_flight
        parts = {
            "grads": nbytes(params) / shards,
            "in_flight": in_flight if forward else step_gathered,
            "shards": shards,
            "activations": tracker.peak["fsdp"] if forward else tracker.peak["opt"] / shards,
        }
        state = {k: v if k == "adamw" and at_once is not None else v / shards for k, v in state.items()}
    parts |= {
        **state,
        "trainable": state["weights"] + state["adamw"] + state["ema"],
        "video_tokens": s["video_tokens"],
        "rank_tokens": s["rank_tokens"],
        "audio_tokens": s["audio_tokens"],
    }
    parts["total"] = sum(parts[k] for k in ("frozen", "trainable", "grads", "activations", "in_flight"))
    return parts


def block_parts(cfg, adapter, model, tracker: Tracker) -> dict:
    """One process's parts of memory for bench/one_gpu.py.

    The frozen bytes outside the blocks and of the largest block (in model.dtype, and with its
    frozen linear weights in fp8 plus an fp32 scale per row, as memory.py keeps them), and what
    streaming pins of them; those linears in the compute dtype, a block's gradient buffer, the step
    without the block inputs, and what activation offload copies."""
    blocks, compute = adapter.blocks(model), AUTOCAST_DTYPES[cfg.train.mixed_precision] or adapter.dtype
    frozen = lambda m: [p for p in m.parameters() if not p.requires_grad] + list(m.buffers())
    linears = lambda b: [
        m.weight for m in b.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
    ]
    in_blocks = [nbytes(frozen(b)) for b in blocks]
    fp8 = [
        n - nbytes(linears(b)) + sum(w.numel() + 4 * w.shape[0] for w in linears(b))
        for b, n in zip(blocks, in_blocks)
    ]
    grads = max(sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks)
    copies = [n for call in tracker.copies for n in call]
    return {
        "layers": len(blocks),
        "root": nbytes(frozen(model)) - sum(in_blocks),
        "block": max(in_blocks),
        "block_fp8": max(fp8),
        "upcast": max(nbytes(linears(b), compute) for b in blocks),
        "reduce": grads * (compute.itemsize + 4),
        "offload_grads": tracker.grads_at_peak["offload"],
        "offload_activations": tracker.peak["offload"] - tracker.grads_at_peak["offload"],
        "inputs": sum(tracker.inputs),
        "block_input": max(map(sum, tracker.copies), default=0),
        "copies": copies,
        "offloaded": sum(copies),
        "offloaded_pinned": sum(map(pinned_bytes, copies)),
        **pinned_weights(adapter, model, blocks),
    }


def pinned_weights(adapter, model, blocks) -> dict:
    """The bytes that block streaming pins, by torch's pinned allocator's rule.

    What streaming pins, by torch's pinned allocator's rule (ranks.pinned_bytes): FSDP2 pins each
    frozen parameter of a streamed unit on its own (FSDPParam, CPUOffloadPolicy(pin_memory=True));
    its buffers stay on the GPU. The largest block in model.dtype and in fp8 (each linear weight and
    its row scales two parameters, memory.py), and the parameters outside the blocks (streamed with
    every block)."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}

    def requests(p, fp8: bool) -> tuple:
        if fp8 and id(p) in linear_weights:
            return p.numel(), p.shape[0] * adapter.dtype.itemsize
        return (p.numel() * p.element_size(),)

    def pinned(params, fp8: bool = False) -> int:
        return sum(pinned_bytes(n) for p in params if not p.requires_grad for n in requests(p, fp8))

    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return {
        "block_pinned": max(pinned(b.parameters()) for b in blocks),
        "block_fp8_pinned": max(pinned(b.parameters(), fp8=True) for b in blocks),
        "root_pinned": pinned(p for p in model.parameters() if id(p) not in in_blocks),
    }


def peak_of(run, modules=(), existing=()) -> int:
    """The peak bytes of the storages run() creates.

    Fake tensors, CUDA's autocast policy; modules' weights and `existing` tensors not counted."""
    tracker = Tracker([*existing, *(t for m in modules for t in (*m.parameters(), *m.buffers()))])
    with HostValues(), cuda_autocast_policy(), tracker:
        run()
    return tracker.peak["single"]


def fake_module(make, dtype: torch.dtype, fake) -> torch.nn.Module:
    with torch.device("meta"):
        module = make()
    for p in module.parameters():
        p.data = p.data.to(dtype)
    materialize(module.eval().requires_grad_(False), fake, torch.device("cpu"))
    return module


def other_phases(cfg, family, adapter) -> dict:
    """The bytes of what runs besides training steps: sampling, the VAE, the text encoder.

    Bytes of what runs besides training steps: a guided sampling forward (cond and uncond, batch 2,
    no gradients, at the validation resolution) over the training model; the VAE's weights, its
    encoding of data.cache_batch_size clips (and of one) and its decoding of one; the text encoder's
    weights and its pass over a batch of prompts. Each on fake tensors, as the adapter runs it."""
    fake, cpu = FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    resolution = cfg.validation.resolution or (cfg.data.buckets or [cfg.data.train_resolution])[0]
    sampled = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, batch_size=2),
        data=dataclasses.replace(cfg.data, train_resolution=resolution),
    )
    model, params, optimizer, ema = build(sampled, family, adapter, fake, cpu, foreach=True)
    model.eval()
    vae = fake_module(lambda: adapter.VAE.from_config(adapter.vae_config), adapter.vae_dtype, fake)
    config = adapter.TEXT_ENCODER.config_class.from_pretrained(adapter.path / "text_encoder")
    text_encoder = fake_module(lambda: adapter.TEXT_ENCODER(config), adapter.dtype, fake)
    s = shapes(sampled, adapter, 1)
    new = lambda shape: torch.randn(shape, device=cpu).to(adapter.dtype)
    with fake, torch.no_grad():
        batch = cached_batch(adapter, s, new)
        generators = [torch.Generator().manual_seed(i) for i in range(2)]
        with torch.autocast(
            "cpu",
            dtype=AUTOCAST_DTYPES[cfg.train.mixed_precision] or torch.bfloat16,
            enabled=cfg.train.mixed_precision != "no",
        ):
            sampling = peak_of(lambda: adapter.train_loss(model, batch, generators), [model], batch.values())
        adapter._load_vae = lambda: vae  # the adapter's own encode and decode, over the fake VAE
        frames, height, width = cfg.data.train_resolution
        encode = {
            n: peak_of(
                lambda: adapter.encode_video(torch.empty(n, frames, height, width, 3, dtype=torch.uint8)),
                [vae],
            )
            for n in {cfg.data.cache_batch_size, 1}
        }
        _, c, f, h, w = s["latent"]
        latents = torch.randn((1, f, c, h, w) if family == "cogvideox" else (1, c, f, h, w))
        decode = peak_of(lambda: adapter.decode_latents(latents), [vae], [latents])
        # The text pass over data.cache_batch_size prompts (and over 1), or validation's prompts and
        # negative prompt.
        prompts = {n: max(n, len(cfg.validation.prompts) + 1) for n in (cfg.data.cache_batch_size, 1)}
        text_modules = [text_encoder]
        if "connectors" in adapter.ENCODERS["text"]:
            # LTX-2: the adapter's own encode_text (Gemma's every hidden state kept, stacked,
            # through the connectors)
            connectors = fake_module(
                lambda: LTX2TextConnectors.from_config(
                    resolved_config(LTX2TextConnectors, adapter.path, "connectors")
                ),
                adapter.dtype,
                fake,
            )
            adapter._text_encoder, adapter._connectors = text_encoder, connectors
            text_modules.append(connectors)
        elif "text_encoder_2" in adapter.ENCODERS["text"]:
            # HunyuanVideo 1.5, Kandinsky 5: the second encoder, loaded with the first; the adapter's
            # own encode_text over tokenizers that give every text its full length
            config_2 = AutoConfig.from_pretrained(adapter.path / "text_encoder_2")
            encoder_2 = fake_module(
                lambda: SECOND_TEXT_ENCODERS[config_2.model_type](config_2), adapter.dtype, fake
            )
            adapter._text_encoder, adapter._text_encoder_2 = text_encoder, encoder_2
            adapter._tokenizer, adapter._tokenizer_2 = FullLengthTokenizer(), FullLengthTokenizer()
            text_modules.append(encoder_2)
        text = {n: text_pass(adapter, text_modules, n) for n in set(prompts.values())}
    return {
        "sampling": sampling,
        "vae": nbytes([*vae.parameters(), *vae.buffers()]),
        "decode": decode,
        "encode": encode[cfg.data.cache_batch_size],
        "encode_1": encode[1],
        "text": text[prompts[cfg.data.cache_batch_size]],
        "text_1": text[prompts[1]],
        "text_encoder": nbytes([t for m in text_modules for t in (*m.parameters(), *m.buffers())]),
    }


def text_pass(adapter, text_modules: list, prompts: int) -> int:
    """The peak of encoding `prompts` prompts of text_length tokens.

    The text encoder's forward, or for a text path with connectors (LTX-2) or two encoders
    (HunyuanVideo 1.5, Kandinsky 5: FullLengthTokenizer) the adapter's own encode_text."""
    if isinstance(adapter._tokenizer, FullLengthTokenizer):  # several encoders
        # a quoted text in each prompt: HunyuanVideo 1.5's ByT5 encodes the glyph text it finds
        return peak_of(lambda: adapter.encode_text(['"text"'] * prompts), text_modules)
    ids = torch.zeros(prompts, adapter.text_length, dtype=torch.long)
    mask = torch.ones_like(ids)
    if len(text_modules) == 1:
        return peak_of(lambda: text_modules[0](input_ids=ids, attention_mask=mask), text_modules, [ids, mask])
    adapter._tokenizer = lambda texts, **_: BatchEncoding({"input_ids": ids, "attention_mask": mask})
    return peak_of(lambda: adapter.encode_text([""] * prompts), text_modules, [ids, mask])


class FullLengthTokenizer:
    """A tokenizer's stand-in for the text pass on fake encoders: each text max_length tokens, the
    worst case (one token where a call names no max_length: Kandinsky 5's look for overlong prompts),
    ids and mask real tensors (HostValues), called as a tokenizer or as apply_chat_template."""

    def __call__(self, text=None, *args, max_length: int = 1, **kwargs) -> BatchEncoding:
        with unset_fake_temporarily():
            ids = torch.ones(1 if isinstance(text, str) else len(text), max_length, dtype=torch.long)
            return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    apply_chat_template = __call__


def one_gpu_parts(cfg, family, adapter) -> dict:
    """Everything bench/one_gpu.py adds up for one process, in bytes."""
    if cfg.train.training_type != "lora":
        raise ConfigError(
            "--fit models LoRA runs: sft's streaming also moves gradients and AdamW's state to the host"
        )
    status = Path("/proc/self/status").read_text()
    step = estimate(cfg, family, adapter)
    return {
        **step,
        **other_phases(cfg, family, adapter),
        "experts": 1 + len(adapter.other_experts()),
        "validation": cfg.validation.do_validation and bool(cfg.validation.prompts),
        "checkpointing": cfg.train.gradient_checkpointing,
        "cache_batch_size": cfg.data.cache_batch_size,
        "cache_pass": True,
        # EMA.swapped_in keeps the online weights
        "ema_swap": step["weights"] if cfg.train.ema_decay else 0,
        # this process: imports, no CUDA
        "process": int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024,
    }


def measure(cfg, family, adapter, device) -> dict:
    """The same build and step measured on real tensors.

    State = the build's resident growth, step = the step's peak over it (VmRSS, VmHWM after
    resetting it through clear_refs; allocated bytes on a GPU)."""
    if device.type == "cuda":
        used, peak, reset = (
            torch.cuda.memory_allocated,
            torch.cuda.max_memory_allocated,
            torch.cuda.reset_peak_memory_stats,
        )
    else:
        status = lambda key: (
            int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
        )
        used, peak = lambda: status("VmRSS"), lambda: status("VmHWM")
        reset = lambda: Path("/proc/self/clear_refs").write_text("5")
    base = used()
    model, params, optimizer, ema = build(cfg, family, adapter, None, device, foreach=device.type == "cuda")
    state = used() - base
    # A first step loads the kernels' code and JIT buffers (resident, but not tensors); the second
    # is measured.
    train_step(cfg, adapter, model, params, optimizer, ema, shapes(cfg, adapter, 1), device)
    ready = used()
    reset()
    train_step(cfg, adapter, model, params, optimizer, ema, shapes(cfg, adapter, 1), device)
    return {"device": device.type, "state": state, "step": peak() - ready}


def check(cfg, family, adapter, argv: list[str]) -> dict:
    """Measure one process's step in a fresh process, estimate it, print both and their ratios."""
    # glibc maps every block of 64 KiB or more on its own and unmaps it when freed: the resident
    # size follows the live tensors, not the heap's high-water mark (an allocator's cache is not
    # estimated).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16)}
    run = subprocess.run(
        [sys.executable, __file__, *argv, "--measure"], capture_output=True, text=True, env=env
    )
    if run.returncode:
        sys.exit(f"the measured run failed:\n{run.stderr[-3000:]}")
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    e = estimate(cfg, family, adapter, gpu=measured["device"] == "cuda")
    rows = {
        "weights + AdamW + EMA before the step": (e["frozen"] + e["trainable"], measured["state"]),
        "the step's peak above them": (e["total"] - e["frozen"] - e["trainable"], measured["step"]),
    }
    rows["peak"] = tuple(map(sum, zip(*rows.values())))
    print(f"check, one process on the {measured['device']}: {describe(cfg, adapter, e)}")
    print(f"  {'GiB':40}{'estimate':>10}{'measured':>10}{'ratio':>8}")
    for name, (est, got) in rows.items():
        print(f"  {name:40}{est / GIB:10.3f}{got / GIB:10.3f}{est / got:8.3f}")
    return {name: est / got for name, (est, got) in rows.items()}


ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr"}  # lora.variant's, as printed


def describe(cfg, adapter, e: dict) -> str:
    c, t = adapter.transformer_config, cfg.train
    # the families' own names where they have them (a block count without VACE's, heads x width)
    heads = "/".join(map(str, adapter.sequence_heads))
    if "attention_head_dim" in c:
        heads += f" x {c['attention_head_dim']}"
    lengths = adapter.text_length
    text_tokens = sum(lengths.values()) if isinstance(lengths, dict) else lengths
    what = (
        f"{ADAPTER_NAMES[cfg.lora.variant]} r{cfg.lora.rank} on {', '.join(cfg.lora.target_modules)}"
        if t.training_type == "lora"
        else "sft"
    )
    vace = f" (+ {len(c['vace_layers'])} VACE blocks)" if c.get("vace_layers") else ""
    return (
        f"{c.get('num_layers', adapter.block_count)} blocks{vace} x {heads} heads, {what}, "
        f"batch {t.batch_size} x {'x'.join(map(str, cfg.data.train_resolution))} ({e['video_tokens']} video + "
        f"{f'{audio} audio + ' if (audio := e['audio_tokens']) else ''}{text_tokens} text tokens), "
        f"{t.mixed_precision}, checkpointing "
        f"{'on' if t.gradient_checkpointing else 'off'}{f', EMA {t.ema_decay}' if t.ema_decay else ''}"
    )


def table(cfg, adapter, world: int, results: dict[int, dict]) -> None:
    """One column per sp size, GiB per rank."""
    first = next(iter(results.values()))
    how = f"{cfg.parallel.strategy} on {world} ranks" if world > 1 else "one process"
    sharded = f", sharded {first['shards']} ways" if first["shards"] > 1 else ""
    print(f"{describe(cfg, adapter, first)}\n{how}{sharded}")
    if list(results) != [1]:
        print(
            "sp is modelled, not run: each sample's video tokens split sp ways from the input on (parallel.py "
            "splits them inside the blocks only)"
        )
    print(f"  {'GiB per rank':28}" + "".join(f"{f'sp {sp}':>9}" for sp in results))
    print(f"  {'video tokens per rank':28}" + "".join(f"{r['rank_tokens']:9d}" for r in results.values()))
    for name, key in (
        ("frozen weights", "frozen"),
        ("trainable weights", "weights"),
        (f"{cfg.train.optimizer} state", "adamw"),
        ("EMA", "ema"),
        ("gradients", "grads"),
        ("activations + temporaries", "activations"),
        ("FSDP in flight", "in_flight"),
        ("peak", "total"),
    ):
        print(f"  {name:28}" + "".join(f"{r[key] / GIB:9.2f}" for r in results.values()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cfg", required=True, help="TOML config file; overrides as for trainer.py")
    parser.add_argument(
        "--arch", choices=list(families()), help="a published transformer config instead of model.path's"
    )
    parser.add_argument("--world", type=int, default=8, help="ranks (GPUs)")
    parser.add_argument("--sp", type=int, nargs="+", default=[1], help="sequence-parallel sizes (a model)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: the config's)")
    parser.add_argument("--check", action="store_true", help="compare with a measured one-process step")
    parser.add_argument(
        "--fit",
        type=float,
        metavar="GB",
        help="one process: the fastest one-GPU setting that fits GB GiB (bench/one_gpu.py), as config lines",
    )
    parser.add_argument("--ram", type=float, metavar="GB", help="with --fit: the host RAM there is, GiB")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.cfg, overrides)
    device = torch.device("cuda" if args.measure and torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        # the folder stays while the estimates run: the encoders' configs are read from it
        family, adapter = make_adapter(cfg, args.arch, Path(tmp), device)
        if args.layers:
            if "num_layers" not in adapter.transformer_config:
                sys.exit(f"--layers sets the transformer's num_layers, which {family}'s config has not")
            adapter.transformer_config["num_layers"] = args.layers
        if hasattr(adapter, "check_resolution"):
            adapter.check_resolution(cfg.data.train_resolution, "data.train_resolution")
        if args.measure:
            print(json.dumps(measure(cfg, family, adapter, device)))
        elif args.check:
            check(cfg, family, adapter, [a for a in argv if a != "--check"])
        elif args.fit is not None:
            title = describe(cfg, adapter, shapes(cfg, adapter, 1))
            one_gpu.report(one_gpu_parts(cfg, family, adapter), args.fit, title, args.ram)
        else:
            try:
                results = {sp: estimate(cfg, family, adapter, sp, args.world) for sp in args.sp}
            except (DataDependentOutputException, DynamicOutputShapeException) as e:
                sys.exit(
                    f"{family}'s training step reads a value ({e.func}) of a tensor that is not "
                    "computed from the text masks alone (the values the estimate holds, HostValues): "
                    "this estimate cannot follow it; measure a step on the device instead (--check on "
                    "a GPU)"
                )
            table(cfg, adapter, args.world, results)


if __name__ == "__main__":
    main()
