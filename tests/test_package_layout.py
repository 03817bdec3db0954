"""The package's shape: layers whose imports point one way, no import circle, no first-party import
hidden in a function but a short listed set, the CLI installed as mask_replay.cli (never as a
top-level `cli`), and every name README shows still importable."""
import ast
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Layer of each top-level part of the package: a module imports only modules of its own layer or
# below (cli -> tools -> integrations -> files / sampler / trainer -> the core). The package root
# (mask_replay/__init__.py, the public names) and __main__ sit outside: no module imports them.
LAYERS = {
    "errors": 0, "version": 0, "params": 0, "csr": 0, "_ops": 0, "_C": 0, "row_order": 0, "mask": 0,
    "_startup": 0,
    "sampler": 1, "trainer": 1, "files": 1,
    "integrations": 2,
    "tools": 3,
    "cli": 4,
}

# Function-level first-party imports, each with its reason (none today). SamplingMask's engine methods
# (from_vllm / from_sglang / from_padded / to_padded) and file methods (save / load) are not here: the
# adapters and files/mask_file.py register themselves with mask.adapter, so mask.py imports nothing
# from the layers above it (mask.py's module doc).
ALLOWED_LATE: dict = {}


def _imports(path: str):
    """(module-level imports, function-level imports) of first-party modules in the file."""
    tree = ast.parse(open(path).read(), filename=path)
    late_nodes = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            late_nodes.update(id(n) for n in ast.walk(fn))
    top, late = set(), set()
    for node in ast.walk(tree):
        names = set()
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names if a.name.split(".")[0] == "mask_replay"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mask_replay":
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # `from p import submodule`
        (late if id(node) in late_nodes else top).update(names)
    return top, late


def _package_modules() -> dict:
    """mask_replay module name -> file, for the package folder and the top-level cli/ folder."""
    modules = {}
    for folder, prefix in ((os.path.join(ROOT, "mask_replay"), "mask_replay"),
                           (os.path.join(ROOT, "cli"), "mask_replay.cli")):
        for dirpath, _, files in os.walk(folder):
            rel = os.path.relpath(dirpath, folder)
            parts = [] if rel == "." else rel.split(os.sep)
            for f in files:
                if f.endswith(".py"):
                    stem = f[:-3]
                    name = ".".join([prefix] + parts + ([] if stem == "__init__" else [stem]))
                    modules[name] = os.path.join(dirpath, f)
    return modules


MODULES = _package_modules()
GRAPH = {}
LATE = {}
for _m, _p in MODULES.items():
    _top, _late = _imports(_p)
    GRAPH[_m] = {i for i in _top if i in MODULES and i != _m and not _m.startswith(i + ".")}
    LATE[_m] = {i for i in _late if i in MODULES}


def _layer(module: str):
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_part_of_the_package_has_a_layer():
    missing = sorted({m.split(".")[1] for m in MODULES if m.count(".") >= 1 and _layer(m) is None} - {"__main__"})
    assert not missing, f"give these a layer in LAYERS: {missing}"


