"""Engines kvguard drives over HTTP: ``llama_server`` (a llama-server it starts, or one at a URL;
``process`` starts and talks to it) and ``openai`` (any OpenAI-compatible server at a URL)."""
