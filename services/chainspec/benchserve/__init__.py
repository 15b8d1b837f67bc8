"""`chainspec bench serve`: a load generator against any OpenAI-compatible endpoint, with
speculation figures from a chainspec stack's metrics (docs/design.md, "Serving benchmark")."""
