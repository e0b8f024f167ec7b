"""pagedllm-toyaccel: an example out-of-tree pagedllm backend (see backend.py).

Importing this package imports nothing heavy; pagedllm loads ``backend.ToyAccelBackend`` through
the ``pagedllm.backends`` entry point, and the attention and worker modules only when chosen.
"""
__version__ = "0.2.0"
