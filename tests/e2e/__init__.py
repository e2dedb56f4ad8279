"""End-to-end tests against real vLLM CPU servers (see fleet/vllm.py and scripts/install-vllm.sh)."""
