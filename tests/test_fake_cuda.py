"""What a GPU run would hit, seen on a CPU-only torch through fake CUDA tensors.

What a GPU run would hit, seen on this CPU-only torch through fake CUDA tensors (FakeTensorMode:
shapes, dtypes and devices, no data, no kernels): each variant's training loss under CUDA's autocast
policy, where a CPU tensor mixed into a CUDA op raises as it does on a GPU and every host-to-device
copy that would make the host wait is recorded (a blocking one, or a non-blocking one from pageable
memory), its batch encoded first by the family's encoders, which are all gone after the cache pass
releases them (2.1 I2V's CLIP image encoder included), and fetched as the trainer fetches it
(cache.Prefetch: read into pinned memory by a thread, then copied); and the lean loader's fill
under parallel.cpu_offload (every unit on the host, or the first parallel.offload_blocks blocks), on
a CUDA mesh over a fake process group.

Two things a CPU-only build lacks. A CUDA device guard: indexing, autocast's cast cache and autograd
ask it for the device or stream of a CUDA tensor, and FakeTensorMode's no-op guard only replaces an
existing one; the fixture below compiles c10's own NoOpDeviceGuardImpl for CUDA into a 2-line
library (g++) and loads it. And CUDA's accelerator hooks, which the autograd engine needs to
run a backward over CUDA tensors: there is no backward here (the forward builds the autograd graph).
torch.autocast("cuda") turns itself off without a GPU: CUDA's policy is switched on below it, with
torch.set_autocast_enabled."""

import contextlib
import gc
import subprocess
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils import cpp_extension
from torch.utils._python_dispatch import TorchDispatchMode

import cache
import data
import lora
import parallel
import ranks
import weights
from config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from model import build_frozen, build_model
from model_adapter import load_adapter

# an index: without one, .to() asks the (absent) CUDA runtime for the current device
CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
RESOLUTION = (9, 32, 32)
# variant: (family, model.type, model.expert). Each code path of train_loss once, in the variant
# that has the most of them (the test-time budget): CogVideoX 1.5 I2V (rotary tables, the image
# posterior, temporal patches, ofs); Wan 2.1 I2V (CLIP tokens), 2.2 TI2V (per-token timesteps) and
# an A14B T2V expert (its share of the timesteps).
VARIANTS = {
    "1.5-5b-i2v": ("cogvideox", "i2v", ""),
    "i2v": ("wan", "i2v", ""),
    "ti2v-5b": ("wan", "i2v", ""),
    "a14b-t2v": ("wan", "t2v", "high_noise"),
}


GUARD = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


@pytest.fixture(scope="module")
def cuda_device_guard(tmp_path_factory):
    """c10's no-op CUDA device guard, registered in this process (see the module's docstring)."""
    folder = tmp_path_factory.mktemp("guard")
    (folder / "guard.cpp").write_text(GUARD)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    subprocess.run(
        [
            "g++",
            "-shared",
            "-fPIC",
            "-std=c++17",
            *includes,
            str(folder / "guard.cpp"),
            "-o",
            str(folder / "guard.so"),
            f"-L{cpp_extension.library_paths()[0]}",
            "-lc10",
        ],
        check=True,
    )
    torch.ops.load_library(str(folder / "guard.so"))


