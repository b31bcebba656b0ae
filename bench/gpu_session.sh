#!/usr/bin/env bash
# Issue 34's runs on a lent GPU machine, one command on that machine, over a working tree
# that carries .gpu/ (bench/gpu_carry.sh: ft and the gpu tests built here). Puts the binaries
# where the tests' compiled-in paths expect them, points their LibTorch run path at the machine's
# own torch 2.11 (cu130), then, each phase under a time limit, its log in $OUT:
#   1. gpu_test.log, ranks_*.log: the gpu test (collectives, the fused CUDA kernels against the
#      unfused ops, offload bit for bit, SIGKILL resume, ft doctor) beside the multi-rank gpu test
#      (test_cuda_gpu_ranks: NCCL ranks on one GPU, every strategy against one rank), in parallel
#   2. speed.log: bench/gpu_speed.sh full-1b with the fused kernels off (train.fused_rms_norm,
#      fused_swiglu, fused_rope false; against transformers) and on (ft's default; against
#      transformers + torch.compile)
#   3. doctor.log: ft doctor at 2 "nodes" on the GPU
#   kernels: the fused CUDA kernels against the unfused ops alone, MoE's experts as the grouped
#   GEMM against one product per expert (and both timed), NF4 dequantization against
#   the host's bits, and ft eval on the GPU against the CPU's loss (the gpu test's checks);
#   offload: the offload checks alone (both gpu tests); profile: ft's full-1b step profiled
#   (fused kernels off and on) and without the chunked loss (profile.log); moe: expert
#   parallelism over NCCL (test_cuda_gpu_ranks moe: EP 2 across 2 "nodes" and inside one, zero3
#   and fsdp, full and LoRA on the experts; bf16 with the grouped GEMM); lora: bench/gpu_speed.sh lora-8b (ft against
#   transformers + PEFT), then the reference alone under torch.compile (lora.log);
#   offload-speed: issue 32's figure, full-1b against offload-1b (zero3 offload_optimizer) with
#   the overlapped host update (strategy.overlap_host_step, the default) and without it, with
#   clipping off (the update during the backward) and with the delayed update, ft plan's
#   prediction of the host's part on this machine, then offload-1b profiled (offload_speed.log)
#   bench/gpu_session.sh [PHASE...]     phases: tests speed doctor kernels offload offload-speed
#                                       profile moe lora (default: tests speed doctor)
set -uo pipefail
out=${OUT:?OUT must name the folder whose files come back}
phases=("$@")
((${#phases[@]})) || phases=(tests speed doctor)
t0=$(date +%s)
say() { echo "== +$(($(date +%s) - t0))s $*"; }
here=$PWD
[[ -f .gpu/pack.tar.xz ]] || { echo "gpu_session: no .gpu/ here (bench/gpu_carry.sh, and carry it)" >&2; exit 1; }
tar -C .gpu -xJf .gpu/pack.tar.xz ||
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .gpu/pack.tar.xz .gpu || exit 1
site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
want=$(cat .gpu/site-packages)
mkdir -p "$(dirname "$want")"
[[ -e $want ]] || ln -s "$site" "$want"
if [[ $here != /work/main ]]; then
  mkdir -p /work
  [[ -e /work/main ]] || ln -s "$here" /work/main
fi
mkdir -p build/bin build/lib
cp .gpu/bin/* build/bin/
cp .gpu/lib/libft_cuda.so build/lib/
export LD_LIBRARY_PATH=$here/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FT_PYTHON=python3 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
say "built from $(head -1 .gpu/commit); working tree at $here"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", torch.cuda.nccl.version())'
nproc --all
build/bin/ft --version || { echo "gpu_session: the carried ft does not run here" >&2; exit 1; }

has() { [[ " ${phases[*]} " == *" $1 "* ]]; }
if has tests; then
  say "phase tests: the gpu test beside test_cuda_gpu_ranks (two streams)"
  timeout 300 build/bin/test_cuda_gpu > "$out/gpu_test.log" 2>&1 &
  p1=$!
  timeout 300 build/bin/test_cuda_gpu_ranks fp32 > "$out/ranks_fp32.log" 2>&1 &
  p2=$!
  timeout 300 build/bin/test_cuda_gpu_ranks offload lora bf16 resume > "$out/ranks_rest.log" 2>&1 &
  p3=$!
  wait $p1; r1=$?
  wait $p2; r2=$?
  wait $p3; r3=$?
  say "gpu test exit $r1; ranks fp32 exit $r2; ranks offload/lora/bf16/resume exit $r3"
  grep -h -E '^(FAIL|SKIP|note|all checks|[0-9]+ check)' "$out/gpu_test.log" "$out"/ranks_*.log
fi
if has moe; then
  say "phase moe: expert parallelism over NCCL"
  timeout 240 build/bin/test_cuda_gpu_ranks moe > "$out/ranks_moe.log" 2>&1
  say "ranks moe exit $?"
  grep -E '^(ok|FAIL|SKIP|all checks|[0-9]+ check)' "$out/ranks_moe.log"
fi
if has lora; then
  say "phase lora: lora-8b, ft against transformers + PEFT (eager)"
  OUT_DIR=/tmp/lora timeout 200 env -u OMP_NUM_THREADS bash bench/gpu_speed.sh build lora-8b > "$out/lora.log" 2>&1
  say "lora exit $?; phase lora: the reference alone under torch.compile"
  timeout 400 env -u OMP_NUM_THREADS python3 bench/gpu_speed_ref.py --mode lora --hidden 4096 \
    --inter 14336 --layers 32 --tie 0 --batch 1 --seq 4096 --steps 10 --warmup 3 --compile \
    >> "$out/lora.log" 2>"$out/lora-compile.err" || tail -n 20 "$out/lora-compile.err"
  say "lora compile exit $?"
  grep -E -A4 '^case |"impl"' "$out/lora.log"
fi
if has kernels; then
  say "phase kernels: the fused CUDA kernels against the unfused ops, MoE's grouped GEMM, NF4 against the host, ft eval"
  timeout 180 build/bin/test_cuda_gpu kernels grouped nf4 eval > "$out/kernels.log" 2>&1
  grep -E '^(ok|FAIL|time|all checks|[0-9]+ check)' "$out/kernels.log"
fi
if has offload; then
  say "phase offload: the offload checks of both gpu tests"
  timeout 150 build/bin/test_cuda_gpu offload > "$out/gpu_test.log" 2>&1 &
  timeout 150 build/bin/test_cuda_gpu_ranks offload > "$out/ranks_offload.log" 2>&1 &
  wait
  grep -h -E '^(ok|FAIL|SKIP|note|all checks|[0-9]+ check|     median)' "$out/gpu_test.log" "$out/ranks_offload.log"
fi
if has offload-speed; then
  say "phase offload-speed: full-1b, offload-1b overlapped (default), offload-1b not overlapped"
  nproc; grep -m1 'model name' /proc/cpuinfo
  BENCH_REF=0 BENCH_STEPS=4 BENCH_WARMUP=2 OUT_DIR=/tmp/off-on timeout 200 env -u OMP_NUM_THREADS \
    bash bench/gpu_speed.sh build full-1b offload-1b > "$out/offload_speed.log" 2>&1
  say "offload-speed (overlap on) exit $?"
  FT_SETS=strategy.overlap_host_step=false BENCH_REF=0 BENCH_STEPS=4 BENCH_WARMUP=2 \
    OUT_DIR=/tmp/off-off timeout 150 env -u OMP_NUM_THREADS \
    bash bench/gpu_speed.sh build offload-1b >> "$out/offload_speed.log" 2>&1
  say "offload-speed (overlap off) exit $?"
  FT_SETS=train.grad_clip=0 BENCH_REF=0 BENCH_STEPS=4 BENCH_WARMUP=2 \
    OUT_DIR=/tmp/off-noclip timeout 120 env -u OMP_NUM_THREADS \
    bash bench/gpu_speed.sh build offload-1b >> "$out/offload_speed.log" 2>&1
  say "offload-speed (clipping off: the update during the backward) exit $?"
  FT_SETS=strategy.zero3.delayed_update=true BENCH_REF=0 BENCH_STEPS=4 BENCH_WARMUP=2 \
    OUT_DIR=/tmp/off-delay timeout 100 env -u OMP_NUM_THREADS \
    bash bench/gpu_speed.sh build offload-1b >> "$out/offload_speed.log" 2>&1
  say "offload-speed (delayed update: the host step beside the next step's forward and backward) exit $?"
  # What ft plan predicted for the host's part on this machine (its cores, its measured memory
  # bandwidth), beside what the runs measured.
  python3 -c 'import json, sys; p = json.load(open(sys.argv[1]))["offload_step"]
print("plan: host part", round(p["seconds"], 3), "s"); [print("  ", i["key"], i["from"]) for i in p["items"]]' \
    /tmp/off-on/offload-1b-plan.json || true
  for d in /tmp/off-on/offload-1b-ft /tmp/off-off/offload-1b-ft /tmp/off-noclip/offload-1b-ft \
           /tmp/off-delay/offload-1b-ft; do
    echo "$d: time.overlapped_update per step"
    grep -o '"overlapped_update":{[^}]*}' "$d/metrics.jsonl" | tail -n 3
    grep -o '"grad_norm":{[^}]*}' "$d/metrics.jsonl" | tail -n 2
    grep -o '"time":{[^}]*}' "$d/metrics.jsonl" | tail -n 2
  done
  BENCH_PROFILE=1 BENCH_REF=0 BENCH_STEPS=1 BENCH_WARMUP=3 OUT_DIR=/tmp/off-prof timeout 150 \
    env -u OMP_NUM_THREADS bash bench/gpu_speed.sh build offload-1b >> "$out/offload_speed.log" 2>&1
  say "offload-speed profile exit $?"
  head -c 200000 /tmp/off-prof/offload-1b-ft/profile.txt > "$out/offload_profile.txt" 2>/dev/null
  grep -E -A3 '^case ' "$out/offload_speed.log"
fi
if has profile; then
  for v in "profile:BENCH_PROFILE=2" "no-chunked-loss:FT_SETS=train.fused_loss=false" \
           "unfused-kernels:FT_SETS=train.fused_rms_norm=false,train.fused_swiglu=false,train.fused_rope=false"; do
    say "phase profile: full-1b, ft only, ${v%%:*}"
    env ${v#*:} BENCH_REF=0 OUT_DIR=/tmp/prof-${v%%:*} timeout 100 env -u OMP_NUM_THREADS \
      bash bench/gpu_speed.sh build full-1b >> "$out/profile.log" 2>&1
  done
  grep -E -A2 '^case ' "$out/profile.log"
fi
if has speed; then
  say "phase speed: full-1b, fused kernels off, transformers eager"
  FT_SETS="train.fused_rms_norm=false train.fused_swiglu=false train.fused_rope=false" \
    OUT_DIR=/tmp/speed-off timeout 120 env -u OMP_NUM_THREADS bash bench/gpu_speed.sh build full-1b > "$out/speed.log" 2>&1
  say "phase speed: full-1b, fused kernels on (the default), transformers + torch.compile"
  REF_COMPILE=1 OUT_DIR=/tmp/speed-on timeout 160 \
    env -u OMP_NUM_THREADS bash bench/gpu_speed.sh build full-1b >> "$out/speed.log" 2>&1
  grep -E -A4 '^case ' "$out/speed.log"
fi
if has doctor; then
  say "phase doctor: 2 nodes on one GPU"
  port=29611
  for n in 0 1; do
    CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID=doctor-node$n NCCL_NET=Socket NCCL_SOCKET_IFNAME='=lo' \
      NCCL_IB_DISABLE=1 timeout 120 build/bin/ft launch --nnodes 2 --node-rank $n \
      --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $port --max-restarts 0 -- \
      build/bin/ft doctor --preset tiny-demo --set hardware.device=cuda --set precision.mode=bf16 \
      --max-size 64MiB --json /tmp/doctor.json > "$out/doctor$n.log" 2>&1 &
  done
  wait
  cat "$out/doctor1.log" >> "$out/doctor0.log" && rm "$out/doctor1.log"
  tail -n 40 "$out/doctor0.log"
fi
say "done"
