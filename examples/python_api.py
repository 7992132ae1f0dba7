# LongStraw from Python: one GRPO step on a tiny random hybrid model, end to end, on a CPU in seconds.
#   python examples/python_api.py [OUT_DIR]
# For a real model, load a checkpoint instead of building one:
#   model = longstraw.load_model("path/to/hf-checkpoint", dtype="bfloat16", device="cuda")
#   tok = longstraw.tokenizer.load_tokenizer("path/to/hf-checkpoint")  # after import longstraw.tokenizer
import sys

import torch

import longstraw
from longstraw.models.qwen_hybrid import tiny_config
from longstraw.rl.rewards import make_reward
from longstraw.rl.trainer import init_weights
from longstraw.tokenizer import ByteTokenizer

torch.manual_seed(0)
tok = ByteTokenizer()  # bytes 0-255 + BOS/EOS/PAD: no downloads
model = longstraw.build_model(tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=2048))
init_weights(model, seed=0)  # HF-style normal(0, 0.02) init, as the trainer's built-in models
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
cfg = longstraw.GRPOConfig(prompt_grad="exact", loss_agg_mode="token-mean", clip_ratio_low=0.2,
                           clip_ratio_high=0.2, clip_ratio_c=3.0, kl_coef=0.0, entropy_coef=0.0,
                           prefill_chunk=256, branch_batch=1, checkpoint_layers=False)

prompt_ids = torch.tensor(tok.encode("The pass key is 42. Remember it. " * 10 + "The pass key is "))
eos = tok.eos_token_id
rollout = longstraw.generate(model, prompt_ids, 8, longstraw.SamplingConfig(temperature=1.0, max_new_tokens=4,
                             stop_token_ids=(eos,), seed=0), keep_state=True, exact_state=True,
                             prefill_chunk=cfg.prefill_chunk)
reward = make_reward("digits_shaped")  # shaped: a random model earns partial credit, so the group's rewards differ
rewards = [reward(tok.decode(r.tolist()), "42") for r in rollout.responses]
adv = longstraw.group_advantages(rewards, norm_by_std=True)
stats = longstraw.grpo_backward(model, prompt_ids, rollout.responses, adv, cfg,
                                old_logprobs=rollout.logprobs, prompt_state=rollout.prompt_state)
grads = longstraw.hf_grads(model)  # gradients under transformers' parameter names
optimizer.step()
grad_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
print(f"prompt {prompt_ids.numel()} tokens, rewards {[round(r, 2) for r in rewards]}, loss {stats.loss:.4f}, "
      f"gradient norm {grad_norm:.4f}, prompt state {stats.prompt_state_bytes:,} bytes")

logps = longstraw.score(model, prompt_ids, rollout.responses, cfg)  # fp32 per-token log-probs, prompt run once
out = sys.argv[1] if len(sys.argv) > 1 else "out/python-api"
longstraw.save_model(model, out)  # an HF directory transformers/vLLM load
tok.save(out)
print(f"scored {len(logps)} responses (mean log-prob {torch.cat(logps).mean():.3f}); saved the model to {out}")
