"""Test helpers and the backend conformance suite.

    pytest --pyargs pagedllm.testing --device NAME

runs every ``test_*.py`` module here against one registered backend (built-in or an installed
plugin): the contract, cache write/copy/swap, paged attention against a float64 reference,
model ops, sampling, bucketing for static-shape backends, and greedy equality with Hugging Face
transformers end to end. ``plugin.py`` (a pytest11 plugin) supplies ``--device``, skips checks
for capabilities the backend does not declare, and prints what the run covered. See
docs/porting.md.
"""
