#!/usr/bin/env bash
# One device run: every check that needs a CUDA GPU. Usage: bash bench/gpu/run_all.sh (output also in $OUT/gpu.log)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py=python3
d=$(mktemp -d)
{
echo "== torch: $($py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())')"
echo "== 1. CUDA-marked tests"
timeout 200 $py -m pytest -q -p no:cacheprovider -m cuda tests/explanations/test_crash.py tests/guard/test_scaler_guard.py \
  tests/monitor/test_activations.py tests/monitor/test_grad_stats.py tests/monitor/test_deferred_read.py \
  tests/repairs/test_master_weights.py 2>&1 | tail -4
echo "== 2. seed error on CUDA: run, then run --fix"
timeout 60 $py -m ampdoctor run --no-watch --json $d/seed.json tests/scripts/seed.py 20 cuda 2>&1 | grep -E "^(ValueError|AMP|ampdoctor)" ; echo "exit ${PIPESTATUS[0]}"
timeout 60 $py -m ampdoctor run --fix tests/scripts/seed.py 20 cuda 2>&1 | grep -E "^(loss|ampdoctor|AMP)" | tail -4; echo "exit ${PIPESTATUS[0]}"
echo "== 3. accelerate fp16 (real CUDA GradScaler): run, then run --fix"
timeout 90 $py -m ampdoctor run --no-watch bench/gpu/accelerate_fp16.py 2>&1 | grep -E "^(ValueError|AMP|ampdoctor|    head|    2)"; echo "exit ${PIPESTATUS[0]}"
timeout 90 $py -m ampdoctor run --fix bench/gpu/accelerate_fp16.py 2>&1 | grep -E "^(done|ampdoctor|AMP)"; echo "exit ${PIPESTATUS[0]}"
echo "== 4. Lightning 16-mixed on CUDA with the callback: stray head, then --fix"
(cd $d && timeout 120 $py $OLDPWD/examples/lightning_callback.py --json l.json 2>&1 | grep -E "^(ValueError|AMP|ampdoctor)" ; echo "exit ${PIPESTATUS[0]}")
(cd $d && timeout 120 $py $OLDPWD/examples/lightning_callback.py --fix --json l2.json 2>&1 | grep -E "^(AMP|ampdoctor|done)" ; echo "exit ${PIPESTATUS[0]}")
echo "== 5. Trainer fp16=True on CUDA with the callback: half model, then --fix"
(cd $d && timeout 150 $py $OLDPWD/examples/trainer_callback.py --half --json t.json 2>&1 | grep -E "^(ValueError|AMP|ampdoctor)" ; echo "exit ${PIPESTATUS[0]}")
(cd $d && timeout 150 $py $OLDPWD/examples/trainer_callback.py --half --fix --json t2.json 2>&1 | grep -E "^(AMP|ampdoctor|done)" ; echo "exit ${PIPESTATUS[0]}")
echo "== 6. host syncs and overhead"
timeout 200 $py bench/gpu/syncs.py 2>&1 | grep -v Warning
echo "== 7. advise vs max_memory_allocated"
timeout 120 $py bench/gpu/advise_cuda.py 2>&1 | grep -v -i warn
} 2>&1 | tee ${OUT:-/tmp}/gpu.log
