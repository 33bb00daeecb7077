"""lmsys.core.hardware and lmsys.plan: the GPU table, the memory and time models, the search, the CLI."""

from __future__ import annotations

import pytest

from lmsys.core import hardware
from lmsys.core.errors import LmsysError


# ------------------------------------------------------------------------------------------- hardware

@pytest.mark.parametrize("torch_name, part", [
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"), ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"), ("NVIDIA B200", "B200"), ("h100-sxm", "H100 SXM"),
    ("A100 80GB SXM", "A100 80GB SXM"),
])
def test_gpu_lookup_by_torch_name_and_table_name(torch_name, part):
    assert hardware.find_gpu(torch_name).name == part


def test_table_figures_are_dense_and_sourced():
    h100 = hardware.GPUS["H100 SXM"]
    assert (h100.bf16, h100.tf32, h100.fp32, h100.fp8) == (989.5, 494.5, 67.0, 1979.0)  # half the sparse 1979/989/3958
    assert hardware.GPUS["A100 80GB SXM"].hbm_GBps == 2039.0 and hardware.GPUS["A100 40GB SXM"].hbm_GBps == 1555.0
    assert hardware.GPUS["B200"].bf16 == 36_000 / 8 / 2  # HGX B200: 36 PFLOP/s sparse for 8 GPUs
    for gpu in hardware.GPUS.values():
        assert set(gpu.sources) == {"compute", "memory", "links", "network"}
        assert gpu.bf16 == gpu.fp16 and gpu.tf32 == pytest.approx(gpu.bf16 / 2, rel=0.01)


def test_mfu_peak_names_the_peak_and_refuses_unknown_gpus():
    assert hardware.mfu_peak("NVIDIA H200", "bf16") == (989.5, "H200 SXM dense bf16 989.5 TFLOP/s")
    assert hardware.mfu_peak("NVIDIA A100-SXM4-80GB", "fp32", tf32=True)[0] == 156.0
    assert hardware.mfu_peak("NVIDIA A100-SXM4-80GB", "fp32")[0] == 19.5
    for name in ("NVIDIA GB200", "Tesla V100-SXM2-32GB", None):
        with pytest.raises(LmsysError, match=r"known: B200, .*A100 40GB SXM.*--peak-tflops"):
            hardware.mfu_peak(name, "bf16")
    with pytest.raises(LmsysError, match="no fp8"):
        hardware.mfu_peak("NVIDIA A100-SXM4-80GB", "fp8")
    assert hardware.mfu(1e12, 1000.0, 2.0) == pytest.approx(0.5)


def test_devices_peak_delegates_to_the_table():
    from lmsys.core import devices

    assert devices.peak_tflops_for("NVIDIA H100 PCIe", "bf16", tf32=False) == 756.5
    assert devices.peak_tflops_for("NVIDIA B200", "fp32", tf32=True) == 1125.0
    assert devices.peak_tflops_for("Tesla V100", "bf16", tf32=False) is None  # callers: no MFU, as before
    assert devices.peak_rates("NVIDIA H200").startswith("H200 SXM, dense TFLOP/s bf16 989.5")
