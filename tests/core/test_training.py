"""The names of a setup's models: the script's own, as the user types them, the same in every finding.

What a run's frames say (``Names.note_script_names``) is kept by the run's one ``core.names.Names``, which each of
its setups holds: a setup with another ``Names`` does not see it (no module-global cache).
"""

import sys
import types

import pytest
import torch
from torch import nn

from ampdoctor.core.names import Names, script_bindings
from ampdoctor.core.training import TrainingSetup


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def script(monkeypatch):
    """The running script's module: ``ampdoctor run`` makes it ``__main__``."""
    module = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", module)
    return module


# ---- models the script keeps in a list or a dict: were named after their class, ``Sequential[0].0`` --------------
def test_models_in_a_list_of_the_scripts_globals_are_named_by_their_entries(script):
    script.models = [mlp(), mlp()]
    setup = TrainingSetup(script.models)
    assert setup.prefixes == ["models[0].", "models[1]."]
    assert [p.name for p in setup.params][:2] == ["models[0].0.weight", "models[0].0.bias"]
    assert setup.params[-1].module == "models[1].2"


def test_models_in_a_dict_of_the_scripts_globals_are_named_by_their_keys(script):
    script.nets = {"G": mlp(), "D": nn.Sequential(nn.Sequential(nn.Linear(2, 4)), nn.Linear(4, 1))}
    setup = TrainingSetup([script.nets["G"], script.nets["D"]])
    assert setup.prefixes == ["nets['G'].", "nets['D']."]
    assert setup.params[-4].name == "nets['D'].0.0.weight"


def test_the_first_binding_in_the_scripts_order_names_a_model(script):
    a, b = mlp(), mlp()
    script.unet, script.models = a, [a, b]   # a variable first, then a list
    script.m = b                              # a loop variable left over: `for m in models: ...`
    assert TrainingSetup([a, b]).prefixes == ["unet.", "models[1]."]


def test_a_model_the_script_does_not_name_keeps_its_numbered_class(script):
    assert TrainingSetup([mlp(), mlp()]).prefixes == ["Sequential[0].", "Sequential[1]."]


# ---- names from the frames of the user's code (models local to main(); a crash after the script's module is gone) --
def test_note_script_names_names_models_local_to_a_function():
    generator, critic = mlp(), mlp()
    names = Names()
    names.note_script_names([generator, critic], [{"main": print}, {"G": generator, "D": critic}])
    assert TrainingSetup([generator, critic], names=names).prefixes == ["G.", "D."]
    assert TrainingSetup([generator, critic]).prefixes == ["Sequential[0].", "Sequential[1]."]   # another run


def test_a_model_keeps_the_first_name_it_was_given():
    a, b = mlp(), mlp()
    names = Names()
    names.note_script_names([a, b], [{"encoder": a}])
    names.note_script_names([a, b], [{"model": a, "decoder": b}])   # an inner frame's parameter name does not rename a
    assert TrainingSetup([a, b], names=names).prefixes == ["encoder.", "decoder."]


def test_one_name_names_one_model():
    a, b = mlp(), mlp()
    names = Names()
    names.note_script_names([a, b], [{"model": a}, {"model": b}])   # `model` in two frames: the outer one's
    assert TrainingSetup([a, b], names=names).prefixes == ["model.", "Sequential."]


def test_one_model_needs_no_name_and_no_frame_is_read():
    def frames():
        raise AssertionError("read")
        yield {}

    Names().note_script_names([mlp()], frames())


def test_script_bindings_leave_out_self_private_names_and_namespaces():
    model = mlp()
    namespace = {"self": model, "_cache": model, "run_globals": {"__name__": "__main__", "model": model}}
    assert script_bindings(namespace) == {}
    assert script_bindings({"pair": (torch.zeros(1), model)}) == {id(model): "pair[1]"}


def test_a_wrapper_bound_to_a_name_names_the_model_it_delegates_to():
    generator, critic = mlp(), mlp()
    namespace = {"G": nn.DataParallel(generator), "D": nn.DataParallel(critic)}
    names = Names()
    names.note_script_names([generator, critic], [namespace], unwrap=lambda wrap: getattr(wrap, "module", wrap))
    assert TrainingSetup([generator, critic], names=names).prefixes == ["G.", "D."]
