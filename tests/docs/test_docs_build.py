"""The documentation site builds with no warning, with a page per rule and the CLI reference."""

import re

import pytest
from conftest import Page

from ampdoctor.core.catalog import RULES
from ampdoctor.core.findings import Severity
from ampdoctor.ui.cli import EXIT_STATUS, build_parser

pytestmark = pytest.mark.slow


def test_site_has_a_page_per_rule_and_an_index_linking_each(site):
    for page in ("index.html", "architecture.html", "advise.html", "cli.html", "rules/index.html"):
        assert (site / page).is_file(), page
    index = (site / "rules" / "index.html").read_text(encoding="utf-8")
    for rule in RULES:
        page = Page(site / "rules" / f"{rule.code}.html")
        assert page.heading == f"{rule.code} {rule.name}"
        assert f'href="{rule.code}.html"' in index, f"the rules index does not link {rule.code}"


def test_cli_page_shows_each_command_help_the_exit_status_and_the_severities(site):
    commands = re.search(r"\{([\w,]+)\}", build_parser().format_usage()).group(1).split(",")
    assert "explain" in commands
    page = Page(site / "cli.html")
    for name in commands:
        (shown,) = page.code(f"ampdoctor-{name}")
        assert shown.startswith(f"usage: ampdoctor {name}"), name
    assert page.code("exit-status") == [EXIT_STATUS.removesuffix("\n")]
    severity = "".join(text for _, text in page.blocks["severity"])
    assert all(s.value in severity for s in Severity)

