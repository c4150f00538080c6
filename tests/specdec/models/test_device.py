"""Where the drafter runs, decided without a GPU: the probe is injected."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specdec.errors import UserError
from specdec.models.device import GpuProbe, Placement, draft_placement, to_device


def no_gpu() -> GpuProbe:
    return GpuProbe(cuda=False)


def h100() -> GpuProbe:
    return GpuProbe(cuda=True, bf16=True)


def t4() -> GpuProbe:  # no bfloat16
    return GpuProbe(cuda=True, bf16=False)


def test_auto_is_cuda_in_bf16_on_a_gpu_host_and_int8_on_a_cpu_host() -> None:
    assert draft_placement(probe=h100) == Placement("cuda", "bfloat16", "none")
    assert draft_placement(probe=t4) == Placement("cuda", "float16", "none")
    assert draft_placement(probe=no_gpu) == Placement("cpu", "float32", "int8")


def test_cpu_is_the_cpu_even_with_a_gpu_and_never_asks_the_probe() -> None:
    def must_not_probe() -> GpuProbe:
        raise AssertionError("probed")

    assert draft_placement("cpu", probe=must_not_probe) == Placement("cpu", "float32", "int8")
    assert draft_placement("cpu", "bfloat16", "none", probe=must_not_probe) == Placement("cpu", "bfloat16", "none")


def test_explicit_settings_win_on_a_gpu() -> None:
    assert draft_placement("cuda", "float32", probe=h100) == Placement("cuda", "float32", "none")
    assert draft_placement("auto", "float16", "none", probe=h100) == Placement("cuda", "float16", "none")


def test_impossible_requests_are_one_error_naming_the_setting() -> None:
    with pytest.raises(UserError, match="device cuda: torch sees no CUDA GPU on this host; .*--device cpu"):
        draft_placement("cuda", probe=no_gpu)
    with pytest.raises(UserError, match="quantize int8 is CPU-only"):
        draft_placement("cuda", quantize="int8", probe=h100)
    with pytest.raises(UserError, match="device 'tpu' is not one of auto, cpu, cuda"):
        draft_placement("tpu", probe=h100)


def test_the_drafter_flag_reaches_the_config() -> None:
    from specdec import config
    from specdec_cli import main as cli

    args = cli.build_parser(["serve"]).parse_args(["serve", "drafter", "--device", "cuda", "--revision", "v2"])
    cfg = cli.serve_config(args)
    assert isinstance(cfg, config.DrafterConfig)
    assert (cfg.device, cfg.revision, cfg.dtype, cfg.quantize) == ("cuda", "v2", "auto", "auto")


def test_a_cpu_draft_in_bfloat16_is_not_quantised_and_int8_with_it_is_refused() -> None:
    """int8 dynamic quantisation computes in float32: a bfloat16 draft on the CPU runs as loaded,
    and asking for both fails at start naming them (it used to crash at the first draft)."""
    assert draft_placement("cpu", "bfloat16", probe=no_gpu) == Placement("cpu", "bfloat16", "none")
    with pytest.raises(UserError, match="quantize int8.*dtype bfloat16"):
        draft_placement("cpu", "bfloat16", "int8", probe=no_gpu)


class _Recorder(torch.nn.Module):
    """Stands in for a draft model: records where it was asked to go (no GPU needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[object, object]] = []

    def to(self, *args: object, **kwargs: object) -> _Recorder:  # type: ignore[override]
        self.moves.append((kwargs.get("device", args[0] if args else None), kwargs.get("dtype")))
        return self


@pytest.fixture
def cudnn_attention() -> Iterator[None]:
    """torch's process-wide cuDNN attention flag, restored after the test."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("cudnn_attention")
def test_a_cuda_draft_runs_without_cudnn_attention() -> None:
    """cuDNN builds an attention plan per new key length: a drafter's every step (docstring of
    specdec.models.device, measured on an H200)."""
    model = _Recorder()
    assert to_device(model, "cuda", torch.bfloat16) is model
    assert model.moves == [("cuda", torch.bfloat16)]
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.usefixtures("cudnn_attention")
def test_a_cpu_draft_leaves_torchs_attention_settings_alone() -> None:
    model = _Recorder()
    to_device(model, "cpu")
    assert model.moves == [("cpu", None)]
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.usefixtures("cudnn_attention")
def test_load_causal_lm_places_a_cuda_draft_through_to_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafter's loader takes the same path (the model's own `.to` stubbed: no GPU here)."""
    from specdec.models import load_causal_lm

    moved: list[object] = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a or k) or self)
    load_causal_lm("tiny/draft-mid", "float32", "none", device="cuda")
    assert moved == [("cuda",)] and not torch.backends.cuda.cudnn_sdp_enabled()
