"""The package's shape: the CLI installs as mask_replay.cli (never as a top-level `cli`), and the
package's own imports form no circle."""
import ast
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_imports(path: str, package: str) -> set:
    """Modules of `package` that the file imports (absolute and relative, any nesting)."""
    tree = ast.parse(open(path).read(), filename=path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            found.add(node.module)
            # `from mask_replay import x` may import the submodule x
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _package_modules() -> dict:
    """mask_replay module name -> file, for the package folder and the top-level cli/ folder."""
    modules = {}
    for folder, prefix in ((os.path.join(ROOT, "mask_replay"), "mask_replay"), (os.path.join(ROOT, "cli"), "mask_replay.cli")):
        for dirpath, _, files in os.walk(folder):
            rel = os.path.relpath(dirpath, folder)
            parts = [] if rel == "." else rel.split(os.sep)
            for f in files:
                if f.endswith(".py"):
                    stem = f[:-3]
                    name = ".".join([prefix] + parts + ([] if stem == "__init__" else [stem]))
                    modules[name] = os.path.join(dirpath, f)
    return modules


def test_module_level_imports_form_no_cycle():
    modules = _package_modules()
    graph = {m: {i for i in _module_imports(p, "mask_replay") if i in modules and i != m} for m, p in modules.items()}
    # a module imports its parent packages implicitly; those edges are not part of the design
    for m in graph:
        graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    # the loader only loads: registrations are imported by the package, not by the loader
    assert "mask_replay._register" not in graph["mask_replay._ext"]
    assert "mask_replay._register" in graph["mask_replay"]


def test_cli_installs_as_mask_replay_cli_only(tmp_path):
    env = dict(os.environ, MASK_REPLAY_SKIP_EXT="1")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), ROOT],
        check=True, env=env, cwd=tmp_path, capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mask_replay/cli/main.py" in names
    assert "mask_replay/cli/__init__.py" in names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"mask_replay"}, tops
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "mask-replay = mask_replay.cli.main:main" in entry


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "mask_replay", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "mask-replay, version" in out.stdout
