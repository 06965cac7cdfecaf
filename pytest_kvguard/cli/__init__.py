"""Command-line tools: kvguard-capacity, kvguard-compare, kvguard-scenarios / kvguard-docs and
kvguard-build-llama-server (kvguard-env lives with the environments it builds)."""
