"""One GPU: which settings of block streaming, fp8 storage and activation offload fit a card.

Added up from bench_memory's parts (bytes) of one process. bench_memory.py --fit GB prints what this
finds.

A setting: the frozen weights in bf16 (model.dtype) or fp8 (model.storage_dtype: 1 byte per frozen
block-linear weight plus a scale per output row in model.dtype; norms, biases, embeddings and the
layers outside the blocks keep their dtype); N of the L blocks in pinned host memory
(parallel.cpu_offload with parallel.offload_blocks), streamed in one block ahead: on the GPU the
other blocks, the layers outside the blocks, and two blocks in flight (the one computing, the one
prefetched: FSDP2 on one rank gathers every block, resident ones too, into a buffer of its own;
DDP's resident run has none), with one block's gradient buffer; the checkpointed block inputs on the
GPU or in pinned host memory (train.activation_offload: each block call's tensor inputs, a tensor
shared by the blocks once), two blocks' back on the GPU in flight. fp8 adds up to one block's linear
weights upcast to the compute dtype (the copies a block's backward keeps). LoRA only: sft's
streaming also moves gradients and AdamW's state to the host, which is not modelled.

Fastest first, the order --fit picks in: bf16 before fp8 (fp8 changes the forward's numerics),
without activation offload before with, then the fewest blocks streamed. Each step moves every
streamed block to the GPU twice (the forward, and the backward's recompute) and every offloaded
block input out and back once; fp8 halves the first.

Phases, each of which must fit: training (one step's peak); validation (the training state, the
other expert of Wan 2.2 A14B placed as the trained one, and the larger of a guided sampling forward,
batch 2, and the VAE decoding one clip); the cache pass (the text encoder's pass over
data.cache_batch_size prompts, then the VAE encoding data.cache_batch_size clips, or one of each
where that many do not fit: cache.prepare frees the text encoder between them; the validation
prompts' encoding, before the model is built, is a text pass too, over the prompts and the negative
prompt). Host RAM: the pinned weights and activations as torch's pinned allocator hands them out
under ranks.ALLOCATOR_SETTINGS (ranks.pinned_bytes: exact sizes above 16 MiB, the next power
of two below), this process's resident size, the VAE parked between validations; in the cache pass
the text encoder, which from_pretrained reads on the host first.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ranks import ALLOCATOR_SETTINGS  # noqa: E402

GIB = 2**30
# What the estimate leaves out, until a GPU run has measured a pick (bench/bench_gpu.py's
# 14b-one-gpu): the CUDA context and its libraries (0.5-1 GiB outside torch's allocator), the
# attention backward's fp32 accumulator for dq (tokens x width x 4 bytes: 0.6 GiB for Wan 14B at
# 81x480x832) and cuBLAS's workspaces, and the caching allocator's fragmentation.
MARGIN = 2.5 * GIB


PARTS = {
    "outside the blocks": "root",
    "a block": "block",
    "in fp8": "block_fp8",
    "LoRA + AdamW": "trainable",
    "step": "activations",
    "of which block inputs": "inputs",
    "step, inputs offloaded": "offload_activations",
    "offloaded (tensors shared by the blocks once)": "offloaded",
    "sampling": "sampling",
    "VAE": "vae",
    "encode": "encode",
    "one clip": "encode_1",
    "decode": "decode",
    "text encoder": "text_encoder",
    "its pass": "text",
}


@dataclass(frozen=True)
class Setting:
    fp8: bool
    activation_offload: bool
    streamed: int  # blocks in pinned host memory

    def describe(self, layers: int) -> str:
        blocks = (
            f"{self.streamed} of {layers} blocks streamed from host memory"
            if self.streamed
            else "every block resident"
        )
        return (
            f"{'fp8' if self.fp8 else 'bf16'} weights, {blocks}, activations "
            f"{'offloaded to host memory' if self.activation_offload else 'on the GPU'}"
        )

    def config_lines(self, layers: int) -> list[str]:
        lines = ["[model]", 'storage_dtype = "fp8"'] if self.fp8 else []
        lines += ["[train]", "activation_offload = true"] if self.activation_offload else []
        if self.streamed:
            every = "  # every block" if self.streamed == layers else ""
            lines += [
                "[parallel]",
                'strategy = "fsdp"',
                "cpu_offload = true",
                f"offload_blocks = {0 if self.streamed == layers else self.streamed}{every}",
            ]
        else:
            lines += ["[parallel]", 'strategy = "ddp"  # one process: no wrapper', "cpu_offload = false"]
        return lines


def settings(p: dict) -> list[Setting]:
    """Every setting, fastest first.

    Activation offload needs checkpointing (it moves what that keeps)."""
    offload = (False, True) if p["checkpointing"] else (False,)
    return [Setting(fp8, a, n) for fp8 in (False, True) for a in offload for n in range(p["layers"] + 1)]


def block_bytes(p: dict, s: Setting) -> int:
    return p["block_fp8"] if s.fp8 else p["block"]


def resident(p: dict, s: Setting) -> int:
    """Frozen weights that stay on the GPU: the layers outside the blocks and the unstreamed blocks."""
    return p["root"] + (p["layers"] - s.streamed) * block_bytes(p, s)


def weights_on_gpu(p: dict, s: Setting) -> int:
    """GPU bytes of the frozen weights: resident, gathered for streaming, and fp8's upcast copies.

    The resident frozen weights, the blocks FSDP2 has gathered (streaming only) and fp8's upcast
    copies."""
    return resident(p, s) + (2 if s.streamed else 0) * block_bytes(p, s) + (p["upcast"] if s.fp8 else 0)


def training(p: dict, s: Setting) -> int:
    """Bytes on the GPU at the peak of a training step (bench_memory.estimate's parts suffice)."""
    if s.activation_offload:
        step = p["offload_grads"] + p["offload_activations"] + 2 * p["block_input"]
    else:
        step = p["grads"] + p["activations"]
    return weights_on_gpu(p, s) + p["trainable"] + step + (p["reduce"] if s.streamed else 0)


def gpu(p: dict, s: Setting) -> dict[str, int]:
    """Bytes on the GPU at the peak of each phase."""
    weights = weights_on_gpu(p, s)
    phases = {"training": training(p, s)}
    if p["validation"]:
        phases["validation"] = (
            weights
            + (p["experts"] - 1) * resident(p, s)
            + p["trainable"]
            + p["ema_swap"]
            + max(p["sampling"], p["vae"] + p["decode"])
        )
    if p["cache_pass"]:
        phases["cache pass"] = cache_pass(p)
    return phases


def cache_pass(p: dict) -> int:
    """The text encoder's pass, then, once cache.prepare has freed it, the VAE's."""
    return max(p["text_encoder"] + p["text"], p["vae"] + p["encode"])


def pinned(p: dict, s: Setting, experts: int = 1) -> dict[str, int]:
    """Pinned host memory: the streamed blocks' weights and the offloaded block inputs.

    As torch's allocator hands it out; the weights of every expert validation holds."""
    block = p["block_fp8_pinned"] if s.fp8 else p["block_pinned"]
    # offload_blocks = 0 streams the root too
    root = p["root_pinned"] if s.streamed == p["layers"] else 0
    return {
        "pinned weights": experts * (s.streamed * block + root),
        "offloaded activations": p["offloaded_pinned"] if s.activation_offload else 0,
    }


def host(p: dict, s: Setting) -> dict[str, int]:
    """Host RAM during training and during the cache pass.

    Training holds the pinned weights of every expert validation holds, pinned activations, the
    process and the parked VAE."""
    parts = {
        **pinned(p, s, p["experts"] if p["validation"] else 1),
        "process": p["process"],
        "parked VAE": p["vae"] if p["validation"] else 0,
    }
    parts["training"] = sum(parts.values())
    parts["cache pass"] = p["process"] + (p["text_encoder"] if p["cache_pass"] or p["validation"] else 0)
    return parts


def moved(p: dict, s: Setting) -> int:
    """Bytes over PCIe per training step (both ways)."""
    return 2 * s.streamed * block_bytes(p, s) + (2 * p["offloaded"] if s.activation_offload else 0)


def host_needed(p: dict, s: Setting) -> int:
    return max(host(p, s)["training"], host(p, s)["cache pass"])


def fits(p: dict, s: Setting, gb: float, ram: float | None = None) -> bool:
    """Whether every phase fits in gb GiB of GPU memory (and ram GiB of host RAM).

    Every phase within gb GiB of GPU memory less the margin, and, given ram, the host RAM within ram
    GiB."""
    return max(gpu(p, s).values()) + MARGIN <= gb * GIB and (ram is None or host_needed(p, s) <= ram * GIB)


def with_cache_batch(p: dict, gb: float) -> dict:
    """p with the cache pass's batches at data.cache_batch_size, or at 1 where only that fits.

    Clips per VAE call and prompts per text encoder call."""
    fitting = cache_pass(p) + MARGIN <= gb * GIB
    return (
        p
        if fitting or p["cache_batch_size"] == 1
        else p | {"encode": p["encode_1"], "text": p["text_1"], "cache_batch_size": 1}
    )


def fit(p: dict, gb: float, ram: float | None = None) -> Setting | None:
    """The fastest setting that fits gb GiB of GPU memory (and ram GiB of host RAM), or None."""
    p = with_cache_batch(p, gb)
    return next((s for s in settings(p) if fits(p, s, gb, ram)), None)


def why_none(p: dict, gb: float, ram: float | None = None) -> str:
    """What stops every setting from fitting.

    The cache pass (the same for all), the phase that stops the setting needing the least GPU
    memory, or, where that one fits, the host RAM."""
    if p["cache_pass"] and cache_pass(p) + MARGIN > gb * GIB:
        text, vae = p["text_encoder"] + p["text"], p["vae"] + p["encode"]
        reason = (
            f"the text encoder's pass needs {text / GIB:.1f} GiB, its weights alone {p['text_encoder'] / GIB:.1f}"
            " GiB (the validation prompts load it too)"
            if text >= vae
            else f"the VAE's encoding of one clip needs {vae / GIB:.1f} GiB"
        )
        return (
            f"none fits {gb:g} GiB: the cache pass needs {cache_pass(p) / GIB:.1f} GiB + "
            f"{MARGIN / GIB:g} GiB margin whatever the setting: {reason}"
        )
    leanest = min(settings(p), key=lambda s: max(gpu(p, s).values()))
    phase, peak = max(gpu(p, leanest).items(), key=lambda kv: kv[1])
    if peak + MARGIN <= gb * GIB:
        least = min(host_needed(p, s) for s in settings(p) if fits(p, s, gb))
        return (
            f"none fits {gb:g} GiB with {ram:g} GiB of host RAM: the settings that fit the GPU need "
            f"{least / GIB:.1f} GiB of host RAM or more (pinned weights and activations, the process)"
        )
    weights = weights_on_gpu(p, leanest)
    reason = (
        f"a guided sampling forward needs {p['sampling'] / GIB:.1f} GiB, the VAE's decode "
        f"{(p['vae'] + p['decode']) / GIB:.1f} GiB"
        if phase == "validation"
        else f"the trainable state and one step's gradients and activations need {(peak - weights) / GIB:.1f} GiB "
        f"beside {weights / GIB:.1f} GiB of weights"
    )
    return (
        f"none fits {gb:g} GiB: the setting that needs the least ({leanest.describe(p['layers'])}) needs "
        f"{peak / GIB:.1f} GiB + {MARGIN / GIB:g} GiB margin in the {phase}: {reason}"
    )


def report(p: dict, gb: float, title: str, ram: float | None = None) -> Setting | None:
    """Print the fastest fitting settings, the pick and its config lines.

    One per weight dtype and activation placement."""
    configured, p = p["cache_batch_size"], with_cache_batch(p, gb)
    print(
        f"{title}\none GPU of {gb:g} GiB, less a {MARGIN / GIB:g} GiB margin for the CUDA context, the "
        "attention and cuBLAS workspaces and the allocator's fragmentation (not yet measured on a GPU)"
        f"{f', {ram:g} GiB of host RAM' if ram else ''}; GiB per phase at its peak, host RAM, GB moved over "
        "PCIe per training step"
    )
    print("  parts: " + ", ".join(f"{name} {p[key] / GIB:.2f}" for name, key in PARTS.items()))
    print(
        f"  {'weights':8}{'activations':13}{'streamed':>10}{'training':>10}{'validation':>11}{'cache':>8}"
        f"{'host RAM':>10}{'moved':>8}"
    )
    for fp8 in (False, True):
        for offload in (False, True) if p["checkpointing"] else (False,):
            found = next(
                (
                    s
                    for s in settings(p)
                    if (s.fp8, s.activation_offload) == (fp8, offload) and fits(p, s, gb, ram)
                ),
                None,
            )
            label = f"  {'fp8' if fp8 else 'bf16':8}{'host' if offload else 'GPU':13}"
            if found is None:
                print(f"{label}{'none fits':>10}")
                continue
            phases = gpu(p, found)
            print(
                f"{label}{found.streamed:>7}/{p['layers']:<2}{phases['training'] / GIB:10.1f}"
                f"{phases.get('validation', 0) / GIB:11.1f}{phases.get('cache pass', 0) / GIB:8.1f}"
                f"{host_needed(p, found) / GIB:10.1f}{moved(p, found) / 1e9:8.1f}"
            )
    chosen = fit(p, gb, ram)
    if chosen is None:
        print(why_none(p, gb, ram))
        elsewhere = p | {"cache_pass": False, "validation": False}
        if p["cache_pass"] and cache_pass(p) + MARGIN > gb * GIB and fit(elsewhere, gb, ram):
            print(
                "with the cache built on a larger GPU (python cache.py; the cache is reused through data.cache_dir) "
                "and no validation prompts:"
            )
            return report(elsewhere, gb, title, ram)
        return None
    needed = host(p, chosen)
    smaller = p["cache_batch_size"] < configured
    data = (
        [
            "[data]",
            "cache_batch_size = 1  # clips per VAE call, prompts per text encoder call, in the cache pass",
        ]
        if smaller
        else []
    )
    print(f"fastest that fits: {chosen.describe(p['layers'])}")
    print(
        "  host RAM: "
        + ", ".join(
            f"{k} {needed[k] / GIB:.1f}"
            for k in ("pinned weights", "offloaded activations", "process", "parked VAE")
        )
        + f" = {needed['training'] / GIB:.1f} GiB in training; {needed['cache pass'] / GIB:.1f} GiB in the cache pass"
    )
    print("paste into the config:\n    " + "\n    ".join(chosen.config_lines(p["layers"]) + data))
    allocator = ",".join(f"{key}:{value}" for key, value in ALLOCATOR_SETTINGS.items())
    print(
        "allocator settings (the host RAM above assumes them; ranks.init sets them at the start of every "
        f"run, but for a key PYTORCH_ALLOC_CONF names):\n    PYTORCH_ALLOC_CONF={allocator}"
    )
    return chosen
