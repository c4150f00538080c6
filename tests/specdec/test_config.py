from __future__ import annotations

from specdec.config import DrafterConfig, VerifierConfig, cache_dir, from_env


def test_env_then_overrides(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_PORT", "6001")
    monkeypatch.setenv("SPECDEC_CPU_SAMPLER_FIX", "0")
    cfg = from_env(VerifierConfig, max_gamma=3, port=None)
    assert cfg.port == 6001 and cfg.max_gamma == 3 and cfg.cpu_sampler_fix is False
    assert from_env(DrafterConfig, port=7000).port == 7000


def test_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
