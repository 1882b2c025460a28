"""Run the rule examples and record what ampdoctor prints, for the rule pages (``docs/rules/``).

    python docs/rules/examples/record.py             # every example: writes AMPnnn.out next to AMPnnn.py
    python docs/rules/examples/record.py AMP403 ...  # only these
    python docs/rules/examples/record.py --check     # compare instead of writing; exit 1 on a difference

An example is ``AMPnnn.py``: a short CPU training script whose run shows that rule. Its module docstring says
what it does wrong (the page shows it above the code). A ``# command: ...`` line gives the command shown on the
page and run here, with ``{script}`` for the file (default: ``ampdoctor run {script}``); it may start with
``AMPDOCTOR=... python`` or ``torchrun``. The output is stdout and stderr as they came, 80 columns, with the
machine's paths taken out (the examples' folder, site-packages), so the page shows what a user sees.
``tests/docs/test_rule_examples.py`` runs the same function and compares.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = "ampdoctor run {script}"
TIMEOUT = 240


def examples(codes: list[str] | None = None) -> list[Path]:
    found = sorted(HERE.glob("AMP[0-9][0-9][0-9].py"))
    return [p for p in found if not codes or p.stem in codes]


def command_of(script: Path) -> str:
    """The command line the page shows: the script's ``# command:`` line, else ``ampdoctor run AMPnnn.py``."""
    for line in script.read_text(encoding="utf-8").splitlines():
        if line.startswith("# command:"):
            return line.removeprefix("# command:").strip().replace("{script}", script.name)
    return DEFAULT.replace("{script}", script.name)


def argv_of(command: str) -> tuple[list[str], dict[str, str]]:
    """The process to start for ``command``: ``ampdoctor`` and ``torchrun`` through this Python, leading
    ``NAME=value`` words as environment variables. A trailing ``2>&1 | cat`` (or ``| cat``), which a page shows to
    say "piped, stderr with stdout", is what `run_command` does anyway and is dropped."""
    words = shlex.split(command)
    if words[-2:] == ["|", "cat"]:
        words = words[:-2]
    if words[-1:] == ["2>&1"]:
        words = words[:-1]
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    head = {"ampdoctor": [sys.executable, "-m", "ampdoctor"], "python": [sys.executable],
            "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    if not words or words[0] not in head:
        raise ValueError(f"{command!r}: an example's command starts with ampdoctor, python or torchrun")
    return head[words[0]] + words[1:], env


def run(script: Path) -> str:
    """Run the example as its page shows it; return its output with the machine's paths taken out."""
    return run_command(command_of(script), HERE)


def run_command(command: str, cwd: Path) -> str:
    """Run ``command`` (see `argv_of`) in ``cwd`` as a user's terminal would, 80 columns wide; return its output
    (stdout and stderr as they came) with ``cwd`` and the machine's paths taken out, and its exit status."""
    argv, extra = argv_of(command)
    src = str(HERE.parents[2] / "src")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AMPDOCTOR", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(COLUMNS="80", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0",
               PYTHONPATH=src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""), **extra)
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT)
    return clean(proc.stdout, cwd) + f"[exit status {proc.returncode}]\n"


def clean(text: str, cwd: Path = HERE) -> str:
    """Take the machine out of ``text``: the folder it ran in, site-packages and Python's own library."""
    text = text.replace(str(cwd) + os.sep, "")
    text = re.sub(r"[^\s\"']*/site-packages/", ".../site-packages/", text)
    text = re.sub(r"[^\s\"']*/lib/python3\.\d+/", ".../lib/python3/", text)
    text = re.sub(r"\b(pid[ =]?)\d+", r"\g<1>N", text)
    return text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    codes = [a for a in argv if a != "--check"]
    differ = []
    for script in examples(codes):
        out = script.with_suffix(".out")
        text = run(script)
        if check:
            if not out.is_file() or out.read_text(encoding="utf-8") != text:
                differ.append(script.stem)
        else:
            out.write_text(text, encoding="utf-8")
            print(f"{script.stem}: {len(text.splitlines())} lines", file=sys.stderr)
    if differ:
        print(f"differ from their .out: {', '.join(differ)} (python {Path(__file__).name} {' '.join(differ)})",
              file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
