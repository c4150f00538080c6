"""One place for configuration.

Every setting has a default here, can be overridden by an environment variable
(`SPECDEC_<NAME>`), and by a command-line flag of `specdec serve ...` / `specdec up`.

Terms:
    gamma      number of draft tokens the verifier checks per target step
               (also called "speculative tokens"); 0 means plain target decoding.
    max_gamma  the largest gamma a request may ask for; the verifier's vLLM engine
               is built with `num_speculative_tokens = max_gamma`.
    lookahead  how many tokens past gamma the drafter may draft ahead of the committed
               context while a block is being verified (overlap).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

DEFAULT_GATEWAY_PORT = 50051
DEFAULT_DRAFTER_PORT = 50052
DEFAULT_VERIFIER_PORT = 50053
DEFAULT_HOST = "127.0.0.1"

# Hard limit on gamma; the issue tracker's users tune gamma in 1..8, vLLM caps at 32.
MAX_GAMMA_LIMIT = 32

T = TypeVar("T")


def cache_dir() -> Path:
    """Where pulled and built models live (`SPECDEC_CACHE_DIR`, default ~/.cache/specdec)."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specdec"


def _coerce(value: str, kind: Any) -> Any:
    if kind in (int, "int"):
        return int(value)
    if kind in (float, "float"):
        return float(value)
    if kind in (bool, "bool"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value


def from_env(cls: type[T], **overrides: Any) -> T:
    """Build a config dataclass: defaults < `SPECDEC_<FIELD>` env vars < explicit overrides.

    Overrides equal to None are ignored, so argparse namespaces can be passed through.
    """
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        env = os.environ.get(f"SPECDEC_{f.name.upper()}")
        if env is not None and env != "":
            kwargs[f.name] = _coerce(env, f.type)
        if overrides.get(f.name) is not None:
            kwargs[f.name] = overrides[f.name]
    return cls(**kwargs)


@dataclass
class DrafterConfig:
    """The drafter service: a small causal LM (and a model-free n-gram drafter)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_DRAFTER_PORT
    # Model reference: a registry name such as "qwen-coder/draft" or a folder.
    model: str = "qwen-coder/draft"
    # Torch threads for drafting (a separate drafter host gives it its cores).
    threads: int = 1
    dtype: str = "float32"
    # "int8": dynamic int8 quantisation of the draft's Linear layers (CPU; ~3x faster drafting
    # for a memory-bound draft, see specdec.models.load_causal_lm); "none": as loaded.
    quantize: str = "int8"
    # Tokens past gamma the drafter may draft ahead of the committed context while a block is
    # being verified (overlap): -1 is gamma + 1 (the next block and a guess of the bonus
    # token); 0 is lock-step (one block per round).
    lookahead: int = -1
    # A partial block is sent when its first token waited this long.
    flush_ms: float = 50.0
    # Prompt tokens per prefill step of the draft model. A session prefills its prompt from
    # `open` on, while the target is queued and prefills; chunks let other sessions' drafts
    # (which come first) interleave with a long prompt's prefill.
    prefill_chunk: int = 128
    # Sampled requests: draft by sampling q (True, q sent as a sparse top-k support) or by
    # taking q's argmax (False). vLLM verifies drafts as one-hot, accepting x with
    # probability p(x): argmax drafts maximise that, so False is the default.
    sample_drafts: bool = False
    # Size of the sparse support of q sent with sampled drafts (top-k of the draft).
    q_top_k: int = 16
    # n-gram drafter: longest/shortest suffix to look up in the context.
    ngram_max: int = 4
    ngram_min: int = 1
    # Prometheus /metrics port (0: off).
    metrics_port: int = 9092
    # Fault injection (tests, drills): sleep inject_delay_ms in every inject_every-th draft step.
    inject_delay_ms: float = 0.0
    inject_every: int = 0


@dataclass
class VerifierConfig:
    """The verifier service: vLLM holding the target model."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_VERIFIER_PORT
    model: str = "qwen-coder/target"
    max_gamma: int = 8
    max_model_len: int = 2048
    max_num_seqs: int = 32
    dtype: str = "float32"
    # KV cache size in GiB (required on CPU: vLLM's utilisation check fails on these VMs).
    kv_cache_gib: float = 1.0
    # CPU threads for the engine (OMP_NUM_THREADS); 0 keeps the environment's value.
    threads: int = 0
    # CPUs (comma list) for the verifier's gRPC and asyncio threads; the engine thread keeps the
    # process's CPUs. Empty: all threads share them. (`specdec up` gives the drafter's core.)
    io_cpus: str = ""
    # Replace vLLM's CPU expand_batch_to_tokens (vLLM issue #55005); never disable in production.
    cpu_sampler_fix: bool = True
    enforce_eager: bool = True
    # vLLM's prefix cache (benchmarks turn it off so repeated prompts cost the same each time).
    prefix_caching: bool = True
    # Most a target step waits for the drafts of its speculative requests, milliseconds;
    # past it the step decodes those requests plainly. Within it, a step waits for a
    # request's missing drafts only as long as they are expected to take: the missing
    # tokens x the drafter's measured ms per token (announced in its `ready`, then measured
    # from arrivals) x (1 + draft_wait_slack), plus draft_wait_margin_ms. A request whose
    # drafter has not finished its prefill (no `ready` yet) is not waited for.
    draft_wait_ms: float = 2000.0
    draft_wait_slack: float = 0.5
    draft_wait_margin_ms: float = 50.0
    # Adaptive gamma (verifier.budget): each step verifies only the drafts that raise its
    # expected tokens per ms under the measured step cost and each request's recent
    # acceptance; under saturation this backs off to plain decoding. False: always a
    # request's full gamma.
    adaptive_gamma: bool = True
    # When the engine is idle and a request arrives, wait until no other arrives for this
    # long (ms; at most 10 times it) so a burst is prefilled in one step instead of one
    # request ahead of the rest, whose prefill would then stall the first one's decoding.
    batch_window_ms: float = 20.0
    # Prometheus /metrics port (0: off).
    metrics_port: int = 9093
    # Fault injection (tests, drills): sleep inject_delay_ms in every inject_every-th engine step,
    # and inject_prefill_delay_ms in every step that starts a new request's prefill.
    inject_delay_ms: float = 0.0
    inject_every: int = 0
    inject_prefill_delay_ms: float = 0.0


@dataclass
class GatewayConfig:
    """The gateway: runs the rounds between one drafter and one verifier per request."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_GATEWAY_PORT
    drafter_address: str = f"{DEFAULT_HOST}:{DEFAULT_DRAFTER_PORT}"
    verifier_address: str = f"{DEFAULT_HOST}:{DEFAULT_VERIFIER_PORT}"
    # Tokenizer used for text prompts and detokenisation (the target's).
    tokenizer: str = "qwen-coder/target"
    default_gamma: int = 4
    default_drafter: str = "model"
    default_max_tokens: int = 128
    # Seconds the drafter may stay silent while it owes an answer: from a commit (the target's
    # tokens, the first one included) to its next message. Past it the request goes on as
    # plain target decoding. The target's queueing and prefill never count: before the
    # first commit the drafter owes nothing (it is prefilling its own copy of the prompt).
    drafter_timeout_s: float = 10.0
    # Prometheus /metrics port (0: off); the REST bridge serves /metrics too.
    metrics_port: int = 9091
    # OpenAI-compatible REST bridge (/v1/completions, /v1/chat/completions, /v1/models,
    # /health, /metrics) port (0: off).
    rest_port: int = 8000
    # Latency spikes: a stage spikes above max(spike_min_ms, spike_factor x its rolling p95),
    # or above spike_ms when that is > 0.
    spike_factor: float = 3.0
    spike_min_ms: float = 5.0
    spike_ms: float = 0.0
