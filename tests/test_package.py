# The package itself: its public surface, and the error a source tree without the
# built native module gives at import.
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import cpu_offload

PUBLIC_NAMES = {"offload_optimizer", "FullCPUOffloadOptimizer", "StateOffloadOptimizer", "SignSGD"}
PUBLIC_MODULES = ("kernels", "topology", "bench")


def test_star_import_gives_exactly_the_public_names():
    namespace: dict = {}
    exec("from cpu_offload import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC_NAMES
    for name in ("FullCPUOffloadOptimizer", "StateOffloadOptimizer", "SignSGD"):
        assert issubclass(namespace[name], torch.optim.Optimizer)
    for name in PUBLIC_NAMES:
        assert f"``{name}" in cpu_offload.__doc__  # the docstring lists the public surface


def test_public_modules_define_what_they_export():
    import importlib

    for name in PUBLIC_MODULES:
        module = importlib.import_module(f"cpu_offload.{name}")
        assert f"cpu_offload.{name}" in cpu_offload.__doc__
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"cpu_offload.{name}.__all__ names undefined {missing}"


def _copy_package(dest: Path, *, source_tree: bool) -> None:
    """The Python files of the package, without the native module; optionally the
    markers of a source checkout (setup.py, csrc/)."""
    shutil.copytree(Path(cpu_offload.__file__).parent, dest / "cpu_offload",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    if source_tree:
        (dest / "setup.py").write_text("")
        (dest / "csrc").mkdir()


def _import_error(path: Path) -> str:
    # NOTE: -S: no site-packages, so neither an installed nor an editable cpu_offload can
    # supply the native module; the check runs before anything else is imported.
    proc = subprocess.run([sys.executable, "-S", "-c", "import cpu_offload"], cwd=path, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(path)})
    assert proc.returncode != 0
    return proc.stderr.strip().splitlines()[-1]


def test_source_tree_without_native_module_says_how_to_build(tmp_path):
    _copy_package(tmp_path, source_tree=True)
    line = _import_error(tmp_path)
    assert line.startswith("ImportError: cpu_offload's native module cpu_offload._C is not built")
    assert f"python -m pip install -e {tmp_path}" in line
    assert "partially initialized" not in line


def test_installed_package_without_native_module_says_reinstall(tmp_path):
    _copy_package(tmp_path, source_tree=False)
    line = _import_error(tmp_path)
    assert "installation is incomplete" in line and "reinstall" in line


def test_version_matches_the_package_metadata():
    import importlib.metadata

    assert cpu_offload.__version__ == importlib.metadata.version("cpu_offload")


def test_package_metadata_files():
    root = Path(__file__).resolve().parents[1]
    assert (Path(cpu_offload.__file__).parent / "py.typed").exists()  # PEP 561: the package is typed
    assert (root / "LICENSE").read_text().startswith("Copyright 2026 The cpu_offload authors")
    assert 'license = "Apache-2.0"' in (root / "pyproject.toml").read_text()


def test_the_source_distribution_holds_everything_the_build_reads(tmp_path):
    # `python -m build` makes the wheel from the sdist, as pip does from PyPI: every native
    # source and header, and the build's own files, must be in it.
    import tarfile

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                           f"print(build_meta.build_sdist({str(tmp_path)!r}))"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sdist = tmp_path / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        held = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {str(p.relative_to(root)) for p in (root / "csrc").rglob("*") if p.is_file()}
    needed |= {"setup.py", "pyproject.toml", "README.md", "LICENSE", "cpu_offload/__init__.py",
               "cpu_offload/_full/optimizer.py", "cpu_offload/topology/__main__.py", "cpu_offload/py.typed"}
    assert len(needed) > 25
    assert sorted(needed - held) == []
