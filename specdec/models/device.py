"""Where a draft model runs, and in which number format: the drafter's `device`, `dtype` and
`quantize` settings with "auto" decided for the host.

    cpu    float32 weights with dynamic int8 quantisation of the Linear layers (a CPU drafter
           is memory-bound: int8 drafts about 3x faster, see specdec.models.load_causal_lm);
           a draft asked for in bfloat16 or float16 runs unquantised (int8's activations are
           float32: asking for both is a UserError naming the settings).
    cuda   one GPU (cuda:0, or the one CUDA_VISIBLE_DEVICES leaves), bfloat16 weights, or
           float16 on a GPU without bfloat16; int8 dynamic quantisation is CPU-only.
    auto   cuda when torch sees a GPU, else cpu.

The probe (`cuda_probe`) is a parameter, so the decision is tested on hosts without a GPU.

`to_device` moves a loaded draft model to its device. On cuda it also turns torch's cuDNN
attention backend off for the process: cuDNN builds an execution plan for every new
key/value length it sees, and a drafter's single-session step attends one query to a cache
one token longer than the last, so every step paid a new plan. Measured on an H200 (torch
2.11.0+cu130, bf16, one query against keys of 64 lengths never seen, 14 heads of dim 64):
`scaled_dot_product_attention` took a median 38 ms (max 760 ms) with cuDNN, 0.03 ms without;
the tiny draft's serial step 13.7 ms a token against 1.5-1.9 ms (docs/models-and-gpus.md, "A
drafter on a GPU"). torch then picks flash or memory-efficient attention, which need no plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.errors import UserError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class GpuProbe:
    """What the host offers: a usable CUDA GPU, and whether it computes in bfloat16."""

    cuda: bool
    bf16: bool = False


def cuda_probe() -> GpuProbe:
    """torch's view of this host (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        return GpuProbe(cuda=False)
    return GpuProbe(cuda=True, bf16=bool(torch.cuda.is_bf16_supported()))


@dataclass(frozen=True)
class Placement:
    """Where and how the draft model is loaded (`load_causal_lm`'s device, dtype, quantize)."""

    device: str  # "cpu" or "cuda"
    dtype: str  # a torch dtype name: float32, bfloat16, float16
    quantize: str  # "none" or "int8"


def draft_placement(
    device: str = "auto", dtype: str = "auto", quantize: str = "auto", probe: Callable[[], GpuProbe] = cuda_probe
) -> Placement:
    """Decide the drafter's placement (see module docstring). Asking for cuda on a host without
    one, or int8 on cuda, is a UserError naming the setting."""
    if device not in DEVICES:
        raise UserError(f"device {device!r} is not one of {', '.join(DEVICES)}", "pass --device auto, cpu or cuda")
    gpu = probe() if device in ("auto", "cuda") else GpuProbe(cuda=False)
    if device == "cuda" and not gpu.cuda:
        raise UserError(
            "device cuda: torch sees no CUDA GPU on this host",
            "check the driver and CUDA_VISIBLE_DEVICES, install a CUDA build of torch, or pass --device cpu",
        )
    where = "cuda" if gpu.cuda else "cpu"
    if where == "cuda":
        if quantize == "int8":
            raise UserError(
                "quantize int8 is CPU-only (torch's dynamic quantisation)",
                "pass --quantize none (or auto) with --device cuda",
            )
        return Placement("cuda", dtype if dtype != "auto" else ("bfloat16" if gpu.bf16 else "float16"), "none")
    dtype = dtype if dtype != "auto" else "float32"
    if quantize == "int8" and dtype != "float32":
        raise UserError(
            f"quantize int8 runs float32 activations (torch's dynamic quantisation), not dtype {dtype}",
            "pass --quantize none with --dtype bfloat16/float16, or leave --dtype auto",
        )
    # auto: int8 for a float32 draft; a draft asked for in bfloat16/float16 runs as loaded
    return Placement("cpu", dtype, ("int8" if dtype == "float32" else "none") if quantize == "auto" else quantize)


def to_device(model: torch.nn.Module, device: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`model` on `device` ("cpu" or "cuda"), in `dtype` when given. On cuda, torch's cuDNN
    attention backend is turned off for this process (see the module docstring): the drafter's
    process runs only its draft model, so the setting is the drafter's to make."""
    import torch

    if device != "cpu":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
