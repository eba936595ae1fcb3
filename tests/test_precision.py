"""The numeric path a run takes (drc_core.model.precision.choose): defaults, "auto", and the one line that says why."""

from __future__ import annotations

import pytest
import torch

from drc_core.errors import DrcError
from drc_core.model import precision
from drc_core.training.config import preset

CPU = torch.device("cpu")


def test_defaults_are_fp32_with_compiled_blocks(monkeypatch):
    monkeypatch.setattr(precision.shutil, "which", lambda name: "/usr/bin/" + name)
    cfg = preset("small")
    path = precision.choose(cfg.autocast, cfg.compile, CPU)
    assert (path.autocast, path.compile) == ("none", True)
    assert path.why.startswith("numeric path: fp32 + compile: autocast=none as set, compiled blocks")
    assert "--set autocast=none --set compile=false" in path.why
    assert preset("tiny").compile == "false" and preset("paper-135m").autocast == "bf16"
    assert (preset("cpu").autocast, preset("cpu").compile) == ("auto", "auto")  # the reference: bf16 where fast


def test_no_compiler_stays_eager_and_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(precision.shutil, "which", lambda name: None)
    path = precision.choose("none", "auto", CPU)
    assert path.compile is False and "install g++" in path.why


@pytest.mark.parametrize(("cpuinfo", "want"), [("flags : fpu amx_bf16 avx512_bf16\n", "bf16"),
                                               ("flags : fpu sse2 avx2\n", "none")])
def test_auto_autocast_follows_the_cpu_flags(monkeypatch, tmp_path, cpuinfo, want):
    info = tmp_path / "cpuinfo"
    info.write_text(cpuinfo)
    read = precision.cpu_bf16_flags.__wrapped__  # the uncached reader, pointed at a made-up /proc/cpuinfo
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: read(str(info)))
    path = precision.choose("auto", "false", CPU)
    assert path.autocast == want and path.compile is False
    assert ("bf16 autocast (CPU with amx_bf16+avx512_bf16)" in path.why) == (want == "bf16")


def test_explicit_settings_win_and_bad_values_are_errors():
    path = precision.choose("bf16", "true", CPU)
    assert (path.autocast, path.compile) == ("bf16", True)
    with pytest.raises(ValueError, match="autocast='fp8'"):
        precision.choose("fp8", "auto", CPU)
    with pytest.raises(DrcError, match="compile='maybe'"):
        preset("tiny").__class__.from_dict({**preset("tiny").to_dict(), "compile": "maybe"})
