"""Data parallelism across processes: the engines that sum the gradient buckets between the two graphs.

``TrainingSession(..., data_parallel=True)`` picks an engine from the launcher's environment:

- ``torch``: ``torch.distributed`` (``pip install "onnxgrad[torch]"``), gloo on CPU and NCCL on CUDA; the
  default process group when the script made one, else one initialised from the environment ``torchrun``
  sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; multi-node rendezvous is torchrun's);
- ``mpi``: ``mpi4py`` (``pip install "onnxgrad[mpi]"``: mpi4py and the ``mpich`` wheel), ``COMM_WORLD`` of a
  program started with ``mpiexec -n N``; CPU tensors only.

An engine works in place on the session's OrtValues: torch reads them through DLPack, MPI through the
numpy view onnxruntime gives of a CPU OrtValue (no copy in either). The core never imports torch or
mpi4py: an engine imports its library when it is chosen.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import sys
from typing import Any, Sequence

from ..errors import OnnxGradError

__all__ = ["DataParallelError", "Engine", "engine"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")

_HOW = ("launch the script with `torchrun --nproc-per-node N script.py` (pip install \"onnxgrad[torch]\"), "
        "with `mpiexec -n N python script.py` (pip install \"onnxgrad[mpi]\"), or call "
        "torch.distributed.init_process_group() before building the session")


class DataParallelError(OnnxGradError):
    """Data parallelism cannot start: no engine installed, no launcher, or an engine that does not fit."""


class Engine:
    """What a data-parallel session needs from a communication library, on OrtValues in place.

    ``rank``, ``world_size``, ``local_rank`` (this worker's index on its machine, its GPU),
    ``local_world_size`` (workers on this machine).
    """

    name = "engine"
    rank = 0
    world_size = 1
    local_rank = 0
    local_world_size = 1

    def all_reduce(self, values: Sequence[Any], average: bool = False) -> None:
        """Replace every value by its sum (``average``: its mean) over the workers."""
        raise NotImplementedError

    def broadcast(self, values: Sequence[Any], src: int = 0) -> None:
        """Replace every value by worker ``src``'s."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Return when every worker has called it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} of {self.world_size})"


class TorchEngine(Engine):
    """``torch.distributed``'s default process group; gloo (CPU) or NCCL (CUDA) when initialised here."""

    name = "torch"

    def __init__(self, device: str = "cpu"):
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise DataParallelError("data_parallel with torch.distributed needs PyTorch: "
                                    "pip install \"onnxgrad[torch]\"; or " + _HOW) from None
        if not dist.is_available():
            raise DataParallelError("this PyTorch build has no torch.distributed; " + _HOW)
        self._torch, self._dist = torch, dist
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not dist.is_initialized():
            missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
            if missing:
                raise DataParallelError(f"data_parallel: no torch.distributed process group and no launcher "
                                        f"environment ({', '.join(missing)} not set); " + _HOW)
            backend = "nccl" if device == "cuda" else "gloo"
            if device == "cuda":
                torch.cuda.set_device(self.local_rank)
            dist.init_process_group(backend)
            atexit.register(_destroy, dist)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()

    def _tensors(self, values: Sequence[Any]) -> list[Any]:
        return [self._torch.from_dlpack(v) for v in values]      # views: the reduction writes the OrtValue

    def all_reduce(self, values: Sequence[Any], average: bool = False) -> None:
        for t in self._tensors(values):
            self._dist.all_reduce(t)
            if average:
                t.div_(self.world_size)

    def broadcast(self, values: Sequence[Any], src: int = 0) -> None:
        for t in self._tensors(values):
            self._dist.broadcast(t, src)

    def barrier(self) -> None:
        self._dist.barrier()


def _destroy(dist: Any) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class MPIEngine(Engine):
    """mpi4py's ``COMM_WORLD`` (the program was started with ``mpiexec``); CPU tensors only."""

    name = "mpi"

    def __init__(self, device: str = "cpu"):
        if device != "cpu":
            raise DataParallelError("data_parallel='mpi' reduces tensors in host memory; on CUDA use "
                                    "torch.distributed (NCCL): launch with torchrun")
        try:
            from mpi4py import MPI
        except ImportError:
            raise DataParallelError("data_parallel with MPI needs mpi4py and an MPI library: "
                                    "pip install \"onnxgrad[mpi]\"; or " + _HOW) from None
        self._mpi, self._comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_world_size = local.Get_rank(), local.Get_size()
        local.Free()

    def _each(self, values: Sequence[Any], fn) -> None:
        for v in values:
            arr = v.numpy()          # a view of a CPU OrtValue's memory (onnxruntime >= 1.16)
            fn(arr)
            if arr.size and arr.__array_interface__["data"][0] != v.data_ptr():
                v.update_inplace(arr)         # an onnxruntime that copied: write the result back

    def all_reduce(self, values: Sequence[Any], average: bool = False) -> None:
        def reduce(arr):
            self._comm.Allreduce(self._mpi.IN_PLACE, arr, op=self._mpi.SUM)
            if average:
                arr /= self.world_size
        self._each(values, reduce)

    def broadcast(self, values: Sequence[Any], src: int = 0) -> None:
        self._each(values, lambda arr: self._comm.Bcast(arr, root=src))

    def barrier(self) -> None:
        self._comm.Barrier()


ENGINES = {"torch": TorchEngine, "mpi": MPIEngine}


def engine(choice: "bool | str | Engine", device: str = "cpu") -> Engine:
    """The engine ``data_parallel=choice`` asks for: an :class:`Engine` as it is, ``"torch"``, ``"mpi"``, or
    ``True``: torch when a process group exists or torchrun's environment is set, MPI under ``mpiexec``."""
    if isinstance(choice, Engine):
        return choice
    if isinstance(choice, str):
        if choice not in ENGINES:
            raise DataParallelError(f"data_parallel must be True, 'torch' or 'mpi', got {choice!r}")
        return ENGINES[choice](device)
    if choice is not True:
        raise DataParallelError(f"data_parallel must be True, 'torch' or 'mpi', got {choice!r}")
    if _torch_group() or all(k in os.environ for k in _TORCHRUN_ENV):
        return TorchEngine(device)
    if any(k in os.environ for k in _MPI_ENV):
        return MPIEngine(device)
    have = [n for n in ("torch", "mpi4py") if importlib.util.find_spec(n) is not None]
    raise DataParallelError("data_parallel=True: this process was not started by a launcher (no torchrun or "
                            "mpiexec environment) and no torch.distributed process group exists "
                            f"(installed: {', '.join(have) or 'neither torch nor mpi4py'}); " + _HOW)


def _torch_group() -> bool:
    """A torch.distributed default process group exists (without importing torch when the script did not)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized())
