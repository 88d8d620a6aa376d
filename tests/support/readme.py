"""The README's Python examples, read from the README itself so that the tests run them as written."""
from __future__ import annotations

import re

from support.paths import REPO

README = REPO / "README.md"


def python_blocks() -> dict[str, str]:
    """Each ```python block of the README, by the heading of the section it is in (one per section)."""
    blocks: dict[str, str] = {}
    heading, lines, fence = "", [], None      # fence: the open block's language ("" = none), or None
    for line in README.read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                assert heading not in blocks, f"README: two Python blocks under '{heading}'"
                blocks[heading] = "\n".join(lines) + "\n"
            fence = None
        elif fence is not None:
            lines.append(line)
        elif m := re.match(r"#+\s+(.*)", line):
            heading = m.group(1).strip()
    return blocks


def with_paths(code: str, paths: dict[str, str]) -> str:
    """``code`` with each quoted literal path of ``paths`` replaced (each must be there exactly once)."""
    for old, new in paths.items():
        assert code.count(f'"{old}"') == 1, f"README example: expected one \"{old}\""
        code = code.replace(f'"{old}"', repr(new))
    return code
