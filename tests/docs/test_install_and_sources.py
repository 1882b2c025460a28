"""What a newcomer reads first: install lines that work from a clone, and rule pages whose sources a reader can
open (public threads, not a file of ours that is not in the repository)."""

import importlib.util
import re
import sys

from conftest import DOCS, ROOT

from ampdoctor.core.catalog import RULES

# what a reader copies to install: ampdoctor is not on PyPI, so every line installs it from the clone (-e .)
_INSTALLS = re.compile(r"""pip install\b[^\n`]*?(?<![-\w./])["']?ampdoctor\b""")


def test_no_install_line_asks_pypi_for_ampdoctor():
    written = {DOCS / "cli.md"}   # docs/_ext/generated_pages.py writes it at each build, from the parser in src
    sources = [ROOT / "README.md", *(set(DOCS.glob("*.md")) - written), *DOCS.glob("guides/*.md"),
               ROOT / "examples" / "README.md", *(ROOT / "src").rglob("*.py")]
    bad = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in sources
           for m in _INSTALLS.finditer(path.read_text(encoding="utf-8"))]
    assert not bad, bad
    assert _INSTALLS.search('pip install "ampdoctor[report]"') and _INSTALLS.search("pip install ampdoctor diffusers")
    assert not _INSTALLS.search('pip install torch==2.13.0 -e ".[report]"')


def test_a_rule_page_cites_public_threads_not_a_file_outside_the_repository():
    spec = importlib.util.spec_from_file_location("generated_pages_for_test", DOCS / "_ext" / "generated_pages.py")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        pages = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pages)
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    for rule in RULES:
        said = pages.sources(rule.cases)
        assert "failures.md" not in said
        assert said.count("https://github.com/") >= len(rule.cases), (rule.code, said)
