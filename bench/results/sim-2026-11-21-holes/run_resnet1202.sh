#!/bin/bash
# ResNet-1202 as in ../sim-2026-11-21-resnet1202/run.sh (same ratios, policies and --verify), with
# PyTorch's segment sizes and with expandable segments, written here.
# Usage: run_resnet1202.sh SRC  (SRC: a clean export with spillway-evict-sim built in SRC/build)
set -eu
R=$(cd "$(dirname "$0")" && pwd)
OUT=$R bash "$R/../sim-2026-11-21-resnet1202/run.sh" "$1"
OUT=$R NAME=resnet1202-expandable EXTRA=--expandable bash "$R/../sim-2026-11-21-resnet1202/run.sh" "$1"
