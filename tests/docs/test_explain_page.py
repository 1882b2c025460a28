"""A rule's page says what ``ampdoctor explain CODE`` prints: the same heading, title, severity, why and fix."""

import pytest
from conftest import Page

from ampdoctor.core.catalog import RULES
from ampdoctor.ui.cli import main
from ampdoctor.ui.plain import INDENT


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_page_text_is_what_explain_prints(rule, site, capsys):
    assert main(["explain", rule.code]) == 0
    printed = capsys.readouterr().out
    page = Page(site / "rules" / f"{rule.code}.html")
    what, said = page.paragraphs("what-it-means")[:2]   # "Severity: warning; error when ... (severities). Phase ..."
    severity = said.removeprefix("Severity: ").split(" (severities)")[0]
    (why,) = page.paragraphs("why-it-breaks-training")
    (fix,) = page.code("fix")
    # explain wraps to 80 columns
    assert printed.split() == f"{page.heading}: {what}\nseverity: {severity}\n{why}\n{fix}".split()
    assert printed.endswith("".join(f"{INDENT}{line}\n" for line in fix.splitlines()))  # the code line by line