class HostWaits(TorchDispatchMode):
    """Records every host-to-device copy that makes the host wait: without non_blocking, or from
    memory that is not pinned (CUDA stages it through a bounce buffer, synchronously); and every
    device-to-host copy. Pinning is emulated (FakeTensorMode has none): a tensor from _pin_memory
    counts as pinned."""

    def __init__(self):
        super().__init__()
        self.pinned, self.waits, self.to_host = [], [], []

    def is_pinned(self, t) -> bool:
        return any(t is p for p in self.pinned)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        if func is aten._pin_memory.default:
            self.pinned.append(args[0].clone())
            return self.pinned[-1]
        if (
            func is aten._to_copy.default
            and args[0].device.type == "cpu"
            and kwargs.get("device", args[0].device).type == "cuda"
        ):
            self.check(args[0], kwargs.get("non_blocking", False))
        if (
            func is aten._to_copy.default
            and args[0].device.type == "cuda"
            and kwargs.get("device", CUDA).type == "cpu"
        ):
            self.to_host.append(tuple(args[0].shape))
        if func is aten.copy_.default and args[0].device.type == "cuda" and args[1].device.type == "cpu":
            self.check(args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return func(*args, **kwargs)

    def check(self, source, non_blocking: bool) -> None:
        if not (non_blocking and self.is_pinned(source)):
            self.waits.append(
                f"{tuple(source.shape)} {source.dtype}: " + ("pageable" if non_blocking else "blocking")
            )


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype):
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)


def on_fake_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """The model's parameters and buffers as fake CUDA tensors."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty_like(param, device=CUDA), requires_grad=param.requires_grad
                )
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(CUDA)
    return model


class InMemory(cache.Cache):
    """The cache's load_batch over entries held in memory (what its files would hold)."""

    def __init__(self, entries: dict[str, dict[str, torch.Tensor]], text_length: int):
        self.entries, self.kinds, self.text_length = entries, tuple(entries), text_length

    def path(self, item, kind: str) -> str:
        return kind


