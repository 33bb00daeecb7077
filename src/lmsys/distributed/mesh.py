"""A device mesh of pipeline × data × tensor parallel ranks, and the checks that run before any process starts.

`parse_mesh("dp=2,tp=2")` -> MeshSpec(pp=1, dp=2, tp=2) (torch-free). `check_plan(...)` raises one
LmsysError for a mesh, model and schedule that cannot work, before torch is imported. `build_mesh(spec)`
calls `init_device_mesh` with the dims ordered (pp, dp, tp): tp varies fastest, so a tensor-parallel
group is consecutive ranks (one node), and `Mesh.group("tp")` is the process group every tensor-parallel
collective takes (likewise "dp" and "pp").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lmsys.core.errors import LmsysError

DIMS = ("pp", "dp", "tp")  # slowest- to fastest-varying
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
CHECKPOINTS = ("none", "block")  # what a mesh's blocks recompute (distributed.parallelize)


@dataclass(frozen=True)
class MeshSpec:
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def label(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in ("dp", "tp", "pp"))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's place on each dim (rank = (pp·dp + dp)·tp + tp, as init_device_mesh lays it out)."""
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp


def parse_mesh(text: str) -> MeshSpec:
    """'dp=2,tp=2,pp=1' (any order, missing dims are 1) -> MeshSpec."""
    degrees: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in DIMS:
            raise LmsysError(f"--mesh {text!r}: each part is DIM=N with DIM one of {', '.join(DIMS)}, got {part!r}")
        if name in degrees:
            raise LmsysError(f"--mesh {text!r}: {name} is given twice")
        try:
            degrees[name] = int(value)
        except ValueError:
            raise LmsysError(f"--mesh {text!r}: {name}={value!r} is not an integer") from None
        if degrees[name] < 1:
            raise LmsysError(f"--mesh {text!r}: {name} must be >= 1")
    return MeshSpec(**degrees)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_problems(tp: int, *, num_heads: int, kv_heads: int, d_ff: int, vocab_size: int) -> list[str]:
    """What a tensor-parallel degree does not divide (empty: it works). Key/value heads are split when
    tp divides them and replicated when they divide tp (each rank keeps the heads its query heads read)."""
    problems = []
    if num_heads % tp:
        problems.append(f"heads ({num_heads})")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"kv heads ({kv_heads}: neither divides the other)")
    if d_ff % tp:
        problems.append(f"d_ff ({d_ff})")
    if vocab_size % tp:
        problems.append(f"vocab ({vocab_size})")
    return problems


def check_plan(spec: MeshSpec, *, world_size: int, num_heads: int, kv_heads: int, d_ff: int, vocab_size: int,
               num_layers: int, schedule: str = "1f1b", microbatches: int = 1, virtual_stages: int = 1) -> None:
    """Every mistake of a mesh, model and pipeline schedule, as one LmsysError, before any process starts."""
    if spec.world_size != world_size:
        hint = ", ".join(f"{d}={world_size // (spec.world_size // getattr(spec, d))}" for d in DIMS
                         if world_size % (spec.world_size // getattr(spec, d)) == 0)
        raise LmsysError(f"--mesh {spec.label}: degrees multiply to {spec.world_size}, not the world size {world_size}",
                         hint=f"change one degree: {hint}" if hint else "give degrees whose product is the world size")
    problems = tp_problems(spec.tp, num_heads=num_heads, kv_heads=kv_heads, d_ff=d_ff, vocab_size=vocab_size)
    if problems:
        works = [t for t in range(1, 2 * spec.tp + 1) if not tp_problems(t, num_heads=num_heads, kv_heads=kv_heads,
                                                                      d_ff=d_ff, vocab_size=vocab_size)]
        below = max((t for t in works if t < spec.tp), default=None)
        above = min((t for t in works if t > spec.tp), default=None)
        near = " or ".join(f"tp={t}" for t in (below, above) if t is not None)
        raise LmsysError(f"--mesh {spec.label}: tp={spec.tp} does not divide the model's {', '.join(problems)}",
                         hint=f"nearest degrees that work: {near}" if near else None)
    if schedule not in PP_SCHEDULES:
        raise LmsysError(f"--pp-schedule {schedule!r}: one of {', '.join(PP_SCHEDULES)}")
    for what, value in (("--virtual-stages", virtual_stages), ("--microbatches", microbatches)):
        if value < 1:
            raise LmsysError(f"{what} must be >= 1, got {value}")
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise LmsysError(f"--virtual-stages {virtual_stages} needs --pp-schedule interleaved-1f1b")
    if schedule == "interleaved-1f1b" and spec.pp == 1 and virtual_stages > 1:  # its chunks go round the pp ranks
        raise LmsysError(f"--mesh {spec.label}: interleaved-1f1b with --virtual-stages {virtual_stages} passes each "
                         "micro-batch round the pipeline ranks, and pp=1 has no pipeline",
                         hint="give pp >= 2 in --mesh, or leave out --pp-schedule and --virtual-stages")
    chunks = spec.pp * (virtual_stages if schedule == "interleaved-1f1b" else 1)
    if num_layers < spec.pp:
        raise LmsysError(f"--mesh {spec.label}: {num_layers} layers cannot fill pp={spec.pp} stages",
                         hint=f"pp <= {num_layers}")
    if schedule == "interleaved-1f1b":
        if num_layers % chunks:
            ok = [v for v in _divisors(num_layers) if v % spec.pp == 0]
            raise LmsysError(f"interleaved-1f1b: {num_layers} layers do not split into pp×V = {spec.pp}×"
                             f"{virtual_stages} = {chunks} equal chunks",
                             hint=("pp×V must divide the layers: V in " +
                                   ", ".join(str(v // spec.pp) for v in ok)) if ok else None)
        if microbatches % spec.pp:
            raise LmsysError(f"interleaved-1f1b: --microbatches {microbatches} must be a multiple of pp={spec.pp}")
    if schedule in ("1f1b", "interleaved-1f1b") and spec.pp > 1 and microbatches < spec.pp:
        raise LmsysError(f"{schedule}: --microbatches {microbatches} is fewer than the pp={spec.pp} stages",
                         hint=f"--microbatches >= {spec.pp}")


@dataclass
class Mesh:
    """The built mesh: its spec, this rank's coordinates, and the torch DeviceMesh with a group per dim."""

    spec: MeshSpec
    rank: int
    device_mesh: Any  # torch.distributed.device_mesh.DeviceMesh, dims ("pp", "dp", "tp")

    def group(self, dim: str):
        return self.device_mesh.get_group(dim)

    def size(self, dim: str) -> int:
        return getattr(self.spec, dim)

    def coord(self, dim: str) -> int:
        return self.spec.coords(self.rank)[dim]

    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in order."""
        c = self.spec.coords(self.rank)
        return [self.spec.rank_of(**{**c, dim: i}) for i in range(self.size(dim))]

    def sub(self, dim: str):
        return self.device_mesh[dim]


def build_mesh(spec: MeshSpec, *, device_type: str = "cpu", rank: Optional[int] = None) -> Mesh:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh(device_type, (spec.pp, spec.dp, spec.tp), mesh_dim_names=DIMS)
    return Mesh(spec=spec, rank=dist.get_rank() if rank is None else rank, device_mesh=dm)
