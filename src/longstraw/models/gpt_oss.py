"""GPT-OSS (``gpt_oss``: gpt-oss-20b, gpt-oss-120b): GQA attention with sinks and alternating sliding windows, and
a mixture of biased experts with a clamped SwiGLU.

As transformers' ``modeling_gpt_oss`` computes it:

* attention: q/k/v/o with biases (``attention_bias``, on in the released configs), RoPE (YaRN with ``truncate:
  false`` in the released configs; theta 150000 when unset), and per head a learned *sink* logit
  (``self_attn.sinks [H]``) that joins every query's softmax with a zero value
  (``segment_attention(sinks=)``). ``layer_types`` (default: even layers ``sliding_attention``, odd ones
  ``full_attention``) give the layers whose keys are limited to a ``sliding_window`` (128 released);
* feed-forward: the router ``mlp.router`` (``weight [E, H]`` and ``bias [E]``) keeps the top ``num_experts_per_tok``
  logits and softmaxes those (:func:`~longstraw.ops.moe.topk_softmax_route`); the experts keep transformers'
  in-memory layout, which is also the checkpoints': ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up
  interleaved (gate at even columns), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias
  [E, H]``, and ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``, ``g = clamp(gate, max=limit)``
  (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7);
* RMSNorms multiply by their weight in float32 before casting back (transformers keeps them in float32 in fp16
  models, and so do we: ``models.keep_fp32``).

Names and layouts are transformers' own, so saving and ``hf_grads`` need no mapping. The released checkpoints
store the experts in MXFP4 (``quantization_config: {quant_method: mxfp4}``; ``mlp.experts.gate_up_proj_blocks
[E, 2I, H/32, 16]`` / ``_scales [E, 2I, H/32]``, ``down_proj_blocks`` / ``_scales`` likewise): :class:`GptOssWeightMap`
dequantises them expert by expert as they load (:mod:`longstraw.ops.mxfp4`), into the layout above, and the model
trains in its dtype; ``save_model`` writes the dequantised weights and a config without the quantisation.

LoRA: the attention projections (``target_modules``) and the routed experts (``target_parameters``, PEFT's
``ParamWrapper`` layout on the ``[E, in, out]`` weights). Not supported (each refused with a ValueError): other
quantisations, expert parallelism, and context parallelism (attention sinks; and past the sliding window). Left out
as for every family: the auxiliary load-balancing loss.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from longstraw.models.attention import Attention
from longstraw.models.config import ConfigReader, interleaved_windows, narrowest_window, num_routed_experts
from longstraw.models.family import Family
from longstraw.models.keep_fp32 import keep_in_float32
from longstraw.models.lora import expert_lora
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import CheckpointReader, Rows, WeightMap, WeightSource
from longstraw.ops.moe import ExpertForm, clamped_swiglu, experts_forward, topk_softmax_route
from longstraw.ops.mxfp4 import dequantize_mxfp4

MODEL_TYPES = ("gpt_oss",)
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}  # transformers' default for gpt_oss


class GptOssRouter(nn.Module):
    """``mlp.router``: logits ``x @ weight.T + bias`` in x's dtype, top k, softmax over the k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={num_experts}")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x ``[N, H]`` -> (weights ``[N, k]`` in x's dtype, expert ids ``[N, k]``)."""
        return topk_softmax_route(nn.functional.linear(x, self.weight, self.bias), self.top_k)


class GptOssExperts(nn.Module):
    """``mlp.experts``: ``E`` biased experts in transformers' layout (module docstring), applied as ``x @ W``
    (``transposed``: LoRA's ``target_parameters`` adapters take ``in = H`` / ``out = 2I`` for ``gate_up_proj``, as
    PEFT's ``ParamWrapper`` does for transformers' ``is_transposed`` experts). Expert parallelism splits the four
    tensors by expert (``ep_tensor_names``, ``distributed.expert_parallel``)."""

    transposed = True
    ep_tensor_names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def __init__(self, hidden: int, num_experts: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.num_experts, self.intermediate, self.alpha, self.limit = num_experts, intermediate, alpha, limit
        self.hidden = hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate).normal_(0, 0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden).normal_(0, 0.02))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self._glu = clamped_swiglu(alpha, limit)

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """x ``[N, H]``, expert_ids / weights ``[N, k]`` -> ``[N, H]``."""
        return self.local_experts(x, expert_ids, weights, [getattr(self, n) for n in self.ep_tensor_names],
                                  expert_lora(self))

    def local_experts(self, x: Tensor, expert_ids: Tensor, weights: Tensor, tensors: list[Tensor],
                      lora: dict | None) -> Tensor:
        """The experts' computation with the given ``tensors`` (``ep_tensor_names``' order: an expert-parallel rank
        passes its rows) and LoRA factors."""
        gate_up, gate_up_bias, down, down_bias = tensors
        form = ExpertForm(transposed=True, interleaved=True, gate_up_bias=gate_up_bias, down_bias=down_bias,
                          glu=self._glu)
        return experts_forward(x, expert_ids, weights, gate_up, down, form=form, lora=lora)


class GptOssMoE(nn.Module):
    """``mlp``: router + experts; ``forward(x [B, T, H]) -> [B, T, H]``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.router = GptOssRouter(hidden, num_experts, top_k)
        self.experts = GptOssExperts(hidden, num_experts, intermediate, alpha, limit)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)
        return self.experts(flat, ids, weights).reshape(x.shape)

    def flops_per_token(self) -> float:
        e = self.experts
        hidden = e.gate_up_proj.shape[1]
        return 2.0 * self.router.top_k * 3 * hidden * e.intermediate + 2.0 * hidden * e.num_experts


