"""Scenarios: what a check does with an engine. They call the Engine protocol only."""
