#!/usr/bin/env bash
# The bitwise on-policy session on the GPU box (issue #24), stages per device call:
#   bash benchmarks/box/bitwise_box_run.sh STAGE...
#   STAGE: stage (copy the carried .gpukit/part_* or .gpukit25/part_*, .gpumodel/smol.zst.part_* and .gpute/te.part_* to /root/stage)
#        | setup (kit + SmolLM2) | te-build (TransformerEngine, in the background) | te-wait
#        | tests[=EXPR] (tests/test_gpu_bitwise.py and test_gpu_bitwise_rollout.py; with EXPR, test_gpu_bitwise.py -k EXPR) | proof[=MODELS][#NAME] ($PROOF_ARGS, or $NAME: more arguments) | cost[=PARTS] ($COST_ARGS: more arguments)
#        | grpo (3 seeds of the arms $GRPO_ARMS, default bf16,fp8_bitwise, at once; $GRPO_ARGS: more arguments)
#        | main-job (`fp8-align bench-error` with its CUDA defaults) | te (benchmarks/box/te_box_run.sh tests ops)
#        | profile (one decode step of the fast mode and of the bitwise mode, kernel families; Qwen3-8B shape)
#        | ncu (Nsight Compute, full set, on one decode launch of fp8_cache_attention: report and its details page)
#        | kernels[=all|=attention] (benchmarks/bitwise_kernels.py: CUTLASS, DeepGEMM and the current Triton tile checked
#          for M-invariance and timed, TRITON_ATTN's decode over a BF16 and an FP8 cache, fp8_cache_attention's
#          current tiling; =all: every GEMM tile configuration, TRITON_ATTN launch setting and fp8_cache_attention
#          tiling; =attention: the attention parts only, every fp8_cache_attention tiling; $BITWISE_KERNELS_ARGS: more
#          arguments, e.g. --fp8-heads 16,8 for Qwen3-1.7B's heads)
#        | trainer-kernels (benchmarks/trainer_kernels.py -> $out/trainer_kernels.json; $TRAINER_KERNELS_ARGS, e.g. --parts linear_backward)
#        | kit (the vLLM bundle alone) | megatron-cost (after te-build, te-wait: benchmarks/megatron_bitwise_cost.py, power-of-two
#          and FP32 scales -> $out/megatron_bitwise_cost_{pow2,fp32}.json; $MEGATRON_COST_ARGS: more arguments, e.g. --profile) | megatron-tests (tests/test_gpu_megatron_bitwise.py; with two GPUs also tests/test_gpu_megatron_bitwise_tp.py) | mcore (megatron-core from the carried .whl/megatron_core-*.whl into /tmp/mcore_site, on PYTHONPATH)
#        | megatron[=MODELS] (on_policy_bitwise.py --scorer megatron -> $out/megatron_bitwise.json; $MEGATRON_ARGS: more arguments)
#        | nemo-rl (NeMo RL's pins from the carried .whl/nemo_rl_site.tar.zst and its vendored units first on PYTHONPATH)
#        | nemo-rl-megatron (after mcore and nemo-rl: tests/nemo_rl_megatron_checks.py on CUDA, then on_policy_bitwise.py --scorer
#          nemo_rl_megatron -> $out/nemo_rl_megatron_bitwise.json)
#        | megatron-steps (stack_bitwise.py --stack megatron: policy steps through megatron-core's optimizer, each synced
#          into the engine -> $out/megatron_steps.json; $MEGATRON_STEPS_ARGS: more arguments)
#        | bg (the stages after it run detached in /root/bitwise_bg, so one run may outlast a call)
#        | wait[=SECONDS] (waits for the detached run, at most SECONDS (540), and brings back what it wrote so far)
# Output under $OUT: env.txt, pytest_bitwise.txt, on_policy_bitwise*.json, on_policy_cost.json, grpo_bitwise/, logs.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out" /root/stage
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    stage) cp .gpukit/part_* .gpukit25/part_* .gpumodel/smol.zst.part_* .gpute/te.part_* /root/stage/ 2>/dev/null; ls -l /root/stage ;;
    setup)
      source benchmarks/box/gpu_box_setup.sh >/dev/null || exit 1
      source benchmarks/box/gpu_model_setup.sh || exit 1 ;;
    te-build)  # TE's torch extension compiles on the CPU (~130 s) while GPU stages run
      ( source benchmarks/box/te_box_setup.sh ) > "$out/te_setup.log" 2>&1 &
      te_build_pid=$! ;;
    te-wait) wait "${te_build_pid:?te-build did not run in this call}"; echo "te setup rc=$?"; tail -3 "$out/te_setup.log" ;;
    tests*)  # tests=EXPR: only tests/test_gpu_bitwise.py's tests that match the pytest -k EXPR
      expr="${stage#tests}"; expr="${expr#=}"
      if [ -n "$expr" ]; then files=(tests/test_gpu_bitwise.py -k "$expr"); else files=(tests/test_gpu_bitwise.py tests/test_gpu_bitwise_rollout.py); fi
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs -s "${files[@]}" > "$out/pytest_bitwise.txt" 2>&1
      tail -25 "$out/pytest_bitwise.txt" ;;
    proof*)
      # proof[=MODELS][#NAME]: the arguments from $NAME instead of $PROOF_ARGS (two proofs of one run with their own)
      spec="${stage#proof}"; spec="${spec#=}"; models="${spec%%#*}"; args_var=PROOF_ARGS
      [[ "$spec" == *"#"* ]] && args_var="${spec#*#}"
      name="on_policy_bitwise${models:+_${models//,/_}}"; [ "$args_var" = PROOF_ARGS ] || name="${name}_$args_var"
      python3 benchmarks/on_policy_bitwise.py --out "$out/$name.json" ${models:+--models "$models"} ${!args_var:-} \
        --work /root/bitwise_work > "$out/$name.log" 2>&1
      echo "rc=$?"; tail -40 "$out/$name.log"
      tail -c 20000 /root/bitwise_work/*.log > "$out/bitwise_engine_logs.txt" 2>/dev/null ;;
    cost*)
      parts="${stage#cost}"; parts="${parts#=}"
      name="on_policy_cost${parts:+_${parts//,/_}}"
      python3 benchmarks/on_policy_cost.py --out "$out/$name.json" ${parts:+--parts "$parts"} ${COST_ARGS:-} \
        --work /root/cost_work > "$out/$name.log" 2>&1
      echo "rc=$?"; tail -20 "$out/$name.log"
      tail -c 8000 /root/cost_work/*.log > "$out/cost_engine_logs.txt" 2>/dev/null ;;
    grpo)
      for seed in 0 1 2; do
        python3 benchmarks/grpo_alignment.py --arms "${GRPO_ARMS:-bf16,fp8_bitwise}" --parallel --seed "$seed" --steps 30 --validate-every 10 \
          ${GRPO_ARGS:---max-seconds 420} --out "$out/grpo_bitwise/seed$seed" > "$out/grpo_bitwise_seed$seed.log" 2>&1 &
      done
      wait; tail -n 4 "$out"/grpo_bitwise/seed*/*.log
      (cd "$out" && tar -czf grpo_bitwise.tgz grpo_bitwise grpo_bitwise_seed*.log && rm -rf grpo_bitwise grpo_bitwise_seed*.log) ;;  # few files back
    main-job)
      python3 -m fp8_align.cli bench-error --out "$out/bench_error_cuda" --json-only --no-plots > "$out/bench_error_cuda.log" 2>&1
      echo "rc=$?"; tail -30 "$out/bench_error_cuda.log" ;;
    te) bash benchmarks/box/te_box_run.sh tests ops ;;
    kernels*)
      case "$stage" in
        kernels=all) kernel_args=(--tiles all) ;;
        kernels=attention) kernel_args=(--parts attention,fp8_attention --attention-settings current --fp8-tilings all) ;;
        *) kernel_args=(--tiles current --attention-settings current --fp8-tilings current) ;;
      esac
      # shellcheck disable=SC2086
      python3 benchmarks/bitwise_kernels.py --out "$out/bitwise_kernels.json" "${kernel_args[@]}" ${BITWISE_KERNELS_ARGS:-} > "$out/bitwise_kernels.log" 2>&1
      echo "rc=$?"; grep -hE "cutlass|deepgemm|\"fp8\"|fp8_cache_attention" "$out/bitwise_kernels.log" | cut -c1-300 | head -60 ;;
    ncu)  # Nsight Compute on one decode launch of fp8_cache_attention (batch 512, 512 tokens): stalls, occupancy, DRAM
      ncu -k regex:_fp8_cache_attention_kernel --launch-skip 2 --launch-count 1 --kill on --set full -f -o "$out/fp8_attention" \
        python3 benchmarks/bitwise_kernels.py --out "$out/ncu_bitwise_kernels.json" --parts fp8_attention --fp8-tilings current \
        > "$out/ncu.log" 2>&1
      echo "rc=$?"; ncu --import "$out/fp8_attention.ncu-rep" --page details > "$out/fp8_attention_ncu.txt" 2>&1
      grep -E "DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|Theoretical Occupancy" \
        "$out/fp8_attention_ncu.txt" | head -12 ;;
    profile)
      python3 benchmarks/decode_profile.py --results "$out/decode_profile" --batch fp8_align=140,fp8_bitwise=140 \
        > "$out/decode_profile.log" 2>&1
      echo "rc=$?"; tail -4 "$out/decode_profile.log"
      tar -C "$out" -czf "$out/decode_profile.tgz" decode_profile && rm -rf "$out/decode_profile" ;;
    trainer-kernels)  # benchmarks/trainer_kernels.py: the bitwise trainer's kernels at the cost benchmark's shape
      python3 benchmarks/trainer_kernels.py --out "$out/trainer_kernels.json" ${TRAINER_KERNELS_ARGS:-} > "$out/trainer_kernels.log" 2>&1
      echo "rc=$?"; cut -c1-300 "$out/trainer_kernels.log" | tail -40 ;;
    mcore)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore_site .whl/megatron_core-*.whl || exit 1
      export PYTHONPATH="$PYTHONPATH:/tmp/mcore_site"; python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" ;;
    kit) source benchmarks/box/gpu_box_setup.sh >/dev/null || exit 1 ;;
    megatron-cost)  # after te-build / te-wait: the bitwise megatron-core spec vs TE's spec, forward+backward
      source benchmarks/box/te_box_setup.sh > /dev/null || exit 1
      python3 benchmarks/megatron_bitwise_cost.py --variant fp8_pow2 --out "$out/megatron_bitwise_cost_pow2.json" \
        --work /root/megatron_cost_work ${MEGATRON_COST_ARGS:-} > "$out/megatron_bitwise_cost_pow2.log" 2>&1
      echo "rc=$?"; tail -3 "$out/megatron_bitwise_cost_pow2.log" | cut -c1-600
      NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python3 benchmarks/megatron_bitwise_cost.py --variant fp8 --out "$out/megatron_bitwise_cost_fp32.json" \
        --work /root/megatron_cost_work ${MEGATRON_COST_ARGS:-} > "$out/megatron_bitwise_cost_fp32.log" 2>&1
      echo "rc=$?"; tail -3 "$out/megatron_bitwise_cost_fp32.log" | cut -c1-600 ;;
    megatron-tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_gpu_megatron_bitwise.py tests/test_gpu_megatron_bitwise_tp.py \
        > "$out/pytest_megatron_bitwise.txt" 2>&1
      tail -15 "$out/pytest_megatron_bitwise.txt" ;;
    nemo-rl)  # NeMo RL's pins (.whl/nemo_rl_site.tar.zst, build_stack_site.sh) and its vendored units first on the path
      if [ ! -f /root/nemo_rl_site/transformers/__init__.py ]; then
        kit="${FP8_ALIGN_GPUKIT:-.gpukit}"
        LD_LIBRARY_PATH="$kit/bin" "$kit/bin/zstd" -d -q -c .whl/nemo_rl_site.tar.zst | tar -C /root -xf - || exit 1
      fi
      export PYTHONPATH="/root/nemo_rl_site:$PWD/tests/third_party/nemo_rl_dtensor:$PYTHONPATH"
      python3 -c "import ray" 2>/dev/null || { echo "nemo-rl: NeMo RL's modules import ray; stage the bundle built with it (build_gpukit.sh 0.25.1 .gpukit25 ray==2.60.0)"; exit 1; } ;;
    megatron* | nemo-rl-megatron)
      if [ "$stage" = megatron-steps ]; then name=megatron_steps; cmd=(benchmarks/stack_bitwise.py --stack megatron ${MEGATRON_STEPS_ARGS:-} --work /root/megatron_steps_work)
      elif [ "$stage" = nemo-rl-megatron ]; then name=nemo_rl_megatron_bitwise
        python3 -m pytest -q -p no:cacheprovider -p no:xdist -o addopts= -rfEs tests/nemo_rl_megatron_checks.py > "$out/pytest_nemo_rl_megatron.txt" 2>&1
        tail -3 "$out/pytest_nemo_rl_megatron.txt"
        cmd=(benchmarks/on_policy_bitwise.py --scorer nemo_rl_megatron ${MEGATRON_ARGS:-} --work /root/megatron_work)
      else models="${stage#megatron}"; models="${models#=}"; name=megatron_bitwise
        cmd=(benchmarks/on_policy_bitwise.py --scorer megatron ${models:+--models "$models"} ${MEGATRON_ARGS:-} --work /root/megatron_work); fi
      python3 "${cmd[@]}" --out "$out/$name.json" > "$out/$name.log" 2>&1
      echo "rc=$?"; tail -30 "$out/$name.log"
      tail -c 20000 /root/megatron_*work/*.log > "$out/${name}_engine_logs.txt" 2>/dev/null ;;
    bg)
      bg=/root/bitwise_bg; shift_to=$(( $(printf '%s\n' "$@" | grep -nx bg | head -1 | cut -d: -f1) ))
      rm -rf "$bg" && mkdir -p "$bg/out" && cp -a . "$bg/repo" || exit 1
      # shellcheck disable=SC2016
      setsid nohup bash -c 'cd "$0/repo" && PYTHONPATH="$PYTHONPATH" OUT="$0/out" bash benchmarks/box/bitwise_box_run.sh "$@" > "$0/log" 2>&1; echo $? > "$0/rc"' \
        "$bg" "${@:$((shift_to + 1))}" < /dev/null > /dev/null 2>&1 &
      echo "detached into $bg: ${*:$((shift_to + 1))}"; break ;;
    wait*)
      bg=/root/bitwise_bg; limit="${stage#wait}"; limit="${limit#=}"
      for ((waited = 0; waited < ${limit:-540}; waited += 10)); do [ -f "$bg/rc" ] && break; sleep 10; done
      echo "$bg rc=$(cat "$bg/rc" 2>/dev/null || echo running)"; tail -25 "$bg/log"
      cp -r "$bg/out/." "$out/" 2>/dev/null; true ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
