"""CPU kernels where MLX's own are slow: attention (MLX tiles, numpy on the host), elementwise."""
