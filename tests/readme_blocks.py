"""The README's code blocks, with the notes that say how a test runs each.

A note is an HTML comment on the line before a block (invisible on GitHub):
`<!-- readme-test: only: REGEX ; sub: OLD => NEW; sub: ... -->`. `only` keeps the lines that
match (e.g. the engramflow commands of a block whose other lines need a cloud account or the
network); `sub` replaces text (a released path by a local checkpoint, 8 stages by 2); `{root}`
and `{ckpt}` in a replacement are the repository and the test's checkpoint. A block without a
note runs exactly as written.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

FENCE = re.compile(r"(?:<!-- readme-test: (?P<note>.*?) -->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)


@dataclasses.dataclass
class Block:
    line: int
    lang: str
    code: str
    only: str | None
    subs: list[tuple[str, str]]

    def runnable(self, **values) -> str:
        code = self.code
        for old, new in self.subs:
            assert old in code, f"README line {self.line}: {old!r} is not in the block"
            code = code.replace(old, new.format(**values))
        if self.only:
            code = "\n".join(l for l in code.splitlines() if re.search(self.only, l)) + "\n"
        return code


def blocks(readme: Path) -> list[Block]:
    text = readme.read_text()
    out = []
    for m in FENCE.finditer(text):
        only, subs = None, []
        for part in filter(None, (p.strip() for p in (m.group("note") or "").split(";"))):
            key, _, value = part.partition(":")
            if key.strip() == "only":
                only = value.strip()
            elif key.strip() == "sub":
                old, _, new = value.partition("=>")
                subs.append((old.strip(), new.strip()))
            else:
                raise ValueError(f"unknown readme-test note {part!r}")
        out.append(Block(text[:m.start("code")].count("\n") + 1, m.group("lang"), m.group("code"), only, subs))
    return out
