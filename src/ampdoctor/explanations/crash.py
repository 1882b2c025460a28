"""Explain a crash or a pasted error with the catalog: which rule, and which parameters or modules are at fault.

Matching uses the ``errors`` patterns of the catalog rules, so a crash explanation and a pre-flight finding share
one source of truth. Nothing here runs before a failure: the culprits are read from the exception's traceback
frames (the ``GradScaler``, optimizer and module that were executing, see `ampdoctor.explanations.reader`) and from
the real objects, by the per-rule explainers of `ampdoctor.explanations.explainers`.

>>> [r.code for r in explain_text("ValueError: Attempting to unscale FP16 gradients.")]
['AMP101']
"""

from __future__ import annotations

import traceback
from typing import Any, Protocol

from ampdoctor.core.catalog import Rule, get_rule, rules_for_error
from ampdoctor.core.findings import Finding
from ampdoctor.core.training import TrainingSetup
from ampdoctor.explanations.culprits import _from_check
from ampdoctor.explanations.explainers import _EXPLAINERS, _generic
from ampdoctor.explanations.families import Family, closest_family
from ampdoctor.explanations.reader import _Crash

__all__ = ["Family", "GuardHistory", "closest_family", "explain", "explain_exception", "explain_text",
           "unknown_answer"]

_STATE_MACHINE = {"AMP401", "AMP402", "AMP403", "AMP404", "AMP405", "AMP406", "AMP407"}
_SAME_TEXT = {"AMP401": "AMP402", "AMP402": "AMP401"}   # one torch message, two causes
# a guard finding that explains another rule's torch message: "No inf checks were recorded for this optimizer"
# after the loop's own zero_grad() between backward and step set the gradients to None (AMP612's cause)
_EXPLAINS = {"AMP612": "AMP406"}


class GuardHistory(Protocol):
    """What an explanation reads from a guard that watched the run (``ampdoctor.guard.ScalerGuard`` offers it).

    Attributes:
        setup: the training objects the guard was given, used when the caller passes none.
        scaler: the GradScaler it observed.
    """

    setup: TrainingSetup
    scaler: Any

    @property
    def broken(self) -> bool:
        """True once the guard failed itself; its history is then ignored."""

    @property
    def iteration(self) -> int:
        """The number of ``update()`` calls seen, the step the findings are dated to."""

    def crash_findings(self) -> list[Finding]:
        """Return the findings that explain the last scaler call that raised, from the guard's history."""


def explain(error: BaseException | str, setup: TrainingSetup | None = None,
            guard: GuardHistory | None = None) -> list[Finding] | list[Rule]:
    """Explain an exception (returns findings) or a pasted error text, code or rule name (returns rules).

    >>> [r.code for r in explain("AMP404")]
    ['AMP404']
    """
    if isinstance(error, BaseException):
        return explain_exception(error, setup, guard)
    if isinstance(error, str):
        return explain_text(error)
    raise TypeError(f"explain() takes an exception or a str, got {type(error).__name__}: {error!r:.80}")


# ---- text -> rules --------------------------------------------------------------------------------------------

def explain_text(text: str) -> list[Rule]:
    """Return the catalog rules that explain a pasted error or traceback, or that a code or name refers to.

    Any size is accepted; only the last 200 KB are read and the work per pattern is capped.

    >>> [r.code for r in explain_text("fp16-trainable-params")]
    ['AMP101']
    >>> explain_text("all good")
    []
    """
    if not isinstance(text, str):
        raise TypeError(f"explain_text() takes a str, got {type(text).__name__}: {text!r:.80}")
    named = _rules_named(text)
    return named if named is not None else match_rules(text)


def unknown_answer(text: str) -> str:
    """Return what to say when no rule explains ``text``: that it is unknown, and its closest family if one fits,
    with the family's rules whose titles are closest to the text (never the whole family: its size, and how to
    list it).

    >>> "closest family: dtype mismatch (AMP5xx)" in unknown_answer("expected tensor of dtype BFloat16 but got Half")
    True
    >>> "closest rules: AMP613 (The loss is inf/NaN)" in unknown_answer("loss is nan")
    True
    """
    answer = "unknown error: no rule in the catalog explains this text"
    family = closest_family(text)
    if family is not None:
        closest = family.closest(text)
        answer += f"; closest family: {family.label}"
        if closest:
            answer += f"; closest rules: {', '.join(f'{r.code} ({r.title})' for r in closest)}"
        answer += (f" (`ampdoctor rules --select {family.prefix}` lists the family's {len(family.codes)} rules; "
                   "`ampdoctor explain CODE` explains one)")
    return answer + ". Run the script under `ampdoctor run` for a diagnosis on the real objects."


