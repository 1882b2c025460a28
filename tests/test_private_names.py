"""Private internals stay in two rooms: torch's in ``ampdoctor/_torch/``, other libraries' in ``ampdoctor/_compat/``.

The check reads each module's AST, not its text, so an alias (``import torch.utils._pytree as pt``), a lazy import
inside a function, or a module found in ``sys.modules`` is seen as well as ``torch._foreach_norm``. A use is:

1. an import of a private module or name: ``import torch._C``, ``from torch.utils import _pytree``,
   ``from torch._subclasses import FakeTensorMode``;
2. a private attribute (``_x``, not ``__x__``) anywhere on a chain rooted at a name bound to a watched package:
   bound by an import (``from accelerate.state import AcceleratorState`` then ``AcceleratorState._shared_state``), by
   ``sys.modules[...]``/``sys.modules.get(...)``/``importlib.import_module(...)`` of one, or by an assignment from such
   a chain (``x = torch.zeros(1)`` then ``x._version``), including ``getattr(root, "_x")``;
3. a read of a frame's internals (``f_locals``, ``gi_frame``, ``cr_frame``, ``ag_frame``), allowed in both rooms;
4. a known private attribute of a torch or third-party object reached through any variable (``scaler._scale``,
   ``module._parameters``, ``model._original_forward``), or the same name as a string (``getattr(s, "_scale")``,
   ``observe(trainer, "_run_stage")``, ``type(m).__name__ == "_FabricModule"``).

A test shows each rule failing on code that breaks it, and the whole check failing on a copy of a real module with one
such line added.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ampdoctor"

TORCH_ROOM = "_torch"
COMPAT_ROOM = "_compat"
EITHER_ROOM = "_torch/ or ampdoctor/_compat"   # frame internals: torch's frames or a library's
# Each watched package and the room its private names may be used in.
ROOMS = {"torch": TORCH_ROOM, **{name: COMPAT_ROOM for name in (
    "accelerate", "transformers", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed", "peft",
    "diffusers", "megatron", "apex")}}
FRAME_INTERNALS = {"f_locals", "gi_frame", "cr_frame", "ag_frame"}
# Private attributes of torch objects that ampdoctor reads through a variable (the scaler, an optimizer, a module, a
# tensor), where the variable's type is not seen in the source.
TORCH_ATTRIBUTES = {
    "_per_optimizer_states", "_scale", "_growth_tracker", "_init_scale", "_init_growth_tracker", "_device",
    "_unscale_grads_", "_step_count", "_mp_policy", "_get_fsdp_state", "_fsdp_param_groups", "_handle",
    "_is_flat_param", "_shard_numel_padded", "_current_graph_task_id", "_execution_engine", "_has_any_global_hook",
    "_version", "_parameters", "_modules", "_buffers", "_schema", "_StridedShard", "_step_supports_amp_scaling",
    "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
}
# The same for accelerate, transformers and Lightning objects (a trainer, a prepared model, a strategy's launcher).
THIRD_PARTY_ATTRIBUTES = {
    "_shared_state", "_original_forward", "_strategy", "_run_stage", "_run_epoch", "_FabricModule",
    "_MultiProcessingLauncher", "_forward_module",
}
KNOWN = {**{name: TORCH_ROOM for name in TORCH_ATTRIBUTES}, **{name: COMPAT_ROOM for name in THIRD_PARTY_ATTRIBUTES}}
# Uses outside the rooms that stay, each with its reason: (module, the use as the checker names it) -> reason.
_WRAPPER_NAMES = ("the attribute names torch's inner wrappers put in `named_modules()` paths, matched as text to "
                  "drop them from the names users see (no attribute is read); core/ lies below _torch/ and cannot "
                  "import it")
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("core/names.py", "'_fsdp_wrapped_module'"): _WRAPPER_NAMES,
    ("core/names.py", "'_checkpoint_wrapped_module'"): _WRAPPER_NAMES,
    ("core/names.py", "'_orig_mod'"): _WRAPPER_NAMES,
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Use:
    """One use of a private name: where, what, and the room it belongs in."""

    line: int
    what: str
    room: str

    def __str__(self) -> str:
        return f"{self.line}: {self.what} (belongs in ampdoctor/{self.room}/)"


def _root(node: ast.AST) -> ast.AST:
    """Return the start of an attribute chain, through calls and subscripts (``a.b().c[0].d`` -> ``a``)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node


def _package(dotted: str | None) -> str | None:
    top = (dotted or "").split(".", 1)[0]
    return top if top in ROOMS else None


def _dynamic_import(node: ast.AST) -> str | None:
    """Return the package of ``sys.modules["pkg.x"]``, ``sys.modules.get("pkg.x")`` or ``import_module("pkg.x")``."""
    key = None
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("sys.modules"):
        key = node.slice
    elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in (
            "sys.modules.get", "importlib.import_module", "import_module", "__import__"):
        key = node.args[0]
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return _package(key.value)
    return None


