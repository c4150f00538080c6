"""One place for configuration.

Every setting has a default and its documentation here (`setting(default, help)`), can be
overridden by an environment variable (`SPECDEC_<NAME>`), and by a command-line flag of
`specdec serve KIND` (`--name`, generated from the dataclasses by `add_flags`, so flags,
environment variables and `--help` cannot drift from the fields).

Terms:
    gamma      number of draft tokens the verifier checks per target step
               (also called "speculative tokens"); 0 means plain target decoding.
    max_gamma  the largest gamma a request may ask for; the verifier's vLLM engine
               is built with `num_speculative_tokens = max_gamma`.
    lookahead  how many tokens past gamma the drafter may draft ahead of the committed
               context while a block is being verified (overlap).
    branch     a continuation the drafter pre-drafts for a rejection the target has not
               made yet (drafter.sessions); the verifier picks it in-step on a match.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import textwrap
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

DEFAULT_GATEWAY_PORT = 50051
DEFAULT_DRAFTER_PORT = 50052
DEFAULT_VERIFIER_PORT = 50053
DEFAULT_HOST = "127.0.0.1"

# Hard limit on gamma; the issue tracker's users tune gamma in 1..8, vLLM caps at 32.
MAX_GAMMA_LIMIT = 32

# Most alternatives a request may ask log-probabilities for (vLLM's `max_logprobs` default,
# which the verifier's engine is built with; OpenAI allows 20 for chat's top_logprobs).
MAX_LOGPROBS = 20

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
    if isinstance(kind, str) and kind.endswith(" | None"):  # a setting whose unset value means "auto"
        if value.strip().lower() == "auto":
            return None
        kind = kind.removesuffix(" | None")
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
    for f in fields(cls):  # type: ignore[arg-type]  # T is bound to any type, not DataclassInstance: callers pass config dataclasses
        env = os.environ.get(f"SPECDEC_{f.name.upper()}")
        if env is not None and env != "":
            kwargs[f.name] = _coerce(env, f.type)
        if overrides.get(f.name) is not None:
            kwargs[f.name] = overrides[f.name]
    return cls(**kwargs)


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    """A config field: its default, and the `--help` text (and allowed values) of its flag.

    The help is the field's documentation, written once here; `add_flags` turns it into the
    `specdec serve KIND --help` text, followed by the default and the environment variable.
    """
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if metavar is not None:
        metadata["metavar"] = metavar
    return field(default=default, metadata=metadata)


@dataclass
class TransportConfig:
    """What every service sets the same way: TLS (specdec.security) and its gRPC limits."""

    tls_cert: str = setting(
        "",
        "PEM certificate chain this service presents: with tls_key, its gRPC server (and the gateway's "
        "REST bridge) serves TLS, and the gateway presents it as its client certificate to the drafter and "
        "verifier. Re-read when the file changes or on SIGHUP.",
        metavar="PATH",
    )
    tls_key: str = setting("", "PEM private key of tls_cert.", metavar="PATH")
    tls_ca: str = setting(
        "",
        "PEM CA bundle: the gateway verifies the drafter and verifier with it (and then connects with TLS); "
        "with tls_client_auth=require a server accepts only clients whose certificate chains to it.",
        metavar="PATH",
    )
    tls_client_auth: str = setting(
        "none",
        "require: mutual TLS, only clients with a certificate from tls_client_ca (or tls_ca) are served "
        "(none: any client).",
        choices=("none", "require"),
    )
    tls_client_ca: str = setting(
        "",
        "PEM CA bundle this server's clients' certificates must chain to under tls_client_auth=require "
        "(empty: tls_ca). A gateway sets it to the CA of its end users' certificates (`specdec certs`: "
        "client-ca.pem), so those never chain to tls_ca, which drafters and verifiers trust.",
        metavar="PATH",
    )
    tls_allowed_peers: str = setting(
        "",
        "Comma-separated identities allowed to call this service (with tls_client_auth=require): a call "
        "whose client certificate names none of them in its subjectAltName (a URI such as "
        "spiffe://specdec/gateway, a DNS name or an IP) ends with PERMISSION_DENIED. Empty: any certificate "
        "that chains to the CA (warned about at start). Health checks stay open to every TLS client.",
        metavar="SANS",
    )
    health_port: int = setting(
        0,
        "A plaintext port that serves only the gRPC health service (grpc.health.v1: the same SERVING / "
        "NOT_SERVING as the main port), for probes that speak no TLS (the kubelet's grpc probes). 0: off.",
    )
    max_message_mb: float = setting(16.0, "Largest gRPC message received or sent, MiB (over it: RESOURCE_EXHAUSTED).")
    keepalive_time_s: float = setting(
        20.0,
        "gRPC keepalive: clients ping an idle connection this often and servers accept pings at half "
        "this interval, so both sides agree (no GOAWAY too_many_pings).",
    )
    keepalive_timeout_s: float = setting(
        10.0, "A peer that does not answer a keepalive ping within this many seconds is treated as gone."
    )
    shutdown_timeout_s: float = setting(
        30.0,
        "Drain on SIGTERM: health turns NOT_SERVING and new calls get UNAVAILABLE at once; calls in "
        "flight may finish for this many seconds, then the rest end with UNAVAILABLE.",
    )


@dataclass
class DrafterConfig(TransportConfig):
    """The drafter service: a small causal LM (and a model-free n-gram drafter)."""

    host: str = setting(DEFAULT_HOST, "Bind address.", metavar="ADDR")
    port: int = setting(DEFAULT_DRAFTER_PORT, "gRPC port.")
    model: str = setting(
        "qwen-coder/draft",
        "Draft model: a registry name such as qwen-coder/draft, a folder, or a "
        "Hugging Face repo id ORG/NAME[@REVISION] (from HF_HOME's cache; HF_HUB_OFFLINE=1: the cache "
        "only).",
        metavar="REF",
    )
    threads: int = setting(1, "Torch threads for drafting (a separate drafter host gives it its cores).")
    dtype: str = setting(
        "auto",
        "Draft model dtype: float32, bfloat16 or float16; auto: float32 on the CPU, bfloat16 on a GPU "
        "(float16 where the GPU has no bfloat16).",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    quantize: str = setting(
        "auto",
        "int8: dynamic int8 quantisation of the draft's Linear layers (CPU only; ~3x faster drafting for a "
        "memory-bound draft, see specdec.models.load_causal_lm; its activations are float32, so not with a "
        "bfloat16/float16 dtype); none: as loaded; auto: int8 for a float32 draft on the CPU, else none.",
        choices=("auto", "none", "int8"),
    )
    forward: str = setting(
        "auto",
        "The draft model's forward on the CPU: lean runs a llama, qwen2 or mistral draft without "
        "transformers' per-layer modules (fused q/k/v and gate/up projections, specdec.models.lean; the "
        "same model, 1.07-1.14x the draft tokens a second on Qwen2.5-Coder-0.5B int8, docs/batched-drafting.md); "
        "transformers: the model's own; auto: "
        "lean where it applies (those model types on the CPU), else transformers.",
        choices=("auto", "lean", "transformers"),
    )
    draft_vocab: str = setting(
        "",
        "A draft vocabulary file (`specdec draft-vocab` makes one from a sample of your traffic): the draft's "
        "output layer scores only its ids, a forward reads fewer bytes (docs/draft-vocabulary.md). The draft "
        "can then not propose other ids; output stays exact. Empty: the whole vocabulary.",
        metavar="FILE",
    )
    lookahead: int = setting(
        -1,
        "Tokens past gamma the drafter may draft ahead of the committed context while a block is being "
        "verified (overlap): -1 is gamma + 1 (the next block and a guess of the bonus token); 0 is lock-step "
        "(one block per round).",
    )
    flush_ms: float = setting(50.0, "A partial block is sent when its first token waited this long (ms).")
    branches: int = setting(
        6,
        "Pre-drafted branches per round (0: off). With its window full, the drafter drafts continuations "
        "for the likeliest rejections (position p, correction t among the draft's top alternatives), best "
        "first; the verifier picks the one that matches its verdict inside the step (no round trip). "
        "The candidates not drafted yet are drafted as one batch of rows (with ride_branches, beside the lookahead).",
    )
    ride_branches: int = setting(
        2,
        "With batch_drafts: branch rows that ride in the forward drafting a session's tokens ahead, a batch (the "
        "best candidates first; 0: off, branches only when the window is full, in a forward of their own). Once "
        "the block being verified is drafted, its likeliest rejections are drafted beside the lookahead, a row "
        'costing a few ms of a forward that reads the weights anyway (docs/performance.md, "Branch rows '
        'riding in the drafting forward").',
    )
    prefill_chunk: int = setting(
        128,
        "Prompt tokens per prefill step of the draft model. A session prefills its prompt from `open` on, "
        "while the target is queued and prefills; chunks let other sessions' drafts (which come first) "
        "interleave with a long prompt's prefill.",
    )
    prefix_cache_mib: int = setting(
        512,
        "The prefix cache (MiB of draft keys/values; 0: off): an ended session's cache is kept, and a new "
        "session whose prompt starts with the same tokens (a chat's next turn, the same file again, a shared "
        "system prompt) copies the keys/values of the common prefix and prefills only the rest, as the "
        "target's vLLM engine does with its own prefix cache. Least recently used entries go first "
        "(drafter.prefix_cache).",
    )
    kv_cache_mib: int = setting(
        0,
        "MiB of draft keys/values the live sessions may hold (0: auto, from the memory this process may "
        "use: 60% of its cgroup's limit, a Kubernetes pod's, less what the loaded model holds; 85% of the "
        "free memory on CUDA; a quarter of the host's memory with no limit; less prefix_cache_mib). A "
        "prompt's prefill starts when its keys/values (prompt, up to 512 generated tokens, drafts) fit; "
        "until then it waits, in arrival order. A generation past its 512 tokens grows its keys/values within "
        "the budget; when they do not fit, the newest session is ended. A prompt over the whole budget, or an "
        "ended session, gets RESOURCE_EXHAUSTED, and its gateway decodes the request plainly (drafter.memory).",
    )
    batch_drafts: bool = setting(
        True,
        "Draft every session's next token in one batched forward of the draft model per step (ragged "
        "lengths, each session's own KV cache; docs/batched-drafting.md); off: one forward per session.",
    )
    draft_confidence: str = setting(
        "off",
        "Drafts sized by confidence (docs/confidence-drafts.md): a session stops a block where the draft "
        "model's cumulative confidence (the product of its probabilities of its own tokens past the verified "
        "context) falls below a threshold tau, sends it at once and drafts branches until the next commit. "
        "auto: tau is learned per session from the verdicts (the draft's calibrated acceptance against the "
        "measured cost of a draft token); a number in (0, 1]: that fixed tau; off: blocks of gamma.",
        metavar="off|auto|TAU",
    )
    sample_drafts: bool = setting(
        False,
        "Sampled requests: draft by sampling the draft's q (its top q_top_k tokens, on) or by taking q's "
        "argmax (off). vLLM verifies drafts as one-hot, accepting x with probability p(x): argmax drafts "
        "maximise that, so off is the default; either way the output is exact.",
    )
    q_top_k: int = setting(16, "Sampled drafts are drawn from the draft's top-k tokens (renormalised), k = this.")
    max_sessions: int = setting(
        256,
        "Most draft sessions at once; one more is refused with RESOURCE_EXHAUSTED (its gateway then "
        "decodes it plainly).",
    )
    ngram_max: int = setting(4, "n-gram drafter: longest suffix to look up in the context.")
    ngram_min: int = setting(1, "n-gram drafter: shortest suffix to look up in the context.")
    metrics_port: int = setting(9092, "Prometheus /metrics port (0: off).")
    first_message_timeout_s: float = setting(
        10.0,
        "A Draft stream that sends no `open` within this many seconds ends with DEADLINE_EXCEEDED and "
        "frees its max_sessions slot (0: no limit).",
    )
    revision: str = setting(
        "",
        "Branch, tag or commit of a Hugging Face repo id model (like `vllm serve --revision`; empty: main, "
        "or the model's @REVISION).",
        metavar="REV",
    )
    device: str = setting(
        "auto",
        "Where the draft model runs: cpu, cuda (one GPU: bf16/fp16, no int8) or auto (cuda when torch "
        "sees a GPU, else cpu).",
        choices=("auto", "cpu", "cuda"),
    )
    target: str = setting(
        "",
        "The target model this drafter drafts for (a model reference): when set, the drafter refuses to "
        "start unless the two vocabularies and special tokens match (specdec.models.compat).",
        metavar="REF",
    )


@dataclass
class VerifierConfig(TransportConfig):
    """The verifier service: vLLM holding the target model."""

    host: str = setting(DEFAULT_HOST, "Bind address.", metavar="ADDR")
    port: int = setting(DEFAULT_VERIFIER_PORT, "gRPC port.")
    model: str = setting(
        "qwen-coder/target",
        "Target model: a registry name such as qwen-coder/target, a folder, "
        "or a Hugging Face repo id ORG/NAME[@REVISION] (from HF_HOME's cache; HF_HUB_OFFLINE=1: the "
        "cache only).",
        metavar="REF",
    )
    max_gamma: int = setting(
        8, "Largest gamma a request may use; the vLLM engine is built with num_speculative_tokens = max_gamma."
    )
    max_model_len: int = setting(
        0,
        "Context length of the engine (prompt + completion tokens); 0: the model's own on CUDA (as `vllm "
        "serve`), and on the CPU the model's own reduced to what the KV cache (--kv-cache-gib) holds for one "
        "request (vLLM's auto-fit); -1: that auto-fit on either device. The verifier logs the length it runs "
        "with; the gateway refuses a longer prompt (HTTP 400 / INVALID_ARGUMENT naming it).",
    )
    max_num_seqs: int = setting(
        0,
        "Engine batch size limit (requests decoded together); 0: `vllm serve`'s on CUDA (256, or 1024 on a "
        "GPU of 70 GiB or more), 32 on the CPU.",
    )
    max_num_batched_tokens: int = setting(
        0,
        "Engine scheduling budget: tokens one step computes (prefill chunks, each request's token and "
        "drafts); 0: `vllm serve`'s on CUDA (by GPU memory), 512 on the CPU (a CPU prefills a burst faster in "
        "steps of 512 than of 2048: docs/performance.md). Keep it at least max_num_seqs x (max_gamma + 1), "
        "or vLLM's scheduler cuts verify blocks.",
    )
    max_sessions: int = setting(
        512,
        "Most Verify sessions at once (running and queued in the engine); one more is refused with "
        "RESOURCE_EXHAUSTED naming this limit.",
    )
    dtype: str = setting(
        "auto",
        "Target model dtype; auto: on a GPU vLLM's own choice (the checkpoint's, as `vllm serve`); on the CPU "
        "bfloat16 for a bfloat16 checkpoint where the CPU has bfloat16 instructions (AVX512-BF16 or AMX: ~3x "
        "faster than float32 there, as `vllm serve` untold, docs/performance.md), else float32.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_gib: float = setting(
        0.0,
        "KV cache size in GiB; 0: on CUDA sized by vLLM from gpu_memory_utilization (as `vllm serve`), "
        "1 GiB on the CPU (where vLLM's utilisation check fails on these VMs).",
    )
    threads: int = setting(0, "CPU threads for the engine (OMP_NUM_THREADS); 0 keeps the environment's value.")
    io_cpus: str = setting(
        "",
        "CPUs (comma list) for the verifier's gRPC and asyncio threads; the engine thread keeps the "
        "process's CPUs. Empty: all threads share them. (`specdec up` gives the drafter's core.)",
        metavar="CPUS",
    )
    cpu_sampler_fix: bool = setting(
        True,
        "Replace the pieces of vLLM's sampler that fail on the CPU: expand_batch_to_tokens (vLLM issue #55005), "
        "top-k on a batch without draft rows, and the logprob rank vLLM compiles at the first request asking for "
        "logprobs (a 9-15 s stall of every request in flight; the engine dies where no C++ compiler is installed). "
        "Never disable in production.",
    )
    enforce_eager: bool | None = setting(
        None,
        "vLLM's enforce_eager: run the model eagerly, without CUDA graphs or torch.compile. Unset (auto): "
        "off on CUDA (CUDA graphs, as `vllm serve`), on on the CPU.",
    )
    warmup: bool | None = setting(
        None,
        "Before serving, prefill one dummy prompt as long as the scheduling budget (max_num_batched_tokens, "
        "within the context) and drop it: the engine's first step past its largest yet costs ~30 % more than "
        "later ones (0.55 s more at 512 tokens, 2.5 s at 2,048 for qwen-coder at bfloat16 on one "
        "core), which would fall on the first burst of requests. Unset (auto): "
        "on on the CPU; off on CUDA, where vLLM's own profile run at start-up does it.",
    )
    prefix_caching: bool = setting(
        True, "vLLM's prefix cache (benchmarks turn it off so repeated prompts cost the same each time)."
    )
    draft_wait_ms: float = setting(
        2000.0,
        "Most a target step waits for the drafts of its speculative requests, milliseconds; past it the step "
        "decodes those requests plainly. Within it, a step waits for a request's missing drafts only as long "
        "as they are expected to take: the missing tokens x the drafter's measured ms per token (announced in "
        "its `ready`, then measured from arrivals) x (1 + draft_wait_slack), plus draft_wait_margin_ms. A "
        "request whose drafter has not finished its prefill (no `ready` yet) is waited for the margin alone.",
    )
    draft_wait_slack: float = setting(
        0.5, "A step waits for missing drafts up to their expected arrival x (1 + this); see draft_wait_ms."
    )
    draft_wait_margin_ms: float = setting(
        50.0, "... plus this margin (ms) on top of the expected arrival; see draft_wait_ms."
    )
    adaptive_gamma: bool = setting(
        True,
        "Adaptive gamma (verifier.budget): each step verifies only the drafts that raise its expected tokens "
        "per ms under the measured step cost and each request's recent acceptance; under saturation this "
        "backs off to plain decoding. Off: always a request's full gamma.",
    )
    batch_window_ms: float = setting(
        20.0,
        "When the engine is idle and a request arrives whose prefill is cheap (its prompt tokens at the "
        "warm-up's measured cost per prompt token, plus twice this window, under a step's fixed cost), wait "
        "until no other arrives for this long (ms; at most 10 times it) so a burst of short prompts is "
        "prefilled in one step, not one request ahead of the rest. A longer prompt, or costs not measured "
        "yet (no warm-up, as on CUDA; no decode step yet), starts at once, as on vLLM's server. 0: never wait.",
    )
    metrics_port: int = setting(9093, "Prometheus /metrics port (0: off).")
    first_message_timeout_s: float = setting(
        10.0,
        "A Verify stream that sends no `open` within this many seconds ends with DEADLINE_EXCEEDED and "
        "frees its max_sessions slot (0: no limit).",
    )
    revision: str = setting(
        "",
        "Branch, tag or commit of a Hugging Face repo id model (like `vllm serve --revision`; empty: main, "
        "or the model's @REVISION).",
        metavar="REV",
    )
    gpu_memory_utilization: float = setting(
        0.92,
        "CUDA only, with kv_cache_gib 0: the share of the GPU's memory vLLM may use for the weights, "
        "activations and KV cache (vLLM's gpu_memory_utilization; 0.92 is vLLM 0.32's default).",
    )


@dataclass
class GatewayConfig(TransportConfig):
    """The gateway: runs the rounds between one drafter and one verifier per request."""

    host: str = setting(DEFAULT_HOST, "Bind address.", metavar="ADDR")
    port: int = setting(DEFAULT_GATEWAY_PORT, "gRPC port.")
    drafter_address: str = setting(
        f"{DEFAULT_HOST}:{DEFAULT_DRAFTER_PORT}",
        "host:port of the drafter; a comma-separated list of replicas, or "
        "dns:///NAME:PORT for every address NAME resolves to (a headless Service). Each request goes to the "
        "least-loaded one that serves (gateway.pool).",
        metavar="ADDRS",
    )
    verifier_address: str = setting(
        f"{DEFAULT_HOST}:{DEFAULT_VERIFIER_PORT}",
        "host:port of the verifier; a list or dns:///NAME:PORT, as for "
        "drafter_address. A generation whose verifier goes away resumes on another.",
        metavar="ADDRS",
    )
    tokenizer: str = setting(
        "qwen-coder/target",
        "Tokenizer used for text prompts and detokenisation (the target's): registry name, "
        "folder or Hugging Face repo id ORG/NAME[@REVISION].",
        metavar="REF",
    )
    prefix_affinity_tokens: int = setting(
        256,
        "A prompt of at least this many tokens goes to the verifier and the drafter that a hash of its first "
        "this many tokens names (rendezvous hashing over the replicas that serve), unless that replica is "
        "busier than another by more than a few requests (gateway.pool.AFFINITY_SLACK): prompts that start alike (a chat's turns, one file's "
        "completions, a shared system prompt) find their start in those replicas' prefix caches (gateway.pool, "
        "affinity). 0: off, every request to the less loaded of two replicas picked at random.",
    )
    default_gamma: int = setting(4, "Gamma (draft tokens per target step) when a request does not say.")
    default_drafter: str = setting(
        "model",
        "Drafter method when a request does not say: a name of the proto enum DraftMethod (the draft "
        "model, the n-gram drafter, or none: plain target decoding); checked at start-up.",
    )
    default_max_tokens: int = setting(128, "max_tokens when a request does not say.")
    drafter_timeout_s: float = setting(
        10.0,
        "Seconds the drafter may stay silent while it owes an answer: from a commit (the target's tokens, the "
        "first one included) to its next message. Past it the request goes on as plain target decoding. The "
        "target's queueing and prefill never count: before the first commit the drafter owes nothing (it is "
        "prefilling its own copy of the prompt). A drafter still prefilling answers with its progress, up to "
        "drafter_prefill_timeout_s.",
    )
    drafter_prefill_timeout_s: float = setting(
        300.0,
        "Seconds a drafter that is still prefilling (no `ready` or block yet) may go on prefilling after the "
        "target's first token. Its prefill can outlast the target's (long prompts queued on one CPU drafter, a "
        "CPU drafter beside a GPU target); meanwhile the target decodes plainly (the verifier waits for such a "
        "drafter one margin, then not until its `ready`), and the drafter must still report progress "
        "(DraftProgress) within every drafter_timeout_s: a drafter that reports none is hung and falls back "
        "then. Past it the request goes on as plain target decoding without it.",
    )
    metrics_port: int = setting(9091, "Prometheus /metrics port (0: off); the REST bridge serves /metrics too.")
    rest_port: int = setting(
        8000,
        "OpenAI-compatible REST bridge (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) port (0: off).",
    )
    rest_keepalive_s: float = setting(
        75.0,
        "Seconds the REST bridge keeps an idle HTTP keep-alive connection open. Longer than the idle "
        "timeout of whatever sits in front (load balancers: 60 s is common), so the server never closes a "
        "connection as a client or proxy sends on it (the request would fail with no response); uvicorn's and "
        "vLLM's 5 s invite that race.",
    )
    health_every_s: float = setting(
        1.0,
        "Seconds between the gRPC health checks of every drafter and verifier replica (gateway.pool); a "
        "replica that fails one, or whose call fails as if it were gone, gets no new request until it serves.",
    )
    resolve_every_s: float = setting(
        10.0,
        "Seconds between two resolutions of each dns:///NAME:PORT in drafter_address and verifier_address "
        "(pods added to or removed from a headless Service are seen within this).",
    )
    verifier_retry_s: float = setting(
        4.0,
        "How long a request waits for a verifier that serves (a new request, or one resuming after its "
        "verifier went away) before it ends with UNAVAILABLE.",
    )
    max_inflight: int = setting(
        256,
        "Most generations in flight at this gateway; one more is refused at once with RESOURCE_EXHAUSTED "
        "(REST: 429 with Retry-After), never queued without bound.",
    )
    max_prompt_tokens: int = setting(
        0, "Longest prompt accepted, tokens, checked before any work (0: the verifier's max_model_len - 1)."
    )
    api_keys: str = setting(
        "",
        "API keys (comma-separated) clients must send as `authorization: Bearer KEY` (gRPC metadata, REST "
        "header); only their SHA-256 hashes are kept. Empty (and no api_key_file): no authentication.",
        metavar="KEYS",
    )
    api_key_file: str = setting("", "File of API keys, one per line (# comments), added to api_keys.", metavar="PATH")
    metrics_auth: bool = setting(
        False,
        "The REST bridge's /metrics needs an API key too (health checks stay open). The metrics_port "
        "listener has no authentication: bind it to a private address or set it to 0.",
    )
    rate_limit_rps: float = setting(
        0.0,
        "Requests per second per API key (token bucket; 0: unlimited); over it: RESOURCE_EXHAUSTED / 429 "
        "with Retry-After.",
    )
    rate_limit_burst: int = setting(0, "Token bucket capacity per API key (0: rate_limit_rps, at least 1).")
    max_streams_per_key: int = setting(
        0, "Generations in flight per API key (0: unlimited); over it: RESOURCE_EXHAUSTED / 429."
    )
    spike_factor: float = setting(
        3.0,
        "Latency spikes: a stage spikes above max(spike_min_ms, spike_factor x its rolling p95), or above "
        "spike_ms when that is > 0.",
    )
    spike_min_ms: float = setting(5.0, "Floor (ms) of the relative spike threshold; see spike_factor.")
    spike_ms: float = setting(0.0, "Fixed spike threshold (ms) instead of the relative one (0: relative).")
    spike_log_every_s: float = setting(
        1.0,
        "At most one log line per this many seconds for latency spikes (the next names how many went "
        "unlogged); every spike still gets its span event and specdec:latency_spikes_total. 0: a line each.",
    )
    verdict_timeout_s: float = setting(
        60.0,
        "Seconds the verifier may stay silent while it owes verdicts, once it sent the first (its queueing "
        "and prefill never count); past it the verifier is treated as gone and the generation resumes on another "
        "(migration). 0: no limit (keepalive still finds a verifier whose process hangs).",
    )
    max_inflight_share_per_key: float = setting(
        0.5,
        "With API keys configured, the largest share of max_inflight one key may hold at once (0.5: half "
        "the slots, so no one key can take them all); max_streams_per_key, when set, caps it further. 1: no "
        "per-key share. Without keys every client is one key and this does not apply.",
    )
    stream_write_timeout_s: float = setting(
        30.0,
        "Seconds one message of a stream (gRPC GenerateStream, REST stream: true) may wait for its client "
        "to take it (a client that stops reading fills its flow-control window, then writes wait); past it the "
        "stream ends (DEADLINE_EXCEEDED / the connection closes), the generation stops and its max_inflight slot "
        "is freed. 0: no limit.",
    )
    max_idle_commits: int = setting(
        8,
        "Commits in a row a drafter may answer with empty blocks only while drafts were possible (not held "
        "by adaptive gamma, two tokens or more to go); past it the request goes on as plain target decoding "
        "(fallback). A commit the drafter sends no block after neither counts nor resets (an honest drafter "
        "slower than its target). 0: never.",
    )
    max_request_mb: float = setting(
        8.0,
        "Largest REST request body, MiB; over it: 413, without reading the rest. (The API key is checked "
        "before any of the body is read.)",
    )
    tokenizer_revision: str = setting(
        "",
        "Branch, tag or commit of a Hugging Face repo id tokenizer (empty: main, or the tokenizer's @REVISION).",
        metavar="REV",
    )


SERVICE_CONFIGS: dict[str, type] = {"drafter": DrafterConfig, "verifier": VerifierConfig, "gateway": GatewayConfig}


_FLAG_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}
_METAVARS: dict[type, str] = {int: "N", float: "X", str: "TEXT"}


def _flag_type(f: Field[Any]) -> type:
    """The Python type of a field (annotations are strings here: `from __future__ import annotations`)."""
    name = f.type.removesuffix(" | None") if isinstance(f.type, str) else f.type  # None default: "auto"
    kind = _FLAG_TYPES.get(name) if isinstance(name, str) else name
    if kind not in (int, float, str, bool):
        raise TypeError(f"{f.name}: config fields are int, float, str or bool, not {f.type!r}")
    return kind


def show_default(value: Any) -> str:
    """A default as `--help` shows it: on/off, 2000 rather than 2000.0, "" for empty."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return '""'
    return str(value)