def _rules_named(text: str) -> list[Rule] | None:
    tokens = text.replace(",", " ").split() if len(text) <= 400 else []
    if not tokens:
        return None
    rules = []
    for token in tokens:
        try:
            rules.append(get_rule(token))
        except KeyError:
            return None
    return list(dict.fromkeys(rules))


def match_rules(text: str) -> list[Rule]:
    """Return the rules whose error patterns occur in ``text``, in catalog order, with bounded work.

    >>> [r.code for r in match_rules("RuntimeError: step() has already been called since the last update().")]
    ['AMP404']
    """
    return rules_for_error(text)


# ---- exception -> findings --------------------------------------------------------------------------------------

def explain_exception(exc: BaseException, setup: TrainingSetup | None = None,
                      guard: GuardHistory | None = None) -> list[Finding]:
    """Return findings that explain ``exc``, naming the parameters, modules or calls at fault.

    The exception is only read: it is never wrapped, changed or re-raised. With a guard that watched the run (a
    ``ScalerGuard``, see `GuardHistory`), GradScaler state-machine errors are explained from its history.

    >>> import torch
    >>> try:
    ...     torch.amp.GradScaler("cpu").load_state_dict({})
    ... except RuntimeError as e:
    ...     [f.code for f in explain_exception(e)]
    ['AMP410']
    """
    rules = _matched_rules(exc)
    if not rules:
        return []
    crash = _Crash.of(exc)   # called here: it also reads the frames that called explain_exception
    if guard is not None and guard.broken:   # its history is not to be trusted any more
        setup, guard = setup or guard.setup, None
    if setup is None:
        setup = guard.setup if guard is not None else crash.guess_setup()
    setup = setup.with_scaler(crash.scaler or (guard.scaler if guard is not None else None))
    setup = setup.renamed(crash.namespaces())
    step = guard.iteration if guard is not None else None

    # the state machine is explained from the guard's history
    findings, handled = _from_guard(guard, {r.code for r in rules}) if guard is not None else ([], set())
    for rule in rules:
        if rule.code not in handled:
            findings.extend(_explain_rule(rule, crash, setup, step))
    return findings


def _matched_rules(exc: BaseException) -> list[Rule]:
    """Return the rules whose error texts ``exc`` (or an exception it came from) shows: in its messages, else
    anywhere in its traceback."""
    rules = match_rules("\n".join(_messages(exc)))
    if not rules:
        rules = match_rules("".join(traceback.format_exception(exc)))
    return rules


def _from_guard(guard: GuardHistory, codes: set[str]) -> tuple[list[Finding], set[str]]:
    """Return the guard's findings of the state-machine rules in ``codes``, and the codes they explain."""
    findings: list[Finding] = []
    handled: set[str] = set()
    for f in guard.crash_findings():
        code = _EXPLAINS.get(f.code, f.code)
        if code in codes and code in _STATE_MACHINE:
            findings.append(f)
            handled |= {code, _SAME_TEXT.get(code, code)}
    return findings, handled


def _explain_rule(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    """Explain one matched rule: by its pre-flight check, else its own explainer, else generically."""
    produced = [] if rule.code in _STATE_MACHINE else _from_check(rule.code, setup, step)
    if not produced:
        explainer = _EXPLAINERS.get(rule.code, _generic)
        produced = explainer(rule, crash, setup, step)
    return produced or _generic(rule, crash, setup, step)


def _messages(exc: BaseException) -> list[str]:
    """Return ``Type: message`` for ``exc`` and the exceptions it was raised from, each cut to 20,000 characters."""
    out, seen, current = [], set(), exc
    while current is not None and id(current) not in seen and len(out) < 8:
        seen.add(id(current))
        try:
            message = str(current)
        except Exception:  # a broken __str__ must not stop the explanation
            message = object.__repr__(current)
        out.append(f"{type(current).__name__}: {message[:20_000]}")
        current = current.__cause__ or current.__context__
    return out
