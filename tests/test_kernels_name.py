"""The repository's kernels/ folder is eagle_fsd.kernels; from the repository root Python also finds it as the
top-level `kernels` (Hugging Face's package of that name, which transformers >= 5.25 imports), and then it must hand
the import over to the installed package. Run in a subprocess without site-packages (-S), so the fake package below
is the one installed."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_from_root(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_top_level_kernels_from_the_repository_root_is_the_installed_package(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'the installed kernels'\n")
    done = import_from_root("import kernels; print(kernels.WHO); print(kernels.__file__)", tmp_path)
    assert done.returncode == 0, done.stderr
    who, where = done.stdout.splitlines()
    assert who == "the installed kernels" and Path(where).parent == tmp_path / "kernels"
