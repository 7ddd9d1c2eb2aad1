# Source on the GPU box from the repository root, after benchmarks/box/gpu_box_setup.sh:
#   source benchmarks/box/verl_deps_setup.sh
# Installs the wheels verl 0.9.1's FSDP engine module needs beyond .whl/site (built next to it by
# benchmarks/box/build_stack_site.sh: verl_deps.part_NN, each copied to /root/stage by an earlier
# call on this machine) into /root/verl_deps, and puts both on PYTHONPATH, so that
# benchmarks/verl_scorer.py imports (on_policy_bitwise.py --scorer verl; needs the bundle with Ray).
# DEPS_CHECK_MODULE: the module that must import afterwards (default verl's FSDP engine; TRL's
# GRPOTrainer for xqa_box_run.sh's `trl` stage, which needs no Ray).
if [ ! -d /root/verl_deps/datasets ]; then
  rm -rf /root/verl_wheels && mkdir -p /root/verl_wheels || return 1
  cat /root/stage/verl_deps.part_* | tar -C /root/verl_wheels -xf - || return 1
  python3 -m pip install -q --no-index --no-deps --target /root/verl_deps /root/verl_wheels/*.whl || return 1
fi
export PYTHONPATH="/root/verl_deps:$PWD/.whl/site:${PYTHONPATH:-}"
check="${DEPS_CHECK_MODULE:-verl.workers.engine.fsdp.transformer_impl}"
python3 -c "import $check" 2>/dev/null && echo "verl_deps_setup: $check imports" || {
  echo "verl_deps_setup: $check does not import"; python3 -c "import $check" 2>&1 | tail -3; return 1; }
