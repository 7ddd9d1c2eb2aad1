"""The developer docs agree with the code: the code map in docs/dev/README.md names every module
of the package (a module added without an entry fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "fp8_align"


def _code_map_entries() -> set[str]:
    text = (ROOT / "docs" / "dev" / "README.md").read_text()
    section = text[text.index("## Code map") : text.index("\n## ", text.index("## Code map") + 1)]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE))


def _modules() -> set[str]:
    """Each module's path relative to the package; a package as its folder (`kv/`), the root `__init__.py` as itself."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.endswith("/__init__.py"):
            rel = rel[: -len("__init__.py")]
        names.add(rel)
    return names


def test_code_map_names_every_module_and_nothing_that_is_gone() -> None:
    entries, modules = _code_map_entries(), _modules()
    assert modules - entries == set(), f"modules missing from docs/dev/README.md's code map: {sorted(modules - entries)}"
    assert entries - modules == set(), f"code map entries with no module: {sorted(entries - modules)}"
