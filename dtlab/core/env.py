"""DistInfo: who this process is in the job, and the init/cleanup pair.

One code path serves world size 1 and N (as in nanoGPT): a rank always has a
process group, even alone, so tiers never branch on "am I distributed?".
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def resolve_backend(backend: str, device: str) -> tuple[str, str]:
    """Map ``auto`` to nccl+cuda when CUDA is usable, else gloo+cpu."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("RunConfig.device='cuda' is invalid on this machine: torch sees no CUDA device; "
                         "use 'cpu' or 'auto'")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("RunConfig.backend='nccl' is invalid on this machine: it needs a CUDA device and torch "
                         "sees none; use 'gloo' or 'auto'")
    return backend, "cuda" if use_cuda else "cpu"


@dataclass(frozen=True)
class DistInfo:
    """The identity of one rank. Built by ``init`` inside the rank process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // max(1, self.local_world_size)

    @property
    def host(self) -> str:
        return socket.gethostname()

    @classmethod
    def init(
        cls,
        backend: str = "auto",
        device: str = "auto",
        timeout_s: float = 60.0,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> DistInfo:
        """Initialise the default process group of *this process*.

        With ``store`` given (dtlab's launcher) rank and world size are explicit;
        otherwise they come from torchrun's environment (RANK, WORLD_SIZE, ...).
        """
        backend, device_type = resolve_backend(backend, device)
        if rank is None:
            rank = int(os.environ["RANK"])
            world_size = int(os.environ["WORLD_SIZE"])
        assert world_size is not None
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        kwargs: dict[str, Any] = dict(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        if store is not None:
            kwargs["store"] = store
        if device_type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
        return cls(rank, local_rank, world_size, local_world, backend, dev)

    @staticmethod
    def cleanup() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def environment_report() -> dict[str, Any]:
    """What this machine offers for distributed training (for notebook 00)."""
    import platform

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu cores": os.cpu_count(),
        "CUDA available": cuda,
        "CUDA devices": torch.cuda.device_count() if cuda else 0,
        "gloo backend": dist.is_gloo_available(),
        "nccl backend": dist.is_nccl_available() and cuda,
        "mpi backend": dist.is_mpi_available(),
        "default backend": resolve_backend("auto", "auto")[0],
        "torch.distributed.rpc": dist.rpc.is_available() if hasattr(dist, "rpc") else False,
    }
