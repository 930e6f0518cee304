"""Tensor parallelism over torch.distributed: process groups, sharded shapes, worker ranks, the step channel."""
