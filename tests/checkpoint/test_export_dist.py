"""``longstraw.save_model`` on an FSDP2-sharded model (3 gloo ranks: uneven shards), without gathering the model on
one rank: every rank writes its own files of whole tensors, rank 0 the index; the export loads in transformers with
the sharded model's logits, and in LongStraw with its weights. Families: a Qwen3 model with tied embeddings and the
Qwen3.5 MoE hybrid (fused experts written as per-expert tensors). A write that fails on one rank is the same
one-line error on every rank. LoRA: adapters added by ``load_model(lora=...)`` before sharding, exported merged
(transformers reads it) and as a PEFT adapter (PEFT applies it to the source model) from the shards."""

import json
from pathlib import Path

import pytest
import torch
from dist_launch import launch
from hf_reference import save_tiny, tiny_hf, true_float64
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

import longstraw

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
WORKER = Path(__file__).with_name("export_worker.py")
V = 96


def _configs():
    qwen3 = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=12, vocab_size=V, max_position_embeddings=256,
                        tie_word_embeddings=True)
    moe = Qwen3_5MoeTextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8, vocab_size=V, max_position_embeddings=256,
                               full_attention_interval=3, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, shared_expert_intermediate_size=24)
    return {"qwen3": qwen3, "qwen3_5_moe_text": moe}


def test_sharded_export_loads_in_transformers_and_longstraw(tmp_path):
    models = {name: str(save_tiny(tiny_hf(cfg, seed=7 + i, init_std=0.15)))
              for i, (name, cfg) in enumerate(_configs().items())}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"models": models, "out": str(tmp_path), "max_shard_size": 20_000,
                                "fail_rank": 2}))
    ranks = launch(3, [str(WORKER), str(spec)], timeout_s=400)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-3000:] for r in ranks]
    for name in models:
        out = tmp_path / name
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert files == sorted(f.name for f in out.glob("*.safetensors"))
        written = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text())["files"] for r in range(3)]
        assert all(written) and sorted(sum(written, [])) == files  # every rank wrote its own, disjoint files
        if name == "qwen3_5_moe_text":  # fused experts exported as transformers' per-expert tensors
            assert any(k.endswith("mlp.experts.3.down_proj.weight") for k in index["weight_map"])
        for f in files:  # whole tensors: each one's shape is the parameter's
            with safe_open(str(out / f), framework="pt") as h:
                assert h.metadata() == {"format": "pt"} and len(list(h.keys())) > 0
        got = torch.load(tmp_path / f"{name}.logits.pt", weights_only=True)
        with torch.no_grad(), true_float64():
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64,
                                                      experts_implementation="eager").eval()
            ref = hf(got["ids"]).logits
        err = (ref - got["logits"]).abs().max().item()
        assert err <= 1e-10 * ref.abs().max().item(), (name, err)
        ours = longstraw.load_model(out)
        with torch.no_grad():
            assert torch.allclose(ours(got["ids"]), got["logits"], rtol=0, atol=1e-12)
        # LoRA from the shards: the merged export is a plain checkpoint with the adapted logits, and the adapter
        # applied by PEFT to the source model gives them too
        import peft

        got = torch.load(tmp_path / f"{name}-lora.logits.pt", weights_only=True)
        with torch.no_grad(), true_float64():
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-merged", dtype=torch.float64,
                                                          experts_implementation="eager").eval()
            base = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float64,
                                                        experts_implementation="eager").eval()
            plain = base(got["ids"]).logits  # the adapters change the logits: the checks below are not vacuous
            assert (plain - got["logits"]).abs().max() > 1e-3
            adapted = peft.PeftModel.from_pretrained(base, tmp_path / f"{name}-adapter").eval()
            for hf_model in (merged, adapted):
                ref = hf_model(got["ids"]).logits
                err = (ref - got["logits"]).abs().max().item()
                assert err <= 1e-10 * ref.abs().max().item(), (name, err)
    # rank 2 could not write: every rank raised the same one-line error (none was left waiting in a gather)
    failed = [(tmp_path / f"failed.rank{r}.txt").read_text() for r in range(3)]
    assert len(set(failed)) == 1 and failed[0].startswith("JobError: rank 2: "), failed
    assert failed[0].endswith(": No space left on device") and "\n" not in failed[0]
    assert not (tmp_path / "failed" / "model.safetensors.index.json").exists()
