"""The seed's gloo demo: every worker joins the group, all-reduces a one, and meets at a barrier.

aelastic run --standalone --nproc-per-node 2 examples/allreduce.py
"""

import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo", init_method="env://")
rank = dist.get_rank()
world_size = dist.get_world_size()
print(f"rank {rank} world_size {world_size}")
a = torch.tensor([1])
dist.all_reduce(a)
print(f"rank {rank} world_size {world_size} {a}")
assert a.item() == world_size, f"all_reduce gave {a.item()}, expected {world_size}"
dist.barrier()
print(f"rank {rank} world_size {world_size}")
dist.destroy_process_group()
