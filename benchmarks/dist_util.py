"""What the 2-process checks (ddp_check.py, fsdp2_check.py) share: a free port for the process
group, and a rank's set-up (its device and its process group: NCCL on cuda:rank, or gloo on CPU).
"""
from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, cpu: bool) -> torch.device:
    """Join the process group on 127.0.0.1:``port`` as ``rank`` of ``world`` and return the
    rank's device (cuda:rank with NCCL; with ``cpu``, the CPU with gloo)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    return device
