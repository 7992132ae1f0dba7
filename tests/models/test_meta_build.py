"""Building a model on the meta device (what loading and the planner start from) draws no random init and so
never imports ``torch._dynamo``: ``normal_``'s and ``log``'s meta kernels would, adding ~70 MiB to every rank's
resident memory inside the first ``load_model`` (the sharded-loading acceptance measures that memory)."""

import json
import subprocess
import sys

import pytest

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=256),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                       max_position_embeddings=256, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, full_attention_interval=2),
}

SCRIPT = """
import json, sys
from longstraw.models.registry import build_on_meta
m = build_on_meta(json.loads(sys.argv[1]))
assert all(p.is_meta for p in m.parameters())
print("dynamo" if "torch._dynamo" in sys.modules else "clean")
"""


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_meta_build_imports_no_dynamo(name):
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CONFIGS[name])], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"
