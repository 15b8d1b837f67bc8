"""Triton kernels for the hot paths, each beside its torch reference (the CPU path and
the test oracle) behind one dispatch in its public function; see triton_support."""
