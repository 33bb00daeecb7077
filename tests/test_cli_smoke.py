import subprocess
import sys


def test_help_lists_every_group_without_importing_torch():
    code = (
        "import sys; from lmsys.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'lmsys --help imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for group in ("bench", "profile", "comm", "ddp", "flash", "precision"):
        assert group in out


def test_version(lmsys):
    from lmsys import __version__

    r = lmsys("--version")
    assert r.code == 0 and r.out.strip() == f"lmsys {__version__}"
