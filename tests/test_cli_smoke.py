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


def test_version_is_the_newest_release_in_the_changelog():
    """pyproject takes its version from lmsys.__version__; both follow CHANGELOG.md's newest release."""
    import re
    import tomllib
    from pathlib import Path

    from lmsys import __version__

    root = Path(__file__).resolve().parents[1]
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d$", (root / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == __version__, releases
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lmsys.__version__"}


def test_ci_runs_the_readme_quick_start_as_it_stands():
    """README's two quick-start commands install a CPU torch the same way, and .ci/run pins the same torch
    and then runs the second command's install-and-test part verbatim."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    bench, test = block.strip().splitlines()
    install = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
    assert bench == install + "pip install -e . && lmsys bench e2e"
    assert test == install + "pip install -e '.[test]' && pytest -q"
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert test.removeprefix(install) in ci
    assert "python -m pip install -q torch==2.13.0" in ci
