"""Sparse attention: block-sparse kernels (`sparse.py`: FlexAttention on the GPU, an exact masked fallback on
the CPU; `fa4.py`: the FlashAttention-4 path) and the connectivity a generation records and a hit reuses
(`connectivity.py`)."""
