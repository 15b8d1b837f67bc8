"""The speculative engine: drafter, verifier, acceptance. Transport-agnostic."""