def cache_entries(adapter, type_: str) -> dict[str, dict[str, torch.Tensor]]:
    """One clip's cache entries, encoded on the CPU by the model's own encoders, as the cache pass
    does."""
    frames = torch.randint(
        0, 256, (1, *RESOLUTION, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    mean, logvar = adapter.encode_video(frames)
    entries = {
        "video": {"latent_mean": mean[0], "latent_logvar": logvar[0]},
        "text": {"prompt_embeds": adapter.encode_text(["a red ball rolls"])[0][:7]},
    }
    encoders = [adapter._load_vae(), adapter._text()[0]]
    if type_ == "i2v":
        image = adapter.encode_image(frames[:, 0], [torch.Generator().manual_seed(1)], RESOLUTION[0])
        entries["image"] = {k: v[0] for k, v in image.items()}
        # 2.1 I2V's CLIP image encoder
        if adapter.FAMILY == "wan" and adapter.transformer_config["image_dim"]:
            encoders.append(adapter._image_tower()[0])
    released = [weakref.ref(encoder) for encoder in encoders]
    del encoders
    adapter.release_encoders()
    gc.collect()
    # none holds device memory after the cache pass
    assert [ref() for ref in released if ref() is not None] == []
    return entries


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_loss_on_cuda_neither_mixes_devices_nor_waits(
    variant, tiny_models, wan_models, monkeypatch, cuda_device_guard
):
    family, type_, expert = VARIANTS[variant]
    cfg = ModelConfig(
        path=str((tiny_models if family == "cogvideox" else wan_models)(variant)),
        family=family,
        type=type_,
        expert=expert,
        dtype="bf16",
    )
    on_cpu = load_adapter(cfg, torch.device("cpu"))
    entries = cache_entries(on_cpu, type_)
    model = on_cpu.load_transformer()
    lora.inject_lora(model, LoraConfig().target_modules, 4, 2.0, 0.0, seed=0)
    monkeypatch.setattr(cache, "load_file", lambda kind: entries[kind])
    waits = HostWaits()
    read = cache.Prefetch.host

    # dispatch modes are per thread: the read's thread enters its own
    def read_in_mode(prefetch, items):
        with waits:
            return read(prefetch, items)

    monkeypatch.setattr(cache.Prefetch, "host", read_in_mode)
    with FakeTensorMode(allow_non_fake_inputs=True):
        adapter = load_adapter(cfg, CUDA)
        model = on_fake_cuda(model)
        with waits, cuda_autocast(torch.bfloat16):
            # The trainer's fetch: a batch read then, and one read ahead while the step before
            # computes.
            prefetch = cache.Prefetch(InMemory(entries, adapter.text_length), CUDA)
            prefetch.batch(["a", "b"], ["b", "a"])
            batch = prefetch.batch(["b", "a"], None)
            loss = adapter.train_loss(model, batch, [data.keyed_generator(0, 1, p) for p in range(2)])
    assert waits.waits == []
    assert loss.device == CUDA and loss.dtype == torch.float32 and loss.shape == (2,) and loss.requires_grad


def outside_the_mode(function):
    """The device mesh's bookkeeping reads the values of its (real) tensors, and the weights are
    read from their files into real ones: not under FakeTensorMode."""

    def call(*args, **kwargs):
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return call


def on_a_fake_cuda_mesh(monkeypatch, path: str, build) -> tuple[torch.nn.Module, dict[str, str], HostWaits]:
    """build(adapter, d) on rank 0 of 2 over a fake process group, under fake CUDA tensors: the
    model, each parameter's local shard's device type, and the copies made."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # fully_shard asks the runtime for it
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for module, name in (
        (parallel, "init_device_mesh"),
        (weights, "compute_local_shape_and_global_offset"),
        (weights.Weights, "_rows"),
    ):
        monkeypatch.setattr(module, name, outside_the_mode(getattr(module, name)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), HostWaits() as copies:
            adapter = load_adapter(ModelConfig(path=path, dtype="bf16"), CUDA)
            model = build(adapter, ranks.Dist(0, 2, 0, CUDA))
            devices = {name: p.to_local().device.type for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return model, devices, copies


def test_offloaded_shards_are_filled_on_the_cpu(tiny_models, monkeypatch, cuda_device_guard):
    """Under parallel.cpu_offload the shards are filled in host memory, not on the GPU.

    parallel.cpu_offload on a GPU: FSDP2 wants every shard in (pinned) host memory at the first
    forward. Filled on the GPU, each block's shards would be made there, then copied back by FSDP2's
    re-pinning (torch 2.13 moves a shard that is not pinned to the CPU when its policy pins): GPU
    memory that offloading is there to save. Full fine-tuning: LoRA's layers are made by skip_init,
    whose to_empty cannot swap tensors in this mode."""
    model, devices, copies = on_a_fake_cuda_mesh(
        monkeypatch,
        str(tiny_models("5b")),
        lambda adapter, d: build_model(
            adapter,
            TrainConfig(training_type="sft"),
            LoraConfig(),
            ParallelConfig(strategy="fsdp", cpu_offload=True),
            0,
            d,
        ),
    )
    assert set(devices.values()) == {"cpu"}, {
        name: device for name, device in devices.items() if device != "cpu"
    }
    assert copies.to_host == []


def test_offload_blocks_keeps_the_first_blocks_on_the_host(tiny_models, monkeypatch, cuda_device_guard):
    """parallel.offload_blocks = 1 keeps block 0's shards on the host and the rest on the GPU.

    parallel.offload_blocks = 1: block 0's shards are made in host memory, the other block's and the
    rest of the model's on the GPU, each where FSDP keeps it (a frozen model: the other expert's
    path, which LoRA's skip_init cannot take here)."""
    model, devices, copies = on_a_fake_cuda_mesh(
        monkeypatch,
        str(tiny_models("5b")),
        lambda adapter, d: build_frozen(
            adapter,
            adapter.transformer_folder,
            TrainConfig(),
            ParallelConfig(strategy="fsdp", cpu_offload=True, offload_blocks=1),
            d,
        ),
    )
    on_host = {name for name, device in devices.items() if device == "cpu"}
    assert on_host == {name for name in devices if name.startswith("transformer_blocks.0.")} and on_host
    assert set(devices.values()) == {"cpu", "cuda"} and copies.to_host == []
