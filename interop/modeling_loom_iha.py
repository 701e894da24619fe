# coding=utf-8
"""Loom's decoder language model (MHA, local and Interleaved Head Attention layers) in PyTorch.

A readable, self-contained reference of what Loom's C++ forward computes
(worker/trainer/model.cc, plugins/attention/{common,mha,local,iha}), so that a model folder
exported by Loom (config.json + model.safetensors, or a sharded model.safetensors.index.json)
runs outside Loom:

    token embedding -> L x [h = x + attn(rmsnorm(x)); x = h + mlp(rmsnorm(h))]
                    -> rmsnorm -> LM head (tied to the embedding or not)

Layer kinds (config.json "loom_layers"): "mha" (global multi-head attention), "local"
(multi-head attention in a sliding window of W tokens) and "iha" (Interleaved Head Attention,
Duvvuri et al., arXiv:2602.21371; docs/iha.md).

Two ways to use it:

* Plain PyTorch (no transformers needed, no numpy needed):
      model = LoomIhaForCausalLM.from_pretrained("folder", dtype=torch.float32)
      logits = model(torch.tensor([[1, 2, 3]])).logits        # [B, N, V]
  The folder's safetensors are read by the small reader in this file.
* Hugging Face transformers, when importable:
      AutoModelForCausalLM.from_pretrained("folder", trust_remote_code=True)
  The same class names are then PretrainedConfig / PreTrainedModel subclasses.
  (Set LOOM_IHA_NO_TRANSFORMERS=1 to force the plain classes.)

Limits, on purpose:
* No KV cache. `use_cache` is ignored and `past_key_values` is always None: generation
  recomputes the whole prefix at every step (prepare_inputs_for_generation passes it all).
* The attention materialises its scores: [N, N] per head for MHA, [N*P, N*P] per head for IHA
  (P^2 times MHA's memory). This is a reference, not a fast kernel.
* Computation runs in the parameters' dtype; RoPE angles are computed in float64 and cast,
  as Loom does. Sequences longer than max_position_embeddings are refused, as Loom does.

Run as a script: python3 modeling_loom_iha.py FOLDER --tokens 1,2,3 [--dtype float64]
[--out logits.bin] prints the logits' shape and the argmax per position and can write the
logits as raw little-endian float32 / float64 bytes.
"""

import ctypes
import json
import math
import os
import struct
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------
# Optional transformers integration: the same class names, on HF base classes when available.
# ----------------------------------------------------------------------------------------------


def _import_transformers():
    """Returns the transformers pieces this file uses, or None (absent, unusable or disabled)."""
    if os.environ.get("LOOM_IHA_NO_TRANSFORMERS", "") not in ("", "0"):
        return None
    try:
        import transformers
        from transformers.utils import is_torch_available

        if not is_torch_available():  # transformers too new for this torch: plain classes
            return None
        from transformers import PretrainedConfig, PreTrainedModel
        from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

        try:
            from transformers import GenerationMixin
        except ImportError:  # transformers < 4.45: PreTrainedModel already generates
            GenerationMixin = None
        try:
            from transformers import initialization as hf_init  # transformers >= 5
        except ImportError:
            hf_init = None
        return {
            "module": transformers,
            "PretrainedConfig": PretrainedConfig,
            "PreTrainedModel": PreTrainedModel,
            "BaseModelOutputWithPast": BaseModelOutputWithPast,
            "CausalLMOutputWithPast": CausalLMOutputWithPast,
            "GenerationMixin": GenerationMixin,
            "init": hf_init,
        }
    except Exception:  # noqa: BLE001 - any failure to import means "use the plain classes"
        return None


_HF = _import_transformers()
HAS_TRANSFORMERS = _HF is not None


class _PlainConfigBase:
    """Stand-in for transformers.PretrainedConfig: keeps every extra field as an attribute."""

    def __init__(self, **kwargs):
        kwargs.setdefault("tie_word_embeddings", True)
        for key, value in kwargs.items():
            setattr(self, key, value)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """Builds the config from a dict (config.json's content), kwargs overriding."""
        merged = dict(config_dict)
        merged.update(kwargs)
        return cls(**merged)

    @classmethod
    def from_json_file(cls, path):
        """Reads a config.json."""
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: config.json must hold a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_pretrained(cls, folder, **kwargs):
        """Reads FOLDER/config.json."""
        config = cls.from_json_file(os.path.join(folder, "config.json"))
        for key, value in kwargs.items():
            setattr(config, key, value)
        return config

    def to_dict(self):
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out["model_type"] = self.model_type
        return out

    def __repr__(self):
        return f"{type(self).__name__} {json.dumps(self.to_dict(), indent=2, sort_keys=True)}"


