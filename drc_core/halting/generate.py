"""Autoregressive decoding with per-token halting and key/value caches, with the semantics of
:func:`~drc_core.halting.skipping.skip_forward` (teacher-forcing the generated sequence through it gives the same
exit loops and logits to float tolerance). Per core and coda block one cache slab per loop (an exit at loop e copies
its keys/values into the later slabs); the prompt runs as one batch, then each new token, a step costing the depth of
its deepest row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from drc_core.errors import DrcError
from drc_core.halting.kvlayout import Attn, KVSlab, LoopCaches, Tokens, block_step, coda, empty_caches
from drc_core.halting.rules import HaltingRule, Oracle, Uniform
from drc_core.halting.skipping import check_state, run_loops
from drc_core.halting.work import Work
from drc_core.model.checks import check_token_ids
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["GenerationResult", "generate", "generate_fixed"]


@dataclass
class GenerationResult:
    """What :func:`generate` returns: ``tokens`` (B, T0 + n); ``exit_loop`` and ``logits`` of each processed position
    (all but the last) at its exit loop; ``avg_depth`` over them, ``new_avg_depth`` over the n that chose the new
    tokens; ``initial_state`` (B, T0 + n, d), the s_0 used; the work done."""

    tokens: Tensor
    exit_loop: Tensor
    logits: Tensor
    avg_depth: float
    new_avg_depth: float
    initial_state: Tensor
    prompt_len: int
    rule: str
    work: Work | None = None

    @property
    def new_tokens(self) -> Tensor:
        """(B, n): the generated tokens."""
        return self.tokens[:, self.prompt_len :]


def check_generate_args(model: DepthRecurrentLM, prompt_ids: object, max_new_tokens: object, rule: object,
                        temperature: object) -> None:
    """One-line DrcErrors naming the bad argument and the fix."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise DrcError(f"max_new_tokens={max_new_tokens!r} is invalid; it must be an integer >= 1")
    check_token_ids(model, prompt_ids, "prompt_ids", targets=False)
    t0, limit = prompt_ids.shape[1], model.cfg.max_seq_len
    if t0 >= limit:
        raise DrcError(f"the prompt has {t0} tokens, which leaves no room to generate within the model's "
                       f"max_seq_len={limit}; shorten the prompt to at most {limit - 1} tokens")
    if t0 + max_new_tokens > limit:
        raise DrcError(f"prompt length {t0} + max_new_tokens {max_new_tokens} = {t0 + max_new_tokens} exceeds "
                       f"max_seq_len={limit}; shorten the prompt or generate at most {limit - t0} tokens")
    if not isinstance(rule, HaltingRule):
        raise DrcError(f"rule={rule!r} is not a HaltingRule; pass e.g. KLThreshold(1e-3)")
    if isinstance(rule, Oracle):
        raise DrcError("Oracle replays exit loops found offline for a fixed batch and cannot decide for new "
                       "tokens; pass a deployable rule (e.g. KLThreshold)")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise DrcError(f"temperature={temperature!r} is invalid; use 0 (greedy) or a finite number > 0")


def _layout(model: DepthRecurrentLM, batch: int, window: tuple[int, int], total: int, device: torch.device) -> Attn:
    """The dense :class:`~drc_core.halting.kvlayout.Attn` of every row's positions [t0, t1)."""
    return Attn(Tokens.window(batch, *window, device), batch, total, model.cfg.n_heads,
                (model.rope_cos, model.rope_sin), window)


def prelude_step(model: DepthRecurrentLM, tokens: Tensor, window: tuple[int, int], kv: list, e: Tensor,
                 work: Work | None = None) -> None:
    """The prelude on positions [t0, t1) of every row over cached keys/values; writes ``e`` there."""
    attn = _layout(model, tokens.shape[0], window, tokens.shape[1], tokens.device)
    x = model.token_embedding(attn.toks.gather(tokens))
    for block, slab in zip(model.prelude, kv, strict=True):
        x = block_step(block, x, attn, slab, model.rope_cos, model.rope_sin, work=work)
    e[:, window[0] : window[1]] = x.view(tokens.shape[0], window[1] - window[0], -1)


