"""The wheel installs one `dflash_mac` namespace and a working `dflash-mac` command."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("dflash_mac-*.whl"))


def test_wheel_layout_and_cli(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300
    )
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    top = {p.name for p in site.iterdir()}
    assert "dflash_mac" in top
    assert not {"models", "app", "metal_kernels"} & top
    pkg = site / "dflash_mac"
    for init in ROOT.glob("dflash_mac/*/__init__.py"):  # every subpackage is shipped
        assert (pkg / init.parent.name / "__init__.py").exists(), init.parent.name
    assert (pkg / "models" / "dflash.py").exists()
    assert (pkg / "metal_kernels" / "__init__.py").exists()
    assert (pkg / "app" / "__init__.py").exists()
    # Dependencies come from the dev environment; .pth files there are not processed, so
    # the wheel's own dflash_mac is the one imported.
    deps = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": deps, "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin"}
    r = subprocess.run(
        [str(env_dir / "bin" / "dflash-mac"), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout
    where = subprocess.check_output(
        [str(py), "-c", "import dflash_mac.models as m; print(m.__file__)"],
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert where.startswith(str(site))


def test_editable_install_maps_folders():
    import dflash_mac.metal_kernels as k
    import dflash_mac.models as m

    assert Path(m.__file__).parent == ROOT / "models"
    assert Path(k.__file__).parent == ROOT / "metal_kernels"
