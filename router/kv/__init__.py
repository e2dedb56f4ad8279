"""The cache as the replicas report it: vLLM's KV events (events, wire) and the prompt's tokens (prompt_tokens)."""
