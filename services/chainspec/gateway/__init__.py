"""The OpenAI-compatible HTTP gateway in front of the verifiers (DESIGN 4.5)."""
