"""The generated reference pages (specdec_cli.docgen): every setting and every wire element, with its
documentation, and nothing invented."""

from __future__ import annotations

import importlib
import re
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

from specdec import config
from specdec.wire import PROTO_FILES, PROTO_ROOT
from specdec_cli import docgen


def _row(page: str, name: str) -> str:
    """The table row of `page` whose first cell is `name` (exactly one)."""
    rows = [line for line in page.splitlines() if re.match(rf"\| `{name}`(<br>| \|)", line)]
    assert len(rows) == 1, f"{name}: {len(rows)} rows"
    return rows[0]


def _section(page: str, heading: str) -> str:
    """The text of `page` under `## heading`, up to the next `## `."""
    start = page.index(f"\n## {heading}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else None]


def test_config_page_has_every_setting_with_flag_env_default_and_help() -> None:
    page = docgen.config_markdown()
    shared = {f.name for f in fields(config.TransportConfig)}
    for kind, cls in config.SERVICE_CONFIGS.items():
        for section, items in (
            ("Every service", [f for f in fields(cls) if f.name in shared]),
            (kind, [f for f in fields(cls) if f.name not in shared]),
        ):
            text = _section(page, section)
            for f in items:
                row = _row(text, f.name)
                assert f"`{config.env_name(f.name)}`" in row and config.flag_name(f.name) in row, row
                assert f"`{config.show_default(f.default)}`" in row, row
                assert " ".join(f.metadata["help"].split())[:40].replace("<", "&lt;") in row, row


def test_config_page_shows_choices_and_bool_flags() -> None:
    page = docgen.config_markdown()
    assert "`--quantize auto|none|int8`" in _row(_section(page, "drafter"), "quantize")
    assert "`--adaptive-gamma` / `--no-adaptive-gamma`" in _row(_section(page, "verifier"), "adaptive_gamma")


def test_grpc_page_has_every_service_message_field_and_enum_value() -> None:
    """Checked against the compiled stubs' descriptors, not against the generator's own parse."""
    page = docgen.grpc_markdown()
    files = [importlib.import_module(f"specdec.v1.{name}_pb2").DESCRIPTOR for name in PROTO_FILES]
    for file in files:
        assert f"## {file.name}" in page
        for service in file.services_by_name.values():
            assert f"### service {service.name} {{#{service.full_name}}}" in page
            for method in service.methods:
                assert f"| `{method.name}` | " in page
        for message in file.message_types_by_name.values():
            heading = f"### message {message.name} {{#{message.full_name}}}"
            assert heading in page
            body = page[page.index(heading) :].split("\n### ", 1)[0]
            for field in message.fields:
                assert f"| `{field.name}` | {field.number} | " in body, (message.name, field.name)
        for enum in file.enum_types_by_name.values():
            body = page[page.index(f"### enum {enum.name} {{#{enum.full_name}}}") :].split("\n### ", 1)[0]
            for value in enum.values:
                assert f"| `{value.name}` | {value.number} | " in body


def test_grpc_page_carries_the_protos_comments() -> None:
    page = docgen.grpc_markdown()
    # a file's header, a service's rpc, a message, a field, reserved numbers: as written in protos/
    assert "The gateway: the public entry point." in page
    assert "| `GenerateStream` | [`GenerateStreamRequest`](#specdec.v1.GenerateStreamRequest) | stream " in page
    assert "What to generate. Exactly one of prompt_text / prompt_token_ids is set." in page
    assert "Draft tokens per target step, 0..max_gamma; unset: the gateway's default." in _row(
        page[page.index("### message GenerationSpec") :].split("\n### ", 1)[0], "gamma"
    )
    assert "Reserved (never reused): 3, 4, `probs`, `q`." in page
    assert re.search(r"\| `trace_context` \| \d+ \| map&lt;`string`, `string`&gt; \|", page)


def test_grpc_page_follows_a_new_proto_and_its_comments(tmp_path: Path) -> None:
    """The page is read from protos/**/*.proto at build time: a new file, a nested folder and
    its comments show up with no list to update."""
    root = tmp_path / "protos"
    shutil.copytree(PROTO_ROOT, root)
    extra = root / "specdec" / "v2" / "extra.proto"
    extra.parent.mkdir(parents=True)
    extra.write_text(
        '// A file added later.\nsyntax = "proto3";\n\npackage specdec.v2;\n\n'
        'import "specdec/v1/common.proto";\n\n'
        "// Says hello.\nservice HelloService {\n  // Once.\n  rpc Hello(Ping) returns (stream Ping);\n}\n\n"
        "// A ping.\nmessage Ping {\n  // Who.\n  string name = 1;\n  specdec.v1.DraftMethod method = 2;\n"
        "  message Inner { int32 x = 1; }\n  Inner inner = 3;\n}\n"
    )
    page = docgen.grpc_markdown(root)
    assert "## specdec/v2/extra.proto" in page and "A file added later." in page
    assert "| `Hello` | [`Ping`](#specdec.v2.Ping) | stream [`Ping`](#specdec.v2.Ping) | Once. |" in page
    assert "| `name` | 1 | `string` | Who. |" in page
    assert "| `method` | 2 | [`DraftMethod`](#specdec.v1.DraftMethod) |" in page
    assert "### message Ping.Inner {#specdec.v2.Ping.Inner}" in page


def test_grpc_page_fails_on_a_proto_that_does_not_compile(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    (root / "bad").mkdir(parents=True)
    (root / "bad" / "bad.proto").write_text('syntax = "proto3";\nmessage Broken { int32 = 1; }\n')
    with pytest.raises(RuntimeError, match="protoc failed"):
        docgen.grpc_markdown(root)


def test_main_prints_a_page(capsys: pytest.CaptureFixture[str]) -> None:
    docgen.main(["configuration"])
    assert "## verifier" in capsys.readouterr().out
