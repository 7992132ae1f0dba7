"""Sharded loading: the tiny checkpoints, and the scenarios each rank of a load job runs (load_worker.py).

Checkpoints (float64, vocabulary ``cp_scenarios.V``): a dense Llama with tied embeddings, the Qwen3.5 hybrid
(DeltaNet + attention) rewritten to the multimodal layout (``model.language_model.`` names, a vision tensor and
an MTP tensor that are skipped), and a DeepSeek-V3 MoE (MLA; experts stored per expert, fused in memory:
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``). Sizes are chosen so that dim 0 of many parameters does not
divide by 4 (uneven shards; 4 ranks split 6 rows, the KV projections and the 6 experts, as 2, 2, 2 and none).
``save_big``: a float32 Llama of 42.7M parameters for the memory figures.
"""

from __future__ import annotations

from pathlib import Path

import torch
from cp_scenarios import V, grpo_two_groups
from safetensors.torch import load_file, save_file

import longstraw
from longstraw.distributed.fsdp import local_rows

FAMILIES = ("llama_tied", "hybrid", "deepseek_v3")
_MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=3,
            first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7)
_MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=10)


def save_checkpoints() -> dict[str, Path]:
    """The three float64 tiny checkpoints, each in a fresh temp dir."""
    from hf_reference import save_tiny, tiny_hf
    from transformers import DeepseekV3Config, LlamaConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    llama = LlamaConfig(hidden_size=42, intermediate_size=50, num_hidden_layers=2, num_attention_heads=7,
                        num_key_value_heads=1, head_dim=6, vocab_size=V, max_position_embeddings=512,
                        rope_theta=1000.0, tie_word_embeddings=True)
    hybrid = Qwen3_5TextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8, vocab_size=V, max_position_embeddings=512,
                               num_hidden_layers=3, intermediate_size=50, full_attention_interval=2)
    v3 = DeepseekV3Config(**_MOE, **_MLA)
    v3._experts_implementation = "eager"
    out = {"llama_tied": save_tiny(tiny_hf(llama, seed=71, init_std=0.15)),
           "hybrid": save_tiny(tiny_hf(hybrid, seed=72, init_std=0.15))}
    hf = tiny_hf(v3, seed=73, init_std=0.15)
    with torch.no_grad():  # the router's correction bias is a zero buffer: make it matter
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3), dtype=b.dtype) * 0.3)
    out["deepseek_v3"] = save_tiny(hf)
    f = out["hybrid"] / "model.safetensors"  # the multimodal checkpoints' layout
    sd = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: t
          for n, t in load_file(f).items()}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3, dtype=torch.float64)
    sd["mtp.fc.weight"] = torch.zeros(4, 4, dtype=torch.float64)
    save_file(sd, f, metadata={"format": "pt"})
    assert not (out["hybrid"] / "model.safetensors.index.json").exists()
    return out


BIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
       "intermediate_size": 2816, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8,
       "head_dim": 128, "vocab_size": 2048, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
       "hidden_act": "silu", "dtype": "float32"}


def save_big(path: Path) -> Path:
    """A float32 Llama of 42.7M parameters (163 MiB): 3 decoder layers of 12.8M, embedding and head 2.1M each."""
    model = longstraw.build_model(BIG)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    longstraw.save_model(model, path)
    return path


# ---------------------------------------------------------------------------------------------------- rank side

def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


def _reset_peak() -> bool:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if local_rows(p) is not None else p


def memory(paths) -> dict:
    """Peak resident memory of load_model on this rank (VmHWM after minus VmRSS before, the peak reset first),
    against this rank's shard (its local parameter bytes), the largest of its local tensors (the largest read
    it makes) and the checkpoint's size. What a process pays once, whatever it loads, is paid before the reset:
    the imports of FSDP2/DTensor and of torch._dynamo (which building any model on meta pulls in: nn.init on meta
    tensors runs through torch._refs)."""
    import torch.distributed.fsdp  # noqa: F401  (FSDP2 and DTensor: imported once per process, not measured)
    import torch.distributed.tensor  # noqa: F401

    from longstraw.models import registry

    path = Path(paths["big"])
    with torch.device("meta"):  # nn.init on meta tensors imports torch._dynamo (~76 MiB, once): not measured
        registry.build_model(BIG)
    reset = _reset_peak()
    before = _status()
    model = longstraw.load_model(path)
    after = _status()
    local = [_local(p) for p in model.parameters()]
    return {"reset": reset, "rss_before": before["VmRSS"], "hwm_before": before["VmHWM"], "hwm": after["VmHWM"],
            "rss_after": after["VmRSS"], "rss_file_after": after.get("RssFile", 0),
            "peak": after["VmHWM"] - before["VmRSS"],
            "shard": sum(t.numel() * t.element_size() for t in local),
            "largest": max(t.numel() * t.element_size() for t in local),
            "sharded": sum(local_rows(p) is not None for p in model.parameters()),
            "checkpoint": (path / "model.safetensors").stat().st_size}


