"""How ampdoctor names what the user's code holds: one `Names` per run, and the spelling rules it follows.

Every part of a run names a parameter, a module, a tensor no model owns, an optimizer and a GradScaler here, so that
the pre-flight, the guard, the watch, the crash explanations and every view use the same words for the same object:

* a parameter by its path in its model (``encoder.0.weight``), with the model's name in front when the run trains
  several (``unet.``, ``text_encoder.``, ``models[1].``: the script's own name for it, else its class);
* a module by that path without the attributes of wrappers torch puts inside a model (`module_label`);
* a tensor no model owns (a logit scale kept beside the model) by where the optimizer holds it,
  ``param_groups[1]['params'][0]`` (`Names.free_tensor`);
* an optimizer by its place in the run, ``optimizer[0] (AdamW)``; a GradScaler by how it was built,
  ``GradScaler('cpu')``.

The script's names for its models are remembered per run (`Names`), never in a module-global cache: two runs in one
process (a notebook's stages, tests) do not name each other's models.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["Names", "user_name", "module_label", "script_bindings", "optimizer_slots", "listing", "MAX_LISTED"]

# Modules torch puts *inside* a model, between a module and its children: an FSDP1 unit (``FullyShardedDataParallel``
# keeps the wrapped module in ``_fsdp_wrapped_module``), activation checkpointing's ``CheckpointWrapper`` and
# ``torch.compile`` of a submodule (``_orig_mod``). Names leave them out, as the state-dict keys of the first two do.
_INNER_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_MAX_ENTRIES = 64   # entries of one list, tuple or dict looked at for models
MAX_LISTED = 10     # names in one finding's detail


def user_name(name: str) -> str:
    """Return a module or parameter name from ``named_modules()`` as the user's code spells it: without the
    attributes of wrappers torch put inside the model (an empty name stays empty: the root).

    >>> user_name("_fsdp_wrapped_module.decoder.block.0._fsdp_wrapped_module._flat_param")
    'decoder.block.0._flat_param'
    """
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in _INNER_WRAPPERS)


def module_label(name: str, prefix: str = "") -> str:
    """Return how the findings name module ``name`` (from ``named_modules()``) of a model whose names start with
    ``prefix`` (`Names.prefixes`): as the user's code spells it (`user_name`); its root is the model's own name, or
    ``(root)`` when the run has one model.

    >>> module_label("_fsdp_wrapped_module.block.0"), module_label("", "netD."), module_label("")
    ('block.0', 'netD', '(root)')
    """
    name = user_name(name)
    return f"{prefix}{name}" if name else prefix.rstrip(".") or "(root)"


def optimizer_slots(optimizer: Any) -> dict[int, str]:
    """Map the id of each tensor ``optimizer`` holds to where it holds it, ``param_groups[g]['params'][i]``: the name
    of a tensor no model owns (a logit scale kept outside the model), as the user reaches it.

    >>> scale = torch.zeros(())
    >>> slots = optimizer_slots(torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [scale]}], lr=0.1))
    >>> slots[id(scale)]
    "param_groups[1]['params'][0]"
    """
    return {id(p): f"param_groups[{gi}]['params'][{pi}]"
            for gi, group in enumerate(getattr(optimizer, "param_groups", ())) for pi, p in enumerate(group["params"])}


def listing(items: Sequence[str], limit: int = MAX_LISTED) -> str:
    """Return ``"a, b, c"``, cut to ``limit`` items with a count of the rest.

    >>> listing(["a", "b", "c"], limit=2)
    'a, b and 1 more'
    """
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def script_bindings(namespace: Mapping[str, Any],
                    unwrap: Callable[[nn.Module], nn.Module] | None = None) -> dict[int, str]:
    """Map the id of each module in ``namespace`` (a script's globals, a frame's locals) to the first name that binds
    it there, in the namespace's order: a variable, or an entry of a list, tuple or dict one holds, as the user types
    it. Names starting with ``_``, ``self`` and namespaces held in it (runpy's ``run_globals``) are left out. With
    ``unwrap``, the module a wrapper delegates to (``G = DDP(G)``) has the wrapper's name too.

    >>> unet, encoder = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> names = script_bindings({"unet": unet, "nets": {"text": encoder}, "parts": [encoder, unet]})
    >>> names[id(unet)], names[id(encoder)]
    ('unet', "nets['text']")
    """
    names: dict[int, str] = {}
    for key, value in list(namespace.items()):
        if not isinstance(key, str) or key.startswith("_") or key == "self":
            continue
        for name, item in _entries(key, value):
            if isinstance(item, nn.Module):
                names.setdefault(id(item), name)
                if unwrap is not None:
                    names.setdefault(id(unwrap(item)), name)
    return names


def _entries(key: str, value: Any) -> list[tuple[str, Any]]:
    """Return ``(name, item)`` for each entry of ``value`` bound to ``key``, a list, tuple or dict; else ``value``."""
    if isinstance(value, (list, tuple)):
        return [(f"{key}[{i}]", item) for i, item in enumerate(value[:_MAX_ENTRIES])]
    if isinstance(value, dict):
        if "__name__" in value:   # a namespace held in a namespace (runpy's run_globals): not the script's name
            return []
        return [(f"{key}[{k!r}]", item) for k, item in itertools.islice(value.items(), _MAX_ENTRIES)
                if isinstance(k, (str, int)) and not isinstance(k, bool)]
    return [(key, value)]


class Names:
    """How one run names the user's objects: the script's names for its models, remembered for the run.

    One is built at the start of a run (``session.Session``) and held by each ``TrainingSetup`` of that run, so the
    pre-flight, the guard, the watch and the crash explanations share what the script's frames said; ``check()``
    and a setup built alone get their own.

    >>> a, b = nn.Linear(2, 2), nn.Conv1d(1, 1, 1)
    >>> names = Names()
    >>> names.prefixes([a]), names.prefixes([a, b]), names.prefixes([a, nn.Linear(2, 2)])
    ([''], ['Linear.', 'Conv1d.'], ['Linear[0].', 'Linear[1].'])
    >>> names.note_script_names([a, b], [{"G": a, "D": b}]); names.prefixes([a, b])
    ['G.', 'D.']
    """

    def __init__(self) -> None:
        self._given: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> the script's name for it

    # ---- models: the script's names -----------------------------------------------------------------------------
    def prefixes(self, models: Sequence[nn.Module]) -> list[str]:
        """Return what each model's parameter and module names start with: nothing for one model; with several, the
        name the script gave it (``text_encoder.``, ``models[1].``, ``nets['D'].``: see `script_bindings`) at module
        level or, noted earlier (`note_script_names`), in a function's frame, else its class (``CLIPTextModel.``),
        numbered when two share one (``Linear[1].``)."""
        if len(models) < 2:
            return [""] * len(models)
        bound = script_bindings(getattr(sys.modules.get("__main__"), "__dict__", {}))
        for m in models:   # kept: a crash is named after the script's module is gone, and must name things the same
            if id(m) in bound:
                self._given[m] = bound[id(m)]
        names = [self._given.get(m, type(m).__name__) for m in models]
        return [f"{n}[{names[:i].count(n)}]." if names.count(n) > 1 else f"{n}." for i, n in enumerate(names)]

    def note_script_names(self, models: Sequence[nn.Module], namespaces: Iterable[Mapping[str, Any]],
                          unwrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """Remember, for each of several ``models`` without a name from the script yet, the first name
        ``namespaces`` give it (the locals of the user's frames, outermost first; see `script_bindings` for
        ``unwrap``): for models local to a function (``def main(): unet = ...``), or named in a crash's frames after
        the script's module is gone. A model keeps its name once given. ``namespaces`` is read only when there is a
        model to name."""
        todo = [m for m in models if m not in self._given] if len(models) > 1 else []
        for namespace in namespaces if todo else ():
            bound = script_bindings(namespace, unwrap)
            taken = {self._given.get(m) for m in models}   # one name, one model: `model` in two frames names the first
            for m in todo:
                name = bound.get(id(m))
                if name is not None and name not in taken:
                    self._given[m] = name
                    taken.add(name)
            todo = [m for m in todo if m not in self._given]
            if not todo:
                return

    def note_part_name(self, part: nn.Module, namespaces: Iterable[Mapping[str, Any]]) -> None:
        """Remember the name the first of ``namespaces`` that binds it gives ``part`` (a model the script runs with
        nothing to train): its own (``teacher``), or its path in a module bound there (``vae.encoder``, which
        ``vae.encode()`` calls). Kept once given; `prefixes` names it so.

        >>> vae, names = nn.Sequential(nn.Linear(2, 2)), Names()
        >>> names.note_part_name(vae[0], [{"vae": vae}]); names.prefixes([nn.Linear(2, 2), vae[0]])[1]
        'vae.0.'
        """
        if part in self._given:
            return
        for namespace in namespaces:
            direct = script_bindings(namespace).get(id(part))
            if direct is not None:
                self._given[part] = direct
                return
            for key, value in list(namespace.items()):
                if not isinstance(key, str) or key.startswith("_") or key == "self":
                    continue
                for name, item in _entries(key, value):
                    path = next((p for p, sub in item.named_modules() if sub is part), None) \
                        if isinstance(item, nn.Module) else None
                    if path:
                        self._given[part] = f"{name}.{user_name(path)}"
                        return

    # ---- tensors, optimizers, scalers ----------------------------------------------------------------------------
    @staticmethod
    def free_tensor(tensor: torch.Tensor, optimizers: Iterable[Any]) -> str | None:
        """Return the name of a tensor no model owns: where the first of ``optimizers`` that holds it keeps it,
        ``param_groups[g]['params'][i]``; None when none does.

        >>> scale = torch.zeros(())
        >>> Names.free_tensor(scale, [torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [scale]}], lr=0.1)])
        "param_groups[1]['params'][0]"
        """
        return next((slots[id(tensor)] for slots in map(optimizer_slots, optimizers) if id(tensor) in slots), None)

    @staticmethod
    def optimizer(optimizer: Any, optimizers: Sequence[Any]) -> str:
        """Return ``optimizer[0] (AdamW)``, numbered by its place in the run's ``optimizers``.

        >>> opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        >>> Names.optimizer(opt, [opt]), Names.optimizer(opt, [])
        ('optimizer[0] (AdamW)', 'optimizer (AdamW)')
        """
        for i, opt in enumerate(optimizers):
            if opt is optimizer:
                return f"optimizer[{i}] ({type(optimizer).__name__})"
        return f"optimizer ({type(optimizer).__name__})"

    @staticmethod
    def scaler(scaler: Any, device: str | None) -> str:
        """Return how ``scaler`` was built, ``GradScaler('cpu')`` (``device``: the device type it was built for,
        read by ``_torch.scaler.scaler_device``; None when unknown).

        >>> Names.scaler(torch.amp.GradScaler("cpu"), "cpu")
        "GradScaler('cpu')"
        """
        return f"{type(scaler).__name__}({device or '?'!r})"
