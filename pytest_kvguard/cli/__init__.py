"""Command-line tools behind one ``kvguard SUBCOMMAND`` (``cli/main.py``): capacity, compare,
scenarios / docs, model-facts, quantize, bisect, saved-cache and build-llama-server (env lives
with the environments it builds). The old ``kvguard-SUBCOMMAND`` scripts are aliases."""
