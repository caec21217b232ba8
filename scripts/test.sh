#!/usr/bin/env bash
# Sets up .venv (with the test tools), checks formatting and lint (ruff), and runs the test suite.
#   bash scripts/test.sh           # the default suite (everything not marked slow)
#   bash scripts/test.sh --slow    # only the slow tests (learning proofs with distributed strategies, ...; .ci/run runs them)
#   bash scripts/test.sh --vllm    # only the tests marked vllm, in .venv-vllm (built by setup.sh --vllm)
#   bash scripts/test.sh -- ARGS   # extra pytest arguments
# The default and slow suites run on two test workers (pytest-xdist; the tests use one torch thread each, torchrun
# tests are kept to one worker: tests/conftest.py); VLRFT_TEST_WORKERS=N sets their number, 0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# the formatter and the linter first (pyproject.toml [tool.ruff]): a tree that is not formatted fails fast
.venv/bin/ruff format --check --quiet . || { echo "ruff format: files above are not formatted (run .venv/bin/ruff format .)" >&2; exit 1; }
.venv/bin/ruff check --quiet .
marker="not slow"
py=.venv/bin/python
workers=${VLRFT_TEST_WORKERS:-2}
if [ "${1:-}" = "--slow" ]; then marker="slow and not vllm"; shift; fi
if [ "${1:-}" = "--vllm" ]; then
  marker="vllm"
  py=.venv-vllm/bin/python
  workers=${VLRFT_TEST_WORKERS:-0}  # vLLM's engines: one at a time (not measured with two workers)
  shift
  bash scripts/setup.sh --vllm
fi
[ "${1:-}" = "--" ] && shift
# where this run happens, so that a failure on another machine can be read
"$py" - <<'PY'
import os, platform, sys
import torch, transformers
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "") if os.path.exists("/proc/cpuinfo") else ""
simd = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "no avx2"
print(f"machine: {cpu} ({simd}), {os.cpu_count()} cores, python {platform.python_version()}, "
      f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
PY
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers" --dist loadgroup)
exec "$py" -m pytest -m "$marker" "${parallel[@]}" "$@"
