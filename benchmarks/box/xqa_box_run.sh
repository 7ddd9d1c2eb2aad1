#!/usr/bin/env bash
# The XQA decode / DeepGEMM rollout session on the GPU box (issue #16), stages per device call:
#   bash benchmarks/box/xqa_box_run.sh STAGE...
#   STAGE: setup | dg-prepare[=MODEL] | dg-probe | tests | tests-moe | tests-fi | tests-mla | probe-nvcc | profile | engine-plan
#        | fi-warm | moe-start | xqa-sweep | rollout-VARIANT[,VARIANT...][@BACKEND][#ARGS_VAR] | par=CHAIN+CHAIN... | bg | wait[=SECONDS]
#        | model | bitwise=STAGE[,STAGE...] | rl-step[=VARIANTS] | tests-tp[=FILE,...] | proof-tp | proof[#ARGS_VAR] | verl | trl | openrlhf | nemo_rl | stack-proof[#ARGS_VAR]
#        | pytest=FILE[@EXPR] (one GPU test file, or its tests matching the pytest -k EXPR; no SmolLM2 staged: the tests that build their own models)
# Needs the vLLM kit staged in /root/stage and .flashinfer_aot/ (benchmarks/box/build_flashinfer_aot.sh)
# carried. setup installs the prebuilt XQA modules into FlashInfer's AOT directory and sets
# FLASHINFER_DISABLE_JIT=1 (nothing may compile on the box; a missing module raises, naming it).
# dg-prepare[=MODEL] fills DeepGEMM's JIT cache /root/dg_cache for the linears of a rollout model
# (benchmarks/rollout/checkpoints.py: qwen3-8b, the default, qwen3-30b-a3b, moonlight-16b-a3b; a carried .dgcache/MODEL.tar that an
# earlier machine's prepare brought back as dgcache_MODEL.tar skips the compile when its marks cover the model on this GPU and vLLM;
# `fp8-align prepare-deepgemm --model`, 16 processes; session 16's `dg-prepare-moe` is
# `dg-prepare=qwen3-30b-a3b`; of an MoE model it compiles the routed experts' grouped kernels
# too); the _dg rollout variants start with it. DG_PREPARE_TP=N (default 1): the per-rank shapes of engines split
# over N GPUs (prepare-deepgemm --tensor-parallel-size N, for --tensor-parallel-size N in ROLLOUT_ARGS). dg-probe times DeepGEMM's grouped GEMM
# per M on its expert shapes (benchmarks/box/deepgemm_grouped_probe.py); tests-moe runs the MoE
# and MLA GPU tests (Triton and DeepGEMM experts, the tiny Moonlight); probe-nvcc says whether the box has a CUDA compiler;
# profile records the decode step of the best Qwen3-8B configuration at batch 512 (after dg-prepare;
# $PROFILE_ARGS, default by the bundle's vLLM: `--batch fp8_align_kv_xqa_dg=512 --model-runner v2` on 0.22,
# `--batch fp8_align_kv_dg=512 --attention-backend FLASHINFER --model-runner v2` on 0.25.1).
# tests-tp: tests/test_gpu_tp.py and tests/test_gpu_stack_sync_tp.py over every visible GPU (carry .whl/site from
# benchmarks/box/build_stack_site.sh; their Ray cases need FP8_ALIGN_GPUKIT=.gpukit_ray); not inside a par chain; killed after
# $TESTS_TP_TIMEOUT seconds (default 600); tests-tp=FILE[,FILE...]: those files, one pytest (and time limit) each;
# $TESTS_TP_ARGS: more pytest arguments for each (no spaces inside one, e.g. --deselect=NODE).
# proof-tp: benchmarks/on_policy_bitwise.py --tensor-parallel-size 2 (the 4-layer Qwen3-8B shape; $PROOF_TP_ARGS) over both GPUs.
# proof[#NAME]: the same on GPU 0 at tensor parallel size 1 ($PROOF_ARGS, or $NAME with reports named after it, so one chain
# runs several); the 4-layer Qwen3-8B shape needs no staged model.
# verl: verl 0.9.1's FSDP engine importable for the stages after it (benchmarks/box/verl_deps_setup.sh: .whl/site carried,
# .whl/verl_deps/verl_deps.part_NN staged), e.g. before proof with PROOF_ARGS="--scorer verl ..." or stack-proof.
# trl: the same wheels for TRL's GRPOTrainer (stack-proof with --stack trl), checked by importing it: no Ray needed.
# openrlhf: what OpenRLHF's Actor imports beyond .whl/site and verl's deps (deepspeed, flash-attn's padding helpers:
# scripts/setup_cpu_env.sh builds .cache/openrlhf_site, copied to /root/openrlhf_site by an earlier call) on PYTHONPATH.
# nemo_rl: NeMo RL's DTensor-policy pins (transformers 5.5.4: NeMo RL refuses >= 5.12) unpacked from the carried
# .whl/nemo_rl_site.tar.zst (benchmarks/box/build_stack_site.sh) and the vendored tests/third_party/nemo_rl_dtensor, first on
# PYTHONPATH for the stages after it (stack-proof with STACK_ARGS="--stack nemo_rl ..."); last in a chain.
# stack-proof[#NAME]: benchmarks/stack_bitwise.py on GPU 0 (a stack's actor, policy steps and sync against a bitwise engine; $STACK_ARGS,
# or $NAME with reports named after it, so one chain runs two stacks).
# model: SmolLM2 reassembled once (benchmarks/box/gpu_model_setup.sh; before a par whose chains use it).
# bitwise=STAGES: benchmarks/box/bitwise_box_run.sh kit STAGES (comma-separated) in this chain, output under
# bitwise[_gpuN]/; stages that need SmolLM2 come after this chain's `model` stage (e.g. model bitwise=tests,grpo
# on one GPU beside rollouts on the others; bitwise=mcore,megatron-tests needs no model).
# Rollouts (rollout-VARIANTS@BACKEND: on one GPU with that attention backend, a report of its own):
# Qwen3-8B shape, $ROLLOUT_ARGS (default: both shapes, vLLM's V2 model runner for every
# variant), variants joined into one report under /root/rollout_work (the same machine across
# calls). engine-plan: benchmarks/box/engine_plan_check.py on a cold DeepGEMM cache (the fill at
# engine start). fi-warm (FLASHINFER_JIT=1, vLLM 0.25+): FlashInfer's modules compiled by a tiny
# engine before the rollout (benchmarks/box/flashinfer_warm.py). moe-start: dg-prepare=qwen3-30b-a3b,
# then one Qwen3-30B-A3B fp8_align_dg engine on that cache (start and its grouped warm-up; short
# shape, one generate). xqa-sweep: XQA decode alone by page size (16, 32, 64) and layout (NHD, HND)
# at batch 512 and 256. par=A/B+C+... runs stages A then B on GPU 0 while C runs on GPU 1, and so
# on (an empty chain leaves its GPU free); a rollout in a chain (or with CUDA_VISIBLE_DEVICES=1,3
# and --gpus 2 in ROLLOUT_ARGS) works and reports under names with its GPUs. --tensor-parallel-size N in
# ROLLOUT_ARGS splits each engine over N GPUs (outside par; rollout-V@BACKEND then runs one engine on N GPUs).
# bg: the stages after it run detached from this call (setsid, from a copy of the tree, output in
# /root/bg, or /root/$BG_NAME for a second one beside it), so one run may outlast the 10-minute
# call; wait[=SECONDS] (default 540) waits for it and brings back what it wrote so far.
# Output: $OUT/xqa_results.tgz.
# FLASHINFER_JIT=1: FlashInfer compiles its modules on the box (nvcc there since session 16)
# instead of the carried prebuilt ones: no .flashinfer_aot, FLASHINFER_DISABLE_JIT unset. With
# FP8_ALIGN_GPUKIT=.gpukit25 (the vLLM 0.25.1 bundle) and ROLLOUT_ARGS with --attention-backend
# FLASHINFER this runs the vLLM 0.25.1 peer comparison (issue #26, item 2).
set -uo pipefail
out="${OUT:-/tmp/out}/xqa"; mkdir -p "$out"
bg="/root/${BG_NAME:-bg}"  # where bg runs the rest detached and wait looks (BG_NAME: a second one beside it)
source benchmarks/box/gpu_box_setup.sh >/dev/null || exit 1
export VLLM_LOGGING_LEVEL=INFO
if [ "${FLASHINFER_JIT:-0}" = 1 ]; then
  unset FLASHINFER_DISABLE_JIT
  # vLLM 0.25 sends SM90 FP8-KV decode to XQA only where NVIDIA's cubin artifactory answers or
  # flashinfer-cubin is installed (vllm/utils/flashinfer.py has_nvidia_artifactory); the box is
  # offline, and XQA's SM90 kernel compiles from source with nvcc: vLLM's own switch says so.
  export VLLM_HAS_FLASHINFER_CUBIN=1
