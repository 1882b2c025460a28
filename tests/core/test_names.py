"""One run, one name per object (``core.names``): a tensor no model owns is named alike by every part of a run."""

import torch
from torch import nn

import ampdoctor
from ampdoctor.core.names import Names
from ampdoctor.core.options import RunOptions
from ampdoctor.core.training import TrainingSetup
from ampdoctor.runner.doctor import Doctor

FREE = "param_groups[1]['params'][0]"   # where the optimizer holds it: how the user reaches it


def _with_a_free_scale(dtype: torch.dtype) -> tuple[nn.Module, nn.Parameter, torch.optim.Optimizer]:
    """A model and a logit scale kept beside it, in the optimizer's second group (CLIP's temperature)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    scale = nn.Parameter(torch.ones((), dtype=dtype))
    return model, scale, torch.optim.SGD([{"params": model.parameters()}, {"params": [scale]}], lr=0.1)


def test_one_free_tensor_is_named_alike_by_the_preflight_the_watch_and_an_explanation():
    model, scale, opt = _with_a_free_scale(torch.float16)
    x = torch.randn(3, 4)
    # pre-flight: the fp16 scale under a GradScaler (AMP101)
    (predicted,) = [f for f in ampdoctor.check(model, opt, torch.amp.GradScaler("cpu")).findings if f.code == "AMP101"]
    assert f"{FREE} (float16, [])" in predicted.detail
    # the watch's gradient statistics
    with ampdoctor.watch(model, opt, every=1) as w:
        (model(x).sum() * scale.float()).backward()
        opt.step()
    assert FREE in w.last_grads and FREE in w.summary_data()["gradients"]["params"]
    # the explanation of the crash it causes: 'Attempting to unscale FP16 gradients.'
    scaler = torch.amp.GradScaler("cpu")
    with Doctor(RunOptions(watch=False)) as doctor:
        try:
            scaler.scale(model(x).sum() * scale.float()).backward()
            scaler.step(opt)
        except ValueError as exc:
            explained = doctor.explain(exc)
    assert [f.code for f in explained] == ["AMP101"]
    assert f"{FREE} (float16, [])" in explained[0].detail


def test_a_setup_names_a_free_tensor_where_its_optimizer_holds_it():
    model, scale, opt = _with_a_free_scale(torch.float32)
    setup = TrainingSetup(model, opt)
    assert setup.name_of(scale) == FREE and setup.describe(scale) == f"{FREE} (float32, [])"
    assert setup.name_of(torch.zeros(1)) == "<tensor not in any model>"
    assert setup.optimizer_label(opt) == "optimizer[0] (SGD)"


def test_a_run_remembers_the_scripts_names_for_its_models_and_another_run_does_not():
    generator, critic = nn.Linear(2, 2), nn.Linear(2, 2)
    run = Names()
    run.note_script_names([generator, critic], [{"G": generator, "D": critic}])
    assert TrainingSetup([generator, critic], names=run).prefixes == ["G.", "D."]
    assert TrainingSetup([generator, critic]).prefixes == ["Linear[0].", "Linear[1]."]
