"""The only place that reads other libraries' internals: accelerate, transformers, Lightning, DeepSpeed, Ray and kin.

Each access checks that the internal exists and states what happens without it, as ``ampdoctor._torch`` does for
torch's; ``tests/_torch/test_probes.py`` imports every module of both rooms on the installed versions and runs the
fallbacks that can be made real in-process. Nothing here imports a library: a module looks in ``sys.modules`` or at
the objects it is handed, so importing ampdoctor never imports accelerate, transformers, Lightning or DeepSpeed.
``tests/test_private_names.py`` fails when a private name of one of them is used anywhere else. Tested with
accelerate 1.15, transformers 5.24, Lightning 2.6 and DeepSpeed 0.19.

- `accelerate`: ``AcceleratorState._shared_state`` (is there an Accelerator), ``model._original_forward`` (a
  prepared forward), and ``AcceleratedOptimizer.__init__``'s frame locals (its placement reload).
- `transformers`: the Trainer calling a callback (its frame locals) and its private ``_run_epoch``.
- `lightning`: Fabric's ``_FabricModule`` (``_forward_module``, ``_strategy``), the ``_MultiProcessingLauncher`` of
  ``ddp_spawn`` workers and ``Trainer._run_stage``.
- `ray`: whether this process is a Ray Train worker (public API only: ``ray.train.get_context()``).
- `engines`: DeepSpeed, Megatron-LM and apex engine objects, recognised by their classes' modules, and what they own.
- `loss_scalers`: the loss scalers of fairseq, DeepSpeed, apex and Megatron-LM, recognised by their class names and
  attributes (public ones only): their scale, and the one call that decides whether a step is skipped.
"""
