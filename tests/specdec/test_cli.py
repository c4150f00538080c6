"""The `specdec` command line: errors as one line, `models list|path`, lazy tool imports.

Every test points SPECDEC_CACHE_DIR at a temporary folder: a pulled pair is simulated by its
completion markers (`pull.MARKER`, holding the pinned sha256), the tiny pair is built there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.errors import ModelNotFoundError, UserError
from specdec.models import pull, resolve
from specdec_cli import main as cli
from specdec_cli.launch import free_port

NOT_PULLED = (
    "specdec: error: model pair 'qwen-coder' is not pulled (missing roles: target, draft); "
    "run `specdec models pull qwen-coder`"
)


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the tiny pair, built by `specdec models pull tiny` (seconds)."""
    root = tmp_path_factory.mktemp("tiny-cache")
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "models", "pull", "tiny"],
        env={**os.environ, "SPECDEC_CACHE_DIR": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "tiny: ready", proc.stderr
    return root


def mark_pulled(cache: Path, pair: str = "qwen-coder") -> dict[str, Path]:
    """Make `pair` look completely pulled: each role's folder with its completion marker."""
    folders = {}
    for spec in pull.PAIRS[pair].roles:
        folder = cache / "models" / pair / spec.role
        folder.mkdir(parents=True)
        (folder / pull.MARKER).write_text(spec.sha256 + "\n")
        folders[spec.role] = folder
    return folders


def specdec(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`specdec ARGV` in a fresh process (the real exit status and streams)."""
    base = {k: v for k, v in os.environ.items() if k != "SPECDEC_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "specdec_cli", *argv],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- errors


def test_model_not_pulled_is_one_line_with_what_to_run(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "path", "qwen-coder"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and one_line(err) == NOT_PULLED


def test_user_error_exits_2_without_traceback_and_debug_adds_it(cache: Path) -> None:
    env = {"SPECDEC_CACHE_DIR": str(cache)}
    proc = specdec("models", "path", "qwen-coder", env=env)
    assert proc.returncode == 2 and one_line(proc.stderr) == NOT_PULLED
    for argv, extra in (
        (("--debug", "models", "path", "qwen-coder"), {}),
        (("models", "path", "qwen-coder"), {"SPECDEC_DEBUG": "1"}),
    ):
        proc = specdec(*argv, env={**env, **extra})
        assert proc.returncode == 2
        assert "Traceback (most recent call last)" in proc.stderr and "ModelNotFoundError" in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == NOT_PULLED  # the one line still ends it


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["models", "pull", "nope"],
            "specdec: error: unknown model pair 'nope'; known pairs: qwen-coder, smollm2-135m, tiny",
        ),
        (["models", "path", "nope"], "specdec: error: unknown model pair 'nope'"),
        (
            ["models", "path", "qwen-coder/nope"],
            "specdec: error: model 'qwen-coder/nope': pair 'qwen-coder' has no role 'nope'; "
            "use one of: qwen-coder/target, qwen-coder/draft",
        ),
        (["models", "path", "qwen-coder/draft"], NOT_PULLED.replace("target, draft", "draft")),  # that role only
        (["generate", "a,b", "--token-ids"], "specdec: error: --token-ids: 'a,b' is not a comma-separated list"),
        (["traces", "missing.jsonl"], "specdec: error: No such file or directory: missing.jsonl; check the path"),
    ],
)
def test_user_errors(argv: list[str], expected: str, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert one_line(capsys.readouterr().err).startswith(expected)


def test_unreachable_gateway_is_a_user_error_not_a_hang(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert cli.main(["generate", "hi", "--address", address, "--connect-timeout", "0.5"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"specdec: error: cannot reach the gateway at {address}")
    assert "`specdec up`" in line and "--address" in line


def test_rpc_errors_say_what_to_do() -> None:
    import grpc

    class Failed(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

    err = cli.rpc_error(Failed(grpc.StatusCode.INVALID_ARGUMENT, "spec.gamma: 99 must be in [0, 8]"), "the gateway")
    assert str(err) == "the gateway refused the request: spec.gamma: 99 must be in [0, 8]; fix the value it names"
    assert "`specdec up`" in str(cli.rpc_error(Failed(grpc.StatusCode.UNAVAILABLE, "refused"), "the gateway"))
    assert cli.explain(Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))[1] == 2


def test_trace_file_without_the_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = tmp_path / "spans.jsonl"
    spans.write_text("")
    assert cli.main(["traces", str(spans), "--request", "abc"]) == 2
    assert one_line(capsys.readouterr().err).startswith("specdec: error: no request 'abc' in ")
    spans.write_text("{not json\n")
    assert cli.main(["traces", str(spans)]) == 2
    assert f"{spans}:1: not a JSON span record" in one_line(capsys.readouterr().err)


def test_unexpected_error_is_one_line_status_1_and_debug_shows_it(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(args: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "_models", boom)
    assert cli.main(["models", "list"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("specdec: error: unexpected RuntimeError: boom; rerun as `specdec --debug")
    assert cli.main(["--debug", "models", "list"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1] == line


def test_ctrl_c_exits_130_quietly(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_models", interrupted)
    assert cli.main(["models", "list"]) == 130
    assert capsys.readouterr() == ("", "")


def test_argparse_errors_keep_their_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["models", "frob"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: specdec models") and "invalid choice: 'frob'" in err and "Traceback" not in err


def test_model_errors_are_user_errors_and_file_not_found(cache: Path) -> None:
    """Callers that catch FileNotFoundError keep working; the CLI sees a UserError with a hint."""
    with pytest.raises(
        ModelNotFoundError, match="is a pair, not one model; name one of its roles: qwen-coder/target, qwen-coder/draft"
    ):
        resolve("qwen-coder")
    with pytest.raises(
        FileNotFoundError, match="not a folder, a registry name PAIR/ROLE or a Hugging Face repo id ORG/NAME"
    ):
        resolve("/no/such/model")
    with pytest.raises(UserError) as err:
        resolve("qwen-coder/target", pull=False)
    assert err.value.hint == "run `specdec models pull qwen-coder`"


# ---------------------------------------------------------------- models list / path


def test_models_list_json_and_table(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folders = mark_pulled(cache)
    assert cli.main(["models", "list", "--json"]) == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert set(entries) == {"qwen-coder", "smollm2-135m", "tiny"}
    qwen = entries["qwen-coder"]
    assert qwen["installed"] and qwen["licence"] == "Apache-2.0"
    assert {r["role"]: r["path"] for r in qwen["roles"]} == {role: str(p) for role, p in folders.items()}
    assert all(r["installed"] and r["size"] > 0 for r in qwen["roles"])
    assert not entries["smollm2-135m"]["installed"]
    assert [r["role"] for r in entries["tiny"]["roles"]] == ["target", "draft-same", "draft-mid", "draft-far"]
    assert not entries["tiny"]["installed"]  # this cache has not built it

    assert cli.main(["models", "list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0][:5] == ["PAIR", "ROLE", "STATUS", "SIZE", "FOLDER"]
    assert rows[1][:5] == ["qwen-coder", "target", "pulled", "1.0", "GiB"] and rows[1][5] == str(folders["target"])
    assert rows[2][:5] == ["qwen-coder", "draft", "pulled", "469", "MiB"] and rows[2][5] == str(folders["draft"])
    assert rows[3][:4] == ["smollm2-135m", "target", "not", "pulled"]
    assert [r[:3] for r in rows[4:]] == [
        ["tiny", role, "not"] for role in ("target", "draft-same", "draft-mid", "draft-far")
    ]


def test_models_list_json_in_a_process(tiny_cache: Path) -> None:
    proc = specdec("models", "list", "--json", env={"SPECDEC_CACHE_DIR": str(tiny_cache)})
    assert proc.returncode == 0, proc.stderr
    tiny = next(e for e in json.loads(proc.stdout) if e["name"] == "tiny")
    assert tiny["installed"] and all(Path(r["path"]).is_dir() for r in tiny["roles"])


def test_models_path_of_a_pulled_pair_and_of_one_role(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folders = mark_pulled(cache)
    assert cli.main(["models", "path", "qwen-coder"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"target  {folders['target']}", f"draft   {folders['draft']}"]
    assert cli.main(["models", "path", "qwen-coder/draft"]) == 0
    assert capsys.readouterr().out.strip() == str(folders["draft"])
    assert cli.main(["models", "path"]) == 0  # the default pair
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_models_path_of_the_tiny_pair(tiny_cache: Path) -> None:
    env = {"SPECDEC_CACHE_DIR": str(tiny_cache)}
    proc = specdec("models", "path", "tiny", env=env)
    assert proc.returncode == 0, proc.stderr
    roles = dict(line.split() for line in proc.stdout.splitlines())
    assert list(roles) == ["target", "draft-same", "draft-mid", "draft-far"]
    assert all(Path(p).is_dir() and Path(p).is_relative_to(tiny_cache) for p in roles.values())
    one = specdec("models", "path", "tiny/target", env=env)
    assert one.returncode == 0 and one.stdout.strip() == roles["target"]


# ---------------------------------------------------------------- lazy tools


def test_tool_placeholders_match_the_tools_help() -> None:
    """The top-level help is the same whichever tool is imported: the placeholders' lines are the tools'."""
    base = cli.build_parser([]).format_help()
    for name in cli._TOOLS:
        assert cli.build_parser([name]).format_help() == base, name


def test_a_command_imports_no_tool_it_does_not_run(cache: Path) -> None:
    code = (
        "import sys\n"
        "from specdec_cli import main as cli\n"
        "assert cli.main(['models', 'list', '--json']) == 0\n"
        "print('TOOLS', sorted(m for m in ('benchmarks.bench', 'specdec_cli.evaldraft', 'specdec_cli.traces', 'numpy',"
        " 'torch') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SPECDEC_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "TOOLS []" in proc.stdout


def test_debug_flag_is_not_a_service_setting() -> None:
    args = cli.build_parser(["--debug", "serve", "drafter"]).parse_args(["--debug", "serve", "drafter", "--port", "1"])
    assert args.debug and cli.serve_config(args).port == 1


def test_models_pull_makes_its_tmpdir_and_pulls_one_role(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdec models pull tiny/target` with TMPDIR on the (empty) model volume, as the
    pull-models init containers run it: the folder is made, the role's folder printed."""
    staging = cache / ".staging" / "tmp"
    monkeypatch.setenv("TMPDIR", str(staging))
    assert cli.main(["models", "pull", "tiny/target"]) == 0
    assert staging.is_dir()
    assert Path(capsys.readouterr().out.strip()) == resolve("tiny/target")


def test_the_generate_summary_says_when_the_drafter_preempted_the_request_and_when_it_fell_back() -> None:
    from specdec.wire import pb
    from specdec_cli.main import format_stats

    usage = pb.Usage(prompt_tokens=10, completion_tokens=33)
    plain = format_stats(pb.SpeculationStats(gamma=4), usage, 2000.0, 500.0)
    assert "preemptions" not in plain and "fallback" not in plain
    stats = pb.SpeculationStats(gamma=4, drafter_preemptions=2, drafter_fallback=True, fallback_reason="drafter gone")
    text = format_stats(stats, usage, 2000.0, 500.0)
    assert "drafter preemptions: 2" in text and "drafter fallback: drafter gone" in text
    assert "33 generated from 10 prompt tokens in 2.00 s (first token 500 ms, 21.3 tok/s after it)" in text
