#!/usr/bin/env bash
# Train with a TOML job file; overrides are forwarded: ./run_train.sh --training.steps=10
# CONFIG_FILE picks the job file (default: the repository's CPU tiny model on AlphabetSort).
# Runs in the folder you call it from: relative paths (CONFIG_FILE, job.output_dir,
# model.hf_checkpoint, loss.kl_reference) resolve there, and modules there can be imported
# (env.name = "my_envs.arith:Arith").
set -euo pipefail
repo="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$repo:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python -m torchtitan_rl.train "$@"