class _Bindings(ast.NodeVisitor):
    """Collect the names bound to a watched package anywhere in a module: ``{name: package}``."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            package = _package(alias.name)
            if package:
                self.names[alias.asname or alias.name.split(".", 1)[0]] = package

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        package = _package(node.module) if not node.level else None
        if package:
            for alias in node.names:
                self.names[alias.asname or alias.name] = package

    def package_of(self, node: ast.AST) -> str | None:
        root = _root(node)
        dynamic = _dynamic_import(node) or next((_dynamic_import(n) for n in ast.walk(node)
                                                 if isinstance(n, (ast.Subscript, ast.Call))), None)
        if dynamic:
            return dynamic
        return self.names.get(root.id) if isinstance(root, ast.Name) else None

    def bind_assignments(self, tree: ast.AST) -> None:
        """Bind the targets of assignments from a bound chain, until nothing new is bound."""
        while True:
            before = len(self.names)
            for node in ast.walk(tree):
                targets: list[ast.AST] = []
                value = None
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    targets, value = [node.target], node.value
                package = self.package_of(value) if value is not None else None
                for target in targets if package else ():
                    if isinstance(target, ast.Name) and target.id not in self.names:
                        self.names[target.id] = package
            if len(self.names) == before:
                return


def private_uses(source: str, room: str | None) -> list[Use]:
    """Return the uses of private names in ``source`` that do not belong in ``room`` (``"_torch"``, ``"_compat"``
    or None for any other module), in line order."""
    tree = ast.parse(source)
    bindings = _Bindings()
    bindings.visit(tree)
    bindings.bind_assignments(tree)
    uses: set[Use] = set()
    for node in ast.walk(tree):
        kind = _USES.get(type(node))
        for what, belongs in kind(node, bindings, room) if kind else ():
            if belongs != room:
                uses.add(Use(node.lineno, what, belongs))
    return sorted(uses, key=lambda u: (u.line, u.what))


def _import_uses(node: ast.Import, bindings: _Bindings, room: str | None) -> Iterator[tuple[str, str]]:
    """Rule 1: ``import torch._C``; each use is ``(what, the room it belongs in)``, as for the others below."""
    for alias in node.names:
        package = _package(alias.name)
        if package and any(_private(part) for part in alias.name.split(".")):
            yield f"import {alias.name}", ROOMS[package]


def _import_from_uses(node: ast.ImportFrom, bindings: _Bindings, room: str | None) -> Iterator[tuple[str, str]]:
    """Rule 1: ``from torch.utils import _pytree``, ``from torch._subclasses import FakeTensorMode``."""
    package = _package(node.module) if not node.level else None
    if not package:
        return
    private = [a.name for a in node.names if _private(a.name)]
    if any(_private(part) for part in node.module.split(".")) or private:
        yield f"from {node.module} import {', '.join(private or [a.name for a in node.names])}", ROOMS[package]


def _attribute_uses(node: ast.Attribute, bindings: _Bindings, room: str | None) -> Iterator[tuple[str, str]]:
    """Rules 2, 3 and 4: a private attribute on a watched chain, a frame's internals, a known private attribute."""
    package = bindings.package_of(node.value)
    if package and _private(node.attr):
        yield ast.unparse(node), ROOMS[package]
    elif node.attr in FRAME_INTERNALS and room is None:
        yield ast.unparse(node), EITHER_ROOM
    elif node.attr in KNOWN and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
        yield ast.unparse(node), KNOWN[node.attr]


def _getattr_uses(node: ast.Call, bindings: _Bindings, room: str | None) -> Iterator[tuple[str, str]]:
    """Rule 2: ``getattr(root, "_x")`` (and hasattr, setattr, delattr) on a watched chain."""
    if not (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1):
        return
    name = node.args[1]
    package = bindings.package_of(node.args[0])
    if package and isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
        yield ast.unparse(node), ROOMS[package]


def _string_uses(node: ast.Constant, bindings: _Bindings, room: str | None) -> Iterator[tuple[str, str]]:
    """Rule 4: a known private attribute's name as a string (``getattr(s, "_scale")``)."""
    if isinstance(node.value, str) and node.value in KNOWN:
        yield repr(node.value), KNOWN[node.value]


# The checks, by the kind of AST node they read.
_USES: dict[type, Callable[[Any, _Bindings, str | None], Iterator[tuple[str, str]]]] = {
    ast.Import: _import_uses, ast.ImportFrom: _import_from_uses, ast.Attribute: _attribute_uses,
    ast.Call: _getattr_uses, ast.Constant: _string_uses,
}


def room_of(path: Path) -> str | None:
    """Return the room a module of ampdoctor sits in (``"_torch"``, ``"_compat"``), None for any other."""
    top = path.relative_to(SRC).parts[0]
    return top if top in (TORCH_ROOM, COMPAT_ROOM) else None


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_private_internals_are_used_only_in_their_rooms():
    found = {}
    for path in _modules():
        name = str(path.relative_to(SRC))
        uses = [str(u) for u in private_uses(path.read_text(encoding="utf-8"), room_of(path))
                if (name, u.what) not in EXCEPTIONS]
        if uses:
            found[name] = uses
    assert found == {}


