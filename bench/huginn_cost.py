"""What a Huginn-0125 checkpoint costs here: the memory of loading one, and the time of its layers at the real width.

    .venv/bin/python bench/huginn_cost.py load-rss /work/shared/fixtures/huginn-tiny          # peak RSS of a load
    .venv/bin/python bench/huginn_cost.py write-random /tmp/huginn-2b --dtype bfloat16        # a bigger random one
    .venv/bin/python bench/huginn_cost.py load-rss /tmp/huginn-2b --dtype bfloat16 --forward 8
    .venv/bin/python bench/huginn_cost.py layer-cost --tokens 32 --repeat 3                   # ~1-2 min, 1 thread

``load-rss`` loads a checkpoint directory with ``drc_core.load`` in this process and prints the resident memory
(``/proc/self/status``: VmRSS split into RssAnon, memory of its own, and RssFile, pages of mapped files such as
the memory-mapped weights, which the kernel can drop and re-read) after the imports, after the load and, with
``--forward T``, after one forward of T tokens at the checkpoint's mean depth; VmHWM is the peak.

``write-random`` writes a random checkpoint in Huginn's on-disk format (config.json + model.safetensors, upstream
tensor names) with the sizes given, to see how a load scales with the file.

``layer-cost`` builds two sandwich blocks, the adapter and the tied head of Huginn-0125's real sizes (d=5280,
55 heads of 96, MLP 17920, vocabulary 65536) with random weights, times each per token on ``--tokens`` tokens at
once (a prompt, a trace: matmuls of T rows) and on one token (a decode step: every weight read once per token),
with 1 thread, and extrapolates to 1,000 tokens at 32 loops (see ``extrapolate``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

HUGINN = {"n_embd": 5280, "n_heads": 55, "intermediate_size": 17920, "padded_vocab_size": 65536, "block_size": 4096,
          "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "mean_recurrence": 32}


def rss() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM (peak) of this process in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def load_rss(path: str, dtype: str | None, forward: int) -> dict:
    import drc_core
    import drc_core.api  # noqa: F401  (drc_core imports it lazily: the baseline includes it)

    torch.set_num_threads(1)
    files = Path(path).glob("model*.safetensors")
    report = {"path": path, "dtype": dtype, "file_mb": sum(f.stat().st_size for f in files) / 2**20,
              "after_imports": rss()}
    t0 = time.perf_counter()
    lm = drc_core.load(path, dtype=dtype)
    report["load_s"] = time.perf_counter() - t0
    report["after_load"] = rss()
    if forward:
        ids = torch.randint(0, lm.model.vocab_size, (1, forward), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            lm.model(ids)
        report["after_forward"] = rss()
    return report


def write_random(out: str, dtype: str, sizes: dict) -> None:
    """A random Huginn-format checkpoint in ``out`` (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from drc_core.model.huginn import HuginnLM
    from drc_core.model.huginn_checkpoint import config_from_json, rename_tensor

    d, h = sizes["n_embd"], sizes["n_heads"]
    config = {**sizes, "model_type": "huginn_raven", "architectures": ["RavenForCausalLM"], "vocab_size":
              sizes["padded_vocab_size"], "num_key_value_heads": h, "head_dim": d // h, "rope_base": 50000,
              "norm_eps": 1e-6, "qk_bias": True, "tie_embeddings": True, "test_time_noise": 0,
              "init_values": {"std": math.sqrt(2 / (5 * d)), "embed_scale": math.sqrt(d)}}
    cfg = config_from_json(config, "random config")
    with torch.device("meta"):
        shapes = {rename_tensor(n, ours=False): p.shape for n, p in HuginnLM(cfg).named_parameters()}
    g = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(s, generator=g) * 0.02 + float("norm_" in n or "ln_f" in n)).to(getattr(torch, dtype))
               for n, s in shapes.items()}  # norm weights around 1, the rest N(0, 0.02)
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def _measure(blocks: list, adapter: torch.Tensor, head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             tokens: int, repeat: int, g: torch.Generator) -> dict[str, float]:
    res = {}
    d, dt = adapter.shape[0], adapter.dtype
    for t in (tokens, 1):
        x, x2 = torch.randn(1, t, d, generator=g).to(dt), torch.randn(1, t, 2 * d, generator=g).to(dt)

        def two_blocks(x: torch.Tensor = x, t: int = t) -> torch.Tensor:
            for b in blocks:
                x = b(x, cos[:t], sin[:t])
            return x

        res[f"block_s_per_token_T{t}"] = _time(two_blocks, repeat) / 2 / t
        res[f"adapter_s_per_token_T{t}"] = _time(lambda x2=x2: x2 @ adapter.t(), repeat) / t
        res[f"head_s_per_token_T{t}"] = _time(lambda x=x: x @ head.t(), repeat) / t
    return res


