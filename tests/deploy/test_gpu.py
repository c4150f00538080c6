"""The GPU deployment uses the verifier's CUDA defaults (vllm serve's), on a CUDA base that
matches the build of vllm 0.32.0 (CUDA 13.0: torch 2.13.0's cuda-toolkit==13.0.3)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# Settings whose unset value means "vllm serve's default on CUDA" (verifier.vllm_hooks.engine_settings).
CUDA_AUTO = {
    "SPECDEC_MAX_MODEL_LEN",
    "SPECDEC_KV_CACHE_GIB",
    "SPECDEC_ENFORCE_EAGER",
    "SPECDEC_MAX_NUM_SEQS",
    "SPECDEC_MAX_NUM_BATCHED_TOKENS",
    "SPECDEC_WARMUP",
}


def _env(path: Path) -> set[str]:
    names: set[str] = set()
    for doc in yaml.safe_load_all(path.read_text()):
        for c in (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            names |= {e["name"] for e in c.get("env", [])}
    return names


def test_the_gpu_verifier_leaves_the_cuda_defaults_to_vllm() -> None:
    k8s = REPO / "deploy" / "k8s"
    gpu = _env(k8s / "overlays" / "gpu" / "verifier-gpu.yaml") | _env(k8s / "base" / "verifier.yaml")
    assert not gpu & CUDA_AUTO, gpu & CUDA_AUTO
    assert {"SPECDEC_DTYPE", "HF_HOME", "HF_HUB_OFFLINE"} <= gpu
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    cuda_stage = dockerfile[dockerfile.index("AS verifier-cuda") :]
    assert not any(name in cuda_stage for name in CUDA_AUTO)


def test_the_cuda_image_matches_vllm_0_32s_cuda_build() -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    image = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(\w+)-ubuntu([\d.]+)$", dockerfile, re.M)
    assert image, "ARG CUDA_IMAGE=nvidia/cuda:X.Y.Z-FLAVOUR-ubuntuV"
    assert image.groups()[:3] == ("13", "0", "3")  # torch 2.13.0 (vllm 0.32.0's pin): cuda-toolkit==13.0.3
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"vllm==0.32.0"' in pyproject, "vLLM moved: check its CUDA build and this base image"