def env_name(name: str) -> str:
    """The environment variable of a field: `SPECDEC_<FIELD>`."""
    return f"SPECDEC_{name.upper()}"


def flag_name(name: str) -> str:
    """The command-line flag of a field: `--field-name`."""
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """Add one flag per field of the config dataclass `cls` to `parser`.

    `--field-name VALUE` (bool fields: `--field-name/--no-field-name`), typed from the field,
    with the field's help, choices and, at the end of the help, its default and environment
    variable. Every flag defaults to None, so `from_env(cls, **vars(args))` keeps the order
    defaults < `SPECDEC_<FIELD>` < flag.
    """
    for f in fields(cls):
        kind = _flag_type(f)
        text = f.metadata.get("help")
        if not text:
            raise ValueError(f"{cls.__name__}.{f.name} has no help text (use config.setting)")
        if not text.endswith((".", ".)")):
            text += "."
        text = f"{text} (default: {show_default(f.default)}; env {env_name(f.name)})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": text.replace("%", "%%")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            else:
                kwargs["metavar"] = f.metadata.get("metavar", _METAVARS[kind])
        parser.add_argument(flag_name(f.name), **kwargs)


class FlagHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` for flags made by `add_flags`: each help wrapped in a column beside its flag (never
    inside a word such as qwen-coder/draft), its `(default: X; env SPECDEC_Y)` on a line of its own.
    The description and epilog are kept as written."""

    _TAIL = re.compile(r"\s*(\(default: .*; env SPECDEC_\w+\))$")

    def __init__(self, prog: str) -> None:
        width = max(80, min(110, shutil.get_terminal_size().columns)) - 2
        super().__init__(prog, max_help_position=30, width=width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        tail = self._TAIL.search(text)
        body = text[: tail.start()] if tail else text
        lines = textwrap.wrap(body, width, break_on_hyphens=False)
        if tail:
            default, _, env = tail.group(1).partition("; ")
            lines += [tail.group(1)] if len(tail.group(1)) <= width else [default + ";", env]
        return lines
