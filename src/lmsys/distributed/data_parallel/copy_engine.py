"""All-reduce of DDP buckets through the GPUs' copy engines instead of NCCL's kernels (BucketedDDP's
`copy-engine` lever, GPUs of one host only).

Why: NCCL's all-reduce runs as a kernel that holds SMs for as long as it runs. Beside DDP's backward
on 2xH200 (xl, bf16) each 400 MiB bucket's all-reduce then took 5.2 ms instead of ~1.3 ms alone, and the
backward grew from 82 to 97 ms (docs/benchmarks/ddp.md). Copy engines move bytes over NVLink without
SMs, so the backward's matrix products keep the whole GPU.

How (for every world size, each rank owning chunk `rank` of each bucket): the buckets live in one flat
fp32 buffer in torch's symmetric memory, which maps every rank's buffer into every other rank. When a
bucket is complete, a side stream runs
1. barrier (every rank's bucket is complete),
2. reduce-scatter: pull the other ranks' copies of my chunk (cudaMemcpy from the peer's memory: copy
   engines) and add them to mine (one short elementwise kernel per peer),
3. barrier (every chunk is reduced),
4. all-gather: pull every other rank's reduced chunk into my buffer,
5. barrier (no rank still reads my buffer when the next step writes it).
The gradients are pre-scaled by 1/world before (exact for power-of-two worlds), so the sum is the mean.
Each barrier waits at most the process group's timeout (LMSYS_DIST_TIMEOUT_S), then fails the kernel:
a dead rank ends the job instead of hanging it. What the failed kernel then shows is a CUDA error
("unspecified launch failure", maybe on autograd's thread), not a message about the barrier: a
copy-engine run that dies that way after about LMSYS_DIST_TIMEOUT_S seconds is a barrier timeout.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist

ALIGN_ELEMS = 128  # each rank's chunk of a bucket starts 512-byte aligned


class CopyEngineAllReduce:
    """Flat symmetric-memory buffer for buckets of `sizes` fp32 elements; `bucket(b)` is bucket b's
    buffer (a view, exactly sizes[b] long), `launch(b)` all-reduces it (sum) on a side stream and returns
    a work whose `wait()` makes the current stream wait for it."""

    def __init__(self, sizes: list[int], device: torch.device, *, timeout_s: float):
        import torch.distributed._symmetric_memory as symm_mem

        if torch.device(device).type != "cuda":
            raise ValueError("the copy-engine all-reduce needs CUDA GPUs")
        # copies only: never let the rendezvous create an NVLink multicast object (DEVICE.md)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        group = dist.group.WORLD
        self.world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))  # torchrun's ranks on this host
        if local != self.world:
            raise ValueError(f"the copy-engine all-reduce needs every rank on one host (NVLink peers); "
                             f"this host has {local} of {self.world}")
        self.rank = dist.get_rank()
        quantum = self.world * ALIGN_ELEMS
        self.sizes = list(sizes)
        self.padded = [math.ceil(n / quantum) * quantum for n in sizes]
        self.offsets = [sum(self.padded[:b]) for b in range(len(sizes))]
        if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) != "CUDA":
            # CUDA's own IPC; raises if another backend (NVSHMEM: collective frees) already allocated
            symm_mem.set_backend("CUDA")
        with warnings.catch_warnings():  # needed before torch 2.8, deprecated (still harmless) after
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group.group_name)
        before = torch.cuda.memory_allocated(device)
        self.flat = symm_mem.empty(sum(self.padded), dtype=torch.float32, device=device)
        # torch 2.11 maps it outside its caching allocator; newer torch may route it through a pool there
        seen = torch.cuda.memory_allocated(device) - before
        self._unaccounted = max(0, self.flat.numel() * self.flat.element_size() - seen)
        self.flat.zero_()  # the padding stays zero: it is summed and gathered with the rest
        self.handle = symm_mem.rendezvous(self.flat, group.group_name)
        ptrs = getattr(self.handle, "buffer_ptrs", None)  # get_buffer offsets count from the allocation
        if self.handle is None or (ptrs is not None and ptrs[self.rank] != self.flat.data_ptr()):
            raise RuntimeError("copy-engine all-reduce: the flat buffer must start its symmetric allocation")
        # high priority: the barriers and adds, the only SM work here, go ahead of the backward's blocks
        self.stream = torch.cuda.Stream(device, priority=-1)
        chunk = max(self.padded) // self.world
        with torch.cuda.stream(self.stream):  # allocated on the stream that uses it
            self.scratch = torch.empty((self.world - 1) * chunk, dtype=torch.float32, device=device)
        self.timeout_ms = int(timeout_s * 1000)

    @property
    def nbytes(self) -> int:
        """Bytes of the symmetric buffer that torch's allocator statistics do not count (all of it on torch
        2.11, where cuMemCreate maps it; measured at allocation, so a torch that counts it adds none)."""
        return self._unaccounted

    def bucket(self, b: int) -> torch.Tensor:
        return self.flat[self.offsets[b]:self.offsets[b] + self.sizes[b]]

    def _barrier(self) -> None:
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def launch(self, b: int) -> "_StreamWork":
        self.stream.wait_stream(torch.cuda.current_stream())  # the bucket's gradients are staged
        with torch.cuda.stream(self.stream):
            self._barrier()
            self.reduce_scatter(b)
            self._barrier()
            self.all_gather(b)
            self._barrier()
            event = torch.cuda.Event()
            event.record(self.stream)
        return _StreamWork(event)

    def _chunk(self, b: int, owner: int) -> tuple[int, int]:
        """(offset in the flat buffer, length) of `owner`'s chunk of bucket b."""
        n = self.padded[b] // self.world
        return self.offsets[b] + owner * n, n

    def _peers(self) -> list[int]:
        return [(self.rank + s) % self.world for s in range(1, self.world)]

    def reduce_scatter(self, b: int) -> None:
        """Pull the peers' copies of my chunk (copy engines), then add them to mine."""
        start, n = self._chunk(b, self.rank)
        for i, peer in enumerate(self._peers()):
            self.scratch[i * n:(i + 1) * n].copy_(self.handle.get_buffer(peer, (n,), torch.float32, start))
        mine = self.flat[start:start + n]
        for i in range(self.world - 1):
            mine.add_(self.scratch[i * n:(i + 1) * n])

    def all_gather(self, b: int) -> None:
        """Pull every peer's reduced chunk into my buffer (copy engines)."""
        for peer in self._peers():
            start, n = self._chunk(b, peer)
            self.flat[start:start + n].copy_(self.handle.get_buffer(peer, (n,), torch.float32, start))


class _StreamWork:
    """What `dist.all_reduce(..., async_op=True)` returns, for a side stream: `wait()` orders the
    current stream after it (no host synchronisation)."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)
