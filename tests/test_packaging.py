"""One import namespace (``antifragile.*``), rooms without import cycles, a CLI that does not
import torch to answer ``--help``, ``list`` or ``validate``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"antifragile": "antifragile", "antifragile.engine": "engine",
           "antifragile.trainer": "trainer", "antifragile.chaos": "chaos"}


def _package_folders() -> dict[str, Path]:
    """Every package of the distribution (a folder with ``__init__.py``), by import name."""
    found = {}
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found[".".join((name, *rel))] = init.parent
    return found


def test_pyproject_lists_every_package_and_maps_the_folders() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == FOLDERS
    assert sorted(conf["packages"]) == sorted(_package_folders())


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in _package_folders().items():
        out[package] = folder / "__init__.py"
        for path in folder.glob("*.py"):
            if path.name != "__init__.py":
                out[f"{package}.{path.stem}"] = path
    return out


def _top_level_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the distribution that ``module`` imports when it is imported (function-level
    and ``TYPE_CHECKING`` imports do not run then)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {m: _top_level_imports(m, p, set(modules)) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if dep.startswith(m + "."):
                continue  # a package importing its own submodules is not a cycle
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [m, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*stack, dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_chaos_rooms_do_not_import_each_other_in_a_circle() -> None:
    """Between the subpackages of chaos (cli, faults, infra, observe, report, run, suite,
    tune), imports go one way."""
    modules = _modules()
    rooms: dict[str, set[str]] = {}
    for m, p in modules.items():
        if not m.startswith("antifragile.chaos."):
            continue
        room = m.split(".")[2]
        for dep in _top_level_imports(m, p, set(modules)):
            if dep.startswith("antifragile.chaos.") and dep.split(".")[2] != room:
                rooms.setdefault(room, set()).add(dep.split(".")[2])
    for room, deps in rooms.items():
        for dep in deps:
            assert room not in rooms.get(dep, set()), f"chaos.{room} <-> chaos.{dep}"


@pytest.mark.parametrize("args", [["--help"], ["list"], ["validate",
                                                          "scenarios/quickstart.yaml"],
                                  ["validate", "README.md"]])
def test_quick_commands_do_not_import_torch(args: list[str]) -> None:
    """What makes ``chaos --help`` answer at once: no torch on these paths."""
    code = ("import sys\nfrom click.testing import CliRunner\n"
            "from antifragile.chaos.cli import main\n"
            f"r = CliRunner().invoke(main, {args!r})\n"
            "print(r.exit_code, 'torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[1] == "False", f"chaos {' '.join(args)} imported torch"


def test_wheel_installs_only_antifragile(tmp_path: Path) -> None:
    """Build the wheel, install it into a fresh venv (dependencies borrowed from this one),
    and import from a folder outside the repository."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("antifragile-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    site_dir = Path(site.stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site_dir), str(wheel)], check=True, capture_output=True)
    top_level = sorted(p.name for p in site_dir.iterdir()
                       if not p.name.endswith((".dist-info", ".pth")) and p.name != "bin")
    assert top_level == ["antifragile"], top_level
    # dependencies (torch, click, ...) from this environment, as a plain path entry: its own
    # .pth files (this checkout's editable finder among them) are not processed
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site_dir / "deps.pth").write_text("\n".join(deps) + "\n")
    probe = ("import importlib, importlib.util, antifragile\n"
             "print(antifragile.__file__)\n"
             "for m in ('antifragile.engine', 'antifragile.trainer', 'antifragile.chaos.cli',"
             " 'antifragile.chaos.run.pipeline', 'antifragile.trainer.train'):\n"
             "    importlib.import_module(m)\n"
             "from antifragile import CheckpointEngine, CheckpointError\n"
             "print([n for n in ('engine', 'trainer', 'chaos')"
             " if importlib.util.find_spec(n) is not None])\n")
    result = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    where, stray = result.stdout.splitlines()
    assert where.startswith(str(site_dir)), where
    assert stray == "[]", f"importable top-level from the wheel: {stray}"


def test_the_top_level_namespace_re_exports_every_public_name_of_the_engine() -> None:
    """``antifragile`` says it re-exports the engine's public names; a user filtering the
    ``StepSkippedWarning`` that README documents (or catching ``CheckpointFormatError``) got
    an ImportError from ``from antifragile import ...``."""
    import antifragile
    import antifragile.engine

    missing = sorted(set(antifragile.engine.__all__) - set(antifragile.__all__))
    assert missing == []
    for name in antifragile.engine.__all__:
        assert getattr(antifragile, name) is getattr(antifragile.engine, name)
