"""The ``ampdoctor advise`` command: its arguments and ``advise_main(args) -> int``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["add_arguments", "advise_main", "EXAMPLES"]

EXAMPLES = """\
examples:
  ampdoctor advise ./llama-7b/config.json --batch-size 1 --seq-len 2048 \\
      --budget 24GiB
  ampdoctor advise mypkg.models:build --batch-size 32 --seq-len 224 \\
      --optimizer sgd
  ampdoctor advise ./llama-7b --budget 80GB --devices 8 --json advice.json
  ampdoctor advise ./llama-7b --budget 24GiB --log logs/ampdoctor.jsonl
      (use a watched run's gradients)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``advise``'s arguments to ``parser``."""
    from ampdoctor.advice.states import OPTIMIZERS

    parser.add_argument("model", help="a transformers config folder or config.json, or 'package.module:factory'")
    parser.add_argument("--batch-size", type=int, default=1, metavar="B", help="micro-batch per device (1)")
    parser.add_argument("--seq-len", type=int, default=512, metavar="S",
                        help="sequence length; the image side for convolutions (512)")
    parser.add_argument("--budget", metavar="SIZE", help="memory per device, e.g. 24GiB or 80GB")
    parser.add_argument("--devices", type=int, default=1, metavar="N", help="devices for ZeRO/FSDP rows (1)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where training will run: what it supports and "
                        "the device in the code shown (cuda when torch sees one, else cpu)")
    parser.add_argument("--lora-rank", type=int, default=8, metavar="R", help="LoRA rank (8)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (adamw)")
    parser.add_argument("--json", metavar="OUT", help="also write the advice as JSON to OUT")
    parser.add_argument("--log", metavar="FLIGHT_RECORDER", help="an ampdoctor.jsonl flight recorder to read the "
                        "measured fp16/bf16 underflow and lost updates from")
    parser.add_argument("--no-activations", action="store_true", help="model states only (skip the fake runs)")


def advise_main(args: argparse.Namespace) -> int:
    """Run ``ampdoctor advise``; return 0, or 2 for a usage error (printed to stderr)."""
    from ampdoctor.advice.advisor import advise
    from ampdoctor.ui.plain import console

    err = console(stderr=True)
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        err.print(f"ampdoctor advise: --json {args.json!r} cannot be written: give a file in an existing folder",
                  markup=False, soft_wrap=True)
        return 2
    if args.log and not os.path.exists(args.log):
        err.print(f"ampdoctor advise: --log {args.log!r} does not exist", markup=False, soft_wrap=True)
        return 2
    if "" not in sys.path and os.getcwd() not in sys.path:  # let 'mymodule:factory' import from here, as python -m
        sys.path.insert(0, os.getcwd())
    try:
        advice = advise(args.model, batch_size=args.batch_size, seq_len=args.seq_len, budget=args.budget,
                        devices=args.devices, lora_rank=args.lora_rank, optimizer=args.optimizer, log=args.log,
                        activations=not args.no_activations, device=args.device)
    except (ValueError, TypeError, OSError) as exc:
        err.print(f"ampdoctor advise: {exc}", markup=False, soft_wrap=True)
        return 2
    console().print(advice, soft_wrap=True)   # laid out to the width already: rich must not fold a long path
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(advice.to_json())
        err.print(f"ampdoctor: advice written to {args.json}", markup=False, soft_wrap=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``ampdoctor advise`` would and run it (for tests before the CLI wires it)."""
    parser = argparse.ArgumentParser(prog="ampdoctor advise", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return advise_main(args)
