from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import config
from specdec.config import (
    SERVICE_CONFIGS,
    DrafterConfig,
    GatewayConfig,
    VerifierConfig,
    cache_dir,
    env_name,
    flag_name,
    from_env,
)
from specdec_cli import main as cli

ROOT = Path(__file__).resolve().parents[2]

# Flags that tests, `specdec up`, `specdec demo`, the benchmarks and deployments pass today.
EXISTING_FLAGS = {
    "drafter": "--host --port --metrics-port --model --threads --dtype --quantize "
    "--sample-drafts --no-sample-drafts --lookahead --prefill-chunk",
    "verifier": "--host --port --metrics-port --model --threads --io-cpus "
    "--max-gamma --max-model-len --max-num-seqs --dtype --kv-cache-gib --draft-wait-ms "
    "--draft-wait-slack --draft-wait-margin-ms --prefix-caching "
    "--no-prefix-caching --adaptive-gamma --no-adaptive-gamma",
    "gateway": "--host --port --metrics-port --drafter-address --verifier-address --tokenizer --default-gamma "
    "--default-drafter --drafter-timeout-s --rest-port --spike-factor --spike-min-ms --spike-ms",
}


@pytest.fixture(autouse=True)
def _no_specdec_env(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPECDEC_"):
            monkeypatch.delenv(name)


def top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec")
    cli._add_serve(parser.add_subparsers(dest="command", required=True))
    return parser


def serve_parser(kind: str) -> argparse.ArgumentParser:
    """The generated parser of `specdec serve KIND`."""
    serve_p = next(a for a in top_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return next(a for a in serve_p._actions if isinstance(a, argparse._SubParsersAction)).choices[kind]


def serve(kind: str, *argv: str):
    """The config `specdec serve KIND ARGV...` would start the service with."""
    args = top_parser().parse_args(["serve", kind, *argv])
    assert args.func is cli._serve
    return cli.serve_config(args)


def test_env_then_overrides(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_PORT", "6001")
    monkeypatch.setenv("SPECDEC_CPU_SAMPLER_FIX", "0")
    cfg = from_env(VerifierConfig, max_gamma=3, port=None)
    assert cfg.port == 6001 and cfg.max_gamma == 3 and cfg.cpu_sampler_fix is False
    assert from_env(DrafterConfig, port=7000).port == 7000


def test_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path


def test_service_configs() -> None:
    assert SERVICE_CONFIGS == {"drafter": DrafterConfig, "verifier": VerifierConfig, "gateway": GatewayConfig}


@pytest.mark.parametrize("kind", sorted(SERVICE_CONFIGS))
def test_every_field_has_help_a_flag_and_an_env_var(kind: str, monkeypatch) -> None:
    cls = SERVICE_CONFIGS[kind]
    options = serve_parser(kind)._option_string_actions
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name}: no help text"
        action = options[flag_name(f.name)]
        assert action.dest == f.name and action.default is None
        assert action.help.endswith(f"(default: {config.show_default(f.default)}; env {env_name(f.name)})")
        type_ = f.type.removesuffix(" | None")  # a None default: "auto" (e.g. enforce_eager)
        if type_ == "bool":
            assert isinstance(action, argparse.BooleanOptionalAction)
            assert f"--no-{f.name.replace('_', '-')}" in options
        # the environment variable reaches the config
        value = {"int": "7", "float": "2.5", "str": "none", "bool": "0" if f.default else "1"}[type_]
        if kind == "gateway" and f.name == "default_drafter":
            value = "ngram"
        if f.name == "tls_client_auth":
            value = "require"
        monkeypatch.setenv(env_name(f.name), value)
        built = getattr(serve(kind), f.name)
        monkeypatch.delenv(env_name(f.name))
        expected = {"int": 7, "float": 2.5, "str": value, "bool": not f.default}[type_]
        assert built == expected and built != f.default, f.name
    # no flag without a field (besides -h)
    fields = {f.name for f in dataclasses.fields(cls)}
    assert {a.dest for a in serve_parser(kind)._actions} - {"help"} == fields


@pytest.mark.parametrize("kind", sorted(EXISTING_FLAGS))
def test_existing_flag_names_still_work(kind: str) -> None:
    options = serve_parser(kind)._option_string_actions
    missing = [flag for flag in EXISTING_FLAGS[kind].split() if flag not in options]
    assert not missing


def test_flags_reach_the_config() -> None:
    cfg = serve(
        "verifier",
        "--draft-wait-ms",
        "125",
        "--max-gamma",
        "5",
        "--io-cpus",
        "0,1",
        "--no-adaptive-gamma",
        "--no-prefix-caching",
        "--batch-window-ms",
        "3",
        "--no-cpu-sampler-fix",
    )
    assert isinstance(cfg, VerifierConfig)
    assert cfg.draft_wait_ms == 125.0 and cfg.max_gamma == 5 and cfg.io_cpus == "0,1"
    assert cfg.adaptive_gamma is False and cfg.prefix_caching is False and cfg.cpu_sampler_fix is False
    assert cfg.batch_window_ms == 3.0 and cfg.enforce_eager is None  # untouched: the default (auto)
    cfg = serve(
        "drafter",
        "--sample-drafts",
        "--quantize",
        "none",
        "--flush-ms",
        "7.5",
        "--q-top-k",
        "8",
        "--ngram-max",
        "6",
        "--ngram-min",
        "2",
    )
    assert isinstance(cfg, DrafterConfig)
    assert (cfg.sample_drafts, cfg.quantize, cfg.flush_ms, cfg.q_top_k, cfg.ngram_max, cfg.ngram_min) == (
        True,
        "none",
        7.5,
        8,
        6,
        2,
    )
    cfg = serve("gateway", "--default-drafter", "ngram", "--default-max-tokens", "9", "--spike-ms", "40")
    assert isinstance(cfg, GatewayConfig)
    assert (cfg.default_drafter, cfg.default_max_tokens, cfg.spike_ms) == ("ngram", 9, 40.0)
    assert serve("gateway") == GatewayConfig()  # no flags, no env: the defaults


def test_choices_are_enforced(capsys) -> None:
    with pytest.raises(SystemExit):
        serve("drafter", "--quantize", "int4")
    assert "invalid choice" in capsys.readouterr().err


def test_an_unknown_default_drafter_names_the_known_methods() -> None:
    """The method names' one owner is the proto enum DraftMethod: the gateway checks at start-up."""
    from specdec.wire import draft_method

    with pytest.raises(ValueError, match="unknown drafter 'magic'; known: model, ngram, none"):
        draft_method(serve("gateway", "--default-drafter", "magic").default_drafter)


def test_flag_wins_over_env(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_DRAFT_WAIT_MS", "300")
    monkeypatch.setenv("SPECDEC_ADAPTIVE_GAMMA", "1")
    monkeypatch.setenv("SPECDEC_MAX_GAMMA", "6")
    cfg = serve("verifier", "--draft-wait-ms", "40", "--no-adaptive-gamma")
    assert cfg.draft_wait_ms == 40.0 and cfg.adaptive_gamma is False
    assert cfg.max_gamma == 6  # no flag: the environment
    monkeypatch.setenv("SPECDEC_ADAPTIVE_GAMMA", "0")
    assert serve("verifier", "--adaptive-gamma").adaptive_gamma is True


def test_serve_help_lists_every_flag_with_its_default() -> None:
    """`specdec serve verifier --help` works without importing vLLM or torch, and shows every flag."""
    code = (
        "import sys\n"
        "from specdec_cli import main as cli\n"
        "try:\n"
        "    cli.main(['serve', 'verifier', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "print('HEAVY:', heavy)\n"
    )
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}, "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "HEAVY: []" in out
    assert "default: 2000; env SPECDEC_DRAFT_WAIT_MS" in out
    for f in dataclasses.fields(VerifierConfig):
        assert re.search(rf"{flag_name(f.name)}\b", out), f.name
        assert env_name(f.name) in out
    # and the command line itself
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "serve", "verifier", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "default: 2000" in proc.stdout and "--no-adaptive-gamma" in proc.stdout


def test_add_flags_rejects_fields_without_help() -> None:
    @dataclasses.dataclass
    class Bare:
        x: int = 1

    with pytest.raises(ValueError, match="no help"):
        config.add_flags(argparse.ArgumentParser(), Bare)


def test_auto_settings_take_auto_from_the_environment_and_a_value_from_a_flag(monkeypatch) -> None:
    """enforce_eager unset is "auto" (decided per device by verifier.vllm_hooks.engine_settings);
    SPECDEC_ENFORCE_EAGER=auto keeps it so, a flag or a true/false value sets it."""
    assert serve("verifier").enforce_eager is None
    assert serve("verifier", "--no-enforce-eager").enforce_eager is False
    monkeypatch.setenv("SPECDEC_ENFORCE_EAGER", "auto")
    assert serve("verifier").enforce_eager is None
    monkeypatch.setenv("SPECDEC_ENFORCE_EAGER", "1")
    assert serve("verifier").enforce_eager is True
    action = serve_parser("verifier")._option_string_actions["--enforce-eager"]
    assert action.help.endswith("(default: auto; env SPECDEC_ENFORCE_EAGER)")
