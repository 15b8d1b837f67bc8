"""chainspec: chained MTP speculative decoding, split into drafter and verifier services."""
