"""Storage: aligned buffers, async O_DIRECT I/O backends, and stores of named flat tensors."""
