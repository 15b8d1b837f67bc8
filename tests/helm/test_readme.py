"""The chart README's value tables match values.yaml: every key they name exists, every
value is covered by a row (a row may name a whole map, e.g. `resources`), and every
default they show is the real one. A value table's first header cell starts with "Key"
and names the blocks its keys live under (`verifier.` ...; none: top level); a header
cell "Default" or a block's name heads a defaults column."""

from __future__ import annotations

import re

import yaml

from tests.tools import CHART

README = CHART / "README.md"
MISSING = object()


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def lookup(tree, path: str):
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def leaves(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= leaves(value, f"{path}.")
        else:
            out.add(path)
    return out


def rows() -> list[tuple[str, str, str]]:
    """(full key, defaults column, cell) for every key row; cell "" = no defaults column."""
    out, header = [], None
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells if cells[0].startswith("Key") else []
        elif header and not set(line) <= set("|- ") and cells[0].startswith("`"):
            blocks = re.findall(r"`(\w+)\.`", header[0])
            key = cells[0].strip("`")
            for block in blocks or [""]:
                full = f"{block}.{key}" if block else key
                columns = [(h, c) for h, c in zip(header[1:], cells[1:], strict=True)
                           if h == "Default" or h == block]
                out += [(full, h, c) for h, c in columns] or [(full, "", "")]
    return out


def test_tables_name_only_real_keys():
    v = values()
    found = [key for key, _, _ in rows()]
    assert len(found) > 50, "the value tables were not found"
    assert [k for k in found if lookup(v, k) is MISSING] == []


def test_every_value_has_a_row():
    documented = {key for key, _, _ in rows()}
    missing = {leaf for leaf in leaves(values())
               if not any(leaf == d or leaf.startswith(d + ".") for d in documented)}
    assert missing == set()
    assert set(values()) <= {k.split(".")[0] for k in documented}  # every top-level key


def test_defaults_shown_are_the_defaults():
    v, wrong = values(), []
    for key, column, cell in rows():
        if re.fullmatch(r"`[^`]*`", cell):  # a literal; prose cells are not checked
            shown = yaml.safe_load(cell.strip("`")) if cell != '`""`' else ""
            if shown != lookup(v, key):
                wrong.append(f"{key} ({column}): README {cell}, values.yaml {lookup(v, key)!r}")
    assert wrong == []
