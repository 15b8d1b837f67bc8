"""`chainspec serve`: the whole stack (Ray controller, verifiers, drafters) plus the HTTP
gateway, as one command; also what `python -m chainspec.demo` runs."""
