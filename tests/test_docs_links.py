"""Every relative link in README.md and docs/**/*.md resolves: the file exists and a `#anchor` names a
heading of the target (GitHub's anchor rule). Web links are not fetched (no network here)."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def _prose(text: str) -> str:
    """The text without code blocks and code spans, where a `](...)` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set:
    seen, out = {}, set()
    for heading in HEADING.findall(FENCE.sub("", open(path, encoding="utf-8").read())):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")  # repeated headings: -1, -2, ...
        seen[base] = n + 1
    return out


def links(path: str):
    for target in LINK.findall(_prose(open(path, encoding="utf-8").read())):
        if not target.startswith(EXTERNAL):
            yield target


def test_the_slug_rule():
    assert slug("verl 0.9.1: `mask_replay.integrations.verl`") == "verl-091-mask_replayintegrationsverl"
    assert slug("Replay inside TRL's GRPOTrainer") == "replay-inside-trls-grpotrainer"


def test_links_are_found_outside_code_only(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](x.md) ![f](img.png#top) `[c](code.md)`\n```\n[d](block.md)\n```\n[e](https://e.org)\n")
    assert list(links(str(page))) == ["x.md", "img.png#top"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(dest):
            broken.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not broken, f"{os.path.relpath(page, ROOT)}: " + "; ".join(broken)
