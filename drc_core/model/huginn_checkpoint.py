"""Reading Huginn-0125 checkpoint directories (JSON and safetensors, never pickle) into a
:class:`~drc_core.model.huginn.HuginnLM`: the config and every safetensors header are checked before a tensor is
touched; every failure is a one-line :class:`DrcError`."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

from drc_core.errors import MAX_LOOPS, DrcError, first_line
from drc_core.guard import read_json, read_regular
from drc_core.model.huginn import HuginnConfig, HuginnLM, rope_tables
from drc_core.model.lm import CONFIG_FILE, WEIGHTS_FILE  # the Hugging Face names, which this project's runs share

__all__ = ["config_from_json", "hf_config", "load_huginn", "load_huginn_tokenizer", "rename_tensor"]

INDEX_FILE, TOKENIZER_FILE = "model.safetensors.index.json", "tokenizer.json"
MODEL_TYPE, ARCHITECTURE = "huginn_raven", "RavenForCausalLM"
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (the safetensors library's own limit)
# The largest value this reader accepts per config field (Huginn-0125: 5280, 55, 17920, 65536, 4096, 2/4/2, 32).
LIMITS = {"n_embd": 1 << 16, "n_heads": 1 << 12, "intermediate_size": 1 << 18, "vocab_size": 1 << 21,
          "padded_vocab_size": 1 << 21, "block_size": 1 << 20, "n_layers_in_prelude": 256,
          "n_layers_in_recurrent_block": 256, "n_layers_in_coda": 256, "mean_recurrence": MAX_LOOPS}
MAX_ROPE = 1 << 25  # block_size x head_dim: the RoPE tables, 128 MB at most (Huginn-0125: 4096 x 96)
# Behaviour the minimal upstream code hard-codes; a config that says otherwise describes another model.
FIXED = {"injection_type": "linear", "state_init": "like-init", "block_class_name": "SandwichBlock",
         "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "bias": False,
         "test_time_noise": 0}
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# upstream tensor-name prefix -> ours
RENAME = (("transformer.wte.", "tok_emb."), ("transformer.prelude.", "prelude."), ("transformer.adapter.", "adapter."),
          ("transformer.core_block.", "core."), ("transformer.coda.", "coda."), ("transformer.ln_f.", "norm."),
          ("lm_head.", "lm_head."))


def _read_json(path: Path, what: str) -> object:
    return read_json(path, what, f"restore the {what}")


def hf_config(path: str | Path) -> dict | None:
    """The ``config.json`` of a Hugging Face-style checkpoint directory (``model_type`` or ``architectures``), else
    None."""
    p = Path(path) / CONFIG_FILE
    try:
        data = _read_json(p, "model config") if p.is_file() else None
    except (DrcError, OSError):
        return None
    return data if isinstance(data, dict) and ("model_type" in data or "architectures" in data) else None


def config_from_json(data: object, where: str) -> HuginnConfig:
    """Check an upstream config.json (one-line DrcError naming the field and the fix) and convert it."""
    if not isinstance(data, dict):
        raise DrcError(f"{where} is not a JSON object: restore the checkpoint's config.json")
    kind, arch = data.get("model_type"), data.get("architectures")
    if kind != MODEL_TYPE and not (isinstance(arch, list) and ARCHITECTURE in arch):
        raise DrcError(f"{where} describes a {kind!r} model ({arch}), not Huginn ({MODEL_TYPE}): drc_core.load "
                       "reads Huginn checkpoints and this project's run directories; convert it or pick another")

    def num(name: str, lo: float, hi: float, src: dict = data, integer: bool = True) -> float:
        v = src.get(name)
        ok = isinstance(v, int) if integer else isinstance(v, int | float) and math.isfinite(v)
        if isinstance(v, bool) or not ok or not lo <= v <= hi:
            what = "an integer" if integer else "a number"
            raise DrcError(f"{where}: {name}={v!r} is invalid; it must be {what} in [{lo:g}, {hi:g}] (the range "
                           "this reader accepts): use the checkpoint's own config.json")
        return v

    ints = {k: int(num(k, 0 if k == "n_layers_in_prelude" else 1, hi)) for k, hi in LIMITS.items()}
    d, h = ints["n_embd"], ints["n_heads"]
    kv = int(num("num_key_value_heads", 1, LIMITS["n_heads"])) if "num_key_value_heads" in data else h
    if d % h or (d // h) % 2 or data.get("head_dim", d // h) != d // h or kv != h:
        raise DrcError(f"{where}: n_embd={d}, n_heads={h}, num_key_value_heads={kv}, head_dim="
                       f"{data.get('head_dim')} do not give one even head size shared by all heads: "
                       "use the checkpoint's own config.json")
    if ints["block_size"] * (d // h) > MAX_ROPE:
        raise DrcError(f"{where}: block_size={ints['block_size']} x head_dim={d // h} is above the {MAX_ROPE} RoPE "
                       "entries this reader accepts: use the checkpoint's own config.json")
    if ints["padded_vocab_size"] < ints["vocab_size"]:
        raise DrcError(f"{where}: padded_vocab_size={ints['padded_vocab_size']} < vocab_size="
                       f"{ints['vocab_size']}; use the checkpoint's own config.json")
    for key, want in FIXED.items():
        if key in data and data[key] != want:
            raise DrcError(f"{where}: {key}={data[key]!r} is not supported; this reader implements Huginn's "
                           f"{key}={want!r} only")
    for key in ("qk_bias", "tie_embeddings"):
        if not isinstance(data.get(key, True), bool):
            raise DrcError(f"{where}: {key}={data[key]!r} is invalid; use true or false")
    init = data.get("init_values")
    if not isinstance(init, dict):
        raise DrcError(f"{where}: init_values is missing or not an object; use the checkpoint's own config.json")
    return HuginnConfig(d_model=d, n_heads=h, hidden_dim=ints["intermediate_size"],
                        vocab_size=ints["padded_vocab_size"], tokenizer_vocab_size=ints["vocab_size"],
                        max_seq_len=ints["block_size"],
                        n_prelude=ints["n_layers_in_prelude"], n_core=ints["n_layers_in_recurrent_block"],
                        n_coda=ints["n_layers_in_coda"], mean_recurrence=ints["mean_recurrence"],
                        rope_base=float(num("rope_base", 1e-3, 1e12, integer=False)),
                        norm_eps=float(num("norm_eps", 1e-12, 1.0, integer=False)),
                        qk_bias=data.get("qk_bias", True), tie_embeddings=data.get("tie_embeddings", True),
                        embed_scale=float(num("embed_scale", 1e-6, 1e6, init, integer=False)),
                        state_std=float(num("std", 0.0, 1e3, init, integer=False)))


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors header, checked against the file's size first."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
            raise DrcError(f"'{path}' declares a {n}-byte header but holds {size} bytes (limit {MAX_HEADER_BYTES >> 20}"
                           " MB): it is truncated or not a safetensors file; download it again")
        raw = f.read(n)
    out, end = {}, 0
    try:
        for name, info in json.loads(raw).items():
            if name == "__metadata__":
                continue
            dtype, shape, (lo, hi) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, lo, hi)):
                raise ValueError(f"tensor {name} has a bad shape or offsets")
            if dtype not in DTYPES:
                raise DrcError(f"'{path}': tensor {name} has dtype {dtype}; Huginn weights are F32, F16 or BF16: "
                               "use an unquantized checkpoint")
            if hi - lo != math.prod(shape) * DTYPES[dtype].itemsize:
                raise DrcError(f"'{path}': tensor {name} declares shape {tuple(shape)} but {hi - lo} bytes: the "
                               "header is damaged; download the file again")
            out[name], end = (dtype, tuple(shape)), max(end, hi)
    except DrcError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # UnicodeDecodeError is a ValueError
        raise DrcError(f"'{path}' has a malformed safetensors header ({first_line(exc, 80)}): download it again"
                       ) from None
    if end > size - 8 - n:
        raise DrcError(f"'{path}' is truncated or declares too much: its header needs {end} bytes of tensor data but "
                       f"the file holds {size - 8 - n}; download it again")
    return out


def _weight_files(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every stored tensor -> (its file, dtype, shape), from model.safetensors or the shards of its index."""
    if (path / WEIGHTS_FILE).is_file():
        files = [path / WEIGHTS_FILE]
    elif (path / INDEX_FILE).is_file():
        index = _read_json(path / INDEX_FILE, "shard index")
        names = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(names, dict) or not all(isinstance(v, str) and Path(v).name == v and v not in ("", ".", "..")
                                                  for v in names.values()):
            raise DrcError(f"'{path / INDEX_FILE}' has no weight_map of file names beside it: download it again")
        files = [path / f for f in sorted(set(names.values()))]
        if missing := [f.name for f in files if not f.is_file()]:
            raise DrcError(f"'{path}' lacks the shard {missing[0]} its {INDEX_FILE} names: download the missing files")
    else:
        raise DrcError(f"'{path}' has {CONFIG_FILE} but no {WEIGHTS_FILE} (nor {INDEX_FILE}): download the weights "
                       "into it")
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for f in files:
        for name, (dtype, shape) in _header(f).items():
            if name in out:
                raise DrcError(f"tensor {name} is stored twice ('{out[name][0].name}', '{f.name}'): download again")
            out[name] = (f, dtype, shape)
    return out


