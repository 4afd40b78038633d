"""Tensor parallelism on one or several hosts: one process per rank, torch.distributed's gloo backend
(docs/tensor_parallel.md)."""