def shards(paths) -> dict:
    """Every parameter's rows on this rank (None: whole), its local tensor and full shape, per family; and every
    read load_model made from the checkpoint files (``__reads__``: (tensor name, rows))."""
    from longstraw.checkpoint import hf

    from longstraw import distributed
    from longstraw.models import registry

    with torch.device("meta"):  # what load_model starts from: FSDP2 applied on meta keeps the parameters there
        meta = distributed.parallelize(registry.build_model(hf.read_config(paths["deepseek_v3"])))
    every = list(meta.parameters())
    out = {"__reads__": {}, "__meta__": (len(every), sum(p.is_meta and local_rows(p) is not None for p in every))}
    real = hf._SafetensorsReader.read
    for fam in FAMILIES:
        reads = out["__reads__"][fam] = []

        def read(self, name, rows=None, reads=reads):
            reads.append((name, rows))
            return real(self, name, rows)

        hf._SafetensorsReader.read = read
        try:
            model = longstraw.load_model(paths[fam])
        finally:
            hf._SafetensorsReader.read = real
        out[fam] = {n: (local_rows(p), _local(p).detach().clone(), tuple(p.shape))
                    for n, p in model.named_weights()}  # parameters and persistent buffers (read whole)
        out[fam]["__tied__"] = model.lm_head.weight is model.model.embed_tokens.weight
    return out


def masters(paths) -> dict:
    """load_model of a model computed in bf16 under FSDP: float32 master shards by default (the checkpoint's values
    read straight into them), bf16 shards with ``master_dtype=bfloat16``. Per variant: the parameters' dtypes and
    their full (gathered) tensors."""
    out = {}
    for name, master in (("default", None), ("bf16", "bfloat16")):
        model = longstraw.load_model(paths["llama_tied"], dtype="bfloat16", master_dtype=master)
        out[name] = {"dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                     "compute_dtype": str(model.compute_dtype),
                     "full": {n: p.full_tensor().detach() for n, p in model.named_parameters()}}
    return out


def too_large(paths) -> str:
    """The size check counts this rank's shard: the error names it (device memory patched to 1 KiB)."""
    from longstraw.checkpoint import hf

    real = hf.device_memory
    hf.device_memory = lambda device: (1024, "available memory (patched)")
    try:
        longstraw.load_model(paths["llama_tied"])
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        hf.device_memory = real


def meshes(paths) -> dict:
    """load_model under FSDP2 placements other than the job's (``apply_fsdp`` swapped for the scenario): ``hsdp``,
    only the decoder layers, over the 2-D ``(dp, cp)`` mesh, ``(Replicate(), Shard(0))``; ``world``, every parameter
    over all ranks of the job on a mesh of its own (the layers, then the root). Per
    variant and family: every parameter's rows, placements, local tensor, and its full tensor (gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from longstraw import distributed

    ctx = distributed.get_context()
    world_mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("all",))

    def hsdp(model, ctx, **_):
        for layer in model.layers:
            fully_shard(layer, mesh=ctx.mesh, reshard_after_forward=True)
        return model

    def whole_world(model, ctx, **_):
        for layer in model.layers:
            fully_shard(layer, mesh=world_mesh, reshard_after_forward=True)
        fully_shard(model, mesh=world_mesh, reshard_after_forward=True)
        return model

    out = {}
    real = distributed.apply_fsdp
    for variant, fn in (("hsdp", hsdp), ("world", whole_world)):
        out[variant] = {}
        distributed.apply_fsdp = fn
        try:
            for fam in FAMILIES:
                model = longstraw.load_model(paths[fam])
                out[variant][fam] = {
                    n: (local_rows(p), tuple(str(pl) for pl in getattr(p, "placements", ())),
                        _local(p).detach().clone(), (p.full_tensor() if local_rows(p) is not None else p).detach())
                    for n, p in model.named_parameters()}
                out[variant][fam]["__tied__"] = model.lm_head.weight is model.model.embed_tokens.weight
        finally:
            distributed.apply_fsdp = real
    return out


SCENARIOS = {
    "meshes": meshes,
    "memory": memory,
    "shards": shards,
    "too_large": too_large,
    "masters": masters,
    "grads_llama_tied": lambda p: grpo_two_groups(p, family="llama_tied", chunk=3),
    "grads_hybrid": lambda p: grpo_two_groups(p, family="hybrid", chunk=4),
    "grads_deepseek_v3": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=4),
}
