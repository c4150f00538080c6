"""Serving by Hugging Face repo id, offline, and compatibility checked where the parts meet.

The tiny pair is put into a fresh Hugging Face cache (HF_HOME) as acme/tiny-target (at tag v1)
and acme/tiny-draft; every service runs with HF_HUB_OFFLINE=1 and gets only repo ids. Its
greedy output must equal a plain vLLM engine's on the target's folder, token for token. A
drafter whose vocabulary does not fit is passed over (the request decodes plainly, exact), and
a gateway whose tokenizer does not fit refuses requests with FAILED_PRECONDITION."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import hf_cache
import model_variants
import pytest
from conftest import vllm_reference
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

from gateway.client import GatewayClient
from specdec.models import resolve
from specdec_cli.launch import Service, free_port, start_service, stop_all

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[dict[str, Service]]:
    root = tmp_path_factory.mktemp("hf-refs")
    hub = root / "hf" / "hub"
    hf_cache.store(resolve("tiny/target"), "acme/tiny-target", hub, revision="v1")
    hf_cache.store(resolve("tiny/draft-mid"), "acme/tiny-draft", hub)
    other = model_variants.other_vocab(resolve("tiny/target"), root / "other-vocab")
    env = {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
    started: list[Service] = []

    def start(kind: str, *args: str) -> Service:
        extra = ["--rest-port", "0"] if kind == "gateway" else []
        svc = start_service(kind, free_port(), [*args, *extra], log_dir, env=env, metrics_port=0)
        started.append(svc)
        return svc

    try:
        verifier = start(
            "verifier",
            "--model",
            "acme/tiny-target",
            "--revision",
            "v1",
            "--max-gamma",
            "8",
            "--threads",
            "1",
            "--no-adaptive-gamma",
            "--draft-wait-margin-ms",
            "2000",
        )
        drafter = start("drafter", "--model", "acme/tiny-draft", "--quantize", "none", "--threads", "1")
        misfit = start("drafter", "--model", str(other), "--quantize", "none", "--threads", "1")
        services = {
            "verifier": verifier,
            "drafter": drafter,
            "misfit": misfit,
            "gateway": start(
                "gateway",
                "--tokenizer",
                "acme/tiny-target@v1",
                "--drafter-address",
                drafter.address,
                "--verifier-address",
                verifier.address,
            ),
            "gateway-misfit-drafter": start(
                "gateway",
                "--tokenizer",
                "acme/tiny-target",
                "--tokenizer-revision",
                "v1",
                "--drafter-address",
                misfit.address,
                "--verifier-address",
                verifier.address,
            ),
            "gateway-misfit-tokenizer": start(
                "gateway",
                "--tokenizer",
                str(other),
                "--drafter-address",
                drafter.address,
                "--verifier-address",
                verifier.address,
            ),
        }
        for svc in started:
            svc.wait_ready(300)
        yield services
    finally:
        stop_all(reversed(started))


@pytest.fixture(scope="module")
def case(stack) -> tuple[list[list[int]], list[list[int]]]:
    target = resolve("tiny/target")
    ps = prompts(AutoTokenizer.from_pretrained(target), 6)
    return ps, vllm_reference(target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ps])


def test_services_started_by_repo_id_offline_give_the_folders_exact_output(stack, case) -> None:
    ps, reference = case
    responses = generate_all(stack["gateway"].address, [spec(p, MAX_TOKENS, gamma=4) for p in ps])
    assert [list(r.token_ids) for r in responses] == reference
    drafted = sum(r.stats.drafted_tokens for r in responses)
    assert drafted > 0 and 0 < sum(r.stats.accepted_tokens for r in responses) < drafted
    assert not any(r.stats.drafter_fallback for r in responses)


def test_a_drafter_that_does_not_fit_is_refused_and_the_output_stays_exact(stack, case) -> None:
    ps, reference = case
    gateway = stack["gateway-misfit-drafter"]
    responses = generate_all(gateway.address, [spec(p, MAX_TOKENS, gamma=4) for p in ps])
    assert [list(r.token_ids) for r in responses] == reference
    assert sum(r.stats.drafted_tokens for r in responses) == 0  # never alpha = 0: no draft was verified
    assert all(r.stats.drafter_fallback for r in responses)
    log = gateway.log_path.read_text()
    assert log.count("refused: draft") == 1, log[-2000:]  # one line, once
    assert "does not fit target 'acme/tiny-target': different vocabularies (512 vs 513 tokens" in log
    ngram = generate_all(gateway.address, [spec(p, MAX_TOKENS, gamma=4, drafter="ngram") for p in ps])
    assert [list(r.token_ids) for r in ngram] == reference  # the n-gram drafter needs no model: not refused
    assert sum(r.stats.drafted_tokens for r in ngram) > 0


def test_a_gateway_whose_tokenizer_does_not_fit_refuses_requests(stack, case) -> None:
    ps, _ = case
    with GatewayClient(stack["gateway-misfit-tokenizer"].address, timeout_s=120) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(spec(ps[0], 4, gamma=4))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        "gateway tokenizer" in err.value.details() and "does not fit target 'acme/tiny-target'" in err.value.details()
    )
