"""The package works installed as bytecode only or from a zip: no face reads a source file.

Each test copies ``src/rallypoint`` into a temporary folder in the install's form, then in
a fresh interpreter with only that copy and the virtual environment's site-packages (for
torch) on ``sys.path`` imports every public package and resolves every name it lists.
"""

from __future__ import annotations

import compileall
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import rallypoint

PACKAGE = Path(rallypoint.__file__).parent
PARTS = sorted(  # every public subpackage, found on disk (the face's own list is checked)
    p.name
    for p in Path(rallypoint.__file__).parent.iterdir()
    if p.is_dir() and not p.name.startswith("_") and (p / "__init__.py").exists()
)
NEEDS_SOURCE = ["rallypoint.testing.run_rpc_contract"]
"""Names that need the ``.py`` files, torch's rule rather than a face's: the RPC contract
suite compiles ``@torch.jit.script`` functions at import, and TorchScript reads source."""

CHECK = """
import importlib, sys

root, needs_source = sys.argv[1], sys.argv[2].split(",")
import rallypoint, rallypoint.launcher, rallypoint.observe

assert "torch" not in sys.modules, "the cheap faces loaded torch"
resolved = 0
for name in ["rallypoint"] + [f"rallypoint.{part}" for part in sys.argv[3:]]:
    module = importlib.import_module(name)
    for entry in module.__all__:
        if f"{name}.{entry}" in needs_source:
            try:
                getattr(module, entry)
            except OSError as exc:
                assert "TorchScript requires source" in str(exc), exc
                continue
            raise AssertionError(f"{name}.{entry} resolves: take it off NEEDS_SOURCE")
        assert getattr(module, entry) is not None, f"{name}.{entry}"
        resolved += 1
outside = [
    name
    for name, module in sys.modules.items()
    if name.partition(".")[0] == "rallypoint"
    and not (getattr(module, "__file__", None) or root).startswith(root)
]
assert not outside, f"loaded from elsewhere: {outside}"
print(resolved)
"""


def _copy(destination: Path) -> Path:
    target = destination / "rallypoint"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def _import_everything(root: Path, needs_source: list[str]) -> int:
    """Run :data:`CHECK` with ``root`` (a folder or a zip) first on ``sys.path``, without
    ``site`` (the editable install's path to ``src`` stays out); return the names resolved
    (each of ``needs_source`` must fail for want of source, and is not counted)."""
    paths = [str(root), sysconfig.get_paths()["purelib"]]
    code = f"import sys; sys.path[:0] = {paths!r}\n{CHECK}"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code, str(root), ",".join(needs_source), *PARTS],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=root.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip())


def _expected() -> int:
    import importlib

    faces = [rallypoint] + [importlib.import_module(f"rallypoint.{part}") for part in PARTS]
    return sum(len(face.__all__) for face in faces)


def test_a_bytecode_only_install_imports_every_name(tmp_path: Path) -> None:
    """``python -m compileall -b``, then the ``.py`` files removed."""
    target = _copy(tmp_path / "site")
    assert compileall.compile_dir(target, quiet=1, legacy=True)
    for source in target.rglob("*.py"):
        source.unlink()
    assert not list(target.rglob("*.py")) and (target / "__init__.pyc").exists()
    resolved = _import_everything(tmp_path / "site", NEEDS_SOURCE)
    assert resolved == _expected() - len(NEEDS_SOURCE)


def test_a_zipped_install_imports_every_name(tmp_path: Path) -> None:
    target = _copy(tmp_path / "tree")
    archive = tmp_path / "rallypoint.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in sorted(target.rglob("*")):
            if path.is_file():
                zipped.write(path, path.relative_to(target.parent).as_posix())
    shutil.rmtree(tmp_path / "tree")
    assert _import_everything(archive, []) == _expected()


def test_the_cheap_faces_load_no_torch_and_none_of_their_modules() -> None:
    code = (
        "import sys; import rallypoint, rallypoint.launcher, rallypoint.observe; "
        "print('torch' in sys.modules, sorted(m for m in sys.modules if 'rallypoint' in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    torch, modules = out.stdout.split(" ", 1)
    assert torch == "False"
    faces = ["rallypoint", "rallypoint._core", "rallypoint._core.version"]
    faces += ["rallypoint._core.public"]  # the lazy faces' one helper
    assert modules.strip() == repr(sorted([*faces, "rallypoint.launcher", "rallypoint.observe"]))
