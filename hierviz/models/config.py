"""Model facts read from a HF `config.json` (Llama 2/3/3.1, Qwen2/2.5, Mistral, SmolLM2)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")


class ModelConfigError(ValueError):
    """A config that hierviz cannot build; the message says why."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    model_type: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type", "llama")
        if mt not in SUPPORTED_TYPES:
            raise ModelConfigError(f"unsupported architecture {mt!r}; hierviz supports {', '.join(SUPPORTED_TYPES)}")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, list) else [int(eos)])
            rs = d.get("rope_scaling") or d.get("rope_parameters")
            if rs is not None and rs.get("rope_type", rs.get("type")) in (None, "default"):
                rs = None
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=rs,
                max_position=int(d.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=bool(d.get("attention_bias", mt == "qwen2")),
                model_type=mt,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelConfigError(f"config.json is missing or has a bad value for {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_config_json(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """config.json of a folder (or the file itself) as a dict, with a clear error."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{p.parent} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ModelConfigError(f"{p} is not a JSON object")
    return d


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], including llama3 rope scaling (Llama 3.1+)."""
    dim = cfg.head_dim
    # float32 like the reference implementation, so positions rotate identically
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    if kind == "linear":
        return inv / float(rs["factor"])
    raise ModelConfigError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")
