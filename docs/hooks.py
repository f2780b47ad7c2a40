"""MkDocs hooks (mkdocs.yml): the repository's root documents as pages of the site, and relative
links written for the repository (as GitHub shows it) rewritten for the site.

A link is resolved against the file's place in the repository: to a root document or a file
under docs/, it becomes a link to that page or file of the site; to any other file of the
repository (scripts/README.md), which the site does not hold, it becomes its plain text.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
ROOT_PAGES = {"BENCHMARKS.md": "benchmarks.md", "CHANGELOG.md": "changelog.md", "CONTRIBUTING.md": "contributing.md"}
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_files(files, config):
    for name, page in ROOT_PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / name)))
    return files


def _site_path(target: str) -> str | None:
    """A repository path's place in the site (None: not part of it)."""
    if target in ROOT_PAGES:
        return ROOT_PAGES[target]
    if target.startswith("docs/"):
        return target.removeprefix("docs/")
    return None


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    in_repo = next((k for k, v in ROOT_PAGES.items() if v == src), "docs/" + src)

    def fix(m: re.Match) -> str:
        bang, text, target, anchor = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        if ":" in target or target.startswith("/"):  # a URL, or an absolute link (left to MkDocs)
            return m.group(0)
        site = _site_path(posixpath.normpath(posixpath.join(posixpath.dirname(in_repo), target)))
        if site is None:
            return text
        return f"{bang}[{text}]({posixpath.relpath(site, posixpath.dirname(src) or '.')}{anchor})"

    return LINK.sub(fix, markdown)
