"""The code blocks of docs/INTEGRATIONS.md that are marked `<!-- snippet: NAME -->`, run as modules, so the
tests use the documented callbacks themselves and the page cannot drift from the code."""

from __future__ import annotations

import re
import types
from pathlib import Path

INTEGRATIONS = Path(__file__).resolve().parent.parent / "docs" / "INTEGRATIONS.md"
_SNIPPET = re.compile(r"<!-- snippet: (\w+) -->\n```python\n(.*?)\n```", re.DOTALL)


def snippet_sources() -> dict[str, str]:
    return dict(_SNIPPET.findall(INTEGRATIONS.read_text()))


def load_snippet(name: str) -> types.ModuleType:
    """Run snippet NAME as a module named `integrations_NAME` and return it."""
    source = snippet_sources()[name]
    module = types.ModuleType(f"integrations_{name}")
    module.__file__ = f"{INTEGRATIONS}#{name}"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
