"""The only place that uses private torch internals (and frame locals); other libraries' are in ``ampdoctor._compat``.

Each probe checks that the internal exists and states what happens without it; `tests/_torch/test_probes.py` imports
every module here on the installed torch and runs each fallback that can be made real in-process, so a rename shows
up as one failing test instead of a broken import. `tests/test_private_names.py` reads the AST of every other module
and fails on a private torch name used there. Tested with torch 2.13; the oldest torch the probes are written for
is 2.4. Nothing here imports another module of ampdoctor.

- `scaler`: `GradScaler._per_optimizer_states`, `OptState`, `_scale`, `_growth_tracker`, `_init_scale`,
  `_init_growth_tracker`, `_device`, `_unscale_grads_`, and the optimizer's `_step_supports_amp_scaling`.
- `optim`: `LRScheduler._step_count`.
- `autograd`: `torch._C._current_graph_task_id`, `Variable._execution_engine.queue_callback`, `Tensor._version`.
- `foreach`: `torch._foreach_norm`, `_foreach_copy_`, `_foreach_add_`, `_foreach_zero_`.
- `sparse`: a sparse COO gradient's stored lists, `Tensor._indices()` and `_values()`.
- `dispatch`: `torch.utils._python_dispatch.TorchDispatchMode`, `torch.utils._pytree.tree_leaves`, `OpOverload._schema`.
- `fake`: `torch._subclasses.fake_tensor.FakeTensorMode` and a storage timeline built on the dispatch mode.
- `modules`: `Module._parameters`, `Module._modules`, `OptimizedModule._orig_mod`; `module_hooks`: whether a global
  module hook exists (`_has_any_global_hook`) and torch.compile's warning about them.
- `distributed`: DTensor's `found_inf_reduce_handler`, gradient layouts, FSDP1's `_handle`, `_is_flat_param`,
  `_shard_numel_padded`.
- `engines`: FSDP2's `_get_fsdp_state()._mp_policy` and `_fsdp_param_groups[0].mesh_info` (reduce dtype, ranks), DDP
  wrappers of parameters, and the garbage-collector scan that ``ampdoctor._compat.engines`` uses too.
- `frames`: frame locals: a parameter generator's module (`gi_frame.f_locals`), what torch's frames held in a crash
  (`_unscale_grads_`'s `param`, `clip_grad_norm_`'s `parameters`, `decorate_autocast`'s `autocast_instance`), the
  user's frames' variables.
"""