class _PlainOutput:
    """Stand-in for transformers' ModelOutput: named fields, tuple access to the set ones."""

    _fields = ()

    def __init__(self, **kwargs):
        for name in self._fields:
            setattr(self, name, kwargs.pop(name, None))
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unknown fields {sorted(kwargs)}")

    def to_tuple(self):
        return tuple(getattr(self, n) for n in self._fields if getattr(self, n) is not None)

    def __getitem__(self, index):
        if isinstance(index, str):
            return getattr(self, index)
        return self.to_tuple()[index]


class _PlainBaseModelOutputWithPast(_PlainOutput):
    _fields = ("last_hidden_state", "past_key_values", "hidden_states", "attentions")


class _PlainCausalLMOutputWithPast(_PlainOutput):
    _fields = ("loss", "logits", "past_key_values", "hidden_states", "attentions")


class _PlainPreTrainedModel(nn.Module):
    """Stand-in for transformers.PreTrainedModel: keeps the config (weights are initialised by
    the modules' constructors, so post_init has nothing to do)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        self.config = config

    def post_init(self):
        pass


if HAS_TRANSFORMERS:
    _ConfigBase = _HF["PretrainedConfig"]
    _ModelBase = _HF["PreTrainedModel"]
    BaseModelOutputWithPast = _HF["BaseModelOutputWithPast"]
    CausalLMOutputWithPast = _HF["CausalLMOutputWithPast"]
    _LMBases = (_HF["GenerationMixin"],) if _HF["GenerationMixin"] is not None else ()
    _HF_MAJOR = int(str(_HF["module"].__version__).split(".")[0])
else:
    _ConfigBase = _PlainConfigBase
    _ModelBase = _PlainPreTrainedModel
    BaseModelOutputWithPast = _PlainBaseModelOutputWithPast
    CausalLMOutputWithPast = _PlainCausalLMOutputWithPast
    _LMBases = ()
    _HF_MAJOR = 0


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------

_LAYER_KINDS = ("mha", "local", "iha")
# Keys a loom_layers entry may carry. Kernel / initialisation / cache choices do not change the
# function the layer computes and are accepted and ignored; anything else is refused (Loom
# refuses unknown options too, plugins/attention/common/attention_common.cc PluginOptions::Finish).
_LAYER_KEYS = {
    "mha": {"kind", "window", "kernel"},
    "local": {"kind", "window", "kernel"},
    "iha": {"kind", "window", "p", "mask", "rope_phase", "score", "scale", "kernel", "init",
            "init_noise", "kv_cache"},
}


class LoomIhaConfig(_ConfigBase):
    """The fields of an exported Loom model's config.json (see the module docstring).

    loom_layers: one dict per layer, {"kind": "mha" | "local" | "iha", "window": W, ...};
    None means every layer is global "mha" (Loom's default schedule). IHA layers add
    p (pseudo-heads per head, default H), mask ("interleaved" | "block"), rope_phase
    ("interleaved" | "token"), score ("softmax" | "linear") and scale (0 = 1/sqrt(head_dim)).
    """

    model_type = "loom_iha"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 256,
        num_attention_heads: int = 4,
        head_dim: Optional[int] = None,
        intermediate_size: Optional[int] = None,
        hidden_act: str = "gelu",
        mlp_gated: Optional[bool] = None,
        num_hidden_layers: int = 2,
        max_position_embeddings: int = 1024,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        attention_bias: bool = False,
        loom_layers: Optional[List[dict]] = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.intermediate_size = (intermediate_size if intermediate_size is not None
                                  else 4 * hidden_size)
        self.hidden_act = hidden_act
        self.mlp_gated = (hidden_act == "silu") if mlp_gated is None else mlp_gated
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.loom_layers = loom_layers
        self.initializer_range = initializer_range
        kwargs.pop("use_cache", None)  # there is no cache (module docstring)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = False


def _field_error(field: str, why: str) -> ValueError:
    return ValueError(f"config.json: {field}: {why}")


def _check_int(value, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field_error(field, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _check_number(value, field: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise _field_error(field, f"must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def _check_bool(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise _field_error(field, f"must be true or false, got {value!r}")
    return value


def _check_choice(value, field: str, choices) -> str:
    if value not in choices:
        raise _field_error(field, f"{value!r} is not one of {' | '.join(choices)}")
    return value


def validate_config(config) -> List[dict]:
    """Checks the config (ValueError naming the field) and returns the resolved layer specs."""
    c = config
    _check_int(c.vocab_size, "vocab_size", 1)
    _check_int(c.hidden_size, "hidden_size", 1)
    _check_int(c.num_attention_heads, "num_attention_heads", 1)
    _check_int(c.head_dim, "head_dim", 1)
    _check_int(c.intermediate_size, "intermediate_size", 1)
    _check_int(c.num_hidden_layers, "num_hidden_layers", 1)
    _check_int(c.max_position_embeddings, "max_position_embeddings", 1)
    theta = _check_number(c.rope_theta, "rope_theta", 0.0)
    _check_number(c.rms_norm_eps, "rms_norm_eps", 0.0)
    _check_bool(c.tie_word_embeddings, "tie_word_embeddings")
    _check_bool(c.attention_bias, "attention_bias")
    _check_choice(c.hidden_act, "hidden_act", ("silu", "gelu"))
    _check_bool(c.mlp_gated, "mlp_gated")
    if c.mlp_gated != (c.hidden_act == "silu"):
        raise _field_error("mlp_gated", "Loom's FFN is SwiGLU (hidden_act 'silu', mlp_gated true) "
                           "or GELU (hidden_act 'gelu', mlp_gated false), got hidden_act "
                           f"{c.hidden_act!r} with mlp_gated {c.mlp_gated!r}")
    kv_heads = getattr(c, "num_key_value_heads", None)
    if kv_heads is not None and kv_heads != c.num_attention_heads:
        raise _field_error("num_key_value_heads", f"Loom layers have one key/value head per "
                           f"query head ({c.num_attention_heads}), got {kv_heads!r}")
    if getattr(c, "rope_scaling", None) is not None:
        raise _field_error("rope_scaling", "Loom's RoPE has no scaling; must be null")
    if theta > 0 and c.head_dim % 2 != 0:
        raise _field_error("head_dim", f"must be even when RoPE is on, got {c.head_dim}")

    layers = c.loom_layers
    if layers is None:
        layers = [{"kind": "mha", "window": 0}] * c.num_hidden_layers
    if not isinstance(layers, list) or len(layers) != c.num_hidden_layers:
        raise _field_error("loom_layers", f"must be a list of num_hidden_layers = "
                           f"{c.num_hidden_layers} entries")
    resolved = []
    for i, layer in enumerate(layers):
        where = f"loom_layers[{i}]"
        if not isinstance(layer, dict):
            raise _field_error(where, "must be an object")
        kind = layer.get("kind")
        if kind not in _LAYER_KINDS:
            raise _field_error(f"{where}.kind", f"unknown layer kind {kind!r} "
                               f"(known: {', '.join(_LAYER_KINDS)})")
        for key in layer:
            if key not in _LAYER_KEYS[kind]:
                raise _field_error(f"{where}.{key}", f"unknown field for a {kind!r} layer")
        window = _check_int(layer.get("window", 0), f"{where}.window", 0)
        spec = {"kind": kind, "window": window}
        if kind == "mha" and window != 0:
            raise _field_error(f"{where}.window", "global attention takes no window (use 'local')")
        if kind == "local" and window <= 0:
            raise _field_error(f"{where}.window", "must be > 0 for a 'local' layer")
        if kind == "iha":
            spec["p"] = _check_int(layer.get("p", c.num_attention_heads), f"{where}.p", 1)
            if spec["p"] > 256:  # Loom's option range (iha_attention.cc)
                raise _field_error(f"{where}.p", f"must be in [1, 256], got {spec['p']}")
            spec["mask"] = _check_choice(layer.get("mask", "interleaved"), f"{where}.mask",
                                         ("interleaved", "block"))  # 'none' would see the future
            spec["rope_phase"] = _check_choice(layer.get("rope_phase", "interleaved"),
                                               f"{where}.rope_phase", ("interleaved", "token"))
            spec["score"] = _check_choice(layer.get("score", "softmax"), f"{where}.score",
                                          ("softmax", "linear"))
            spec["scale"] = _check_number(layer.get("scale", 0.0), f"{where}.scale", 0.0)
        resolved.append(spec)
    return resolved


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class LoomIhaRMSNorm(nn.Module):
    """RMSNorm: x * rsqrt(mean(x^2, last dim) + eps) * weight (model.cc RMSNormImpl::forward)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LoomIhaMLP(nn.Module):
    """Feed-forward: down(silu(gate(x)) * up(x)) when gated (SwiGLU), else down(gelu(up(x)))
    with the exact (erf) GELU. No biases (model.cc FeedForwardImpl)."""

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool):
        super().__init__()
        self.gated = gated
        if gated:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class LoomIhaRotaryEmbedding(nn.Module):
    """Rotary position embedding as Loom's ApplyRope (plugins/attention/kernels/rope.cc): rotate-half pairing
    (dimension i with i + d/2), frequencies theta^(-2i/d), angles pos * freq computed in
    float64, then cos / sin cast to x's dtype. No parameters."""

    def __init__(self, theta: float):
        super().__init__()
        self.theta = float(theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, H, L, d]; positions: int64 [B or 1, L]. Returns x rotated."""
        d = x.size(-1)
        half = d // 2
        i = torch.arange(0, half, dtype=torch.float64, device=x.device)
        inv_freq = torch.pow(self.theta, -i * 2.0 / float(d))  # as Loom: (-i * 2) / d
        angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [B|1, L, d/2]
        cos = angles.cos().unsqueeze(1).to(x.dtype)  # [B|1, 1, L, d/2]
        sin = angles.sin().unsqueeze(1).to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed keys (masked scores -inf, as Loom). A row with no allowed key
    (a padding query under left padding) gets all-zero weights instead of NaN."""
    weights = torch.softmax(scores.masked_fill(allowed.logical_not(), float("-inf")), dim=-1)
    return torch.where(allowed.any(dim=-1, keepdim=True), weights, torch.zeros_like(weights))


