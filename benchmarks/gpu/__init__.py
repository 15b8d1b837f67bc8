"""The sections of `benchmarks/gpu_check.py`: timing helpers, the report, and one module per
group of timed sections (engine steps, attention, small kernels)."""
