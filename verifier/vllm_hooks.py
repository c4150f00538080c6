"""The one seam between the verifier and vLLM's internals (written against vLLM 0.32.0).

Everything the verifier does with vLLM beyond its public request API (`vllm.EngineArgs`,
`vllm.SamplingParams` and `RequestOutputKind`, built in verifier.convert, and the `LLMEngine` methods add_request, step,
abort_request, has_unfinished_requests) is here, so a vLLM upgrade is checked in one file.
Each hook, why it is needed, and what it touches in vLLM:

  configure_vllm_env      environment vLLM reads at import (`vllm/envs.py`):
                          VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core, hence our
                          proposer, must run in this process to share the draft board),
                          VLLM_CPU_OMP_THREADS_BIND (VLLM_CPU_KVCACHE_SPACE removed), and the
                          OMP_NUM_THREADS / NUMBA_NUM_THREADS thread counts. Must run before
                          `import vllm`.
  check_vllm_version      every hook below relies on internals of one vLLM release: start-up
                          fails with UnsupportedVLLMVersion on any other (package metadata of
                          `vllm-cpu` or `vllm`, else `vllm.__version__`).
  apply_cpu_sampler_fix   vLLM issue #55005 (CPU only): replaces
                          `vllm/v1/sample/rejection_sampler.py: expand_batch_to_tokens`, whose
                          CPU stand-in for its Triton kernel fills a temporary copy, so
                          speculative SAMPLING divides logits by uninitialised memory; and
                          guards its `apply_top_k_top_p` against a step with no draft rows
                          (CPU top-k takes the max of an empty tensor: top_k_top_p_rows); and
                          replaces `vllm/v1/sample/sampler.py`'s binding of
                          `batched_count_greater_than` (a logprob's rank), which vLLM compiles
                          with torch.compile at the first request asking for logprobs, by an
                          eager count (count_at_least): that compile stalls the engine's step
                          9-15 s, and kills the engine where no C++ compiler is installed.
  request_cpu_amx         vLLM's CPU attention (`_custom_ops.cpu_attention_with_kv_cache`) runs
                          AMX tile instructions at bfloat16 without asking Linux for the AMX
                          state: build_engine asks first (else SIGILL on a short prompt).
  engine_settings         the engine's device-dependent settings (`vllm.platforms.current_platform`
                          says cuda or cpu): on CUDA `vllm serve`'s defaults (KV cache from
                          gpu_memory_utilization, CUDA graphs, the model's max_model_len, the
                          checkpoint's dtype), on the CPU the settings measured there (1 GiB KV
                          cache, eager, a budget of 512; a bfloat16 checkpoint at bfloat16 where the CPU
                          has bfloat16 instructions, float32 otherwise).
  build_engine            `vllm.v1.engine.llm_engine.LLMEngine.from_engine_args` with the
                          experimental `custom_class` speculative method
                          (`vllm/v1/spec_decode/custom_class_proposer.py: create_custom_proposer`,
                          called from `vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.__init__`),
                          naming ExternalDraftProposer below; hands the draft board to it
                          through the one process-wide handle (see `_board_for_proposer`).
                          vLLM's own stats stay on (`disable_log_stats=False`).
  warm_up                 one dummy prompt as long as the scheduling budget
                          (`engine.vllm_config.scheduler_config.max_num_batched_tokens`), prefilled
                          through the public request API before the engine serves (build_engine,
                          on the CPU): the first step that large costs ~30 % more than later ones.
  spec_stats_logger       a stat logger (`vllm/v1/metrics/loggers.py: StatLoggerBase`, passed as
                          `stat_loggers`) reading each step's `SchedulerStats.spec_decoding_stats`
                          (`vllm/v1/spec_decode/metrics.py: SpecDecodingStats`) into the
                          verifier's vllm:spec_decode_* counters.
  model_facts             vocabulary size and stop ids from `engine.model_config`
                          (`vllm/config/model.py: ModelConfig`) and the engine's tokenizer.
  install_schedule_hook   wraps `Scheduler.schedule` (`vllm/v1/core/sched/scheduler.py`),
                          reached as `engine.engine_core.engine_core.scheduler` (in-process
                          `InprocClient` -> `EngineCore`), so the engine learns each step's
                          scheduled tokens (`SchedulerOutput`, `vllm/v1/core/sched/output.py`)
                          and queue length; the caller's callback gets a plain ScheduledStep.
  request_counts          (running, waiting) from the same scheduler's `get_request_counts()`
                          (the verifier's engine gauges, read at scrape time).
  find_model_runner       vLLM builds the proposer with only `vllm_config`; the rows of
                          `propose` follow `runner.input_batch.req_ids`, so the proposer walks
                          up the call stack to the model runner constructing it.
  ExternalDraftProposer   the `custom_class` proposer: vLLM calls its `propose(...)` at the end
                          of every step (`GPUModelRunner.propose_draft_token_ids`); it maps
                          vLLM's rows to request ids and asks the draft board
                          (verifier.proposer.DraftBoard, which knows nothing of vLLM).

Importing this module is cheap and imports neither vLLM, torch nor numpy (their thread pools
read the environment configure_vllm_env sets): they are imported inside the functions.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from specdec.config import MAX_LOGPROBS, VerifierConfig, from_env

if TYPE_CHECKING:  # no numpy/torch at import: configure_vllm_env must run before their thread pools start
    import numpy as np
    import torch
    from vllm.config.model import ModelDType
    from vllm.v1.engine.llm_engine import LLMEngine

    from verifier.proposer import DraftBoard

log = logging.getLogger("specdec.verifier")

# The only vLLM release these hooks are written and tested against (pyproject.toml pins
# vllm-cpu and vllm to it). A local build label (0.32.0+cpu) counts as the same release.
SUPPORTED_VLLM = "0.32.0"
# Distributions that provide the `vllm` module, in the order they are looked up.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")
# Dotted path vLLM imports the custom_class proposer from (speculative_config["model"]).
PROPOSER_CLASS = f"{__name__}.ExternalDraftProposer"
# CPU defaults (settings left at 0 / unset): a 1 GiB KV cache fits the small CPU hosts this runs on
# (vLLM's own default, a KV cache sized from the free memory, fails there: its utilisation check), and
# the context is vLLM's auto-fit (max_model_len -1): the model's own context length, reduced to what
# that KV cache holds for one request (Qwen2.5-Coder-1.5B: its 32,768 tokens at bfloat16, 28 KiB a
# token). A fixed 2048 here refused a real source file of 2,533 tokens that `vllm serve` accepts.
CPU_MAX_MODEL_LEN = -1
CPU_KV_CACHE_GIB = 1.0
CPU_MAX_NUM_SEQS = 32
# The CPU's scheduling budget (tokens one engine step computes): 512, not `vllm serve`'s 2048 (its
# generic default; vLLM's table has no CPU entry for the usage context the verifier builds in). On
# the CPU a step's cost per prompt token grows with the step: a burst prefilled in steps of 512 took
# 25-37 % less time than in steps of 2,048 at bfloat16 on an AMX CPU (~7 % at float32), and a
# decode step beside a burst's prefill waits ~1.8 s instead of ~8 s (docs/performance.md, "Prefill
# chunks of 512 tokens at bfloat16"). Decodes do not feel it: a step's running requests need at
# most max_num_seqs x (max_gamma + 1) = 32 x 9 = 288 tokens at the defaults (under that vLLM's
# scheduler would cut verify blocks: still exact, fewer drafts verified).
CPU_MAX_NUM_BATCHED_TOKENS = 512
# The CPU's dtype when left to "auto": a bfloat16 checkpoint runs bfloat16 where the CPU has bfloat16
# instructions (AVX512-BF16 or AMX: ~3x faster than float32 there, docs/performance.md, serve-c8, as
# `vllm serve` untold), and float32 everywhere else: on a CPU without them vLLM's bfloat16 is far
# slower (~87 s to a first token on the notes' older CPUs), and a float32 checkpoint keeps the
# precision it was saved in (vLLM's own auto would downcast it to bfloat16).
CPU_FALLBACK_DTYPE = "float32"


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is built with, once "auto" (0 / unset) settings are decided for a device.

    None means vLLM's own default: max_model_len None is the model's context length (-1: vLLM's
    auto-fit, the model's context length reduced to what the KV cache holds; the engine reports the
    length it chose, build_engine puts it on the board),
    kv_cache_memory_bytes None sizes the KV cache from gpu_memory_utilization, and max_num_seqs
    and max_num_batched_tokens None are what `vllm serve` takes (the engine is built in its usage
    context, `serve`).
    """

    device: str  # "cuda" or "cpu" (vLLM's current_platform.device_type; other accelerators: as cuda)
    dtype: str  # the target's dtype for vLLM: "auto" is vLLM's own choice (the checkpoint's)
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enforce_eager: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    warmup: bool = False  # prefill one budget-long dummy prompt before serving (warm_up)


