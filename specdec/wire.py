"""The generated gRPC stubs of protos/specdec/v1, compiled at setup time.

The stubs land in `specdec/v1/` (gitignored, never hand-edited). `make protos`
(part of `make setup`) compiles them; importing this module compiles them too
when they are missing or older than the .proto files, so a fresh checkout works.

Usage:
    from specdec.wire import pb, rpc
    pb.DraftBlock(...)            # messages of every .proto in one namespace
    rpc.VerifierServiceStub(ch)   # service stubs and servicers
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
OUT_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("common", "drafter", "verifier", "gateway")


def _stale() -> bool:
    out = OUT_ROOT / "specdec" / "v1"
    for name in PROTO_FILES:
        src = PROTO_ROOT / "specdec" / "v1" / f"{name}.proto"
        for gen in (out / f"{name}_pb2.py", out / f"{name}_pb2_grpc.py"):
            if not gen.exists() or gen.stat().st_mtime < src.stat().st_mtime:
                return True
    return False


def compile_protos() -> None:
    """Compile protos/specdec/v1/*.proto into specdec/v1/ (messages, stubs, .pyi)."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # grpcio-tools ships no type information

    include = Path(importlib.import_module("grpc_tools").__file__).parent / "_proto"
    files = [str(PROTO_ROOT / "specdec" / "v1" / f"{n}.proto") for n in PROTO_FILES]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUT_ROOT}",
        f"--pyi_out={OUT_ROOT}",
        f"--grpc_python_out={OUT_ROOT}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    (OUT_ROOT / "specdec" / "v1" / "__init__.py").write_text('"""Generated from protos/ (do not edit)."""\n')


if PROTO_ROOT.is_dir() and _stale():
    compile_protos()


def _namespace(suffix: str) -> types.SimpleNamespace:
    ns = types.SimpleNamespace()
    for name in PROTO_FILES:
        mod = importlib.import_module(f"specdec.v1.{name}{suffix}")
        for attr in dir(mod):
            if not attr.startswith("_"):
                setattr(ns, attr, getattr(mod, attr))
    return ns


pb = _namespace("_pb2")
rpc = _namespace("_pb2_grpc")

# The one map between finish reasons as vLLM and OpenAI name them and the wire's enum.
FINISH_REASONS: dict[str | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def finish_reason_name(code: int) -> str | None:
    """"length", "stop", "abort", or None for FINISH_REASON_UNSPECIFIED (still running)."""
    return _FINISH_NAMES[code]

if __name__ == "__main__":
    compile_protos()
    sys.stdout.write(f"compiled {len(PROTO_FILES)} protos into {OUT_ROOT / 'specdec' / 'v1'}\n")


# Draft methods: the proto enum is the one owner; users see these names.
DRAFT_METHOD_NAMES: tuple[str, ...] = tuple(
    n.removeprefix("DRAFT_METHOD_").lower() for n in pb.DraftMethod.keys() if n != "DRAFT_METHOD_UNSPECIFIED"
)


def draft_method_name(method: int) -> str:
    """"model", "ngram", "none" ("" for UNSPECIFIED)."""
    if method == pb.DRAFT_METHOD_UNSPECIFIED:
        return ""
    return pb.DraftMethod.Name(method).removeprefix("DRAFT_METHOD_").lower()


def draft_method(name: str) -> int:
    """The enum value of a method name ("" is UNSPECIFIED); ValueError names the known ones."""
    if not name:
        return pb.DRAFT_METHOD_UNSPECIFIED
    try:
        return pb.DraftMethod.Value(f"DRAFT_METHOD_{name.upper()}")
    except ValueError:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DRAFT_METHOD_NAMES)}") from None
