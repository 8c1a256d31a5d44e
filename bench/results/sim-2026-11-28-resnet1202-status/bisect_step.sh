#!/bin/bash
# usage: bis.sh COMMIT -> prints budget and times for resnet1202 0.225 predicted fixed
set -e
C=$1; W=/tmp/bis-$C
cd /work/main
[ -d $W ] || git worktree add -q $W $C
cmake -S $W -B $W/build -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF -DSPILLWAY_WITH_CUDA=OFF > /dev/null 2>&1
cmake --build $W/build --target spillway_evict_sim -j2 > /tmp/bis-$C.log 2>&1
$W/build/bench/spillway-evict-sim --trace bench/op_traces/torch-resnet1202-cpu.optrace.gz --budgets 0.225 --policies dtr,dtr-frag --modes drop --warmup-steps 1 2>&1 | grep -E "^(dtr|dtr-frag)/drop|baseline" | awk -v c=$C '{print c, $0}'
