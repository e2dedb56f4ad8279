"""A real serving fleet: vLLM servers and the tools that drive them (shared by the CLI and the tests)."""
