"""Issue 27 item 1 for the files beside --output: plots and calibration profiles are written whole, through a
symlink to its target, to a device directly, a failed write one line (exit 2), and at exactly the path given
(matplotlib appends .png to a name without an extension: `--plot /dev/full` wrote /dev/full.png)."""

from __future__ import annotations

import os

import pytest

from test_cli_safety import one_line

PLAN = ("plan", "train", "--size", "tiny", "--gpu", "H100 SXM", "--gpus", "2", "--top", "2", "-f", "csv")


def test_a_plot_to_dev_full_is_one_line_and_writes_nothing_beside_the_device(lmsys):
    before = set(os.listdir("/dev"))
    assert "--plot: cannot write /dev/full: No space left on device" in one_line(lmsys(*PLAN, "--plot", "/dev/full"))
    assert set(os.listdir("/dev")) - before == set()


@pytest.mark.parametrize("name,magic", [("plot", b"\x89PNG"), ("plot.png", b"\x89PNG"), ("plot.svg", b"<?xml")])
def test_a_plot_goes_to_exactly_the_path_given_in_its_extensions_format(lmsys, tmp_path, name, magic):
    r = lmsys(*PLAN, "--plot", str(tmp_path / name))
    assert r.code == 0, r.err
    assert os.listdir(tmp_path) == [name]  # no plot.png beside plot, no temporary file
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_a_plot_through_a_symlink_writes_its_target(lmsys, tmp_path):
    target, link = tmp_path / "real.png", tmp_path / "link.png"
    link.symlink_to(target)
    assert lmsys(*PLAN, "--plot", str(link)).code == 0
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")


def test_bench_attention_plot_without_an_extension_is_a_png_there(lmsys, tmp_path):
    out = tmp_path / "attn"
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "naive", "--d-head", "16", "--seq-len", "16",
              "--warmup", "0", "--steps", "1", "--plot", str(out), "-f", "csv")
    assert r.code == 0, r.err  # it was a crash: the temporary name's tail was read as a format
    assert os.listdir(tmp_path) == ["attn"] and out.read_bytes().startswith(b"\x89PNG")


def test_a_calibration_profile_is_written_as_every_output(tmp_path):
    from lmsys.core.errors import LmsysError
    from lmsys.plan.profile import load_profile, save_profile

    profile = {"device": "cpu", "matmul_tflops": {"fp32": 1.0}, "attention_tflops": {"fp32": 0.5}, "hbm_GBps": 10.0}
    target, link = tmp_path / "real.yaml", tmp_path / "link.yaml"
    link.symlink_to(target)
    save_profile(profile, link)
    assert link.is_symlink() and load_profile(target)["device"] == "cpu"  # the link stays a link
    with pytest.raises(LmsysError, match="--profile: cannot write /dev/full: No space left on device"):
        save_profile(profile, "/dev/full")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    save_profile(profile, fifo)
    reader.join(10)
    assert fifo.is_fifo() and '"device": "cpu"' in got[0]
    assert sorted(os.listdir(tmp_path)) == ["fifo.json", "link.yaml", "real.yaml"]
