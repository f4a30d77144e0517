"""FSDP2 in bf16 computes the model DDP computes.

Every parameter is gathered in its own dtype (the frozen base in model.dtype, LoRA and Wan's fp32
modules in fp32), the blocks' inputs (the rotary tables) are not cast, and sft gathers its fp32
weights in bf16 but for the fp32 modules. The suite's other runs are fp32, where no cast shows.
DoRA and LoKr (lora.variant) too: DoRA's magnitudes start from each rank's rows of the base, and
their tensors go through DCP and EMA as LoRA's do."""

import json

from conftest import run_worker

WORKER = r'''
import json, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path.insert(0, sys.argv[1])
import command, data, ranks
from config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from model import EMA, build_model, model_state
from model_adapter import load_adapter

dist.init_process_group("gloo")
rank = dist.get_rank()
d = ranks.Dist(rank, 2, rank, torch.device("cpu"))
train = TrainConfig(mixed_precision="bf16", gradient_checkpointing=False)
lora = LoraConfig(rank=4, lora_alpha=2)
report = {}


def step1_loss(adapter, model, batch):
    """The trainer's first micro-step: its loss, and the LoRA gradients' norm after the reduction."""
    generators = [data.keyed_generator(0, 1, 2 * rank + i) for i in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = adapter.train_loss(model, batch, generators).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    return loss.item(), (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


for family, path in (("cogvideox", sys.argv[2]), ("wan", sys.argv[3])):
    adapter = load_adapter(ModelConfig(path=path, family=family, dtype="bf16"), d.device)
    g = torch.Generator().manual_seed(rank)
    latents = (2, adapter.latent_channels, 3, 8, 8)
    text = adapter.transformer_config["text_embed_dim" if family == "cogvideox" else "text_dim"]
    batch = {"latent_mean": torch.randn(latents, generator=g), "latent_logvar": torch.randn(latents, generator=g) - 4,
             "prompt_embeds": torch.randn(2, adapter.text_length, text, generator=g).bfloat16()}
    report[family] = {s: step1_loss(adapter, build_model(adapter, train, lora, ParallelConfig(strategy=s), 0, d), batch)
                      for s in ("ddp", "fsdp")}
    for variant in ("dora", "lokr") if family == "cogvideox" else ():
        cfg = LoraConfig(rank=2, lora_alpha=2, variant=variant)
        models = {s: build_model(adapter, train, cfg, ParallelConfig(strategy=s), 0, d) for s in ("ddp", "fsdp")}
        report[f"{family}_{variant}"] = {s: step1_loss(adapter, m, batch) for s, m in models.items()}
        # a checkpoint's trained tensors into a model built from another seed: DCP and EMA keys
        state = model_state(models["fsdp"], "lora")
        dcp.save(state, checkpoint_id=f"{sys.argv[4]}/{variant}")
        fresh = model_state(build_model(adapter, train, cfg, ParallelConfig(strategy="fsdp"), 1, d), "lora")
        dcp.load(fresh, checkpoint_id=f"{sys.argv[4]}/{variant}")
        report[f"{variant}_state"] = {"keys": sorted(state), "ema": sorted(EMA(models["fsdp"], 0.9).state_dict()),
                                      "equal": all(torch.equal(state[k].full_tensor(), fresh[k].full_tensor()) for k in state)}
    if family == "wan":  # sft: the dtype each parameter has when the forward uses it
        model = build_model(adapter, TrainConfig(training_type="sft", mixed_precision="bf16",
                                                 gradient_checkpointing=False),
                            lora, ParallelConfig(strategy="fsdp"), 0, d)
        seen = {}
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda m, args, name=name: seen.update(
                {f"{name}.{n}".lstrip("."): str(p.dtype) for n, p in m.named_parameters(recurse=False)}))
        step1_loss(adapter, model, batch)
        report["wan_sft"] = {name: (dtype, adapter.keeps_fp32(name)) for name, dtype in seen.items()}
with open(f"{sys.argv[4]}/rank{rank}.json", "w") as f:
    json.dump(report, f)
del model
command.shutdown()  # FSDP2 models collected before the group goes, as the trainer does
'''


def test_bf16_fsdp_computes_what_ddp_computes(tiny_models, wan_models, tmp_path):
    result = run_worker(WORKER, tmp_path, tiny_models("5b"), wan_models("t2v"), tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # CogVideoX-5B's rotary tables; Wan's too, and its fp32 modules
        for family in ("cogvideox", "wan", "cogvideox_dora", "cogvideox_lokr"):
            (ddp_loss, ddp_norm), (fsdp_loss, fsdp_norm) = report[family]["ddp"], report[family]["fsdp"]
            assert abs(fsdp_loss - ddp_loss) <= 1e-5 * abs(ddp_loss), (family, rank, ddp_loss, fsdp_loss)
            assert abs(fsdp_norm - ddp_norm) <= 1e-5 * abs(ddp_norm), (family, rank, ddp_norm, fsdp_norm)
        for variant, parts in (("dora", "lora_magnitude_vector"), ("lokr", "lokr_w2_b")):
            state = report[f"{variant}_state"]
            assert state["equal"] and state["keys"] == state["ema"], state
            assert any(key.endswith(parts) for key in state["keys"])
        sft = report["wan_sft"]
        assert {dtype for dtype, fp32 in sft.values() if fp32} == {"torch.float32"}, sft
        assert {dtype for dtype, fp32 in sft.values() if not fp32} == {"torch.bfloat16"}, sft
        assert any(name.endswith("scale_shift_table") for name in sft) and any(
            "time_embedder" in n for n in sft
        )
