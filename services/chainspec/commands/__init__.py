"""CLI subcommand implementations (thin: parse, delegate, print)."""
