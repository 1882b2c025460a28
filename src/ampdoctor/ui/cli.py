"""The `ampdoctor` command: `main(argv) -> int`, with one exit-status rule for every command (``EXIT_STATUS``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

from ampdoctor.core.options import RunOptions, check_audit, check_every
from ampdoctor.core.usage import UsageError as _UsageError
from ampdoctor.core.usage import check_writable as _check_writable
from ampdoctor.core.usage import write_text as _write
from ampdoctor.core.views import Line
from ampdoctor.core.words import counted
from ampdoctor.ui.plain import Printer

EXAMPLES = """\
examples:
  ampdoctor run train.py --epochs 1
      diagnose a training script, unchanged
  ampdoctor run --fix train.py
      ... and repair fp16 parameters or add fp32 master weights
  ampdoctor run --json report.json --log-dir logs train.py
      also write the JSON report, and a flight recorder: logs/ampdoctor.jsonl
  ampdoctor run -m mypackage.train --lr 1e-4
      run a module, like python -m
  ampdoctor run --strict train.py
      in CI: exit 1 on error findings
  ampdoctor explain "ValueError: Attempting to unscale FP16 gradients."
  python train.py 2>&1 | ampdoctor explain -
      explain a pasted traceback
  ampdoctor explain AMP401
      show one rule (ampdoctor rules: the catalog)
  ampdoctor report logs/ampdoctor.jsonl --html report.html
      one self-contained HTML page with plots
  ampdoctor advise ./llama-7b/config.json --batch-size 1 --seq-len 2048
      memory per strategy, and which one fits (--budget 24GiB)
  ampdoctor demo
      reproduce the classic error, diagnose it, fix it
"""


EXIT_STATUS = """\
exit status:
  0  done; for `run`, the script exited 0. Findings alone do not fail a
     command.
  1  `run`: the script failed (its own status is passed on, 1 if it had
     none). --strict (run, report): also 1 when a finding is at error
     severity (training is broken or about to crash), nothing was trained
     where ampdoctor could see, or an optimizer stepped tensors of a model
     it never saw run. `explain`: no rule explains the text (like grep
     finding nothing).
  2  ampdoctor could not do what was asked: bad arguments (a rule code
     that is not in the catalog), an unreadable input, an output path that
     cannot be written (checked before the script starts).
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep its message, add a hint
        self.print_usage(sys.stderr)
        raise _UsageError(f"{self.prog}: error: {message}\nSee `{self.prog} --help` for examples.")