def test_every_listed_exception_is_still_needed():
    for (name, what), reason in EXCEPTIONS.items():
        path = SRC / name
        assert reason and any(u.what == what for u in private_uses(path.read_text(encoding="utf-8"), room_of(path))), \
            f"{name}: {what!r} is no longer used there; take it off EXCEPTIONS"


def test_the_check_fails_on_a_copy_of_a_module_with_a_private_use_added():
    findings = (SRC / "core" / "findings.py").read_text(encoding="utf-8")
    assert private_uses(findings, None) == []
    uses = private_uses(findings + "\nimport torch\nx = torch._foreach_norm\n", None)
    assert [u.what for u in uses] == ["torch._foreach_norm"]
    assert uses[0].room == TORCH_ROOM and uses[0].line == len(findings.splitlines()) + 3


@pytest.mark.parametrize("source, what", [
    ("import torch._C", "import torch._C"),
    ("import torch.utils._pytree as pytree", "import torch.utils._pytree"),
    ("from torch.utils import _pytree", "from torch.utils import _pytree"),
    ("from torch._subclasses.fake_tensor import FakeTensorMode", "from torch._subclasses.fake_tensor import "
                                                                 "FakeTensorMode"),
    ("from torch.utils._python_dispatch import TorchDispatchMode", "from torch.utils._python_dispatch import "
                                                                   "TorchDispatchMode"),
    ("import torch\ntorch._foreach_norm([])", "torch._foreach_norm"),
    ("import torch\ntorch.utils._pytree.tree_map(f, x)", "torch.utils._pytree"),
    ("import torch as t\nt.nn.modules.module._has_any_global_hook()", "t.nn.modules.module._has_any_global_hook"),
    ("def f():\n    from torch import nn\n    return nn.Module._call_impl", "nn.Module._call_impl"),
    ("import torch\nx = torch.zeros(1)\nx._version", "x._version"),
    ("import torch\ngetattr(torch, '_foreach_norm')", "getattr(torch, '_foreach_norm')"),
    ("import sys\nd = sys.modules.get('torch.distributed')\nd._coalescing_manager",
     "d._coalescing_manager"),
    ("def f(scaler):\n    return scaler._scale", "scaler._scale"),
    ("def f(scaler):\n    return getattr(scaler, '_per_optimizer_states', None)", "'_per_optimizer_states'"),
    ("def f(frame):\n    return frame.f_locals", "frame.f_locals"),
    ("def f(gen):\n    return gen.gi_frame", "gen.gi_frame"),
    ("def f(m):\n    return m._parameters.values()", "m._parameters"),
])
def test_each_rule_catches_torch_internals(source, what):
    assert what in [u.what for u in private_uses(source, None)]
    assert [u.what for u in private_uses(source, TORCH_ROOM) if u.room == TORCH_ROOM] == []


@pytest.mark.parametrize("source, what", [
    ("from accelerate.state import AcceleratorState\nAcceleratorState._shared_state",
     "AcceleratorState._shared_state"),
    ("import sys\nstate = sys.modules['accelerate.state']\nstate.AcceleratorState._shared_state",
     "state.AcceleratorState._shared_state"),
    ("from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher",
     "from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher"),
    ("import deepspeed\ndeepspeed.runtime._private", "deepspeed.runtime._private"),
    ("def f(trainer):\n    trainer._run_stage()", "trainer._run_stage"),
    ("def f(observe, trainer):\n    observe(trainer, '_run_epoch')", "'_run_epoch'"),
    ("def f(m):\n    return type(m).__name__ == '_FabricModule'", "'_FabricModule'"),
    ("def f(model):\n    return hasattr(model, '_original_forward')", "'_original_forward'"),
])
def test_each_rule_catches_third_party_internals(source, what):
    uses = private_uses(source, None)
    assert what in [u.what for u in uses] and {u.room for u in uses if u.what == what} == {COMPAT_ROOM}
    assert private_uses(source, COMPAT_ROOM) == []
    assert [u.what for u in private_uses(source, TORCH_ROOM)] == [what]   # torch's room is no place for them


@pytest.mark.parametrize("source", [
    "import torch\ntorch.nn.Linear(2, 2).weight.__class__",    # dunders are public
    "import torch\nclass A:\n    def f(self):\n        return self._scale",   # our own attribute
    "from ampdoctor._torch.scaler import live_scale",         # our own private module
    "import torch\ntorch.amp.GradScaler('cpu').get_scale()",
    "def f(frame):\n    return frame.f_code.co_filename, frame.f_lineno",   # where a frame is, not its locals
    "import sys\nsys._getframe(1)",                           # the standard library's, not a watched package
    "def f(x):\n    return x.get('_scale_at')",                # a string that is no listed name
])
def test_the_check_stays_quiet_on_public_and_own_names(source):
    assert private_uses(source, None) == []
