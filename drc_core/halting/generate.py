"""Autoregressive decoding with per-token halting and key/value caches.

:func:`generate` decodes with the semantics of :func:`drc_core.halting.skipping.skip_forward` (and the masked
reference :func:`drc_core.halting.reference.masked_forward`): every processed token runs the core until the rule
halts it at its exit loop e; at loop l it attends to each earlier token's loop-min(l, e') keys/values, in
every core block and in every coda block, and its next-token logits are its readout at its exit loop.
Because attention is causal and a token's halting depends only on itself and earlier tokens, teacher-forcing
the generated sequence through ``skip_forward`` gives the same exit loops and logits (to float tolerance).

Caches (zeros until written, all ``(B, H, T0 + max_new_tokens, hd)`` per slab):

- prelude: one (K, V) slab per prelude block (the prelude runs once per token);
- core and coda: per block one slab per loop 1..``rule.max_loops``; a token active at loop l writes its
  loop-l keys/values into slab l, and a token that exits at loop e copies its loop-e keys/values into the
  slabs e+1..max_loops, so slab l always holds every earlier token's loop-min(l, e) keys/values. The coda is
  per loop too (not just the exit state): a later token that exits at loop l < e' reads an earlier token's
  coda keys/values of loop l, exactly as the batched path does. With a rule that needs no log-probs a token
  still writes its coda keys/values at every loop it is active (for one coda block: one k/v projection),
  but runs the last coda block's attention/MLP and the head only at its exit loop.

The prompt is processed as one batch (:func:`drc_core.halting.skipping.run_loops`, equal to ``skip_forward`` on the
prompt), then each new token alone; a step runs loop l only for the rows whose token is still active, so
in a batch of rows a step costs the depth of its deepest row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from drc_core.errors import DrcError
from drc_core.halting.kvlayout import Attn, LoopCaches, Tokens, block_step, coda, empty_caches
from drc_core.halting.rules import HaltingRule, Oracle, Uniform
from drc_core.halting.skipping import check_state, run_loops
from drc_core.halting.work import Work
from drc_core.model.checks import check_token_ids
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["GenerationResult", "generate", "generate_fixed"]


@dataclass
class GenerationResult:
    """What :func:`generate` returns (n = ``max_new_tokens``, T0 the prompt length).

    ``tokens`` (B, T0 + n): the prompt followed by the generated tokens. ``exit_loop`` (B, T0 + n - 1) long and
    ``logits`` (B, T0 + n - 1, V): each processed position's exit loop and its logits there (position t's
    logits chose token t + 1 at t >= T0 - 1; the last generated token is never processed). ``avg_depth``: the
    mean exit loop over all processed positions; ``new_avg_depth``: over the n positions T0-1 .. T0+n-2 whose
    outputs chose the new tokens. ``initial_state`` (B, T0 + n, d): the s_0 used (the last position's is
    unused). ``rule``: ``str(rule)``. ``work``: the :class:`~drc_core.halting.work.Work` done.
    """

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
    total, limit = prompt_ids.shape[1] + max_new_tokens, model.cfg.max_seq_len
    if prompt_ids.shape[1] >= limit:
        raise DrcError(
            f"the prompt has {prompt_ids.shape[1]} tokens, which leaves no room to generate within the model's "
            f"max_seq_len={limit}; shorten the prompt to at most {limit - 1} tokens"
        )
    if total > limit:
        raise DrcError(
            f"prompt length {prompt_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds "
            f"max_seq_len={limit}; shorten the prompt or generate at most {limit - prompt_ids.shape[1]} tokens"
        )
    if not isinstance(rule, HaltingRule):
        raise DrcError(f"rule={rule!r} is not a HaltingRule; pass e.g. KLThreshold(1e-3)")
    if isinstance(rule, Oracle):
        raise DrcError("Oracle replays exit loops found offline for a fixed batch and cannot decide for new "
                         "tokens; pass a deployable rule (e.g. KLThreshold)")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise DrcError(f"temperature={temperature!r} is invalid; use 0 (greedy) or a finite number > 0")


def _layout(model: DepthRecurrentLM, batch: int, window: tuple[int, int], total: int, device: torch.device) -> Attn:
    """The dense :class:`~drc_core.halting.kvlayout.Attn` of every row's positions [t0, t1) over caches of
    ``total`` positions."""
    return Attn(Tokens.window(batch, *window, device), batch, total, model.cfg.n_heads,
                (model.rope_cos, model.rope_sin), window)


def prelude_step(model: DepthRecurrentLM, tokens: Tensor, window: tuple[int, int], kv: list, e: Tensor,
             work: Work | None = None) -> None:
    """:meth:`DepthRecurrentLM.embed <drc_core.model.lm.DepthRecurrentLM.embed>` on positions [t0, t1) of every
    row, the prelude attending over cached keys/values (:func:`~drc_core.halting.kvlayout.block_step`); write e
    there."""
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


@torch.no_grad()
def generate(
    model: DepthRecurrentLM,
    prompt_ids: Tensor,
    max_new_tokens: int,
    rule: HaltingRule,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    state: Tensor | None = None,
    fused: bool = False,
) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens after ``prompt_ids`` (B, T0), halting every token by ``rule``.

    Semantics and caches: see the module docstring; each token runs at most ``rule.max_loops`` loops.
    ``temperature`` 0 is greedy (argmax), > 0 samples from ``softmax(logits / temperature)`` with
    ``generator``. The initial latent state s_0 of all T0 + n positions is ``state`` (B, T0 + n, d) or, when
    None, ``model.initial_state`` drawn once up front from ``generator`` (else the global RNG) with that
    shape, before any sampling -- so a run is reproducible from the generator's seed, and the batched path
    with ``state=result.initial_state[:, :T]`` reproduces it. Runs under ``torch.no_grad()``; put the model in
    eval mode first if it has dropout. :class:`~drc_core.halting.rules.Oracle` is rejected (not deployable).
    ``fused``: the readout statistics through the compiled kernel (see
    :func:`~drc_core.halting.skipping.skip_forward`).
    """
    check_generate_args(model, prompt_ids, max_new_tokens, rule, temperature)
    B, T0 = prompt_ids.shape
    total, d = T0 + max_new_tokens, model.cfg.d_model
    check_state(state, (B, total, d), "(B, T0 + max_new_tokens, d_model)")
    device = model.rope_cos.device
    dtype = model.tok_emb.weight.dtype
    tokens = torch.zeros(B, total, dtype=torch.long, device=device)
    tokens[:, :T0] = prompt_ids.to(device)
    e = torch.zeros(B, total, d, dtype=dtype, device=device)
    if state is None:
        state = model.initial_state(e, generator)
    s = state.to(device=device, dtype=dtype).clone()
    pre_kv = empty_caches(model, len(model.prelude), (B, total), e)
    loops = rule.max_loops
    caches = LoopCaches(core=empty_caches(model, len(model.core), (loops, B, total), e),
                        coda=empty_caches(model, len(model.coda), (loops, B, total), e), per_loop=True)
    exits, outs = [], []
    window = (0, T0)
    work = Work()
    while True:
        prelude_step(model, tokens, window, pre_kv, e, work)
        res = run_loops(model, rule, s, e, window, caches, work=work, fused=fused)
        exits.append(res.exit_loop)
        outs.append(res.logits)
        t = window[1]
        tokens[:, t] = choose_next(res.logits[:, -1], temperature, generator)
        if t == total - 1:
            break
        window = (t, t + 1)
    exit_loop, logits = torch.cat(exits, dim=1), torch.cat(outs, dim=1)
    return GenerationResult(
        tokens=tokens, exit_loop=exit_loop, logits=logits, avg_depth=float(exit_loop.float().mean()),
        new_avg_depth=float(exit_loop[:, T0 - 1 :].float().mean()), initial_state=state, prompt_len=T0,
        rule=str(rule), work=work,
    )


