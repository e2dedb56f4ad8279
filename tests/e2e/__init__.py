"""End-to-end tests against real vLLM CPU servers (see tests/e2e/vllm_servers.py and scripts/install-vllm.sh)."""
