"""Beyond one device: tensor parallelism over torch.distributed, data-parallel Ray replicas."""
