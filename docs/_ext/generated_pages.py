"""Write the generated pages into the docs at the start of each build: one per rule, the rules' index, the CLI.

A rule's page comes from its catalog entry (``ampdoctor.core.catalog.RULES``), the same fields in the same order
``ampdoctor explain CODE`` prints (``ampdoctor.ui.console.RuleView``): the heading, the title, why, the fix. Its
example is ``rules/examples/AMPnnn.py`` with what ampdoctor printed, ``AMPnnn.out`` (``record.py`` writes it). The
CLI page is the parser's own help (``ampdoctor.ui.cli.build_parser``), the exit status (``EXIT_STATUS``) and the
severities (``Severity``). The written files are ignored by git (``docs/.gitignore``); a file is rewritten only
when its text changed, so Sphinx rebuilds only what changed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType

from reports import REPORTS  # docs/_ext/reports.py (conf.py puts _ext on the path)
from sphinx.application import Sphinx
from sphinx.util import logging

from ampdoctor.core.catalog import CHECKED_BY, RULES, Rule
from ampdoctor.core.findings import Severity
from ampdoctor.ui.cli import EXIT_STATUS, build_parser
from ampdoctor.ui.console import error_text, fix_lines

logger = logging.getLogger(__name__)

EXAMPLES = "rules/examples"
WIDTH = 80  # the fix as `ampdoctor explain` prints it in a pipe or a log (rich's width there), line for line
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation mark may be escaped in CommonMark


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("builder-inited", write_pages)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


def write_pages(app: Sphinx) -> None:
    """Write every generated page into the source folder."""
    src = Path(app.srcdir)
    record = load_record(src / EXAMPLES / "record.py")
    pages = {f"rules/{rule.code}.md": rule_page(rule, src / EXAMPLES, record) for rule in RULES}
    pages["rules/index.md"] = rules_index()
    pages["cli.md"] = cli_page()
    for stale in set((src / "rules").glob("AMP[0-9][0-9][0-9].md")) - {src / name for name in pages}:
        stale.unlink()  # a code that left the catalog
    for name, text in pages.items():
        path = src / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")


def load_record(path: Path) -> ModuleType:
    """Import the examples' runner, ``record.py``, by its path (it is a script, not a module of ampdoctor)."""
    spec = importlib.util.spec_from_file_location("ampdoctor_docs_record", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def text(plain: str) -> str:
    """Return ``plain`` as Markdown that shows exactly it: every punctuation mark escaped."""
    return _PUNCTUATION.sub(r"\\\1", plain)


def fence(body: str, info: str = "text", options: str = "") -> str:
    """Return a fenced block of ``body``, its fence longer than any run of backticks in it."""
    ticks = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", body)), default=0))
    return f"{ticks}{info}\n{options}{body.rstrip()}\n{ticks}\n"


def rule_page(rule: Rule, examples: Path, record: ModuleType) -> str:
    """Return the page of one rule, in the order ``ampdoctor explain`` prints it, then the example and the rest."""
    parts = [
        f"# {rule.code} {text(rule.name)}\n",
        f"## What it means\n\n{text(rule.title)}\n",
        f"Severity: **{rule.severity.value}**{''.join(f'; **{s.value}** when {text(w)}' for s, w in rule.escalates)} "
        "([severities](../cli.md#severity)). "
        f"Phase `{rule.phase}`: checked by {text(CHECKED_BY[rule.phase])}.\n",
        f"## Why it breaks training\n\n{text(rule.why)}\n",
        "## Example\n\n" + example(rule, examples, record),
        "## Fix\n\n" + fence("\n".join(fix_lines(rule.fix, WIDTH)), "python"),
        "## Error texts it explains\n\n" + (fence("\n".join(map(error_text, rule.errors))) if rule.errors else
                                             f"None: found by {text(CHECKED_BY[rule.phase])}.\n"),
        "## Sources\n\n" + sources(rule.cases),
    ]
    return "\n".join(parts)


def sources(cases: tuple[int, ...]) -> str:
    """Return the public reports a rule comes from (``reports.REPORTS``), one line per case, each a link."""
    if not cases:
        return "None recorded: the rule comes from torch's own code, not from a public report.\n"
    lines = ["Public issue and pull-request threads that show it:\n"]
    for case in cases:
        links = ", ".join(f"[{text(label)}]({url})" for label, url in REPORTS[case])
        lines.append(f"- {links}")
    return "\n".join(lines) + "\n"


def example(rule: Rule, examples: Path, record: ModuleType) -> str:
    """Return the example: its docstring, the command, the script and what ampdoctor printed."""
    script = examples / f"{rule.code}.py"
    if not script.is_file():
        return f"No example yet (`docs/{EXAMPLES}/{rule.code}.py`).\n"
    source = script.read_text(encoding="utf-8")
    module = ast.parse(source)
    doc = ast.get_docstring(module) or ""
    lines = source.splitlines()
    start = module.body[0].end_lineno if doc else 0  # the script after its docstring, numbered as in a traceback
    while start < len(lines) and not lines[start].strip():
        start += 1
    out = script.with_suffix(".out")
    if out.is_file():
        shown = "What ampdoctor prints:\n\n" + fence(out.read_text(encoding="utf-8"))
    else:
        logger.warning("%s has no recorded output: python docs/%s/record.py %s", script.name, EXAMPLES, rule.code)
        shown = "Its output is not recorded yet.\n"
    code = fence("\n".join(lines[start:]), "{code-block} python", f":caption: {script.name}\n:lineno-start: "
                 f"{start + 1}\n\n")
    return "\n".join([f"{doc}\n", fence(f"$ {record.command_of(script)}", "console"), code, shown])


def rules_index() -> str:
    """Return the rules' index: a table of every rule, linking its page."""
    rows = [f"| [{r.code}]({r.code}.md) | {'/'.join(s.value for s in r.severities)} | {r.phase} | {text(r.title)} |"
            for r in RULES]
    phases = "\n".join(f"- `{phase}`: {text(by)}" for phase, by in CHECKED_BY.items())
    toctree = "\n".join(r.code for r in RULES)
    return "\n".join([
        "# Rules\n",
        "Every problem ampdoctor reports has a stable code; a code is never reused. `ampdoctor explain CODE` "
        "prints a rule's explanation and fix, `ampdoctor rules` the list. A rule is checked in one phase:\n",
        phases + "\n",
        "| code | severity | phase | what it means |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n",
        fence(toctree, "{toctree}", ":hidden:\n\n"),
    ])


def cli_page() -> str:
    """Return the command-line reference: each command's help, the exit status, the severities."""
    parser = build_parser()
    parts = ["# Command line\n", "What `ampdoctor --help` and `ampdoctor COMMAND --help` print.\n",
             f"## {parser.prog}\n\n" + fence(help_text(parser))]
    for name, command in subcommands(parser).items():
        parts.append(f"## {parser.prog} {name}\n\n" + fence(help_text(command)))
    parts.append("## Exit status\n\n" + fence(EXIT_STATUS))
    levels = "\n".join(f"- `{s.value}`" for s in Severity)
    parts.append(f"## Severity\n\n{Severity.__doc__.strip()}\n\n{levels}\n")
    return "\n".join(parts)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Return the parser's subcommands by name, in the order they were added."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # argparse's own record
    return {name: command for action in actions for name, command in action.choices.items()}


def help_text(parser: argparse.ArgumentParser) -> str:
    """Return ``--help`` as it prints in 80 columns (argparse reads the width from ``COLUMNS``)."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        return parser.format_help()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
