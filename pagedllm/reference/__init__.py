"""The reference room: torch implementations of every op of the contract's op table (ops.py,
moe.py, quant.py) and of paged attention with the standard cache layout (attention.py).

Any backend may use them (as defaults, as fallbacks, or as the parts it does not replace), and
the conformance suite compares every backend with them. They import only the contract and torch.
"""