def rename_tensor(name: str, ours: bool) -> str:
    """An upstream tensor name as ours (``ours``), or ours as upstream's."""
    for pair in RENAME:
        src, dst = pair if ours else pair[::-1]
        if name.startswith(src):
            return dst + name[len(src):]
    return name


def load_huginn(path: str | Path, *, dtype: torch.dtype | str | None = None,
                map_location: str | torch.device = "cpu") -> HuginnLM:
    """A Huginn checkpoint directory as a :class:`HuginnLM` in eval mode, weights in ``dtype`` (default: the stored
    embedding's; memory-mapped where stored so). A stored ``freqs_cis`` must be ``rope_base``'s; a tied checkpoint's
    stored ``lm_head.weight`` is ignored."""
    path, want = Path(path), dtype
    if dtype is not None:
        names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        want = names.get(dtype, getattr(torch, dtype, None)) if isinstance(dtype, str) else dtype
        if want not in DTYPES.values():
            raise DrcError(f"dtype={dtype!r} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    if not (path / CONFIG_FILE).is_file():
        raise DrcError(f"'{path}' has no {CONFIG_FILE}: pass a Huginn checkpoint directory")
    cfg = config_from_json(_read_json(path / CONFIG_FILE, "model config"), f"'{path / CONFIG_FILE}'")
    stored = _weight_files(path)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = HuginnLM(cfg)
    expected = {rename_tensor(n, ours=False): tuple(p.shape) for n, p in model.named_parameters()}
    optional = {"freqs_cis": (1, cfg.max_seq_len, 1, cfg.head_dim // 2, 2)}
    if cfg.tie_embeddings:
        optional["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    hint = (f"config.json (n_embd={cfg.d_model}, n_heads={cfg.n_heads}, intermediate_size={cfg.hidden_dim}, "
            f"padded_vocab_size={cfg.vocab_size}, block_size={cfg.max_seq_len}, layers {cfg.n_prelude}/{cfg.n_core}/"
            f"{cfg.n_coda}) does not match the weights in '{path}'; use the checkpoint's own config.json")
    for name, shape in {**expected, **optional}.items():  # in the model's order
        if name in expected and name not in stored:
            raise DrcError(f"tensor {name} is missing: the {hint}")
        if name in stored and stored[name][2] != shape:
            raise DrcError(f"tensor {name} has shape {stored[name][2]} but config.json implies {shape}: the {hint}")
    for name in stored:
        if name not in expected and name not in optional:
            raise DrcError(f"tensor {name} is not part of this architecture: the {hint}")
    want = DTYPES[stored["transformer.wte.weight"][1]] if want is None else want
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
    with ExitStack() as stack:
        maps: dict[Path, object] = {}  # one memory map per file for the tensors used in place
        for name, (file, stored_dtype, _) in stored.items():
            if name not in expected and name != "freqs_cis":
                continue  # a tied checkpoint's stored lm_head.weight
            target = torch.float32 if name == "freqs_cis" else want
            if DTYPES[stored_dtype] == target:
                if file not in maps:
                    maps[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                t = maps[file].get_tensor(name)  # memory-mapped: no copy
            else:  # converted through a map of its own, released (with the source's pages) right after
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    t = f.get_tensor(name).to(target)
            if name == "freqs_cis":  # used as stored if it is rope_base's table (to its dtype's rounding)
                stored_cos, stored_sin = t[0, :, 0, :, 0].float().contiguous(), t[0, :, 0, :, 1].float().contiguous()
                err = max(float((stored_cos - cos).abs().max()), float((stored_sin - sin).abs().max()))
                if not err <= (1e-5 if stored_dtype == "F32" else 1e-2):
                    raise DrcError(f"the stored RoPE table freqs_cis differs from rope_base={cfg.rope_base:g} by "
                                   f"{err:.3g}: config.json does not belong to these weights; use the checkpoint's "
                                   "own config.json")
                cos, sin = stored_cos, stored_sin
            else:
                owner, _, leaf = rename_tensor(name, ours=True).rpartition(".")
                setattr(model.get_submodule(owner), leaf, nn.Parameter(t, requires_grad=False))
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.rope_cos, model.rope_sin = cos, sin
    return model.to(map_location).eval()


def load_huginn_tokenizer(path: str | Path, cfg: HuginnConfig) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json`` (None where absent), its id count checked against the vocabulary."""
    p = Path(path) / TOKENIZER_FILE
    if not p.is_file():
        return None
    raw = read_regular(p, "a tokenizer")
    try:
        tok = Tokenizer.from_str(raw.decode())
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file (and not UTF-8)
        raise DrcError(f"'{p}' is not a readable tokenizer ({first_line(exc, 120)}): restore it") from None
    n = tok.get_vocab_size()
    if not cfg.tokenizer_vocab_size <= n <= cfg.vocab_size:
        raise DrcError(f"'{p}' has {n} ids but the checkpoint's vocabulary is {cfg.tokenizer_vocab_size} (embedding "
                       f"{cfg.vocab_size} rows): put the checkpoint's own tokenizer.json there")
    return tok