def layer_cost(tokens: int, repeat: int, dtypes: list[str]) -> dict:
    """Seconds per token of one sandwich block, the adapter and the head at Huginn-0125's sizes, T tokens at once
    and one token alone, per dtype (best of ``repeat``, 1 thread)."""
    from drc_core.model.huginn import HuginnBlock, HuginnConfig, rope_tables

    torch.set_num_threads(1)
    cfg = HuginnConfig(d_model=5280, n_heads=55, hidden_dim=17920, vocab_size=65536, tokenizer_vocab_size=65536,
                       max_seq_len=4096, n_prelude=2, n_core=4, n_coda=2, mean_recurrence=32, rope_base=50000.0,
                       norm_eps=1e-6, qk_bias=True, tie_embeddings=True, embed_scale=72.66, state_std=0.0087)
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
    g = torch.Generator().manual_seed(0)
    out: dict = {"tokens": tokens, "threads": torch.get_num_threads(), "torch": torch.__version__}
    for name in dtypes:
        dt = getattr(torch, name)
        with torch.device("meta"):
            blocks = [HuginnBlock(cfg) for _ in range(2)]
        for b in blocks:  # random weights, allocated directly in the dtype
            for mod_name, p in list(b.named_parameters()):
                owner, _, leaf = mod_name.rpartition(".")
                w = torch.empty(p.shape, dtype=dt).normal_(0, 0.02, generator=g)
                setattr(b.get_submodule(owner), leaf, torch.nn.Parameter(w, requires_grad=False))
        adapter = torch.empty(cfg.d_model, 2 * cfg.d_model, dtype=dt).normal_(0, 0.02, generator=g)
        head = torch.empty(cfg.vocab_size, cfg.d_model, dtype=dt).normal_(0, 0.02, generator=g)
        res = _measure(blocks, adapter, head, cos, sin, tokens, repeat, g)
        res["weights_gb"] = (sum(p.numel() for p in blocks[0].parameters()) * 8 + adapter.numel() + head.numel()) \
            * adapter.element_size() / 1e9
        out[name] = res
        del blocks, adapter, head
    return out


def extrapolate(res: dict, t: int, loops: int = 32, n_tokens: int = 1000) -> dict[str, float]:
    """Seconds for ``n_tokens`` tokens at ``loops`` loops from the per-token costs at T=``t``, with Huginn-0125's
    2 prelude, 4 core and 2 coda blocks: a forward (upstream ``num_steps=32``) is 2 + 2 blocks, 32 x (4 blocks +
    adapter) and one head; a trace also reads out at every loop (32 x (2 coda blocks + head)) after a pre-pass that
    is one forward; generation without a per-loop readout (Uniform, state rules) costs a forward per new token at
    T=1, one with it (KL) the trace's per-loop readouts too. Attention over the context is left out (at 1,000
    tokens about 4 x 1000 x 5280 = 21 MFLOP per token and block, under 3% of a block's 0.79 GFLOP)."""
    def per_token(tt: int, readout_every_loop: bool) -> float:
        blk, ad, hd = res[f"block_s_per_token_T{tt}"], res[f"adapter_s_per_token_T{tt}"], res[f"head_s_per_token_T{tt}"]
        base = 4 * blk + loops * (4 * blk + ad) + hd
        return base + (loops * (2 * blk + hd) if readout_every_loop else 0.0)

    return {"forward_s": n_tokens * per_token(t, False),
            "trace_s": n_tokens * (per_token(t, False) + per_token(t, True)),
            "generate_uniform_s": n_tokens * per_token(1, False),
            "generate_kl_s": n_tokens * per_token(1, True)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("load-rss")
    a.add_argument("path")
    a.add_argument("--dtype", default=None, help="default: the stored dtype")
    a.add_argument("--forward", type=int, default=0, metavar="T", help="also run one forward of T tokens")
    w = sub.add_parser("write-random")
    w.add_argument("out")
    w.add_argument("--dtype", default="bfloat16")
    for key, default in {**HUGINN, "n_embd": 2048, "n_heads": 16, "intermediate_size": 8192}.items():
        w.add_argument("--" + key.replace("_", "-"), type=int, default=default)
    c = sub.add_parser("layer-cost")
    c.add_argument("--tokens", type=int, default=32)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--dtypes", default="float32,bfloat16")
    c.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if args.cmd == "load-rss":
        print(json.dumps(load_rss(args.path, args.dtype, args.forward), indent=1))
    elif args.cmd == "write-random":
        write_random(args.out, args.dtype, {k: getattr(args, k) for k in HUGINN})
        print(f"wrote {args.out}")
    else:
        t0 = time.perf_counter()
        res = layer_cost(args.tokens, args.repeat, args.dtypes.split(","))
        for name in args.dtypes.split(","):
            res[name]["per_1000_tokens_at_32_loops_1_thread"] = extrapolate(res[name], args.tokens)
        res["wall_s"] = time.perf_counter() - t0
        print(json.dumps(res, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
