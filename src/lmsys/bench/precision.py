"""`lmsys precision`: what autocast does to each tensor, and why accumulators stay in fp32."""

from __future__ import annotations

import torch
from torch import nn

from lmsys.core import progress
from lmsys.core.devices import torch_dtype


class ToyModel(nn.Module):
    """fc1 -> ReLU -> LayerNorm -> fc2, the assignment's autocast example."""

    def __init__(self, in_features: int = 8, out_features: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x, record: dict | None = None):
        h = self.fc1(x)
        a = self.relu(h)
        n = self.ln(a)
        out = self.fc2(n)
        if record is not None:
            record.update({"fc1 output": h, "ReLU output": a, "LayerNorm output": n, "logits (fc2)": out})
        return out


def autocast_walkthrough(device, dtypes: list[str]) -> list[dict]:
    """One row per (autocast dtype, tensor): the dtype it ends up in."""
    rows = []
    for name in dtypes:
        torch.manual_seed(0)
        model = ToyModel().to(device)
        x = torch.randn(16, 8, device=device)
        y = torch.randint(0, 4, (16,), device=device)
        record: dict = {}
        with torch.autocast(device.type, dtype=torch_dtype(name)):
            logits = model(x, record)
            loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        seen = {"parameters (fc1.weight)": model.fc1.weight, **record, "loss": loss,
                "gradient fc1.weight": model.fc1.weight.grad, "gradient ln.weight": model.ln.weight.grad}
        for what, t in seen.items():
            rows.append({"autocast": name, "tensor": what, "dtype": str(t.dtype).replace("torch.", "")})
    return rows


def accumulation_experiment(n: int = 1000, addend: float = 0.01) -> list[dict]:
    """Add `addend` n times with several accumulator / addend dtypes; exact answer n·addend."""
    exact = n * addend
    cases = [
        ("fp32", torch.float32, torch.float32),
        ("fp16", torch.float16, torch.float16),
        ("fp32 accumulator, fp16 addend", torch.float32, torch.float16),
        ("bf16", torch.bfloat16, torch.bfloat16),
    ]
    rows = []
    progress.plan_rows(len(cases))
    every = -(-n // 100)  # progress at most a hundred times per case, not per addition
    for label, acc_dtype, add_dtype in cases:
        progress.start_row(label)
        progress.plan_steps(n, "additions")
        s = torch.tensor(0.0, dtype=acc_dtype)
        for i in range(1, n + 1):
            s += torch.tensor(addend, dtype=add_dtype)  # in-place: the result keeps acc_dtype
            if i % every == 0:
                progress.step(every)
        if n % every:
            progress.step(n % every)
        value = float(s)
        rows.append({"accumulation": label, "result": value, "abs error": abs(value - exact),
                     "rel error": abs(value - exact) / exact})
    return rows


def precision_reports(device: str, steps: int) -> list:
    """`lmsys precision`: the autocast walk-through on `device` and the accumulation experiment of `steps`
    additions (under the progress display), two Reports."""
    from lmsys.core import progress
    from lmsys.core.devices import environment, resolve_device
    from lmsys.core.results import Report

    dev = resolve_device(device)
    walk = Report("autocast: dtype of each tensor (toy model fc1 → ReLU → LayerNorm → fc2)",
                  autocast_walkthrough(dev, ["fp16", "bf16"]), environment(dev))
    with progress.display("precision: accumulation"):
        rows = accumulation_experiment(steps)
    return [walk, Report(f"accumulating 0.01 {steps} times (exact: {0.01 * steps:g})", rows)]
