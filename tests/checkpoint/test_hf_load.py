"""load_model/save_model on bad input: stray weight files, damaged files, absurd sizes, devices; the tokenizer
travels with a saved model."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import longstraw
from longstraw.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer

CFG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 259,
       "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
       "hidden_act": "silu"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "model"
    torch.manual_seed(0)
    m = longstraw.build_model(CFG)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    longstraw.save_model(m, d)
    ByteTokenizer().save(d)
    return d


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _same(model, sd):
    return torch.equal(model.model.embed_tokens.weight, sd["model.embed_tokens.weight"])


def test_a_stray_safetensors_file_is_not_read_as_weights(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in sd.items()}, d / "weights_grad.safetensors")  # same names
    assert _same(longstraw.load_model(d), sd)


def test_only_other_safetensors_files_is_an_error_naming_what_is_expected(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    (d / "model.safetensors").rename(d / "weights.safetensors")
    with pytest.raises(ValueError, match=r"has no model.safetensors and no model.safetensors.index.json; it holds "
                                         r"only weights.safetensors, which are not read"):
        longstraw.load_model(d)


def test_shards_come_from_the_index_only(ckpt, tmp_path):
    m = longstraw.load_model(ckpt)
    d = tmp_path / "sharded"
    longstraw.save_model(m, d, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sd = load_file(ckpt / "model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in sd.items()}, d / "model_grads.safetensors")
    assert _same(longstraw.load_model(d), sd)
    # save_model replaces its own shards but leaves the stray file alone
    longstraw.save_model(m, d)
    assert (d / "model_grads.safetensors").exists() and not (d / "model.safetensors.index.json").exists()
    assert not list(d.glob("model-*.safetensors"))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "tiny"])
def test_a_damaged_weights_file_is_one_error_naming_it(ckpt, tmp_path, damage):
    d = _copy(ckpt, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "tiny": b"abc"}[damage])
    with pytest.raises(ValueError, match=r"model.safetensors: cannot read the weights, the file is damaged or "
                                         r"truncated \(SafetensorError"):
        longstraw.load_model(d)


def test_absurd_sizes_are_refused_before_allocating(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 10**12
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"the model's 64,000,[\d,]+ parameters need .*TiB on cpu, more than its "
                                         r"available memory \(MemAvailable\) of .*iB"):
        longstraw.load_model(d)


def test_an_allocation_failure_is_a_value_error(ckpt, monkeypatch):
    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to_empty", oom)
    with pytest.raises(ValueError, match=r"cannot allocate the model's .* on cpu: CUDA out of memory"):
        longstraw.load_model(ckpt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_is_a_value_error(ckpt):
    with pytest.raises(ValueError, match=r"device='cuda': this torch build has no CUDA|device='cuda': no CUDA"):
        longstraw.load_model(ckpt, device="cuda")
    with pytest.raises(ValueError, match=r"device='tpu' is not a device name"):
        longstraw.load_model(ckpt, device="tpu")


def test_save_model_writes_the_tokenizer_of_the_loaded_checkpoint(ckpt, tmp_path):
    m = longstraw.load_model(ckpt)
    assert m.source_dir == ckpt
    longstraw.save_model(m, tmp_path / "out")
    assert (tmp_path / "out" / BYTE_TOKENIZER_FILE).read_bytes() == (ckpt / BYTE_TOKENIZER_FILE).read_bytes()
    longstraw.save_model(m, ckpt)  # into its own directory: nothing to copy, nothing lost
    assert (ckpt / BYTE_TOKENIZER_FILE).is_file()
    fresh = longstraw.build_model(CFG)  # not loaded from anywhere: no tokenizer to write
    longstraw.save_model(fresh, tmp_path / "fresh")
    assert not (tmp_path / "fresh" / BYTE_TOKENIZER_FILE).exists()


def test_save_model_copies_hf_tokenizer_files(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    (d / BYTE_TOKENIZER_FILE).unlink()
    files = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
             "vocab.json": "{}", "merges.txt": "#\n", "chat_template.jinja": "{{ x }}"}
    for n, text in files.items():
        (d / n).write_text(text)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool.jinja").write_text("t")
    (d / "notes.txt").write_text("not a tokenizer file")
    longstraw.save_model(longstraw.load_model(d), tmp_path / "out")
    for n, text in files.items():
        assert (tmp_path / "out" / n).read_text() == text
    assert (tmp_path / "out" / "additional_chat_templates" / "tool.jinja").read_text() == "t"
    assert not (tmp_path / "out" / "notes.txt").exists()


def test_weights_false_allocates_without_reading_tensor_data(ckpt, monkeypatch):
    """load_model(weights=False) checks the files' headers and allocates the model, reading no tensor data (the
    trainer then fills every weight from a sharded checkpoint); the same load with weights reads them all."""
    from longstraw.checkpoint import hf

    reads = []
    real = hf._SafetensorsReader.read
    monkeypatch.setattr(hf._SafetensorsReader, "read", lambda self, name, rows=None: reads.append(name) or
                        real(self, name, rows))
    m = longstraw.load_model(ckpt, weights=False)
    assert reads == [] and m.model.embed_tokens.weight.shape == (259, 32)
    assert _same(longstraw.load_model(ckpt), load_file(ckpt / "model.safetensors")) and len(reads) > 0


MLA_MOE = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
           "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
           "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
           "vocab_size": 300, "max_position_embeddings": 8192}


def test_save_model_dtype_writes_float32_masters_in_the_compute_dtype(tmp_path):
    """save_model(dtype="bfloat16") of a model held in float32 (master weights): every parameter written in bf16,
    each the master rounded; the router's e_score_correction_bias (a buffer transformers keeps float32) as held;
    config.json names the dtype; the export loads back in bf16 with those values. Bad dtypes are one line."""
    torch.manual_seed(0)
    m = longstraw.build_model(MLA_MOE)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
        for b in m.buffers():
            if b.is_floating_point() and b.dim() == 1 and b.numel() == 4:
                b.normal_(0, 0.1)  # the router biases: values bf16 would round
    longstraw.save_model(m, tmp_path / "f32")
    longstraw.save_model(m, tmp_path / "bf16", dtype="bfloat16")
    full, half = load_file(tmp_path / "f32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert full.keys() == half.keys()
    bias = [k for k in half if k.endswith("e_score_correction_bias")]
    assert bias and all(half[k].dtype == torch.float32 and torch.equal(half[k], full[k]) for k in bias)
    for k in set(half) - set(bias):
        assert full[k].dtype == torch.float32 and half[k].dtype == torch.bfloat16, k
        assert torch.equal(half[k], full[k].to(torch.bfloat16)), k
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    back = longstraw.load_model(tmp_path / "bf16")
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(back.model.embed_tokens.weight, half["model.embed_tokens.weight"])
    for bad in ("int8", torch.int64):
        with pytest.raises(ValueError, match=r"save_model dtype"):
            longstraw.save_model(m, tmp_path / "bad", dtype=bad)
    assert not (tmp_path / "bad").exists()
