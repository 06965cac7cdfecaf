"""What a check reads: bundled and user-supplied models, GGUF headers, texts."""
