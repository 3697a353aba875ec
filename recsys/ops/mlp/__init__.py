"""The fused linear layer of the MLPs (``fused_linear.py``: matmul + bias + activation +
dropout) and its activations (``activations.py``)."""
