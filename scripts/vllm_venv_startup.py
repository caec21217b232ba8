"""Start-up hook for the vLLM venv (.venv-vllm), installed by `scripts/setup.sh --vllm` as a .pth import.

Placeholder: replaced below once vLLM is installed and inspected.
"""
