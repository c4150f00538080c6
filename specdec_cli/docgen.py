"""Reference pages generated from the code: the settings and the wire format.

The docs site (`mkdocs.yml`, `make docs`) calls these at build time through
`docs/hooks/generate.py`, so the pages cannot drift from the code and nothing generated
is committed. To print one of them: `python -m specdec_cli.docgen configuration|grpc`.

Terms:
    setting    a field of a service's config dataclass in specdec.config, declared with
               `setting(default, help)`; its flag (`--name`) and environment variable
               (`SPECDEC_NAME`) follow from the field's name.
    location   protoc's name for a piece of a .proto file (a message, a field, an rpc ...);
               its `leading_comments` / `trailing_comments` are the comments written
               above / beside it, which is what the gRPC reference shows.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

from specdec import config
from specdec.wire import PROTO_ROOT

# FileDescriptorProto / DescriptorProto / ... field numbers, as protoc's SourceCodeInfo paths use them.
_FILE_SYNTAX, _FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 12, 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE = 2
_SERVICE_METHOD = 2
# The public API (what clients call) comes first; then the other files with services, then the
# rest, each group by name.
PUBLIC_FIRST = ("specdec/v1/gateway.proto",)


def _cell(text: str) -> str:
    """Text fit for one markdown table cell: one line, pipes and angle brackets escaped."""
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    joined = "<br><br>".join(p for p in paragraphs if p)
    return joined.replace("|", "\\|").replace("<br>", "\0").replace("<", "&lt;").replace("\0", "<br>")


# --- configuration ---------------------------------------------------------------------------


def _flag(f: Field[Any]) -> str:
    name = config.flag_name(f.name)
    if config._flag_type(f) is bool:
        return f"`{name}` / `--no-{name[2:]}`"
    if "choices" in f.metadata:
        return f"`{name} {'|'.join(f.metadata['choices'])}`"  # a pipe inside a code span splits no cell
    return f"`{name} {f.metadata.get('metavar') or config._METAVARS[config._flag_type(f)]}`"


def _settings_table(items: list[Field[Any]]) -> list[str]:
    rows = ["| setting, flag, environment variable | default | meaning |", "| --- | --- | --- |"]
    for f in items:
        rows.append(
            f"| `{f.name}`<br>{_flag(f)}<br>`{config.env_name(f.name)}` | "
            f"`{config.show_default(f.default)}` | {_cell(f.metadata['help'])} |"
        )
    return rows


def config_markdown() -> str:
    """The settings of every service (specdec.config's dataclasses) as markdown tables: the
    settings all services share once, then each service's own."""
    shared = {f.name for f in fields(config.TransportConfig)}
    terms = (config.__doc__ or "").split("Terms:", 1)
    out = []
    if len(terms) == 2:
        out += [
            "Terms used below (from `specdec/config.py`):",
            "",
            "```text",
            textwrap.dedent(terms[1]).strip("\n"),
            "```",
            "",
        ]
    out += [
        "## Every service",
        "",
        _cell(config.TransportConfig.__doc__ or ""),
        "",
        *_settings_table(list(fields(config.TransportConfig))),
        "",
    ]
    for kind, cls in config.SERVICE_CONFIGS.items():
        own = [f for f in fields(cls) if f.name not in shared]
        out += [f"## {kind}", "", f"`specdec serve {kind}`: {_cell(cls.__doc__ or '')}", "", *_settings_table(own), ""]
    return "\n".join(out)


# --- gRPC ------------------------------------------------------------------------------------


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto file under `root` (protos/), sorted."""
    return sorted(root.rglob("*.proto"))


def descriptor_set(root: Path = PROTO_ROOT) -> descriptor_pb2.FileDescriptorSet:
    """The protos under `root`, compiled by protoc with their comments (source info)."""
    import grpc_tools  # grpcio-tools ships no type information: Any (ignore_missing_imports)
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "protos.pb"
        files = [str(p.relative_to(root)) for p in proto_files(root)]
        args = ["protoc", f"-I{root}", f"-I{include}", "--include_source_info", f"--descriptor_set_out={out}", *files]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Each location's comments (leading, then trailing), by its path."""
    out = {}
    for loc in file.source_code_info.location:
        text = "\n\n".join(c.strip() for c in (loc.leading_comments, loc.trailing_comments) if c.strip())
        if text:
            out[tuple(loc.path)] = text
    return out


def _messages(
    file: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
    """Every message of a file (nested ones as Outer.Inner; map entries left out), with its path."""

    def walk(
        prefix: str, msgs: list[descriptor_pb2.DescriptorProto], path: tuple[int, ...]
    ) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
        for i, m in enumerate(msgs):
            if m.options.map_entry:
                continue
            name = f"{prefix}{m.name}"
            yield name, m, (*path, i)
            yield from walk(f"{name}.", list(m.nested_type), (*path, i, _MESSAGE_NESTED))

    yield from walk("", list(file.message_type), (_FILE_MESSAGE,))


def _enums(
    file: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto, tuple[int, ...]]]:
    for i, e in enumerate(file.enum_type):
        yield e.name, e, (_FILE_ENUM, i)
    for name, m, path in _messages(file):
        for i, e in enumerate(m.enum_type):
            yield f"{name}.{e.name}", e, (*path, _MESSAGE_ENUM, i)


def grpc_markdown(root: Path = PROTO_ROOT) -> str:
    """The services, messages and enums of every .proto under `root`, with their comments, as
    markdown: the gateway's file first, then the other files that define services."""
    fds = descriptor_set(root)
    documented = {}  # full name without the leading dot -> anchor
    maps: dict[str, descriptor_pb2.DescriptorProto] = {}
    for file in fds.file:
        for name, _m, _ in _messages(file):
            documented[f"{file.package}.{name}"] = f"{file.package}.{name}"
        for name, _, _ in _enums(file):
            documented[f"{file.package}.{name}"] = f"{file.package}.{name}"

        def collect(prefix: str, msgs: list[descriptor_pb2.DescriptorProto]) -> None:
            for m in msgs:
                if m.options.map_entry:
                    maps[f"{prefix}.{m.name}"] = m
                collect(f"{prefix}.{m.name}", list(m.nested_type))

        collect(file.package, list(file.message_type))

    def ref(type_name: str) -> str:
        name = type_name.lstrip(".")
        return f"[`{name.rsplit('.', 1)[-1]}`](#{documented[name]})" if name in documented else f"`{name}`"

    def field_type(f: descriptor_pb2.FieldDescriptorProto) -> str:
        if f.type_name and f.type_name.lstrip(".") in maps:
            key, value = maps[f.type_name.lstrip(".")].field
            return f"map&lt;{field_type(key)}, {field_type(value)}&gt;"
        if f.type_name:
            return ref(f.type_name)
        type_name: str = descriptor_pb2.FieldDescriptorProto.Type.Name(f.type)  # "TYPE_INT32", ...
        return "`" + type_name[len("TYPE_") :].lower() + "`"

    out: list[str] = []
    ours = {str(p.relative_to(root)) for p in proto_files(root)}
    for file in sorted(fds.file, key=lambda f: (f.name not in PUBLIC_FIRST, not f.service, f.name)):
        if file.name not in ours:
            continue  # an import from outside protos/ (none today)
        notes = _comments(file)
        out += [f"## {file.name}", ""]
        header = next((loc for loc in file.source_code_info.location if tuple(loc.path) == (_FILE_SYNTAX,)), None)
        if header is not None:  # the comment above `syntax = ...`: what the file holds
            text = "\n\n".join([*header.leading_detached_comments, header.leading_comments])
            out += [line for p in text.split("\n\n") if p.strip() for line in (" ".join(p.split()), "")]
        for si, service in enumerate(file.service):
            anchor = f"{file.package}.{service.name}"
            out += [f"### service {service.name} {{#{anchor}}}", ""]
            if (_FILE_SERVICE, si) in notes:
                out += [_cell(notes[(_FILE_SERVICE, si)]), ""]
            out += ["| rpc | request | response | description |", "| --- | --- | --- | --- |"]
            for mi, method in enumerate(service.method):
                req = ("stream " if method.client_streaming else "") + ref(method.input_type)
                res = ("stream " if method.server_streaming else "") + ref(method.output_type)
                text = _cell(notes.get((_FILE_SERVICE, si, _SERVICE_METHOD, mi), ""))
                out.append(f"| `{method.name}` | {req} | {res} | {text} |")
            out.append("")
        for name, m, path in _messages(file):
            out += [f"### message {name} {{#{file.package}.{name}}}", ""]
            if path in notes:
                out += [_cell(notes[path]), ""]
            if m.field:
                out += ["| field | number | type | description |", "| --- | --- | --- | --- |"]
                real_oneofs = [
                    o.name
                    for i, o in enumerate(m.oneof_decl)
                    if any(f.HasField("oneof_index") and f.oneof_index == i and not f.proto3_optional for f in m.field)
                ]
                for fi, f in enumerate(m.field):
                    label = ""
                    if (
                        f.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                        and f.type_name.lstrip(".") not in maps
                    ):
                        label = "repeated "
                    elif f.proto3_optional:
                        label = "optional "
                    text = notes.get((*path, _MESSAGE_FIELD, fi), "")
                    if f.HasField("oneof_index") and m.oneof_decl[f.oneof_index].name in real_oneofs:
                        text = f"One of `{m.oneof_decl[f.oneof_index].name}`. {text}"
                    out.append(f"| `{f.name}` | {f.number} | {label}{field_type(f)} | {_cell(text)} |")
            else:
                out.append("No fields.")
            reserved = [str(r.start) if r.end == r.start + 1 else f"{r.start}-{r.end - 1}" for r in m.reserved_range]
            if reserved or m.reserved_name:
                out += [
                    "",
                    "Reserved (never reused): " + ", ".join([*reserved, *(f"`{n}`" for n in m.reserved_name)]) + ".",
                ]
            out.append("")
        for name, e, path in _enums(file):
            out += [f"### enum {name} {{#{file.package}.{name}}}", ""]
            if path in notes:
                out += [_cell(notes[path]), ""]
            out += ["| value | number | description |", "| --- | --- | --- |"]
            for vi, v in enumerate(e.value):
                out.append(f"| `{v.name}` | {v.number} | {_cell(notes.get((*path, _ENUM_VALUE, vi), ''))} |")
            out.append("")
    return "\n".join(out)


PAGES: dict[str, Callable[[], str]] = {"configuration": config_markdown, "grpc": grpc_markdown}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_cli.docgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("page", choices=sorted(PAGES), help="which generated reference to print (markdown)")
    print(PAGES[parser.parse_args(argv).page]())


if __name__ == "__main__":
    main()
