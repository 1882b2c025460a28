"""The only place that reads private torch internals.

Each probe checks that the internal exists and states what happens without it; `tests/_torch/test_probes.py`
runs every probe on the installed torch, so a rename shows up as one failing test instead of a broken import.
Tested with torch 2.13; the oldest torch the probes are written for is 2.4.

- `scaler`: `GradScaler._per_optimizer_states`, `OptState`, `_scale`, `_growth_tracker`, `_init_scale`,
  `_init_growth_tracker`, `_device`, and the optimizer's `_step_supports_amp_scaling`.
- `optim`: `LRScheduler._step_count`.
- `autograd`: `torch._C._current_graph_task_id`, `Variable._execution_engine.queue_callback`.
- `distributed`: DTensor's `found_inf_reduce_handler`, FSDP2's `_get_fsdp_state()._mp_policy`.
- `engines`: FSDP2's `_get_fsdp_state()._mp_policy` and `_fsdp_param_groups[0].mesh_info` (reduce dtype, ranks);
  DDP wrappers of parameters and DeepSpeed / Megatron-LM / apex objects, found by a gc scan only when they can exist.
- `frames`: a generator's frame locals (`gi_frame.f_locals`), to find the module behind `model.parameters()`.
"""