else
  aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
  mkdir -p "$aot" && cp -r .flashinfer_aot/aot/* "$aot/" || exit 1
  export FLASHINFER_DISABLE_JIT=1
fi
engine_log_tail() {  # LOG: its last 20,000 characters without the engine's line per FP8 layer (the plan line
  # sums them up), so an engine's error stays in the tail
  grep -v -- '-> [a-z_]* (passed: ' "$1" | tail -c 20000
}

dg_prepare() {  # MODEL: fill /root/dg_cache for its linears (and experts) from its config.json in benchmarks/rollout/checkpoints.py
  local tp="${DG_PREPARE_TP:-1}" tag="$1"; [ "$tp" = 1 ] || tag="$1_tp$tp"  # per-rank shapes of a TP=$tp engine
  mkdir -p "/root/dg_config/$1" && python3 -c "import json, sys; from benchmarks.rollout.checkpoints import MODELS; \
    json.dump(MODELS[sys.argv[1]].config, open(sys.argv[2], 'w'))" "$1" "/root/dg_config/$1/config.json" || return 1
  # a cache an earlier machine brought back (.dgcache/TAG.tar, carried): used when its marks cover this model on this setup
  [ -f ".dgcache/$tag.tar" ] && mkdir -p /root/dg_cache && tar -C /root/dg_cache -xf ".dgcache/$tag.tar"
  if python3 -c "import json, sys, torch; from pathlib import Path
from fp8_align.vllm_plugin.kernels.deepgemm.fill import model_deepgemm_shapes
from fp8_align.vllm_plugin.kernels.deepgemm.inventory import DEFAULT_MAX_BATCHED_TOKENS, is_prepared
from fp8_align.vllm_plugin.kernels.deepgemm.warmup import deepgemm_cache_setup
shapes, setup = model_deepgemm_shapes(json.load(open(sys.argv[1])), int(sys.argv[2])), deepgemm_cache_setup(torch.device('cuda', 0))
sys.exit(0 if shapes and all(is_prepared(Path('/root/dg_cache'), setup, s.n, s.k, DEFAULT_MAX_BATCHED_TOKENS) for s in shapes) else 1)" \
      "/root/dg_config/$1/config.json" "$tp"; then
    echo "dg-prepare $tag: the carried cache covers it"; du -sh /root/dg_cache; return 0
  fi
  python3 -m fp8_align.cli prepare-deepgemm --model "/root/dg_config/$1" --tensor-parallel-size "$tp" --cache-dir /root/dg_cache \
    --json "$out/deepgemm_prepare_$tag.json" > "$out/deepgemm_prepare_$tag.log" 2>&1
  local rc=$?
  tail -c 1500 "$out/deepgemm_prepare_$tag.log"; du -sh /root/dg_cache
  # brought back for the next machine: copy it to .dgcache/TAG.tar here (git-ignored) and carry .dgcache
  [ $rc = 0 ] && tar -C /root/dg_cache -cf "$out/dgcache_$tag.tar" .
  return $rc  # a failed prepare stops the chain (its rollouts would time an engine that fills the cache at start)
}
while [ $# -gt 0 ]; do
  stage="$1"; shift
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    bg)
      rm -rf "$bg" && mkdir -p "$bg/out" && cp -a . "$bg/repo" || exit 1
      # shellcheck disable=SC2016
      setsid nohup bash -c 'cd "$0/repo" && OUT="$0/out" XQA_BOX_TAR=0 bash benchmarks/box/xqa_box_run.sh "$@" \
        > "$0/log" 2>&1; echo $? > "$0/rc"' "$bg" "$@" < /dev/null > /dev/null 2>&1 &
      echo "detached into $bg: $*"; break ;;
    wait*)
      limit="${stage#wait}"; limit="${limit#=}"
      for ((waited = 0; waited < ${limit:-540}; waited += 10)); do [ -f "$bg/rc" ] && break; sleep 10; done
      echo "$bg rc=$(cat "$bg/rc" 2>/dev/null || echo running)"; tail -25 "$bg/log"
      cp -r "$bg/out/xqa/." "$out/" 2>/dev/null
      for work in /root/rollout_work* /root/rl_step_work*; do [ -d "$work" ] && mkdir -p "$out/${work##*/}" && cp "$work"/*.json "$out/${work##*/}/"; done 2>/dev/null
      for log in /root/rl_step_work*/*.log; do
        [ -f "$log" ] && work="${log%/*}" && mkdir -p "$out/${work##*/}" && engine_log_tail "$log" > "$out/${work##*/}/${log##*/}.tail"
      done 2>/dev/null; true ;;
    par=*)
      IFS=+ read -r -a chains <<< "${stage#par=}"; pids=()
      for gpu in "${!chains[@]}"; do
        IFS=/ read -r -a stages <<< "${chains[$gpu]}"
        CUDA_VISIBLE_DEVICES=$gpu XQA_BOX_TAR=0 bash benchmarks/box/xqa_box_run.sh "${stages[@]}" > "$out/gpu$gpu.txt" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid"; done; tail -n 15 "$out"/gpu*.txt ;;
    fi-warm)
      python3 benchmarks/box/flashinfer_warm.py > "$out/flashinfer_warm.log" 2>&1; echo "rc=$?"
      grep -E "FlashInfer warm|Error" "$out/flashinfer_warm.log" | tail -3 ;;
    moe-start)
      dg_prepare qwen3-30b-a3b > "$out/moe_start_prepare.txt" 2>&1 || exit 1
      python3 benchmarks/rollout_throughput.py --model qwen3-30b-a3b --shapes short --variants fp8_align_dg --model-runner v2 \
        --deepgemm-cache /root/dg_cache --work /root/moe_start_work --results "$out/moe_start" > "$out/moe_start.log" 2>&1
      echo "rc=$?"; tail -4 "$out/moe_start.log"; cp /root/moe_start_work/fp8_align_dg/*.log "$out/moe_start/" 2>/dev/null; true ;;
    engine-plan)
      rm -rf /root/dg_cold_tiny
      DG_JIT_CACHE_DIR=/root/dg_cold_tiny python3 benchmarks/box/engine_plan_check.py > "$out/engine_plan_check.log" 2>&1
      grep -E "engine plan|fill|prepare-deepgemm|XQA decode calls|Error" "$out/engine_plan_check.log" | cut -c1-600 | tail -12 ;;
    setup) [ "${FLASHINFER_JIT:-0}" = 1 ] && echo "FlashInfer JIT on: $(command -v nvcc)" || ls "$aot" ;;
    model) source benchmarks/box/gpu_model_setup.sh || exit 1 ;;
    verl) source benchmarks/box/verl_deps_setup.sh || exit 1 ;;
    trl) DEPS_CHECK_MODULE=trl.trainer.grpo_trainer source benchmarks/box/verl_deps_setup.sh || exit 1 ;;
    openrlhf)
      [ -f /root/openrlhf_site/flash_attn/bert_padding.py ] || { echo "openrlhf: copy .cache/openrlhf_site to /root/openrlhf_site first"; exit 1; }
      export PYTHONPATH="$PYTHONPATH:/root/openrlhf_site"
      python3 -c "import openrlhf.models.actor" && echo "OpenRLHF's Actor imports" || exit 1 ;;
    nemo_rl)
      [ -f .whl/nemo_rl_site.tar.zst ] || { echo "nemo_rl: carry .whl/nemo_rl_site.tar.zst (benchmarks/box/build_stack_site.sh)"; exit 1; }
      if [ ! -f /root/nemo_rl_site/transformers/__init__.py ]; then
        rm -rf /root/nemo_rl_site && LD_LIBRARY_PATH="$kit/bin" "$kit/bin/zstd" -d -q -c .whl/nemo_rl_site.tar.zst | tar -C /root -xf - || exit 1
      fi
      export PYTHONPATH="/root/nemo_rl_site:$PWD/tests/third_party/nemo_rl_dtensor:$PYTHONPATH"
      python3 -c "import benchmarks.nemo_rl_scorer, transformers; print('NeMo RL DTensor policy imports; transformers', transformers.__version__)" \
        || exit 1 ;;
    bitwise=*)
      IFS=, read -r -a bitwise_stages <<< "${stage#bitwise=}"
      bitwise_out="$out/bitwise${CUDA_VISIBLE_DEVICES:+_gpu${CUDA_VISIBLE_DEVICES//,/_}}"
      OUT="$bitwise_out" bash benchmarks/box/bitwise_box_run.sh kit "${bitwise_stages[@]}"
      tail -5 "$bitwise_out"/pytest_*.txt 2>/dev/null; true ;;
    dg-prepare*) model="${stage#dg-prepare}"; model="${model#=}"; dg_prepare "${model:-qwen3-8b}" || exit 1 ;;
    dg-probe)
      DG_JIT_CACHE_DIR=/root/dg_probe_cache python3 benchmarks/box/deepgemm_grouped_probe.py "$out/deepgemm_grouped_probe.json" \
        > "$out/deepgemm_grouped_probe.log" 2>&1; tail -20 "$out/deepgemm_grouped_probe.log" ;;
    tests-moe)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s tests/test_gpu_moe_deepgemm.py tests/test_gpu_moe.py tests/test_gpu_mla.py \
        > "$out/pytest_moe.txt" 2>&1
      grep -E "reference|passed|failed|Error|error" "$out/pytest_moe.txt" | tail -25 ;;
    profile)
      # the best configuration of the bundle's vLLM: fp8_align's XQA route on 0.22, FlashInfer's on 0.25+
      case "$(python3 -c 'import vllm; print(vllm.__version__)')" in
        0.22.*) best="--batch fp8_align_kv_xqa_dg=512 --model-runner v2" ;;
        *) best="--batch fp8_align_kv_dg=512 --attention-backend FLASHINFER --model-runner v2" ;;
      esac
      # shellcheck disable=SC2086
      python3 benchmarks/decode_profile.py --results "$out/profile" ${PROFILE_ARGS:-$best} \
        --deepgemm-cache "${PROFILE_DG_CACHE:-/root/dg_cache}" > "$out/decode_profile.log" 2>&1
      find "$out/profile" -name "*trace.json*" -size +8M -delete  # the table (profiler_out_0.txt) is what is read
      tail -5 "$out/decode_profile.log" ;;
    probe-nvcc)
      { which nvcc; ls -d /usr/local/cuda*/bin/nvcc; nvcc --version; python3 -c "import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)"; } 2>&1 | tail -8 ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s tests/test_gpu_xqa.py tests/test_gpu_deepgemm_cache.py \
        tests/test_gpu_flashinfer_scales.py \
        > "$out/pytest_xqa_dg.txt" 2>&1
      grep -E "XQA|xqa|cold|FLASHINFER|passed|failed|Error" "$out/pytest_xqa_dg.txt" | tail -25 ;;
    pytest=*)
      spec="${stage#pytest=}"; file="${spec%%@*}"; expr=""; [[ "$spec" == *"@"* ]] && expr="${spec#*@}"
      name="pytest_$(basename "$file" .py)${expr:+_${expr//[^A-Za-z0-9]/_}}"
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s "$file" ${expr:+-k "$expr"} > "$out/$name.txt" 2>&1
      echo "rc=$?"; tail -15 "$out/$name.txt" ;;
    tests-tp*)
      # tensor parallel size 2 over every visible GPU (not inside a par chain): fp8_align's own TP tests and the
      # stacks' sync at TP=2 (their packages from .whl/site, benchmarks/box/build_stack_site.sh; Ray cases where
      # the bundle has Ray, FP8_ALIGN_GPUKIT=.gpukit_ray); tests-tp=FILE[,FILE...]: those test files instead, a report each
      files="${stage#tests-tp}"; files="${files#=}"; runs=("tests/test_gpu_tp.py tests/test_gpu_stack_sync_tp.py")
      [ -n "$files" ] && IFS=, read -r -a runs <<< "$files"
      for run in "${runs[@]}"; do
        name="pytest_tp"; [ -n "$files" ] && name="pytest_$(basename "$run" .py)"
        # shellcheck disable=SC2086
        PYTHONPATH="$PWD/.whl/site:${PYTHONPATH:-}" timeout "${TESTS_TP_TIMEOUT:-600}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s \
          --basetemp "/root/pt_$name" ${TESTS_TP_ARGS:-} $run > "$out/$name.txt" 2>&1
        echo "$run rc=$?"; grep -E "passed|failed|skipped|Error|error" "$out/$name.txt" | grep -v INFO | tail -25
      done ;;
    proof-tp)
      # benchmarks/on_policy_bitwise.py at tensor parallel size 2 over both GPUs (the 4-layer Qwen3-8B shape; $PROOF_TP_ARGS: more)
      # shellcheck disable=SC2086
      python3 benchmarks/on_policy_bitwise.py --out "$out/on_policy_bitwise_tp2.json" --models qwen3-8b-4l --tensor-parallel-size 2 \
        --work /root/bitwise_tp_work ${PROOF_TP_ARGS:-} > "$out/on_policy_bitwise_tp2.log" 2>&1
      echo "rc=$?"; tail -30 "$out/on_policy_bitwise_tp2.log"
      tail -c 20000 /root/bitwise_tp_work/*.log > "$out/bitwise_tp_engine_logs.txt" 2>/dev/null; true ;;
    proof|proof#*)
      # proof#NAME: the arguments from $NAME instead of $PROOF_ARGS, reports named after it (several proofs in one chain)
      args_var=PROOF_ARGS; tag=""
      [[ "$stage" == *#* ]] && { args_var="${stage#*#}"; tag="_$args_var"; [ -n "${!args_var:-}" ] || { echo "$stage: \$$args_var is empty"; exit 2; }; }
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=0 python3 benchmarks/on_policy_bitwise.py --out "$out/on_policy_bitwise$tag.json" --models qwen3-8b-4l \
        --work "/root/bitwise_work$tag" ${!args_var:-} > "$out/on_policy_bitwise$tag.log" 2>&1
      echo "rc=$?"; tail -30 "$out/on_policy_bitwise$tag.log"
      tail -c 20000 "/root/bitwise_work$tag"/*.log > "$out/bitwise_engine_logs$tag.txt" 2>/dev/null; true ;;
    stack-proof|stack-proof#*)
      # stack-proof#NAME: the arguments from $NAME instead of $STACK_ARGS, reports named after it (two stacks in one chain)
      args_var=STACK_ARGS; tag=""
      [[ "$stage" == *#* ]] && { args_var="${stage#*#}"; tag="_$args_var"; [ -n "${!args_var:-}" ] || { echo "$stage: \$$args_var is empty"; exit 2; }; }
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=0 python3 benchmarks/stack_bitwise.py --out "$out/stack_bitwise$tag.json" --work "/root/stack_work$tag" ${!args_var:-} \
        > "$out/stack_bitwise$tag.log" 2>&1
      echo "rc=$?"; tail -12 "$out/stack_bitwise$tag.log"
      tail -c 20000 "/root/stack_work$tag"/*.log > "$out/stack_engine_logs$tag.txt" 2>/dev/null; true ;;
    tests-fi|tests-mla)
      # one test file alone (tests takes ~14 minutes on vLLM 0.25: give its slowest file a GPU of its own)
      file=tests/test_gpu_flashinfer_scales.py; [ "$stage" = tests-mla ] && file=tests/test_gpu_mla.py
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s "$file" > "$out/pytest_$stage.txt" 2>&1
      grep -E "FLASHINFER|MLA|mla|reference|passed|failed|Error" "$out/pytest_$stage.txt" | grep -v INFO | tail -15 ;;
    rollout-*)
      # rollout-VARIANTS@BACKEND: those variants on one GPU (N at --tensor-parallel-size N) with that attention backend
      # ("auto": vLLM's choice), in a report and work folder of their own (e.g. beside a FLASHINFER run, in a par chain)
      # Chains of a par (CUDA_VISIBLE_DEVICES set: one or more host GPUs) work and report apart.
      # rollout-VARIANTS[@BACKEND]#NAME: the rollout arguments from $NAME instead of $ROLLOUT_ARGS (chains of one par
      # measuring different models)
      variants="${stage#rollout-}"; args_var=ROLLOUT_ARGS
      [[ "$variants" == *#* ]] && { args_var="${variants#*#}"; variants="${variants%%#*}"; }
      rollout_args="${!args_var:-}"; [ "$args_var" != ROLLOUT_ARGS ] && [ -z "$rollout_args" ] && { echo "$stage: \$$args_var is empty"; exit 2; }
      backend=""; gpus="${CUDA_VISIBLE_DEVICES:+_gpu${CUDA_VISIBLE_DEVICES//,/_}}"
      tp=$(sed -nE 's/.*--tensor-parallel-size[= ]+([0-9]+).*/\1/p' <<< "$rollout_args")  # GPUs of one engine
      work="/root/rollout_work$gpus"; extra=()
      if [[ "$variants" == *@* ]]; then
        backend="${variants#*@}"; variants="${variants%@*}"; work="/root/rollout_work_$backend$gpus"
        extra=(--attention-backend "$backend" --gpus "${tp:-1}")
      fi
      tag="${variants//,/_}${backend:+_$backend}$gpus"; log="$out/rollout_$tag.log"; mkdir -p "$out/report$gpus"
      # shellcheck disable=SC2086
      python3 benchmarks/rollout_throughput.py ${rollout_args:---shapes short,long --model-runner v2} "${extra[@]}" --work "$work" \
        --deepgemm-cache /root/dg_cache --variants "$variants" --results "$out/report$gpus" > "$log" 2>&1
      tail -12 "$log"
      mkdir -p "$out/engine_logs_$tag" && cp "$work"/*/*.log "$out/engine_logs_$tag/" 2>/dev/null; true ;;
    rl-step*)
      # rl-step[=VARIANTS]: benchmarks/rl_step_time.py (GRPO steps per variant on one GPU; $RL_STEP_ARGS: more
      # arguments, e.g. --model qwen3-1.7b --colocate), after dg-prepare of that model for fp8_fast; chains of a par split
      # the variants; wait brings back each finished variant's JSON and every variant's log tail as the run goes
      variants="${stage#rl-step}"; variants="${variants#=}"; tag="${variants//,/_}"; tag="${tag:-all}"
      python3 benchmarks/rl_step_time.py --out "$out/rl_step_time_$tag.json" ${variants:+--variants "$variants"} \
        --deepgemm-cache /root/dg_cache --work "/root/rl_step_work_$tag" ${RL_STEP_ARGS:-} > "$out/rl_step_time_$tag.log" 2>&1
      echo "rc=$?"; tail -5 "$out/rl_step_time_$tag.log"
      for log in /root/rl_step_work_"$tag"/*.log; do [ -f "$log" ] && engine_log_tail "$log" > "$out/rl_step_${tag}_${log##*/}"; done; true ;;
    xqa-sweep)
      # XQA decode alone by page size and layout at the rollout's decode batch (benchmarks/attention_decode.py)
      for batch in 512 256; do
        python3 benchmarks/attention_decode.py --kernels xqa --xqa-layouts NHD,HND --block-sizes 16,32,64 --batch "$batch" \
          --context 1554 --results "$out/xqa_sweep" --output "attention_decode_xqa_layouts_b$batch.json" 2>&1 | tail -6
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
[ "${XQA_BOX_TAR:-1}" = 0 ] || { tar -C "${OUT:-/tmp/out}" -czf "${OUT:-/tmp/out}/xqa_results.tgz" xqa && rm -rf "$out"; }
