"""Training of the demo model: corpus, tokenizer, joint target + MTP training, export to
a Hugging Face folder, and held-out acceptance measurement.

`python -m chainspec.training.trainer --out DIR` (or `chainspec train-demo`) runs it all.
"""