def choose_next(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """(B, V) -> (B,) next tokens: argmax (temperature 0) or a draw from softmax(logits / temperature)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _start(model: DepthRecurrentLM, prompt_ids: Tensor, max_new_tokens: int, rule: HaltingRule, temperature: float,
           state: Tensor | None, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor, list[KVSlab]]:
    """Checked arguments -> the token buffer holding the prompt, zeroed prelude outputs, s_0, prelude caches."""
    check_generate_args(model, prompt_ids, max_new_tokens, rule, temperature)
    B, T0 = prompt_ids.shape
    total, d = T0 + max_new_tokens, model.cfg.d_model
    check_state(state, (B, total, d), "(B, T0 + max_new_tokens, d_model)")
    device = model.rope_cos.device
    tokens = torch.zeros(B, total, dtype=torch.long, device=device)
    tokens[:, :T0] = prompt_ids.to(device)
    e = torch.zeros(B, total, d, dtype=model.tok_emb.weight.dtype, device=device)
    state = model.initial_state(e, generator) if state is None else state
    return tokens, e, state, empty_caches(model, len(model.prelude), (B, total), e)


def _windows(t0: int, total: int) -> Iterator[tuple[int, int]]:
    """The positions each decode step processes: the prompt, then every new token but the last."""
    yield 0, t0
    yield from ((t, t + 1) for t in range(t0, total - 1))


@torch.no_grad()
def generate(model: DepthRecurrentLM, prompt_ids: Tensor, max_new_tokens: int, rule: HaltingRule, *,
             temperature: float = 0.0, generator: torch.Generator | None = None, state: Tensor | None = None,
             fused: bool = False) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens after ``prompt_ids`` (B, T0), halting every token by ``rule`` (not an
    :class:`~drc_core.halting.rules.Oracle`); ``temperature`` 0 is greedy, > 0 samples with ``generator``. s_0 of
    all T0 + n positions is ``state`` or drawn up front from ``generator``, before any sampling."""
    tokens, e, state, pre_kv = _start(model, prompt_ids, max_new_tokens, rule, temperature, state, generator)
    B, T0 = prompt_ids.shape
    s = state.to(device=e.device, dtype=e.dtype).clone()
    caches = LoopCaches(core=empty_caches(model, len(model.core), (rule.max_loops, *tokens.shape), e),
                        coda=empty_caches(model, len(model.coda), (rule.max_loops, *tokens.shape), e), per_loop=True)
    exits, outs, work = [], [], Work()
    for window in _windows(T0, tokens.shape[1]):
        prelude_step(model, tokens, window, pre_kv, e, work)
        res = run_loops(model, rule, s, e, window, caches, work=work, fused=fused)
        exits.append(res.exit_loop)
        outs.append(res.logits)
        tokens[:, window[1]] = choose_next(res.logits[:, -1], temperature, generator)
    exit_loop, logits = torch.cat(exits, dim=1), torch.cat(outs, dim=1)
    return GenerationResult(
        tokens=tokens, exit_loop=exit_loop, logits=logits, avg_depth=float(exit_loop.float().mean()),
        new_avg_depth=float(exit_loop[:, T0 - 1 :].float().mean()), initial_state=state, prompt_len=T0,
        rule=str(rule), work=work,
    )


@torch.no_grad()
def generate_fixed(model: DepthRecurrentLM, prompt_ids: Tensor, max_new_tokens: int, loops: int, *,
                   state: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Greedy KV-cached decoding at a fixed depth with no halting machinery: the dense reference for
    :func:`generate` with ``Uniform(loops)``. Returns the tokens (B, T0 + max_new_tokens)."""
    tokens, e, state, pre_kv = _start(model, prompt_ids, max_new_tokens, Uniform(loops), 0.0, state, generator)
    B, total = tokens.shape
    s, d = state.to(device=e.device, dtype=e.dtype), e.shape[-1]
    core_kv = empty_caches(model, len(model.core), (loops, B, total), e)
    coda_kv = empty_caches(model, len(model.coda), (B, total), e)
    cos, sin = model.rope_cos, model.rope_sin
    for window in _windows(prompt_ids.shape[1], total):
        t0, t1 = window
        prelude_step(model, tokens, window, pre_kv, e)
        attn = _layout(model, B, window, total, e.device)
        x, inj = s[:, t0:t1].reshape(-1, d), e[:, t0:t1].reshape(-1, d)
        for loop in range(loops):
            x = model.inject(x, inj)
            for block, (k, v) in zip(model.core, core_kv, strict=True):
                x = block_step(block, x, attn, (k[loop], v[loop]), cos, sin)
        logits = model.head(coda(model, x, attn, coda_kv)).view(B, t1 - t0, -1)
        tokens[:, t1] = logits[:, -1].argmax(dim=-1)
    return tokens
