"""Benchmarks of batchmlx's engine against simple mode and mlx-lm's batch_generate."""
