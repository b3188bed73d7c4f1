"""OpenAI-compatible HTTP server for tunix-rt (built on the rollout engine; see DESIGN.md)."""
