"""README's flag table is the config fields' (`tools/flags_doc.py`), kept true by this test."""

from __future__ import annotations

from subway.tools import flags_doc
from subway.tools.cli import engine_flags


def test_the_readmes_flag_table_is_generated_from_the_fields():
    with open(flags_doc.readme_path()) as f:
        text = f.read()
    assert flags_doc.BEGIN in text and flags_doc.END in text
    assert flags_doc.replace_block(text, flags_doc.render()) == text, (
        "README.md's flag table is stale: run `python -m subway.tools.flags_doc --write`"
    )


def test_every_flag_has_a_row_and_a_default():
    table = flags_doc.render()
    for _, names, kw in engine_flags():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{names[0]}`"))
        assert row.count("|") >= 4, row
        if kw.get("action") is None and kw["default"] not in ("", None, ()):
            assert f"`{kw['default']}`" in row, row
