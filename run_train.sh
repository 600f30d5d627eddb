#!/usr/bin/env bash
# Train with a TOML config; overrides are forwarded: ./run_train.sh --training.steps=10
# CONFIG_FILE picks the config (default: the CPU tiny model on AlphabetSort).
set -euo pipefail
cd "$(dirname "$0")"
export CONFIG_FILE=${CONFIG_FILE:-train_configs/alphabet_sort_tiny.toml}
exec python -m torchtitan_rl.train "$@"
