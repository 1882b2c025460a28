"""The documentation site, built once per session, and a reader of its pages."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "rules" / "examples"


def load_record() -> ModuleType:
    """Import the examples' runner, ``docs/rules/examples/record.py``, by its path."""
    spec = importlib.util.spec_from_file_location("ampdoctor_tests_record", EXAMPLES / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site as a user does, warnings as errors: ``sphinx-build -W --keep-going -b html docs OUT``."""
    if importlib.util.find_spec("sphinx") is None:
        pytest.skip('sphinx is not installed: pip install "ampdoctor[docs]" to build the docs')
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


class Page(HTMLParser):
    """A built page's text as a reader sees it: the heading, then each section's paragraphs and code blocks, by
    the section's id (``why-it-breaks-training``). Permalink marks and line numbers are left out."""

    BLOCKS = ("h1", "h2", "p", "pre")

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.blocks: dict[str, list[tuple[str, str]]] = {}
        self.heading = ""
        self._block: tuple[str, list[str]] | None = None
        self._skip: list[str] = []  # open tags whose text is not shown as text
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if self._skip or "headerlink" in classes or "linenos" in classes:
            self._skip.append(tag)
        elif tag == "section":
            self.sections.append(dict(attrs).get("id") or "")
        elif tag in self.BLOCKS and self._block is None:
            self._block = (tag, [])

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            self._skip.pop()
        elif tag == "section":
            self.sections.pop()
        elif self._block and tag == self._block[0]:
            kind, parts = self._block
            self._block = None
            if kind == "h1":
                self.heading = "".join(parts)
            elif self.sections:
                self.blocks.setdefault(self.sections[-1], []).append((kind, "".join(parts)))

    def handle_data(self, data: str) -> None:
        if self._block and not self._skip:
            self._block[1].append(data)

    def paragraphs(self, section: str) -> list[str]:
        return [text for kind, text in self.blocks.get(section, []) if kind == "p"]

    def code(self, section: str) -> list[str]:
        """The section's code blocks, each without its last newline."""
        return [text.removesuffix("\n") for kind, text in self.blocks.get(section, []) if kind == "pre"]
