"""The CPU backend: oneDNN and numpy kernels, the host forward pass of a step, the packed-weight
cache, the fast BLAS under MLX and the compute threads. Imports no MLX at import time (the CLI
imports fast_blas before MLX loads)."""