class LoomIhaMultiHeadAttention(nn.Module):
    """Multi-head attention ('mha', window 0) or sliding-window attention ('local', window W):
    q/k/v projections, RoPE on q and k at the token positions, causal mask by sequence index
    (key n' <= query n, and |n - n'| < W when W > 0), softmax(q k^T / sqrt(d)) v, o_proj.
    Materialises the [N, N] scores per head (plugins/attention/mha/mha_attention.cc)."""

    def __init__(self, config, window: int):
        super().__init__()
        h, d, dm, bias = config.num_attention_heads, config.head_dim, config.hidden_size, \
            config.attention_bias
        self.num_heads, self.head_dim, self.window = h, d, window
        self.q_proj = nn.Linear(dm, h * d, bias=bias)
        self.k_proj = nn.Linear(dm, h * d, bias=bias)
        self.v_proj = nn.Linear(dm, h * d, bias=bias)
        self.o_proj = nn.Linear(h * d, dm, bias=bias)
        self.rotary = LoomIhaRotaryEmbedding(config.rope_theta) if config.rope_theta > 0 else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                key_padding: Optional[torch.Tensor]) -> torch.Tensor:
        """x: [B, N, D]; positions: int64 [B|1, N]; key_padding: bool [B, N] (True = real token)
        or None. Returns [B, N, D]."""
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, d]

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        idx = torch.arange(n, device=x.device)
        diff = idx.unsqueeze(1) - idx.unsqueeze(0)  # query index - key index
        allowed = diff >= 0  # causal
        if self.window > 0:
            allowed = allowed & (diff.abs() < self.window)
        if key_padding is not None:
            allowed = allowed & key_padding[:, None, None, :]  # [B, 1, N, N]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        out = torch.matmul(_masked_softmax(scores, allowed), v)  # [B, H, N, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class LoomIhaInterleavedHeadAttention(nn.Module):
    """Interleaved Head Attention (plugins/attention/iha/iha_core.cc, docs/iha.md).

    1. q, k, v = projections, viewed [B, N, H, d].
    2. Mixing: pseudo q~[b, n, h, j] = sum_m alpha_q[m, h, j] q[b, n, m] (same for k, v), with
       alpha [H, H, P] indexed [source head m, target head h, pseudo j].
    3. Interleave token-major: expanded index s = n*P + j, sequence length N*P, per head.
    4. RoPE on pseudo q and k after mixing, at pos(n)*P + j ("interleaved" phase) or pos(n)
       ("token" phase).
    5. Scores q~ k~^T * scale (scale 0 means 1/sqrt(d)); allowed pairs: mask "interleaved"
       s' <= s, "block" n' <= n; window W > 0 also |s - s'| < W*P. Score "softmax" normalises
       over the allowed keys; "linear" keeps the raw scores and zeroes the masked ones.
    6. Un-interleave to [B, N, H, P, d]; collapse with R [H, H*P]:
       O[b, n, h] = sum_{h', j} R[h, h'*P + j] out[b, n, h', j]; concatenate heads; o_proj.

    Materialises the P-times expanded q/k/v and the [N*P, N*P] scores per head (a reference,
    not a fast kernel).
    """

    def __init__(self, config, spec: dict):
        super().__init__()
        h, d, dm, bias = config.num_attention_heads, config.head_dim, config.hidden_size, \
            config.attention_bias
        p = spec["p"]
        self.num_heads, self.head_dim, self.p = h, d, p
        self.window, self.mask, self.rope_phase = spec["window"], spec["mask"], spec["rope_phase"]
        self.score = spec["score"]
        self.scale = spec["scale"] if spec["scale"] > 0 else 1.0 / math.sqrt(d)
        self.q_proj = nn.Linear(dm, h * d, bias=bias)
        self.k_proj = nn.Linear(dm, h * d, bias=bias)
        self.v_proj = nn.Linear(dm, h * d, bias=bias)
        self.o_proj = nn.Linear(h * d, dm, bias=bias)
        # Loom's 'identity' initialisation: each pseudo-head copies its own head; R keeps pseudo 0.
        self.alpha_q = nn.Parameter(self.identity_alpha(h, p))
        self.alpha_k = nn.Parameter(self.identity_alpha(h, p))
        self.alpha_v = nn.Parameter(self.identity_alpha(h, p))
        self.collapse = nn.Parameter(self.identity_collapse(h, p))
        self.rotary = LoomIhaRotaryEmbedding(config.rope_theta) if config.rope_theta > 0 else None

    @staticmethod
    def identity_alpha(h: int, p: int) -> torch.Tensor:
        """alpha[m, h, j] = 1 if m == h else 0, [H, H, P]."""
        return torch.eye(h).unsqueeze(-1).repeat(1, 1, p)

    @staticmethod
    def identity_collapse(h: int, p: int) -> torch.Tensor:
        """R[h, h'*P + j] = 1 if h' == h and j == 0 else 0, [H, H*P]."""
        r = torch.zeros(h, h, p)
        r[:, :, 0] = torch.eye(h)
        return r.reshape(h, h * p)

    def mix_and_interleave(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """x [B, N, H, d], alpha [H, H, P] -> [B, H, N*P, d], row s = n*P + j holding
        sum_m alpha[m, h, j] x[b, n, m] (iha_core.cc MixAndInterleave)."""
        b, n, h, d = x.shape
        mixed = torch.einsum("bnmd,mhj->bhnjd", x, alpha.to(x.dtype))
        return mixed.reshape(b, h, n * self.p, d)

    def expanded_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 [B|1, N] token positions -> [B|1, N*P] RoPE positions of the pseudo-tokens."""
        rows, n = positions.shape
        j = torch.arange(self.p, device=positions.device)
        base = positions.unsqueeze(-1)
        expanded = base * self.p + j if self.rope_phase == "interleaved" \
            else base.expand(rows, n, self.p)
        return expanded.reshape(rows, n * self.p)

    def allowed_mask(self, n: int, device) -> torch.Tensor:
        """Bool [N*P, N*P] of allowed (query s, key s') pairs (iha_core.cc AllowedBetween)."""
        idx = torch.arange(n * self.p, device=device)
        s, t = idx.unsqueeze(1), idx.unsqueeze(0)
        if self.mask == "interleaved":
            allowed = t <= s
        else:  # block: token-level causality
            allowed = torch.div(t, self.p, rounding_mode="floor") <= \
                torch.div(s, self.p, rounding_mode="floor")
        if self.window > 0:
            allowed = allowed & ((s - t).abs() < self.window * self.p)
        return allowed

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                key_padding: Optional[torch.Tensor]) -> torch.Tensor:
        """x: [B, N, D]; positions: int64 [B|1, N]; key_padding: bool [B, N] (True = real token)
        or None. Returns [B, N, D]."""
        b, n, _ = x.shape
        h, d, p = self.num_heads, self.head_dim, self.p

        def heads(t):
            return t.view(b, n, h, d)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        qi = self.mix_and_interleave(q, self.alpha_q)  # [B, H, N*P, d]
        ki = self.mix_and_interleave(k, self.alpha_k)
        vi = self.mix_and_interleave(v, self.alpha_v)
        if self.rotary is not None:
            expanded = self.expanded_positions(positions)
            qi, ki = self.rotary(qi, expanded), self.rotary(ki, expanded)
        scores = torch.matmul(qi, ki.transpose(-2, -1)) * self.scale  # [B, H, N*P, N*P]
        allowed = self.allowed_mask(n, x.device)
        if key_padding is not None:  # pseudo-key (n', j') is padding when token n' is
            allowed = allowed & key_padding.repeat_interleave(p, dim=1)[:, None, None, :]
        if self.score == "linear":
            weights = scores * allowed.to(scores.dtype)
        else:
            weights = _masked_softmax(scores, allowed)
        out = torch.matmul(weights, vi)  # [B, H, N*P, d]
        pseudo = out.view(b, h, n, p, d).permute(0, 2, 1, 3, 4)  # [B, N, H, P, d]
        collapsed = torch.einsum("bngjd,hgj->bnhd", pseudo,
                                 self.collapse.view(h, h, p).to(pseudo.dtype))  # [B, N, H, d]
        return self.o_proj(collapsed.reshape(b, n, h * d))


class LoomIhaDecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(rmsnorm(x)); out = h + mlp(rmsnorm(h)) (model.cc Block)."""

    def __init__(self, config, spec: dict):
        super().__init__()
        self.kind = spec["kind"]
        self.input_layernorm = LoomIhaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if spec["kind"] == "iha":
            self.self_attn = LoomIhaInterleavedHeadAttention(config, spec)
        else:
            self.self_attn = LoomIhaMultiHeadAttention(config, spec["window"])
        self.post_attention_layernorm = LoomIhaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LoomIhaMLP(config.hidden_size, config.intermediate_size, config.mlp_gated)

    def forward(self, x, positions, key_padding):
        h = x + self.self_attn(self.input_layernorm(x), positions, key_padding)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


class LoomIhaPreTrainedModel(_ModelBase):
    """Shared model plumbing (config class, weight initialisation for transformers)."""

    config_class = LoomIhaConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["LoomIhaDecoderLayer"]
    _supports_cache_class = False
    _supports_static_cache = False
    _supports_sdpa = False
    _supports_flash_attn_2 = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No KV cache: generate() must not hand us a DynamicCache."""
        return False

    def _init_weights(self, module):
        """Fresh weights for transformers' initialisation (skipped for loaded tensors):
        N(0, initializer_range) for linears and embeddings, ones for norms, identity IHA mixing."""
        init = (_HF or {}).get("init") or torch.nn.init
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, LoomIhaRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, LoomIhaInterleavedHeadAttention):
            if getattr(module, "_is_hf_initialized", False):
                return
            h, p = module.num_heads, module.p
            with torch.no_grad():
                for name in ("alpha_q", "alpha_k", "alpha_v", "collapse"):
                    param = getattr(module, name)
                    if getattr(param, "_is_hf_initialized", False) or param.device.type == "meta":
                        continue
                    value = module.identity_collapse(h, p) if name == "collapse" \
                        else module.identity_alpha(h, p)
                    param.copy_(value.to(param.dtype))


