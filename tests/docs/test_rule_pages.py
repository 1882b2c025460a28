"""Every rule's page shows an example, run as the page shows it, and what it really prints."""

import ast
import re

import pytest
from conftest import EXAMPLES, Page, load_record

from ampdoctor.core.catalog import RULES

# Codes whose example (docs/rules/examples/AMPnnn.py) is not written yet. Empty it as examples arrive.
PENDING = {'AMP001', 'AMP101', 'AMP102', 'AMP103', 'AMP104', 'AMP105', 'AMP201', 'AMP202', 'AMP203', 'AMP204',
    'AMP205', 'AMP206', 'AMP207', 'AMP208', 'AMP209', 'AMP210', 'AMP211', 'AMP212', 'AMP301', 'AMP302', 'AMP401',
    'AMP402', 'AMP404', 'AMP405', 'AMP406', 'AMP407', 'AMP408', 'AMP409', 'AMP410', 'AMP411', 'AMP412', 'AMP413',
    'AMP501', 'AMP502', 'AMP503', 'AMP504', 'AMP601', 'AMP602', 'AMP603', 'AMP604', 'AMP605', 'AMP606', 'AMP607',
    'AMP608', 'AMP609', 'AMP610', 'AMP611', 'AMP612', 'AMP613', 'AMP614', 'AMP615', 'AMP616', 'AMP617', 'AMP618',
    'AMP619'}
WITH_EXAMPLE = [r for r in RULES if r.code not in PENDING]


def test_every_rule_has_an_example():
    missing = [r.code for r in WITH_EXAMPLE if not (EXAMPLES / f"{r.code}.py").is_file()]
    assert not missing, f"no docs/rules/examples/CODE.py for {missing}"


def test_pending_names_only_rules_still_without_an_example():
    codes = {r.code for r in RULES}
    assert PENDING <= codes, f"not in the catalog: {sorted(PENDING - codes)}"
    written = sorted(c for c in PENDING if (EXAMPLES / f"{c}.py").is_file())
    assert not written, f"these have an example now: remove them from PENDING: {written}"


@pytest.mark.slow
@pytest.mark.parametrize("rule", WITH_EXAMPLE, ids=lambda r: r.code)
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
@pytest.mark.parametrize("rule", WITH_EXAMPLE, ids=lambda r: r.code)
def test_example_prints_what_its_page_shows(rule):
    script = EXAMPLES / f"{rule.code}.py"
    recorded = script.with_suffix(".out").read_text(encoding="utf-8")
    assert re.search(rf"\b{rule.code}\b", recorded), f"{script.with_suffix('.out').name} does not name {rule.code}"
    assert load_record().run(script) == recorded, f"rerecord: python docs/rules/examples/record.py {rule.code}"