def vllm_device() -> str:
    """The device vLLM's platform runs on ("cuda", "cpu", ...). Imports vLLM: after configure_vllm_env."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "cpu")


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions vLLM's CPU kernels use: AVX512-BF16 or AMX tiles
    (x86; torch's capability checks, as vLLM's own `platforms/cpu.py`). Imports torch."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def request_cpu_amx() -> bool:
    """Ask Linux for this process's AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, through torch)
    where the CPU has AMX; True when granted. vLLM 0.32's CPU attention (`_custom_ops.
    cpu_attention_with_kv_cache`) runs AMX tile instructions at bfloat16 without asking: in a
    process whose first AMX use is that kernel (a prompt of a few tokens, before any oneDNN matmul
    large enough to ask for it) it dies of SIGILL. Measured here, plain vLLM, bfloat16, a 3-token
    prompt: exit 132 without this, served with it. Imports torch."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def checkpoint_dtype(model_path: str | None) -> str | None:
    """The dtype a checkpoint folder's config.json declares (`dtype`; `torch_dtype` before
    transformers 5), e.g. "bfloat16"; None without a folder, a config, or the field."""
    config = Path(model_path, "config.json") if model_path else None
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    found = data.get("dtype") or data.get("torch_dtype") if isinstance(data, dict) else None
    return str(found) if found else None


def cpu_dtype(model_path: str | None, computes_bf16: Callable[[], bool] = cpu_computes_bf16) -> str:
    """The CPU's dtype for "auto" (see CPU_FALLBACK_DTYPE): "bfloat16" for a bfloat16 checkpoint
    where `computes_bf16()` (asked only then), else CPU_FALLBACK_DTYPE."""
    if checkpoint_dtype(model_path) == "bfloat16" and computes_bf16():
        return "bfloat16"
    return CPU_FALLBACK_DTYPE


def engine_settings(
    cfg: VerifierConfig,
    device: str,
    model_path: str | None = None,
    computes_bf16: Callable[[], bool] = cpu_computes_bf16,
) -> EngineSettings:
    """The engine settings for `device` (see EngineSettings): a setting given explicitly wins; an
    unset one takes `vllm serve`'s default on a GPU and the CPU default (above) on the CPU. dtype
    "auto" stays vLLM's auto (the checkpoint's dtype) on a GPU; on the CPU it is cpu_dtype of the
    checkpoint in `model_path` (a local folder; None: float32)."""
    gib = cfg.kv_cache_gib
    if device == "cpu":
        return EngineSettings(
            device="cpu",
            dtype=cpu_dtype(model_path, computes_bf16) if cfg.dtype == "auto" else cfg.dtype,
            max_model_len=cfg.max_model_len or CPU_MAX_MODEL_LEN,
            max_num_seqs=cfg.max_num_seqs or CPU_MAX_NUM_SEQS,
            max_num_batched_tokens=cfg.max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS,
            enforce_eager=True if cfg.enforce_eager is None else cfg.enforce_eager,
            kv_cache_memory_bytes=int((gib or CPU_KV_CACHE_GIB) * (1 << 30)),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            warmup=True if cfg.warmup is None else cfg.warmup,
        )
    return EngineSettings(
        device=device,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len or None,
        max_num_seqs=cfg.max_num_seqs or None,
        max_num_batched_tokens=cfg.max_num_batched_tokens or None,
        enforce_eager=False if cfg.enforce_eager is None else cfg.enforce_eager,
        kv_cache_memory_bytes=int(gib * (1 << 30)) if gib > 0 else None,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        warmup=bool(cfg.warmup),  # unset: off, vLLM's profile run prefills a budget's worth at start-up
    )


def engine_settings_from_env(device: str, model_path: str | None = None) -> EngineSettings:
    """engine_settings of the verifier `specdec serve verifier` would start here with no flags on
    the model in `model_path`: its defaults and SPECDEC_* variables (benchmarks and the tests'
    references give their vLLM baselines the same settings)."""
    return engine_settings(from_env(VerifierConfig), device, model_path)


# ---- environment ----------------------------------------------------------------------
def configure_vllm_env(cfg: VerifierConfig) -> None:
    """Environment vLLM reads at import: in-process engine and CPU thread settings. The KV cache is
    the engine's kv_cache_memory_bytes (engine_settings), so VLLM_CPU_KVCACHE_SPACE, vLLM's legacy
    variable, is removed: vLLM's CPU platform lets it override that in whole GiB (a --kv-cache-gib of
    0.5 or 2.5 ran 1 or 2 GiB while it was set here)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the proposer must share our process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    legacy = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if legacy:
        log.warning(
            "VLLM_CPU_KVCACHE_SPACE=%s ignored: the verifier's KV cache is --kv-cache-gib (SPECDEC_KV_CACHE_GIB)",
            legacy,
        )
    if cfg.threads:
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)


# ---- version check ----------------------------------------------------------------------
class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the release these hooks were written against."""


def installed_vllm_version() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: the package metadata of `vllm-cpu` or
    `vllm`, whichever is installed; else (a source checkout) the module's `__version__`."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return "vllm", str(vllm.__version__)


def check_vllm_version() -> str:
    """Fail unless the installed vLLM is SUPPORTED_VLLM; returns the version found."""
    dist, found = installed_vllm_version()
    if found.split("+", 1)[0] != SUPPORTED_VLLM:
        raise UnsupportedVLLMVersion(
            f"the verifier supports vLLM {SUPPORTED_VLLM} only (it uses vLLM internals, see "
            f"verifier/vllm_hooks.py), found {dist} {found}: install {dist}=={SUPPORTED_VLLM}"
        )
    return found


# ---- CPU sampler fixes (vLLM issue #55005, top-k without draft rows, logprob ranks) ------
def expand_batch_to_tokens(
    # [batch_size]
    x: torch.Tensor,
    # [batch_size]: cumulative draft tokens per request (inclusive)
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Repeat x[i] for each of request i's tokens, replacing replace_from by replace_to.

    The pure-torch equivalent of vLLM's `rejection_sampler.expand_batch_to_tokens`. On CPU,
    vLLM 0.32's version runs its Triton kernel through a C++ stand-in that fills a temporary
    int64 copy instead of the caller's buffer (and would truncate float temperatures even if
    copied back); the rejection sampler then divides logits by uninitialised memory: with
    temperature > 0 and any speculative method, tokens follow the wrong distribution. Greedy
    and GPU are unaffected.

    x = [a, b, c], cu_num_tokens = [2, 5, 6] -> [a, a, b, b, b, c]. Returns [num_tokens].
    """
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        expanded = torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)
    return expanded


def top_k_top_p_rows(apply: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `apply_top_k_top_p`, returning a batch without rows untouched.

    The rejection sampler truncates the target's logits at the draft positions of a step:
    a sampled step whose requests (with top_k) got no drafts has none, and on CPU vLLM 0.32's
    top-k path (`apply_top_k_only`, Triton's kernels are not used there) takes `k.max()` of
    the empty tensor: the engine step raises and the engine is dead. GPU builds are unaffected.
    """

    def guarded(logits: Any, k: Any, p: Any) -> Any:
        if logits.shape[0] == 0:
            return logits  # [0, vocab]: nothing to truncate
        return apply(logits, k, p)

    return guarded


RANK_ROWS = 4  # rows count_at_least compares at once: their bools (4 x 151,936 B for Qwen2.5) stay in cache


def count_at_least(
    # [rows, vocab]: logprobs
    x: torch.Tensor,
    # [rows, 1]: each row's token's logprob
    values: torch.Tensor,
) -> torch.Tensor:
    """How many entries of each row of x are >= that row's value: the token's rank among the
    row's logprobs (1: the likeliest). Returns [rows] int64, what vLLM's
    `vllm/v1/sample/ops/logprobs.py: batched_count_greater_than` returns, computed eagerly.

    vLLM compiles that function with torch.compile (inductor) at its first call, and
    `Sampler.gather_logprobs` (the rejection sampler's too) first calls it at the first request
    asking for logprobs. On the CPU inductor builds C++ with the host's compiler, inside the engine's
    step: 8.5-14.5 s measured here (one core, an empty inductor cache; 2.5 s with it warm), while
    every request in flight waits (a first logprobs request through the services took 16.4 s, the
    next ones 0.9 s); and where no C++ compiler is installed (the verifier-cpu image), the
    step raises InvalidCxxCompiler and the engine is dead. Eager, RANK_ROWS rows at a time: 0.5 ms
    for 5 rows of 151,936, 4.0 ms for 40 (compiled: 0.13 and 0.94 ms), against a CPU step's
    hundreds of ms."""
    import torch

    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], RANK_ROWS):
        rows = slice(i, i + RANK_ROWS)
        torch.sum(x[rows] >= values[rows], dim=-1, out=out[rows])
    return out


def apply_cpu_sampler_fix() -> bool:
    """Install expand_batch_to_tokens, the empty-batch guard and count_at_least above when vLLM
    runs on CPU; returns True when installed."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler, sampler

    if not current_platform.is_cpu():
        return False
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    # rejection_sampler's own binding of apply_top_k_top_p (imported there, so not its export
    # for mypy): the one its calls read, rebound in the module's namespace
    namespace = vars(rejection_sampler)
    if not getattr(namespace["apply_top_k_top_p"], "__wrapped_empty__", False):
        guarded = top_k_top_p_rows(namespace["apply_top_k_top_p"])
        guarded.__wrapped_empty__ = True  # type: ignore[attr-defined]  # a marker attribute on a function
        namespace["apply_top_k_top_p"] = guarded
    vars(sampler)["batched_count_greater_than"] = count_at_least  # sampler's own binding (imported there)
    return True


# ---- the engine ---------------------------------------------------------------------------
# THE process-wide handle, the only one. vLLM's custom_class contract builds the proposer
# itself, as `ExternalDraftProposer(vllm_config)` inside the model runner's __init__, so the
# draft board cannot be passed to it. build_engine sets this to its board for the duration of
# the engine's construction (under _build_lock) and the proposer's __init__ takes it; outside
# build_engine it is None, and a proposer built then fails.
_board_for_proposer: DraftBoard | None = None
_build_lock = threading.Lock()


@contextmanager
def _proposer_board(board: DraftBoard) -> Iterator[None]:
    global _board_for_proposer
    with _build_lock:
        _board_for_proposer = board
        try:
            yield
        finally:
            _board_for_proposer = None


def build_engine(cfg: VerifierConfig, model_path: str, board: DraftBoard, device: str | None = None) -> LLMEngine:
    """vLLM's V1 LLMEngine, in-process, verifying the drafts of `board` (custom_class method),
    with engine_settings for `device` (None: vllm_device()). Sets `board.max_model_len` to the
    engine's context length (the model's own when it was left to vLLM).

    configure_vllm_env must have run before vLLM was first imported.
    """
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    settings = engine_settings(cfg, device or vllm_device(), model_path)
    args = EngineArgs(
        model=model_path,
        tokenizer=model_path,
        dtype=cast("ModelDType", settings.dtype),  # a str (the flag's type); vLLM checks the name
        max_model_len=settings.max_model_len,  # type: ignore[arg-type]  # vLLM annotates int, defaults to None (the model's)
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enforce_eager=settings.enforce_eager,
        enable_prefix_caching=cfg.prefix_caching,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_logprobs=MAX_LOGPROBS,
        speculative_config={
            "method": "custom_class",
            "model": PROPOSER_CLASS,
            "num_speculative_tokens": cfg.max_gamma,
        },
        disable_log_stats=False,  # vLLM's own stats stay on: its log lines, and SpecStatsLogger below
    )
    from vllm.usage.usage_lib import UsageContext

    # on CUDA, the defaults `vllm serve` takes (max_num_seqs, max_num_batched_tokens by GPU memory);
    # on the CPU, the engine's own (every CPU setting above is explicit)
    usage = UsageContext.OPENAI_API_SERVER if settings.device != "cpu" else UsageContext.ENGINE_CONTEXT
    if settings.device == "cpu":
        request_cpu_amx()  # before the first step: vLLM's bfloat16 attention may be the first AMX user
    with _proposer_board(board):
        engine = LLMEngine.from_engine_args(args, usage_context=usage, stat_loggers=[spec_stats_logger(board.metrics)])
    board.max_model_len = int(engine.model_config.max_model_len)
    log.info(
        "target dtype %s (--dtype %s on %s), max_model_len %d",
        str(engine.model_config.dtype).removeprefix("torch."),
        cfg.dtype if cfg.dtype == settings.dtype else f"{cfg.dtype}: {settings.dtype}",
        settings.device,
        board.max_model_len,
    )
    if settings.warmup:
        tokens, seconds = warm_up(engine)
        board.cost.prefill_ms_per_token = seconds * 1e3 / tokens
        log.info("warm-up: a dummy prompt of %d tokens prefilled in %.2f s before serving", tokens, seconds)
    return engine


WARMUP_REQUEST_ID = "specdec-warmup"


def warm_up(engine: Any) -> tuple[int, float]:
    """Prefill one dummy prompt as long as the engine's scheduling budget (its
    `scheduler_config.max_num_batched_tokens`, within its context), one token out, before any
    request: (its prompt tokens, seconds taken). The first engine step that computes more tokens
    than any before it costs ~30 % more than the same step later (measured on vLLM 0.32's CPU
    backend: 2.30 against 1.72-1.77 s for 512 tokens, 11.0 against 8.5 s for 2,048, qwen-coder at
    bfloat16 on one core; a step of 1,300 tokens after one of 2,048 is warm: the cost follows the
    largest step so far, not each shape), so unwarmed it falls on the first burst of prompts.
    vLLM's own warm-up of that size, the profile run, runs at every GPU engine's start
    (`vllm/v1/worker/gpu_worker.py: determine_available_memory`) but on the CPU only where the
    model is compiled (`vllm/v1/worker/cpu_model_runner.py: warming_up_model` returns at
    CompilationMode.NONE, i.e. enforce_eager). The engine holds no other request: the draft
    board knows nothing of this one and proposes it no drafts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    budget = int(engine.vllm_config.scheduler_config.max_num_batched_tokens)
    n = max(1, min(budget, int(engine.model_config.max_model_len) - 1))
    vocab = int(engine.model_config.get_vocab_size())
    # any ids: a prefill costs the same whatever its tokens
    prompt = TokensPrompt(prompt_token_ids=[(7 * i + 1) % vocab for i in range(n)])
    t0 = time.perf_counter()
    engine.add_request(WARMUP_REQUEST_ID, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return n, time.perf_counter() - t0


def spec_stats_logger(metrics: Any) -> Callable[[Any, int], Any]:
    """A vLLM stat-logger factory (`LLMEngine.from_engine_args(stat_loggers=...)`) whose logger
    adds each engine step's SpecDecodingStats (vLLM's scheduler counts them when log stats are
    on) to `metrics` (telemetry.VerifierMetrics.observe_vllm_spec): the verifier's /metrics then
    carries vLLM's own spec-decode counters, under vLLM's names, beside specdec's. vLLM's default
    loggers (its periodic log line, its Prometheus logger on the default registry) run too."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SpecStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                metrics.observe_vllm_spec(
                    spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_accepted_tokens_per_pos
                )

        def log_engine_initialized(self) -> None:
            """Nothing to log: vLLM's LoggingStatLogger says it."""

    return SpecStatsLogger


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    eos_token_ids: list[int]  # the model config's eos id(s)
    stop_ids: set[int]  # every id vLLM may stop at: config, generation config, tokenizer


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else list(value or [])


def model_facts(engine: Any) -> ModelFacts:
    """The served model's vocabulary size and end-of-sequence ids, from the engine's config."""
    model_config = engine.model_config
    eos = _ids(getattr(model_config.hf_config, "eos_token_id", None))
    gen_eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    tok_eos = getattr(engine.get_tokenizer(), "eos_token_id", None)
    return ModelFacts(int(model_config.get_vocab_size()), eos, set(eos) | set(_ids(gen_eos)) | set(_ids(tok_eos)))


# ---- the scheduler hook ---------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduledStep:
    """What vLLM's scheduler decided for the step about to run (from its SchedulerOutput)."""

    num_scheduled_tokens: dict[str, int]  # engine request id -> tokens it computes this step
    spec_tokens: dict[str, int]  # engine request id -> drafts it verifies this step (absent: 0)
    total_tokens: int  # all tokens scheduled this step
    new_requests: int  # requests scheduled for the first time (their prefill starts)
    waiting: int  # requests still waiting to be scheduled
    prefill_chunks: int = 0  # scheduled requests whose prompt has a chunk still to come (is_prefill_chunk)


def install_schedule_hook(
    engine: Any, after: Callable[[ScheduledStep], None], before: Callable[[], None] | None = None
) -> None:
    """Call `before()` ahead of, and `after(step)` right after, each scheduling decision of the
    engine (on the thread that steps it, inside `engine.step()`)."""
    scheduler = engine.engine_core.engine_core.scheduler  # in-process only (InprocClient)
    original = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        out = original(*args, **kwargs)
        after(
            ScheduledStep(
                num_scheduled_tokens=out.num_scheduled_tokens,
                spec_tokens={rid: len(t) for rid, t in out.scheduled_spec_decode_tokens.items()},
                total_tokens=int(out.total_num_scheduled_tokens),
                new_requests=len(out.scheduled_new_reqs),
                waiting=len(scheduler.waiting),
                # vLLM advanced each request's computed tokens in schedule(): a prompt prefilled in
                # chunks is still `is_prefill_chunk` while a chunk is to come (prefix-cache hits counted)
                prefill_chunks=sum(
                    bool(getattr(scheduler.requests.get(rid), "is_prefill_chunk", False))
                    for rid in out.num_scheduled_tokens
                ),
            )
        )
        return out

    scheduler.schedule = schedule


def request_counts(engine: Any) -> tuple[int, int]:
    """(running, waiting) requests in the engine's scheduler (`Scheduler.get_request_counts`);
    plain reads of its queues' lengths, so any thread may call it."""
    counts: tuple[int, int] = engine.engine_core.engine_core.scheduler.get_request_counts()
    return counts


# ---- the custom_class proposer ----------------------------------------------------------------
def find_model_runner() -> Any:
    """The model runner that is constructing the caller (vLLM passes only vllm_config)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and type(candidate).__name__.endswith("ModelRunner"):
            return candidate
        frame = frame.f_back
    raise RuntimeError("ExternalDraftProposer must be built by a vLLM model runner")


class ExternalDraftProposer:
    """vLLM `custom_class` proposer reading drafts from the board given to build_engine (the
    engine must run in-process). See verifier.proposer for what the board decides."""

    def __init__(self, vllm_config: Any) -> None:
        board = _board_for_proposer
        if board is None:
            raise RuntimeError("ExternalDraftProposer is built only by verifier.vllm_hooks.build_engine")
        self.board: DraftBoard = board
        self.k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.runner = find_model_runner()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafts come from the drafter service."""

    def propose(
        self,
        # [batch_size][tokens sampled this step]; empty for a partial prefill chunk
        sampled_token_ids: list[list[int]],
        # [max_num_reqs]: context length of each row, this step's tokens included
        num_tokens_no_spec: np.ndarray,
        # [max_num_reqs, max_model_len]: each row's token ids
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        req_ids = self.runner.input_batch.req_ids
        rows: list[tuple[str, np.ndarray]] = []
        index: list[int] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            length = int(num_tokens_no_spec[row])
            self.board.preview(req_ids[row], length - len(sampled), list(sampled))
            rows.append((req_ids[row], token_ids_cpu[row, :length]))
            index.append(row)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for row, d in zip(index, self.board.propose_batch(rows, self.k_max)):
            drafts[row] = d
        return drafts
