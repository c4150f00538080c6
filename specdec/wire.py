"""The generated gRPC stubs of protos/specdec/v1, compiled at setup time.

The stubs land in `specdec/v1/` (gitignored, never hand-edited). `make protos`
(part of `make setup`) compiles them; importing this module compiles them too
when they are missing or older than the .proto files, so a fresh checkout works.

Besides protoc's modules (`<name>_pb2.py` messages, `<name>_pb2_grpc.py` services) it
writes two namespaces that gather every .proto's names: `specdec/v1/pb.py` (messages and
enums) and `specdec/v1/rpc.py` (service stubs and servicers). The types of the modules
(`<name>_pb2.pyi`, `<name>_pb2_grpc.pyi`, read by `make typecheck`) come from mypy-protobuf's
plugins when it is installed (the `test` extra); without it, protoc's own `.pyi` of the
messages (looser: its containers lack type arguments) and none for the services.

Usage:
    from specdec.wire import pb, rpc
    pb.DraftBlock(...)            # messages of every .proto in one namespace
    rpc.VerifierServiceStub(ch)   # service stubs and servicers
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
OUT_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("common", "drafter", "verifier", "gateway")
# The namespaces written beside protoc's modules: name -> (suffix of the modules it gathers, what they hold).
NAMESPACES = {"pb": ("_pb2", "messages and enums"), "rpc": ("_pb2_grpc", "service stubs and servicers")}


def _types_plugin(name: str) -> str | None:
    """The path of mypy-protobuf's protoc plugin `protoc-gen-<name>` ("mypy": messages, "mypy_grpc":
    services), or None when mypy-protobuf is not installed."""
    found = shutil.which(f"protoc-gen-{name}")
    beside = Path(sys.executable).parent / f"protoc-gen-{name}"  # a venv's python run without activating it
    return found or (str(beside) if beside.exists() else None)


def _stale() -> bool:
    out = OUT_ROOT / "specdec" / "v1"
    gen_suffixes = ["_pb2.py", "_pb2_grpc.py"] + (["_pb2_grpc.pyi"] if _types_plugin("mypy_grpc") else [])
    for name in PROTO_FILES:
        src = PROTO_ROOT / "specdec" / "v1" / f"{name}.proto"
        for gen in (out / f"{name}{suffix}" for suffix in gen_suffixes):
            if not gen.exists() or gen.stat().st_mtime < src.stat().st_mtime:
                return True
    return not all((out / f"{ns}.py").exists() for ns in NAMESPACES)


def compile_protos() -> None:
    """Compile protos/specdec/v1/*.proto into specdec/v1/ (messages, stubs, .pyi, the pb and rpc namespaces)."""
    from grpc_tools import protoc  # untyped (no stubs): ignore_missing_imports in pyproject.toml

    grpc_tools_file = importlib.import_module("grpc_tools").__file__
    assert grpc_tools_file is not None, "grpc_tools is a regular package, so it has a __file__"
    include = Path(grpc_tools_file).parent / "_proto"
    files = [str(PROTO_ROOT / "specdec" / "v1" / f"{n}.proto") for n in PROTO_FILES]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUT_ROOT}",
        f"--grpc_python_out={OUT_ROOT}",
    ]
    messages, services = _types_plugin("mypy"), _types_plugin("mypy_grpc")
    if messages:
        args += [f"--plugin=protoc-gen-mypy={messages}", f"--mypy_out={OUT_ROOT}"]
    else:
        args += [f"--pyi_out={OUT_ROOT}"]
    if services:
        args += [f"--plugin=protoc-gen-mypy_grpc={services}", f"--mypy_grpc_out={OUT_ROOT}"]
    args += files
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    out = OUT_ROOT / "specdec" / "v1"
    (out / "__init__.py").write_text('"""Generated from protos/ (do not edit)."""\n')
    for ns, (suffix, holds) in NAMESPACES.items():
        lines = [f'"""Every .proto\'s {holds} in one namespace (written by specdec.wire; do not edit)."""', ""]
        lines += [f"from specdec.v1.{name}{suffix} import *  # noqa: F403" for name in PROTO_FILES]
        (out / f"{ns}.py").write_text("\n".join(lines) + "\n")


if PROTO_ROOT.is_dir() and _stale():
    compile_protos()

# Below the compile: on a fresh checkout the stubs exist only from here on (E402). `x as x`
# marks them re-exported for mypy.
from specdec.v1 import pb as pb  # noqa: E402
from specdec.v1 import rpc as rpc  # noqa: E402

# The one map between finish reasons as vLLM and OpenAI name them and the wire's enum.
FINISH_REASONS: dict[str | None, pb.FinishReason.ValueType] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def finish_reason_name(code: pb.FinishReason.ValueType) -> str | None:
    """ "length", "stop", "abort", or None for FINISH_REASON_UNSPECIFIED (still running)."""
    return _FINISH_NAMES[code]


if __name__ == "__main__":
    compile_protos()
    sys.stdout.write(f"compiled {len(PROTO_FILES)} protos into {OUT_ROOT / 'specdec' / 'v1'}\n")


# Draft methods: the proto enum is the one owner; users see these names.
DRAFT_METHOD_NAMES: tuple[str, ...] = tuple(
    n.removeprefix("DRAFT_METHOD_").lower() for n in pb.DraftMethod.keys() if n != "DRAFT_METHOD_UNSPECIFIED"
)


def draft_method_name(method: pb.DraftMethod.ValueType) -> str:
    """ "model", "ngram", "none" ("" for UNSPECIFIED)."""
    if method == pb.DRAFT_METHOD_UNSPECIFIED:
        return ""
    return pb.DraftMethod.Name(method).removeprefix("DRAFT_METHOD_").lower()


def draft_method(name: str) -> pb.DraftMethod.ValueType:
    """The enum value of a method name ("" is UNSPECIFIED); ValueError names the known ones."""
    if not name:
        return pb.DRAFT_METHOD_UNSPECIFIED
    try:
        return pb.DraftMethod.Value(f"DRAFT_METHOD_{name.upper()}")
    except ValueError:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DRAFT_METHOD_NAMES)}") from None