def _checked_inputs(input_ids, inputs_embeds, attention_mask, position_ids, max_len):
    """Validates the forward inputs; returns (B, N, device, positions [B|1, N] int64,
    key_padding bool [B, N] or None)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("forward: give exactly one of input_ids and inputs_embeds")
    ref = input_ids if input_ids is not None else inputs_embeds
    if ref.dim() < 2:
        raise ValueError(f"input_ids: must be [B, N], got {tuple(ref.shape)}")
    b, n = ref.shape[0], ref.shape[1]
    if n > max_len:
        raise ValueError(f"input_ids: sequence of {n} tokens exceeds max_position_embeddings "
                         f"{max_len}")
    device = ref.device
    if position_ids is None:
        positions = torch.arange(n, device=device).unsqueeze(0)
    else:
        positions = position_ids.to(device=device, dtype=torch.int64)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if positions.dim() != 2 or positions.size(0) not in (1, b) or positions.size(1) != n:
            raise ValueError(f"position_ids: must be [N] or [B, N] = [{b}, {n}], got "
                             f"{tuple(position_ids.shape)}")
    key_padding = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, n):
            raise ValueError(f"attention_mask: must be a [B, N] = [{b}, {n}] padding mask of 1/0, "
                             f"got {tuple(attention_mask.shape)}")
        key_padding = attention_mask.to(device) != 0
        if bool(key_padding.all()):
            key_padding = None  # nothing is padding: the exact Loom path
    return b, n, device, positions, key_padding


def _check_no_past(past_key_values):
    """Accepts None or an empty cache object; a filled cache cannot be used (no KV cache)."""
    if past_key_values is None:
        return
    length = 0
    if hasattr(past_key_values, "get_seq_length"):
        length = int(past_key_values.get_seq_length())
    elif isinstance(past_key_values, (list, tuple)):
        length = len(past_key_values)
    if length:
        raise ValueError("past_key_values: this model keeps no KV cache; pass the whole sequence")


class LoomIhaModel(LoomIhaPreTrainedModel):
    """The decoder stack: embedding, layers, final RMSNorm. Returns the last hidden state."""

    def __init__(self, config):
        super().__init__(config)
        self.layer_specs = validate_config(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LoomIhaDecoderLayer(config, s) for s in self.layer_specs)
        self.norm = LoomIhaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None, **kwargs):
        """input_ids [B, N] (or inputs_embeds [B, N, D]); attention_mask [B, N] of 1 (token) /
        0 (padding: never attended to); position_ids [N] or [B, N] (default arange(N))."""
        _check_no_past(past_key_values)
        _, _, _, positions, key_padding = _checked_inputs(
            input_ids, inputs_embeds, attention_mask, position_ids,
            self.config.max_position_embeddings)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        all_hidden = [] if output_hidden_states else None
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden.append(h)
            h = layer(h, positions, key_padding)
        h = self.norm(h)
        if all_hidden is not None:
            all_hidden.append(h)
        out = BaseModelOutputWithPast(last_hidden_state=h, past_key_values=None,
                                      hidden_states=tuple(all_hidden) if all_hidden else None)
        return out if return_dict is not False else out.to_tuple()


class LoomIhaForCausalLM(LoomIhaPreTrainedModel, *_LMBases):
    """The causal language model: LoomIhaModel + LM head (tied to the embedding or not).

    forward(input_ids, attention_mask=None, position_ids=None, labels=None) returns
    CausalLMOutputWithPast with logits [B, N, V] and, with labels, the mean cross-entropy of
    logits[:, :-1] against labels[:, 1:] (labels -100 are ignored), as transformers does.
    """

    if _HF_MAJOR >= 5:
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = LoomIhaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # Loom: linear(h, embed.weight)
        else:
            self._tied_weights_keys = type(self._tied_weights_keys)()  # nothing is tied
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def set_decoder(self, decoder):
        self.model = decoder

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None,
                logits_to_keep=0, **kwargs):
        """See the class docstring. use_cache / cache_position are ignored (no KV cache);
        logits_to_keep (int n > 0: the last n positions, or an index tensor) trims the logits."""
        base = self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, past_key_values=past_key_values,
                          inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                          return_dict=True)
        h = base.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"))
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=None,
                                     hidden_states=base.hidden_states)
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def causal_lm_loss(logits, labels, num_items_in_batch=None):
        """Cross-entropy of position t's logits against labels[t + 1] (ignore_index -100)."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        labels = labels.to(logits.device)
        shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1))
        shift_labels = labels[..., 1:].reshape(-1)
        if num_items_in_batch is None:
            return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        total = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
        return total / num_items_in_batch

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: every step runs the whole sequence; positions follow the padding mask
        (left padding: the first real token is at position 0)."""
        position_ids = None
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "position_ids": position_ids, "use_cache": False}

    def _reorder_cache(self, past_key_values, beam_idx):
        return past_key_values

    if not HAS_TRANSFORMERS:

        @classmethod
        def from_pretrained(cls, folder, dtype=None, torch_dtype=None, device=None,
                            trust_remote_code=None):
            """Loads an exported Loom folder (config.json + safetensors) with this file's own
            reader. dtype: torch dtype or its name, "auto" = config's torch_dtype; default
            float32."""
            return load_pretrained(folder, dtype=dtype if dtype is not None else torch_dtype,
                                   device=device, model_class=cls)


# ----------------------------------------------------------------------------------------------
# safetensors reading (pure Python) and loading
# ----------------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": (torch.float32, 4), "F64": (torch.float64, 8),
              "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2)}
_ST_MAX_HEADER = 100 * 1024 * 1024


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """Reads a .safetensors file: 8-byte little-endian header length n, an n-byte JSON header
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw
    little-endian tensor bytes. Offsets are checked strictly: every tensor's byte count matches
    its shape and dtype, and the tensors tile the data section exactly (no gap, no overlap, no
    trailing bytes). Returns CPU tensors of the file's dtypes (F32, F64, BF16, F16)."""
    if sys.byteorder != "little":
        raise RuntimeError("read_safetensors: needs a little-endian machine")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _ST_MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: header length {n} does not fit the file of {size} bytes")
        try:
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path}: header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: header must be a JSON object")
        data_start, data_size = 8 + n, size - 8 - n
        metadata = header.pop("__metadata__", None)
        if metadata is not None and (not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise ValueError(f"{path}: __metadata__ must map strings to strings")
        entries = []
        for name, info in header.items():
            where = f"{path}: tensor {name!r}"
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise ValueError(f"{where}: needs exactly dtype, shape and data_offsets")
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{where}: dtype {info['dtype']!r} is not one of "
                                 f"{', '.join(_ST_DTYPES)}")
            shape, offsets = info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
                raise ValueError(f"{where}: shape must be a list of integers >= 0, got {shape!r}")
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(
                    isinstance(o, int) and not isinstance(o, bool) for o in offsets) \
                    or not 0 <= offsets[0] <= offsets[1] <= data_size:
                raise ValueError(f"{where}: data_offsets {offsets!r} outside the data section of "
                                 f"{data_size} bytes")
            dtype, itemsize = _ST_DTYPES[info["dtype"]]
            numel = math.prod(shape)
            if offsets[1] - offsets[0] != numel * itemsize:
                raise ValueError(f"{where}: {offsets[1] - offsets[0]} bytes for shape {shape} of "
                                 f"{info['dtype']} ({numel * itemsize} bytes)")
            entries.append((offsets[0], offsets[1], name, dtype, shape, numel))
        entries.sort(key=lambda e: (e[0], e[1]))
        cursor = 0
        for begin, end, name, _, _, _ in entries:
            if begin != cursor:
                raise ValueError(f"{path}: tensor {name!r} starts at byte {begin}, expected "
                                 f"{cursor} (gap or overlap in the data section)")
            cursor = end
        if cursor != data_size:
            raise ValueError(f"{path}: data section has {data_size} bytes, tensors cover {cursor}")
        tensors = {}
        for begin, end, name, dtype, shape, numel in entries:
            if numel == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            f.seek(data_start + begin)
            buf = bytearray(end - begin)  # its own (aligned) buffer per tensor
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{path}: tensor {name!r}: file ended early")
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
    return tensors


