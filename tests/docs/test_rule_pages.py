"""Every rule's page shows an example, run as the page shows it, and what it really prints."""

import ast
import re

import pytest
from conftest import EXAMPLES, Page, load_record

from ampdoctor.core.catalog import RULES


def test_every_rule_has_an_example():
    missing = [r.code for r in RULES if not (EXAMPLES / f"{r.code}.py").is_file()]
    assert not missing, f"no docs/rules/examples/CODE.py for {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_page_shows_the_command_the_script_and_its_output(rule, site):
    script = EXAMPLES / f"{rule.code}.py"
    source = script.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source))
    shown = Page(site / "rules" / f"{rule.code}.html").code("example")
    assert len(shown) == 3, f"the page of {rule.code} shows no example: {shown}"
    command, code, output = shown
    assert command == f"$ {load_record().command_of(script)}"
    assert source.rstrip("\n").endswith(code) and doc not in code  # the script, after its docstring
    assert output == (EXAMPLES / f"{rule.code}.out").read_text(encoding="utf-8").removesuffix("\n")


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_example_prints_what_its_page_shows(rule):
    script = EXAMPLES / f"{rule.code}.py"
    recorded = script.with_suffix(".out").read_text(encoding="utf-8")
    assert re.search(rf"\b{rule.code}\b", recorded), f"{script.with_suffix('.out').name} does not name {rule.code}"
    assert load_record().run(script) == recorded, f"rerecord: python docs/rules/examples/record.py {rule.code}"


@pytest.mark.slow
def test_a_rule_page_states_every_severity_its_findings_take(site):
    said = " ".join(Page(site / "rules" / "AMP612.html").paragraphs("what-it-means"))
    assert "Severity: warning; error when no optimizer step updated a weight" in " ".join(said.split())