def test_imports_point_down_the_layers():
    wrong = []
    for m, deps in GRAPH.items():
        if m in ("mask_replay", "mask_replay.__main__"):
            continue
        for d in deps:
            if d == "mask_replay":
                wrong.append(f"{m} imports the package root")
            elif _layer(d) is not None and _layer(m) is not None and _layer(d) > _layer(m):
                wrong.append(f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_first_party_import_inside_a_function_but_the_listed_ones():
    found = {(m, d) for m, deps in LATE.items() for d in deps if d != "mask_replay._C"}
    assert found <= set(ALLOWED_LATE), sorted(found - set(ALLOWED_LATE))


def test_the_mask_knows_nothing_of_files():
    """The file layer reads and writes masks; the mask imports nothing of it, not even in a function."""
    files = sorted(d for d in GRAPH["mask_replay.mask"] | LATE["mask_replay.mask"] if d.startswith("mask_replay.files"))
    assert not files, files


def test_the_listed_late_imports_would_be_cycles_or_upward():
    """Each listed exception must still be needed: the import points up a layer."""
    for m, d in ALLOWED_LATE:
        assert _layer(d) > _layer(m), (m, d)


def test_module_level_imports_form_no_cycle():
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(GRAPH[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


# One folder per framework under mask_replay/integrations/ (docs/layout.md), and the old single-file paths
# kept for one release as shims that only re-export their new home.
FRAMEWORK_FOLDERS = {"transformers", "trl", "vllm_support", "verl"}
DEPRECATED_SHIMS = {"mask_replay.integrations.vllm_cpu": "mask_replay.integrations.vllm_support.cpu_colocate"}
# folder -> the other framework folders it may import: TRL generates with transformers' recorder and reads
# the vLLM plugin's supports; verl's rollout turns the vLLM plugin on in the engine it starts
FOLDER_IMPORTS = {"trl": {"transformers", "vllm_support"}, "verl": {"vllm_support"}}
INTEGRATIONS = "mask_replay.integrations."


def _framework_folder(module: str):
    return module[len(INTEGRATIONS):].split(".")[0] if module.startswith(INTEGRATIONS) else None


def test_integrations_hold_one_folder_per_framework():
    here = os.path.join(ROOT, "mask_replay", "integrations")
    folders = {e for e in os.listdir(here) if os.path.isfile(os.path.join(here, e, "__init__.py"))}
    files = {e for e in os.listdir(here) if e.endswith(".py")}
    assert folders == FRAMEWORK_FOLDERS, folders ^ FRAMEWORK_FOLDERS
    shims = {m.rsplit(".", 1)[1] + ".py" for m in DEPRECATED_SHIMS}
    assert files == {"__init__.py"} | shims, f"a module of a framework goes in its folder: {sorted(files - shims)}"


@pytest.mark.parametrize("shim", sorted(DEPRECATED_SHIMS))
def test_deprecated_shims_only_re_export_their_new_home(shim):
    target = DEPRECATED_SHIMS[shim]
    assert GRAPH[shim] and all(d == target or d.startswith(target + ".") for d in GRAPH[shim]), GRAPH[shim]
    assert "DeprecationWarning" in open(MODULES[shim]).read()


def test_framework_folders_import_each_other_only_as_listed():
    wrong = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                   if m not in DEPRECATED_SHIMS and _framework_folder(m) and _framework_folder(d)
                   and _framework_folder(d) != _framework_folder(m)
                   and _framework_folder(d) not in FOLDER_IMPORTS.get(_framework_folder(m), set()))
    assert not wrong, "\n".join(wrong)


README_NAMES = [
    "mask_replay.capture", "mask_replay.capture_fixed", "mask_replay.replay_logprobs",
    "mask_replay.replay_logprobs_from_hidden", "mask_replay.full_logprobs", "mask_replay.kept_mass",
    "mask_replay.support_entropy", "mask_replay.support_kl", "mask_replay.support_entropy_from_hidden",
    "mask_replay.support_kl_from_hidden", "mask_replay.build_info", "mask_replay.SamplingMask",
    "mask_replay.SamplingMask.from_vllm", "mask_replay.SamplingMask.from_sglang", "mask_replay.SamplingMask.align",
    "mask_replay.SamplingMask.to_padded", "mask_replay.SamplingMask.from_padded", "mask_replay.SamplingMask.load",
    "mask_replay.MaskFormatError", "mask_replay.OutsideSupportError",
    "mask_replay.trainer.replay_logprobs_vocab_parallel",
    "mask_replay.trainer.replay_logprobs_vocab_parallel_from_hidden",
]


@pytest.mark.parametrize("name", README_NAMES)
def test_readme_names_resolve(name):
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        assert obj is not None
        return
    pytest.fail(name)


def test_readme_mentions_only_resolvable_mask_replay_names():
    """Every `mask_replay.x.y` README names in code resolves (a moved module would leave a dead name)."""
    import importlib
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    dead = []
    for name in sorted(set(re.findall(r"\bmask_replay(?:\.[A-Za-z_]\w*)+", text))):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
                break
            except (ModuleNotFoundError, AttributeError):
                continue
        else:
            dead.append(name)
    assert not dead, dead


@pytest.mark.slow
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


def test_docs_layout_lists_every_module():
    """docs/layout.md says which file holds what: a new module must be listed there."""
    text = open(os.path.join(ROOT, "docs", "layout.md")).read()
    missing = sorted(os.path.relpath(path, ROOT) for path in MODULES.values()
                     if os.path.relpath(path, ROOT) not in text)
    assert not missing, f"add to docs/layout.md: {missing}"