def read_folder_tensors(folder: str) -> Dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed by
    model.safetensors.index.json ({"weight_map": {name: shard file}}), checked against the map."""
    single = os.path.join(folder, "model.safetensors")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(single):
        return read_safetensors(single)
    if not os.path.exists(index_path):
        raise ValueError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
    with open(index_path, "r", encoding="utf-8") as f:
        index = json.load(f)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: weight_map must be a non-empty object")
    tensors: Dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or os.path.basename(shard) != shard \
                or shard in ("", ".", ".."):
            raise ValueError(f"{index_path}: weight_map: shard {shard!r} is not a file name")
        for name, tensor in read_safetensors(os.path.join(folder, shard)).items():
            if weight_map.get(name) != shard:
                raise ValueError(f"{folder}/{shard}: tensor {name!r} is not mapped to this shard "
                                 f"in weight_map")
            tensors[name] = tensor
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"{index_path}: weight_map lists tensors no shard holds: {missing[:5]}")
    return tensors


def _resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = getattr(config, "torch_dtype", None) or "float32"
        if isinstance(dtype, torch.dtype):
            return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype: {dtype!r} is not a torch floating-point dtype")
    return value


def load_state(model: nn.Module, tensors: Dict[str, torch.Tensor]) -> None:
    """Copies the folder's tensors into the model (cast to the model's dtype), refusing a missing
    tensor, a tensor of the wrong shape, or an unexpected extra tensor (ValueError)."""
    # state_dict lists a shared parameter under every name (lm_head.weight when tied).
    expected = {name: t for name, t in model.state_dict(keep_vars=True).items()
                if isinstance(t, nn.Parameter)}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)  # the head is the embedding
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise ValueError(f"model.safetensors: missing tensor(s) {', '.join(missing)}")
    if extra:
        raise ValueError(f"model.safetensors: unexpected tensor(s) {', '.join(extra)}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ValueError(f"model.safetensors: tensor {name} has shape "
                             f"{list(tensors[name].shape)}, expected {list(param.shape)}")
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name].to(device=param.device, dtype=param.dtype))


def load_pretrained(folder: str, dtype=None, device=None, model_class=None):
    """Builds the model of FOLDER/config.json and loads its safetensors with this file's reader
    (works with and without transformers). Returns the model in eval mode."""
    with open(os.path.join(folder, "config.json"), "r", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{folder}/config.json: must hold a JSON object")
    if data.get("model_type", "loom_iha") != "loom_iha":
        raise ValueError(f"config.json: model_type: {data.get('model_type')!r} is not 'loom_iha'")
    config = LoomIhaConfig(**{k: v for k, v in data.items() if k != "model_type"})
    torch_dtype = _resolve_dtype(dtype, config)
    model = (model_class or LoomIhaForCausalLM)(config)
    model.to(dtype=torch_dtype, device=device)
    load_state(model, read_folder_tensors(folder))
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a CPU tensor (no numpy)."""
    if sys.byteorder != "little":
        raise RuntimeError("needs a little-endian machine")
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Run a Loom-exported model folder on tokens.")
    parser.add_argument("folder")
    parser.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--out", help="write the logits [1, N, V] as raw little-endian floats")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip() != ""]
    except ValueError:
        parser.error(f"--tokens: {args.tokens!r} is not a comma-separated list of integers")
    if not tokens:
        parser.error("--tokens: no tokens")
    dtype = getattr(torch, args.dtype)
    model = load_pretrained(args.folder, dtype=dtype)
    vocab = model.config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        parser.error(f"--tokens: ids {bad} outside the vocabulary [0, {vocab})")
    with torch.no_grad():
        logits = model(torch.tensor([tokens], dtype=torch.int64)).logits
    print(f"logits shape: {list(logits.shape)} ({args.dtype})")
    print("argmax per position: " + " ".join(str(i) for i in logits[0].argmax(-1).tolist()))
    if args.out:
        with open(args.out, "wb") as f:
            f.write(_tensor_bytes(logits.to(dtype)))
        print(f"wrote {logits.numel()} {args.dtype} values to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
