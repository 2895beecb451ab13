#!/usr/bin/env bash
# Issue 34's GPU measurements as one command for a session lent a GPU (the device tool:
# one call, 15 minutes of device time in all, 10 per command). Run from the repo root:
#
#   bash benchmarks/gpu_battery.sh [PLACEMENT] [OUT]
#
# PLACEMENT: flexshard's placement in the fake-world runs, shard (Shard(0), the default),
# ragged (RaggedShard), owned (Owned), mixed or shard1 (Shard(1) matrices); FSDP2 stays
# Shard(0). OUT: where results go (default runs/gpu). The log ends with the engine rows of every mode: the GPU time in
# copy-family ops outside collective ops, and per labelled region (all of it, and the
# engine's: the fake backend's writes under collective ops set apart), both sides.
#
# Each step has its own time limit, so a slow step costs its limit and the rest still
# run; the whole battery ends within about 9 minutes. Results (at most 8 files, as the device tool
# brings back at most 8): OUT/battery.log (every step's output, then a summary line per
# step), each fake-world mode's JSON report as OUT/<mode>.json and the one-rank run's as
# OUT/one-rank.json. A CPU smoke run:
#   FAKE_ARGS="--device cpu --preset tiny" MODES=eager bash benchmarks/gpu_battery.sh shard /tmp/b
# torchao's
# wheel (the float8 modes) is installed from .whl/ when that folder holds it; without it
# the float8 step fails fast and says so. Order: what is cheapest and most asked first.
set -u
placement=shard
case ${1:-} in shard|ragged|owned|mixed|shard1) placement=$1; shift ;; esac
out=${1:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU')" | tee "$out/battery.log"
echo "flexshard placement: $placement (FSDP2: Shard(0))" | tee -a "$out/battery.log"

log=$out/battery.log
summary=()
step() {  # step NAME SECONDS COMMAND...: run with a limit into the log, note how it ended
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "===== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  summary+=("$name: exit $rc after $((SECONDS - start)) s (limit $limit s)")
  echo "${summary[-1]}"
}

fake() {  # fake MODE SECONDS: one fake-world mode, its JSON report kept as OUT/MODE.json
  rm -rf "runs/fake-world-$1"
  # shellcheck disable=SC2086  # FAKE_ARGS is a list of words
  step "fake-$1" "$2" python3 -m benchmarks.gpu --fake-world 8 --modes "$1" \
    --steps 6 --warmup 2 --placement "$placement" --out "runs/fake-world-$1" ${FAKE_ARGS:-}
  cp "runs/fake-world-$1"/*.json "$out/$1.json" 2>/dev/null
}

step cuda-tests 160 python3 -m pytest -q -rs tests/test_cuda.py
# the engine's bulk copies each way torch offers (_foreach_copy_, copy_, _chunk_cat)
step copy-kernels 30 python3 -m benchmarks.copy_kernels
# whole-compile: fs.compile's whole step against FSDP2's compiled blocks (issue 46);
# int8-gather: the fused kernels' tables made once per layout (the H200 read 1.41x
# bf16's step before); cudagraph, the float8 modes and fp8-gather did not change since
# their last H200 run: name them in MODES to rerun (float8-whole took 120 s there)
declare -A limits=([eager]=45 [compile]=60 [whole-compile]=100 [int8-gather]=40
                   [cudagraph]=100 [float8-whole]=150)
for mode in ${MODES:-eager compile whole-compile int8-gather}; do
  fake "$mode" "${limits[$mode]:-120}"
done
# issue 46's one-rank target: the 1.2 B Llama, the plain model and flexshard's step each
# compiled whole (FSDP2 its blocks), tokens/s; its JSON report as OUT/one-rank.json
step one-rank 100 python3 -m benchmarks.gpu --steps 6 --warmup 2 --compile whole \
  --json "$out/one-rank.json"
# (the int8 gathers with the fused kernels off: FLEXSHARD_FUSED_QUANT=0 MODES=int8-gather)
# the engine rows of every mode (its heading, the engine measures, the per-label times, targets)
engine=$(grep -E '^### mode|\(engine\)|\(the model|^\| (label|FlexShard::|FSDP::|fsdp::)|^target .*engine' "$log")
printf '%s\n' "===== engine rows" "$engine" | tee -a "$log"
printf '%s\n' "===== summary" "${summary[@]}" "battery done in $SECONDS s" >>"$log"
