"""Upstream references in report text become links: `owner/repo#123`, `FairScale#354`, URLs.

Why: xfail reasons and scenario notes cite the upstream issue a known failure rests on; a CI
user reading the HTML report should be one click from it. Everything else is HTML-escaped.
"""

from __future__ import annotations

import html
import re

# Projects cited by their short name in reasons ("FairScale#354") -> their GitHub repository.
ALIASES = {
    "pytorch": "pytorch/pytorch", "torch": "pytorch/pytorch", "fairscale": "facebookresearch/fairscale",
    "deepspeed": "microsoft/DeepSpeed", "transformers": "huggingface/transformers",
}
_REPO = r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+"
PATTERN = re.compile(
    rf"(?P<url>https?://[^\s<>\"')\]]+)"
    rf"|(?P<repo>{_REPO})#(?P<num>\d+)"
    rf"|\b(?P<alias>{'|'.join(ALIASES)})#(?P<anum>\d+)",
    re.IGNORECASE,
)


def issue_url(repo: str, number: str) -> str:
    return f"https://github.com/{repo}/issues/{number}"


def _url(m: re.Match) -> str:
    if m.group("url"):
        return m.group("url")
    if m.group("repo"):
        return issue_url(m.group("repo"), m.group("num"))
    return issue_url(ALIASES[m.group("alias").lower()], m.group("anum"))


def references(text: str) -> list[tuple[str, str]]:
    """(label, url) for every upstream reference in `text`, in order."""
    return [(m.group(0), _url(m)) for m in PATTERN.finditer(text or "")]


def linkify(text) -> str:
    """`text` HTML-escaped, with each upstream reference an `<a>` to it."""
    text = "" if text is None else str(text)
    parts, last = [], 0
    for m in PATTERN.finditer(text):
        parts.append(html.escape(text[last:m.start()], quote=True))
        parts.append(f'<a href="{html.escape(_url(m), quote=True)}">{html.escape(m.group(0), quote=True)}</a>')
        last = m.end()
    parts.append(html.escape(text[last:], quote=True))
    return "".join(parts)