def _check_quantization(cfg: dict, r: ConfigReader) -> None:
    """MXFP4 (the released checkpoints) is dequantised on load; any other quantisation is refused."""
    q = cfg.get("quantization_config")
    if q:
        method = q.get("quant_method") if isinstance(q, dict) else q
        if method != "mxfp4":
            raise ValueError(f"{r.where}: quantization_config (quant_method={method!r}) is not supported for "
                             "gpt_oss: MXFP4 (the released checkpoints) is dequantised on load; dequantise other "
                             "formats first")


def _rope_config(cfg: dict) -> dict:
    """``cfg`` with transformers' gpt_oss defaults where it gives no RoPE settings: YaRN (``_YARN``), theta 150000."""
    out = dict(cfg)
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not rp:
        out["rope_parameters"] = {**_YARN, "rope_theta": cfg.get("rope_theta", 150000.0)}
    elif "rope_theta" not in rp and cfg.get("rope_theta") is None:
        out["rope_theta"] = 150000.0
    return out


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised model from an HF config dict."""
    r = ConfigReader(cfg)
    _check_quantization(cfg, r)
    hidden = r.positive("hidden_size")
    n = r.positive("num_hidden_layers")
    windows = interleaved_windows(cfg, r, n, full_every=2, default_window=128)  # even layers slide
    spec = ModelSpec(
        model_type=cfg["model_type"], vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=r.positive("max_position_embeddings", 131072),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool),
        eos_token_id=cfg.get("eos_token_id"), bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        sliding_window=narrowest_window(windows),
    )
    heads = r.positive("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads, int)
    head_dim = r.opt("head_dim", hidden // heads, int)
    eps = r.opt("rms_norm_eps", 1e-5, float)
    bias = r.opt("attention_bias", True, bool)
    key, experts = num_routed_experts(cfg, r, default=128)
    if experts < 1:
        raise ValueError(f"{r.where}: {key}={experts} must be >= 1")
    top_k = r.positive("num_experts_per_tok", 4)
    inter = r.positive("intermediate_size")
    alpha = r.opt("swiglu_alpha", 1.702, (int, float))
    limit = r.opt("swiglu_limit", 7.0, (int, float))
    if limit <= 0:
        raise ValueError(f"{r.where}: swiglu_limit={limit} must be > 0")
    layers = [
        DecoderLayer(
            Attention(hidden, heads, kv_heads, head_dim, qkv_bias=bias, o_bias=bias, norm_eps=eps, window=w,
                      sinks=True),
            GptOssMoE(hidden, experts, top_k, inter, float(alpha), float(limit)),
            _norm(hidden, eps),
            _norm(hidden, eps),
        )
        for w in windows
    ]
    rotary = RotaryEmbedding(rope_params_from_hf(_rope_config(cfg), head_dim))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, hidden, layers, _norm(hidden, eps), rotary))


def _norm(hidden: int, eps: float) -> RMSNorm:
    """GPT-OSS's RMSNorm: the weight applied in float32, and kept in float32 in fp16 models (transformers'
    ``_keep_in_fp32_modules``: the decoder norms and the final one; bf16 models keep it in bf16)."""
    return keep_in_float32(RMSNorm(hidden, eps, weight_in_float32=True), "weight", strict=False)


_PACKED = re.compile(r"(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)")


def _mxfp4_source(param: str, blocks: str, scales: str, reader: CheckpointReader) -> WeightSource:
    """Expert parameter ``param`` ``[E, 32 G, R]`` from MXFP4 ``blocks [E, R, G, 16]`` / ``scales [E, R, G]``:
    rows (experts) ``[a, b)`` read and dequantised one expert at a time, transposed to transformers' in-memory
    layout (bfloat16 without ``out``: every value is exact in it)."""
    bshape, sshape = tuple(reader.shape(blocks)), tuple(reader.shape(scales))
    if len(bshape) != 4 or bshape[3] != 16 or bshape[:3] != sshape:
        raise ValueError(f"{param}: MXFP4 {blocks} {bshape} and {scales} {sshape} must be [E, R, G, 16] and "
                         "[E, R, G]")
    e, rows_out, g = sshape
    shape = (e, 32 * g, rows_out)

    def read(rows: Rows, out: torch.Tensor | None) -> torch.Tensor:
        a, b = rows if rows is not None else (0, e)
        if out is None:
            out = torch.empty((b - a, *shape[1:]), dtype=torch.bfloat16)
        for i in range(a, b):
            deq = dequantize_mxfp4(reader.read(blocks, (i, i + 1))[0], reader.read(scales, (i, i + 1))[0])
            out[i - a].copy_(deq.T)  # [R, 32 G] -> [32 G, R]
            del deq
        return out

    return WeightSource(param, shape, read)


class GptOssWeightMap(WeightMap):
    """Transformers' names as they are; MXFP4 expert pairs (``<param>_blocks`` + ``<param>_scales``) dequantised into
    ``<param>`` (module docstring)."""

    def sources(self, ckpt_names: list[str], reader: CheckpointReader) -> list[WeightSource]:
        out, matched = self.partition(ckpt_names, reader, _PACKED)
        packed: dict[str, dict[str, str]] = {}
        for m, n in matched:
            packed.setdefault(m.group(1), {})[m.group(2)] = n
        for param, parts in packed.items():
            if set(parts) != {"blocks", "scales"}:
                have = next(iter(parts))
                raise ValueError(f"the checkpoint has {param}_{have} but not "
                                 f"{param}_{'scales' if have == 'blocks' else 'blocks'} (MXFP4 needs both)")
            out.append(_mxfp4_source(param, parts["blocks"], parts["scales"], reader))
        return out


def weights(cfg: dict) -> WeightMap:
    return GptOssWeightMap()


FAMILY = Family("gpt_oss", MODEL_TYPES, build, weights, quantizations=("mxfp4",))