def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ampdoctor", description="Find, explain and fix mixed-precision training problems.",
                     epilog=EXAMPLES + "\n" + EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    run = sub.add_parser("run", help="run a training script with the doctor attached",
                         description="Run SCRIPT as __main__ in this process with ampdoctor attached.",
                         epilog=EXAMPLES + "\n" + EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--fix", action="store_true", help="repair fp16/bf16 trainable params (upcast or fp32 "
                     "master weights) at the first step, and again if the script downcasts them")
    run.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    run.add_argument("--log-dir", metavar="DIR", help="write the JSON-lines flight recorder to DIR")
    run.add_argument("--every", type=int, default=50, metavar="N", help="sample numerics every N steps (50)")
    run.add_argument("--activations", action="store_true", help="also watch activations (first inf/NaN module)")
    run.add_argument("--audit", action="store_true", help="re-run each fp16/bf16 op in fp32: the first sampled step, "
                     "the first whole step and the step after the first anomaly")
    run.add_argument("--audit-steps", metavar="STEPS", help="re-run each fp16/bf16 op in fp32 on these steps (0,5)")
    run.add_argument("--audit-every", action="store_true", help="--audit on every sampled step")
    run.add_argument("--no-audit", action="store_true", help="no numerics audit (the default)")
    run.add_argument("--no-watch", action="store_true", help="only pre-flight, guards and crash explanations")
    run.add_argument("--strict", action="store_true", help="exit 1 when a finding is at error severity, even if "
                     "the script exited 0 (for CI)")
    run.add_argument("--no-children", action="store_true", help="do not follow child Python processes "
                     "(subprocess with sys.executable, multiprocessing spawn/forkserver)")
    run.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
                     help="run a module as `python -m MODULE` does (the rest of the line is its arguments)")
    run.add_argument("script", nargs="?", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    explain = sub.add_parser("explain", help="explain an error text, a traceback (- reads stdin) or a rule code")
    explain.add_argument("text", nargs="+", help="error text, '-' for stdin, or a code such as AMP101")

    rules = sub.add_parser("rules", help="print the rule catalog")
    rules.add_argument("--markdown", action="store_true", help="print the catalog as a Markdown table")
    rules.add_argument("--select", metavar="PREFIX", action="append", help="only codes with this prefix")

    report = sub.add_parser("report", help="render a JSON report or a JSON-lines flight recorder",
                            epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("path", help="report.json or ampdoctor.jsonl")
    report.add_argument("--strict", action="store_true", help="exit 1 when the report has a finding at error "
                        "severity, a crash, saw nothing trained, or an unwatched model")
    report.add_argument("--html", metavar="OUT", help="also write an HTML report with plots to OUT")
    report.add_argument("--png", metavar="DIR", help="also write the report's figures as PNG files into DIR (needs "
                        "matplotlib: pip install matplotlib)")
    report.add_argument("--tensorboard", metavar="DIR", help="also write the watch's scalars as TensorBoard events "
                        "into DIR (needs the tensorboard package)")
    report.add_argument("--with-report", metavar="JSON", help="the JSON report (run --json) of the same run as a "
                        "flight recorder, for its findings")

    demo = sub.add_parser("demo", help="reproduce the seed error on a tiny model, diagnose it, repair it")
    demo.add_argument("--no-fix", action="store_true", help="stop after the diagnosis")

    sub.add_parser("env", help="print the environment report to paste into an issue")

    from ampdoctor.ui.advise_command import EXAMPLES as ADVISE_EXAMPLES
    from ampdoctor.ui.advise_command import add_arguments as add_advise_arguments

    advise = sub.add_parser("advise", help="memory per training strategy (fp32, AMP, master weights, LoRA, 8-bit, "
                            "checkpointing, ZeRO/FSDP) and which one fits", epilog=ADVISE_EXAMPLES + "\n" + EXIT_STATUS,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_advise_arguments(advise)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    err = Printer(stderr=True)
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as exc:
        _say(err, str(exc))
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.version:
        from ampdoctor import __version__

        print(f"ampdoctor {__version__}")
        return 0
    if args.command is None:
        build_parser().print_help()
        return 2
    args.argv = argv   # as typed: argparse drops a "--"
    handler = {"run": _run, "explain": _explain, "rules": _rules, "report": _report, "demo": _demo,
               "env": _env, "advise": _advise}[args.command]
    try:
        return handler(args)
    except _UsageError as exc:
        _say(err, f"ampdoctor {args.command}: {exc}")  # wrapped between words: a path stays whole
        return 2


def _run(args: argparse.Namespace) -> int:
    from ampdoctor.ranks.exchange import RankExchange
    from ampdoctor.runner.children import ChildProcesses
    from ampdoctor.runner.doctor import Doctor
    from ampdoctor.runner.launcher import RunResult, run_module, run_script
    from ampdoctor.session.run import SIGTERM_STATUS
    from ampdoctor.session.termination import Termination

    options = _run_options(args)
    err = Printer(stderr=True)
    for option in _given_to_the_script(args):
        _say(err, f"ampdoctor: {option} comes after the script's name, so it goes to the script, not to ampdoctor; "
                  f"for ampdoctor, put it before: {_with_option_first(args, option)}")
    ended: list[int] = []

    def end(result: RunResult) -> int:   # once: after the script, or on SIGTERM while it runs
        if not ended:
            termination.begin_end()
            ended.append(_finish_run(args, options, result, doctor, exchange, err))
        return ended[0]

    def end_on_sigterm() -> None:
        doctor.terminated()
        if children is not None:   # the hook files go now: the signal ends this process without atexit
            children.__exit__(None, None, None)
        end(RunResult(SIGTERM_STATUS, doctor.report, False))

    termination = Termination(end_on_sigterm)
    exchange = RankExchange.for_this_process(termination.stopped)   # None outside a torchrun job of several ranks
    say = (lambda line: None) if exchange and exchange.rank else err  # rank 0 speaks
    doctor = Doctor(options, on_event=say)
    children = None if args.no_children else ChildProcesses(options)
    termination.install()   # the end of the run also happens on SIGTERM (a scheduler, torchrun's agent)
    try:
        if args.module is not None:
            module, *module_args = args.module
            try:
                result = run_module(module, module_args, doctor, children=children)
            except ModuleNotFoundError as exc:
                raise _UsageError(str(exc)) from None
        else:
            script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
            result = run_script(args.script, script_args, doctor, children=children)
        return end(result)
    finally:
        termination.release()   # a SIGTERM that came while the run ended is delivered now


def _run_options(args: argparse.Namespace) -> RunOptions:
    """Return the run's options; refuse what cannot run before the script starts: a long run must not end with
    "cannot write"."""
    if args.module is not None:
        if not args.module:
            raise _UsageError("-m needs a module name, e.g. `ampdoctor run -m mypackage.train --epochs 1`")
        if args.script is not None:  # options came after the script's arguments started
            raise _UsageError(f"give either a script or -m MODULE, not both (got {args.script!r} and -m)")
    elif args.script is None:
        raise _UsageError("give the training script to run, e.g. `ampdoctor run train.py --epochs 1`, "
                          "or a module: `ampdoctor run -m mypackage.train`")
    elif not os.path.isfile(args.script):
        raise _UsageError(f"no such script: {args.script!r}. Pass the path of a Python file, "
                          "e.g. `ampdoctor run train.py --epochs 1`.")
    check_every(args.every, "--every")
    audit = check_audit(args.audit_steps, "--audit-steps") if args.audit_steps is not None else \
        "off" if args.no_audit else "all" if args.audit_every else "auto" if args.audit else "off"
    if args.no_audit and (args.audit or args.audit_every or args.audit_steps is not None):
        raise _UsageError("--no-audit turns the audit off, but --audit/--audit-steps asks for it: drop one of them")
    asked = (("--log-dir", args.log_dir), ("--activations", args.activations), ("--audit", args.audit),
             ("--audit-every", args.audit_every), ("--audit-steps", args.audit_steps))
    if args.no_watch and any(v for _, v in asked):
        given = " and ".join(o for o, v in asked if v)
        raise _UsageError(f"--no-watch turns the watch off, but {given} needs it: drop one of them")
    options = RunOptions(fix=args.fix, watch=not args.no_watch, every=args.every, log_dir=args.log_dir,
                         activations=args.activations, json_path=args.json, fix_command=_fix_command(args),
                         audit=audit)
    options.check_outputs("--json", "--log-dir")
    return options


_RUN_OPTIONS = ("--fix", "--json", "--log-dir", "--every", "--activations", "--audit", "--audit-every",
                "--audit-steps", "--no-audit", "--no-watch", "--strict", "--no-children")


def _given_to_the_script(args: argparse.Namespace) -> list[str]:
    """Return ``run``'s own options written after the script's name (``run train.py --fix``): argparse hands them
    to the script, as it must (the script may have a --fix of its own), but the user rarely means that. Nothing
    after ``--`` counts: that is how to pass them to the script on purpose."""
    if args.module is not None:
        return []
    raw = getattr(args, "argv", [])
    tail = raw[raw.index(args.script) + 1:] if args.script in raw else list(args.args)
    before = tail[:tail.index("--")] if "--" in tail else tail   # argparse drops the "--": read what was typed
    return list(dict.fromkeys(a.split("=", 1)[0] for a in before if a.split("=", 1)[0] in _RUN_OPTIONS))


def _with_option_first(args: argparse.Namespace, option: str) -> str:
    """Return the command line with ``option`` (and its value) moved before the script's name."""
    import shlex

    rest, moved, i = list(args.args), [], 0
    while i < len(rest):
        if rest[i].split("=", 1)[0] == option:
            takes_value = option in ("--json", "--log-dir", "--every") and "=" not in rest[i] and i + 1 < len(rest)
            moved, rest = rest[i:i + 1 + takes_value], rest[:i] + rest[i + 1 + takes_value:]
            break
        i += 1
    return shlex.join(["ampdoctor", "run", *moved, args.script, *rest])


def _fix_command(args: argparse.Namespace) -> str:
    """Return this run's command line with ``--fix``: what the fixes tell the user to run (a ``--fix`` typed after
    the script's name moves before it, as the warning about it says)."""
    import shlex

    if "--fix" in _given_to_the_script(args):
        return _with_option_first(args, "--fix")
    target = ["-m", *args.module] if args.module is not None else [args.script, *args.args]
    return shlex.join(["ampdoctor", "run", "--fix", *target])


def _finish_run(args: argparse.Namespace, options: RunOptions, result: Any, doctor: Any, exchange: Any,
                err: Printer) -> int:
    """End the run (``session.run.end_run``); under torchrun, once, for the whole job. Return the exit status."""
    from ampdoctor.session.run import end_run

    failed_at = doctor.failed_at or (time.time() if result.exit_code else None)
    report = end_run(result.report, options, exit_code=result.exit_code, failed_at=failed_at, say=err,
                     write=_write, explained=result.explained, exchange=exchange, rank=doctor.rank_info)
    if exchange is not None and exchange.rank != 0:
        return result.exit_code   # --strict is decided by rank 0, on the whole job's report
    return result.exit_code or (_strict_status(report, err) if args.strict else 0)


def _explain(args: argparse.Namespace) -> int:
    from ampdoctor.core.catalog import get_rule
    from ampdoctor.explanations.crash import explain_text
    from ampdoctor.ui.console import rule_panel

    out = Printer(stderr=False)
    text = " ".join(args.text)
    if text == "-":
        text = sys.stdin.buffer.read(50_000_000).decode("utf-8", errors="replace")
    if not text.strip():
        raise _UsageError("nothing to explain: give an error text, a rule code such as AMP101, or '-' with a "
                          "traceback on stdin")
    try:
        rules = [get_rule(text)]
    except KeyError:
        _check_codes(text)
        rules = explain_text(text)
    if not rules:
        from ampdoctor.explanations.crash import unknown_answer

        _say(out, f"ampdoctor: {unknown_answer(text)}")
        return 1  # nothing explained it: a pipe `explain - && ...` must not read it as explained (EXIT_STATUS)
    for rule in rules:
        out(rule_panel(rule, severity=True))
    return 0


def _check_codes(text: str) -> None:
    """Refuse words of ``text`` that look like rule codes (``AMP999``) but are not in the catalog, when the text
    is only such words: a mistyped code is bad input, not an unknown error."""
    import re

    from ampdoctor.core.catalog import RULES, get_rule

    words = text.replace(",", " ").split()
    if not words or not all(re.fullmatch(r"(?i)AMP\d+", w) for w in words):
        return
    for word in words:
        try:
            get_rule(word)
        except KeyError:
            raise _UsageError(f"{word} is not a rule code: codes run from {RULES[0].code} to {RULES[-1].code}, with "
                              "gaps; `ampdoctor rules` lists them") from None


def _rules(args: argparse.Namespace) -> int:
    from ampdoctor.core.catalog import select
    from ampdoctor.ui.console import rules_markdown, rules_table

    chosen = select(args.select or ["AMP"])
    if not chosen:
        raise _UsageError(f"no rule code starts with {args.select!r}; codes look like AMP101")
    if args.markdown:
        from ampdoctor.ui.plain import encodable

        encodable(sys.stdout).write(rules_markdown(chosen))
    else:
        Printer(stderr=False)(rules_table(chosen))
    return 0


def _report(args: argparse.Namespace) -> int:
    from ampdoctor.ui.report_files import load_any, render_loaded, write_html

    out = Printer(stderr=False)
    try:
        loaded = load_any(args.path)
        if args.with_report:
            from ampdoctor.ui.report_files import combine

            loaded = combine(loaded, load_any(args.with_report))
    except (OSError, ValueError) as exc:
        raise _UsageError(str(exc)) from None
    except RecursionError:
        raise _UsageError(f"{args.path!r} nests JSON too deeply to be an ampdoctor report") from None
    if args.html:
        _check_writable(args.html, "--html")
    out(render_loaded(loaded))
    if args.html:
        _export(out, f"cannot write --html {args.html!r}", lambda: write_html(loaded, args.html),
                lambda _: f"ampdoctor: HTML report written to {args.html}")
    if args.png:
        from ampdoctor.ui.figures import write_pngs

        _export(out, f"--png {args.png!r}", lambda: write_pngs(loaded, args.png),
                lambda paths: f"ampdoctor: {counted(len(paths), 'PNG figure')} written to {args.png}")
    if args.tensorboard:
        from ampdoctor.ui.tensorboard_export import write_tensorboard

        _export(out, f"--tensorboard {args.tensorboard!r}", lambda: write_tensorboard(loaded, args.tensorboard),
                lambda n: f"ampdoctor: {counted(n, 'scalar value')} written for TensorBoard to {args.tensorboard}")
    return _strict_status(loaded.report, out) if args.strict else 0


def _export(out: Printer, what: str, write: Callable[[], Any], said: Callable[[Any], str]) -> None:
    """Write one of ``report``'s files; a path that cannot be written is bad input (exit 2), not a traceback."""
    try:
        result = write()
    except (OSError, ValueError) as exc:
        raise _UsageError(f"{what}: {getattr(exc, 'strerror', None) or exc}") from None
    _say(out, said(result), wrap=False)


def _strict_status(report: object, out: Printer) -> int:
    """Return 1 for ``--strict`` when ``report`` has a finding at error severity, a crash, saw nothing, or trained
    tensors of models it never saw run (``Report.unwatched``)."""
    errors = [f for f in getattr(report, "findings", []) if f.severity.value == "error"]
    why = (f"{counted(len(errors), 'finding')} at error severity ({', '.join(dict.fromkeys(f.code for f in errors))})"
           if errors else "the script crashed" if getattr(report, "exception", None)
           else "nothing was trained where ampdoctor could see" if getattr(report, "saw_nothing", False)
           else "an optimizer stepped tensors of a model ampdoctor never saw run" if getattr(report, "unwatched", None)
           else None)
    if why is None:
        return 0
    _say(out, f"ampdoctor: --strict: exit 1: {why}")
    return 1


def _demo(args: argparse.Namespace) -> int:
    from ampdoctor.ui.demo import run_demo

    return run_demo(fix=not args.no_fix)


def _advise(args: argparse.Namespace) -> int:
    from ampdoctor.ui.advise_command import advise_main

    return advise_main(args)


def _env(args: argparse.Namespace) -> int:
    from ampdoctor.core.environment import environment

    print(json.dumps(environment(), indent=2))
    return 0


def _say(out: Printer, text: str | Line, wrap: bool = True) -> None:
    """Print ``text`` as a `Line`: wrapped between words to the console's width, with a hanging indent (names stay
    whole); ``wrap=False`` keeps it on one line (a message built around a path, to copy whole). An open tqdm bar is
    cleared first and redrawn after, so the line starts at column 0 (``grep '^ampdoctor'`` finds it in a log)."""
    out(text if isinstance(text, Line) else Line(text, whole=not wrap))


if __name__ == "__main__":
    raise SystemExit(main())
