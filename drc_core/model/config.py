"""The hyper-parameters of :class:`~drc_core.model.lm.DepthRecurrentLM`, checked when built."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from drc_core.errors import (
    MAX_D_MODEL,
    MAX_LAYERS,
    MAX_MODEL_PARAMS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    DrcError,
    check_fields,
    need_float,
    need_int,
)

__all__ = ["ModelConfig"]

_CHOICES = {"norm": ("pre", "sandwich"), "injection": ("concat", "add"), "init_state": ("random", "zeros")}


def _valid_heads(d_model: int) -> str:
    ok = [h for h in range(1, d_model + 1) if d_model % h == 0 and (d_model // h) % 2 == 0]
    shown = ", ".join(str(h) for h in ok[:8])
    return "{" + shown + (", ..." if len(ok) > 8 else "") + "}"


@dataclass
class ModelConfig:
    """Hyper-parameters of :class:`DepthRecurrentLM`, a bad value a one-line :class:`DrcError`; ``mlp_hidden=None``:
    ``8/3 * d_model`` rounded up to a multiple of 8."""

    vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    mlp_hidden: int | None = None
    max_seq_len: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    norm: str = "pre"
    injection: str = "concat"
    init_state: str = "random"
    init_state_scale: float = 1.0
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        # the limits of drc_core.errors, checked before anything is allocated (a config file is untrusted input)
        limits = {"vocab_size": (1, MAX_VOCAB), "d_model": (1, MAX_D_MODEL), "n_heads": (1, MAX_D_MODEL),
                  "n_core": (1, MAX_LAYERS), "max_seq_len": (1, MAX_SEQ_LEN), "n_prelude": (0, MAX_LAYERS),
                  "n_coda": (0, MAX_LAYERS), "mlp_hidden": (1, 8 * MAX_D_MODEL)}
        for name, (lo, hi) in limits.items():
            if name != "mlp_hidden" or self.mlp_hidden is not None:
                need_int(name, getattr(self, name), lo, maximum=hi)
        if self.d_model % self.n_heads != 0:
            raise DrcError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; choose n_heads in "
                           f"{_valid_heads(self.d_model)}")
        if (self.d_model // self.n_heads) % 2 != 0:
            raise DrcError(f"head_dim = d_model/n_heads = {self.d_model // self.n_heads} is odd but RoPE needs an even "
                           f"head_dim; choose n_heads in {_valid_heads(self.d_model)}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise DrcError(f"{name}={getattr(self, name)!r} is not supported; use one of {allowed}")
        need_float("rope_base", self.rope_base, 0.0, lo_open=True)
        need_float("norm_eps", self.norm_eps, 0.0, lo_open=True)
        need_float("init_state_scale", self.init_state_scale, 0.0)
        need_float("dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if not isinstance(self.tie_embeddings, bool):
            raise DrcError(f"tie_embeddings={self.tie_embeddings!r} is invalid; use true or false")
        size = self.num_elements()
        if size > MAX_MODEL_PARAMS:
            raise DrcError(f"this model config (d_model={self.d_model}, {self.n_prelude}+{self.n_core}+{self.n_coda} "
                           f"blocks, vocab_size={self.vocab_size}, max_seq_len={self.max_seq_len}) holds {size:,} "
                           f"parameters and RoPE entries, above the limit of {MAX_MODEL_PARAMS:,} "
                           "(drc_core.errors.MAX_MODEL_PARAMS): choose a smaller model")

    def num_elements(self) -> int:
        """The parameters (a tied lm_head once) plus RoPE entries the model holds, from the config alone."""
        d, h = self.d_model, self.hidden_dim
        norms = 4 if self.norm == "sandwich" else 2
        block = 4 * d * d + 3 * d * h + norms * d
        adapter = 2 * d * d if self.injection == "concat" else 0
        head = 0 if self.tie_embeddings else self.vocab_size * d
        rope = self.max_seq_len * (d // self.n_heads)
        return self.vocab_size * d + adapter + (self.n_prelude + self.n_core + self.n_coda) * block + d + head + rope

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden size actually used."""
        return self.mlp_hidden if self.mlp_hidden is not None else 8 * math.ceil(8 * self.d_model / 3 / 8)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object], where: str = "model config") -> ModelConfig:
        """A config from its stored dict: every field present, none unknown."""
        return cls(**check_fields(cls, data, where))