@torch.no_grad()
def generate_fixed(model: DepthRecurrentLM, prompt_ids: Tensor, max_new_tokens: int, loops: int, *,
                   state: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Greedy KV-cached decoding at a fixed depth with no halting machinery at all: the dense reference that
    :func:`generate` with ``Uniform(loops)`` is measured against (same tokens, same logits to float tolerance).

    Per new token: the prelude, ``loops`` loops of the core over per-loop key/value caches (a token at loop l
    attends to every earlier token's loop-l keys/values), the coda over one cache (only the last loop's coda
    keys/values are ever read) and the head; no statistics, no decisions, no exit bookkeeping. Returns the
    tokens (B, T0 + max_new_tokens). ``state``/``generator``: the initial states, as in :func:`generate`.
    """
    check_generate_args(model, prompt_ids, max_new_tokens, Uniform(loops), 0.0)
    B, T0 = prompt_ids.shape
    total, d = T0 + max_new_tokens, model.cfg.d_model
    check_state(state, (B, total, d), "(B, T0 + max_new_tokens, d_model)")
    device = model.rope_cos.device
    tokens = torch.zeros(B, total, dtype=torch.long, device=device)
    tokens[:, :T0] = prompt_ids.to(device)
    e = torch.zeros(B, total, d, dtype=model.tok_emb.weight.dtype, device=device)
    s = (model.initial_state(e, generator) if state is None else state).to(device=device, dtype=e.dtype)
    pre_kv = empty_caches(model, len(model.prelude), (B, total), e)
    core_kv = empty_caches(model, len(model.core), (loops, B, total), e)
    coda_kv = empty_caches(model, len(model.coda), (B, total), e)
    cos, sin = model.rope_cos, model.rope_sin
    window = (0, T0)
    while True:
        t0, t1 = window
        prelude_step(model, tokens, window, pre_kv, e)
        attn = _layout(model, B, window, total, device)
        x, inj = s[:, t0:t1].reshape(-1, d), e[:, t0:t1].reshape(-1, d)
        for loop in range(loops):
            x = model.inject(x, inj)
            for block, (k, v) in zip(model.core, core_kv, strict=True):
                x = block_step(block, x, attn, (k[loop], v[loop]), cos, sin)
        logits = model.head(coda(model, x, attn, coda_kv)).view(B, t1 - t0, -1)
        tokens[:, t1] = logits[:, -1].argmax(dim=-1)
        if t1 == total - 1:
            return tokens
        window = (t1, t1 + 1)
