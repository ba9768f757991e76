"""Packaging: declared dependencies and extras, one version source, the public API, the console
script, and training without the optional extras."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import fp8_lightning

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in PROJECT["dependencies"]}
EXTRAS = {k: [Requirement(r) for r in v] for k, v in PROJECT["optional-dependencies"].items()}


def test_imported_third_party_packages_are_declared():
    assert "pyyaml" in CORE  # `import yaml` in cli, bench, fp8_stats
    assert "matplotlib" not in CORE  # only compare and bench draw: the [plots] extra
    assert [r.name for r in EXTRAS["plots"]] == ["matplotlib"]
    assert [r.name for r in EXTRAS["stats"]] == ["nvdlfw-inspect"]  # FP8Stats' tensor statistics
    # the tests draw and run the torchao engine: [dev] brings those extras
    assert any(r.name == "fp8-lightning" and r.extras == {"plots", "torchao"} for r in EXTRAS["dev"])


def test_torchao_floor_is_the_one_checked():
    from fp8_lightning.fp8.torchao_engine import TORCHAO_MIN_VERSION, TORCHAO_REQUIREMENT

    (torchao,) = EXTRAS["torchao"]
    assert str(torchao.specifier) == f">={TORCHAO_MIN_VERSION}"
    assert TORCHAO_REQUIREMENT.requirement == f"torchao>={TORCHAO_MIN_VERSION}"


def test_private_apis_are_capped_and_te_floor_is_the_one_checked():
    from fp8_lightning.te_availability import TE_MIN_VERSION, TE_REQUIREMENT

    for name in ("lightning", "litdata"):  # private APIs used: an upper bound each
        assert any(s.operator == "<" for s in CORE[name].specifier), CORE[name]
        assert importlib.metadata.version(name) in CORE[name].specifier
    (te,) = EXTRAS["te"]
    assert str(te.specifier) == f">={TE_MIN_VERSION}" == TE_REQUIREMENT.requirement.split("engine")[1]


def test_one_version_source():
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    init = (ROOT / "fp8_lightning" / "__init__.py").read_text()
    assert re.findall(r'^__version__ = "([^"]+)"$', init, re.M) == [fp8_lightning.__version__]
    assert importlib.metadata.version("fp8-lightning") == fp8_lightning.__version__


def test_all_is_complete_and_importable():
    for name in ("GPTLightningModule", "TokenShardDataModule", "prepare", "TrainingMonitor",
                 "FP8Precision", "GPT", "GPTConfig", "Checkpoint", "NaNGuard", "__version__"):
        assert name in fp8_lightning.__all__
    namespace: dict = {}
    exec("from fp8_lightning import *", namespace)
    assert set(fp8_lightning.__all__) <= set(namespace)
    # every public class the package exposes at the top level is listed
    public = {n for n, v in vars(fp8_lightning).items()
              if not n.startswith("_") and isinstance(v, type)}
    assert public <= set(fp8_lightning.__all__), public - set(fp8_lightning.__all__)


def test_console_script_is_declared_and_in_the_readme():
    assert PROJECT["scripts"] == {"fp8-lightning": "fp8_lightning.cli:main"}
    assert "`fp8-lightning COMMAND ...`" in (ROOT / "README.md").read_text()


NO_MATPLOTLIB = """
import importlib.abc, importlib.metadata, sys

class NoMatplotlib(importlib.abc.MetaPathFinder):  # as if not installed: no module, no metadata
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

def hide(lookup):
    def wrapped(name):
        if name.lower() == "matplotlib":
            raise importlib.metadata.PackageNotFoundError(name)
        return lookup(name)
    return wrapped

sys.meta_path.insert(0, NoMatplotlib())
importlib.metadata.version = hide(importlib.metadata.version)
importlib.metadata.distribution = hide(importlib.metadata.distribution)
"""


def test_training_and_compare_tables_need_no_matplotlib():
    """Without the [plots] extra: the package, the CLI, bench and compare import; drawing is one
    clear error naming the extra."""
    code = NO_MATPLOTLIB + (
        "import fp8_lightning, fp8_lightning.cli, fp8_lightning.commands.compare, fp8_lightning.commands.bench\n"
        "from fp8_lightning.plots import MissingExtraError, pyplot\n"
        "try:\n    pyplot('x')\nexcept MissingExtraError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == 'x needs matplotlib: pip install "fp8-lightning[plots]"'


# The rule: figures live in the docs only, each in docs/benchmarks.md. The code, configs and
# scripts say what and why (a message says what to do, not a ratio); they name no GPU model and
# no bare issue or PR number. Comments and strings alike: every line of these files is read.
CODE_FILES = ("fp8_lightning/**/*.py", "configs/*.yaml", "scripts/*.sh", "scripts/*.py",
              "benchmarks/*.py", "examples/*.py", "examples/*.sbatch")
GPU_NAME = re.compile(r"(?i)(?:(?<![a-z])|(?<=\dx))(?:GH200|H100|H200|A100|B200)(?!\d)")
FIGURE = re.compile(r"\b\d+\.\d+x\b|\d[\d,.]*k? tok/s")
ISSUE_NUMBER = re.compile(r"(?i:\bissues?\s+#?\d+)|\bPR\s+#?\d+|#\d+\b")
OWNER_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+$")  # pytorch/pytorch in pytorch/pytorch#123


def quotes_a_measurement(text: str) -> bool:
    """A GPU named beside a measured ratio (``1.23x``) or throughput (``241k tok/s``)."""
    return bool(GPU_NAME.search(text) and FIGURE.search(text))


def cites_a_bare_issue(line: str) -> bool:
    """``issue #12``, ``PR 34`` or ``#56`` that no ``owner/repo`` names: whose tracker is it?"""
    return any(not (m[0].startswith("#") and OWNER_REPO.search(line[:m.start()]))
               for m in ISSUE_NUMBER.finditer(line))


def peak_table_lines() -> set[int]:
    """The one place outside docs/ that may name a GPU model: fp8_lightning/flops.py's datasheet
    peaks, which the code matches by device name (the ``PEAKS`` table and ``peak_for``'s example
    name). Code that prints a device name reads it from the device, so no name is in its text."""
    tree = ast.parse((ROOT / "fp8_lightning" / "flops.py").read_text())
    table = [n for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "PEAKS"]
    lookup = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "peak_for"]
    assert len(table) == 1 and len(lookup) == 1, "flops.py: PEAKS or peak_for moved"
    doc = lookup[0].body[0]
    return set(range(table[0].lineno, table[0].end_lineno + 1)) | \
        set(range(doc.lineno, doc.end_lineno + 1))


def test_package_code_quotes_no_measured_figures():
    """Figures live in docs/benchmarks.md; the package, configs, scripts, benchmarks and examples
    name no GPU model (but flops.py's peak table), quote no measurement (a sentence wraps, so each
    line is read with the two either side of it) and cite no issue without its owner/repo."""
    assert quotes_a_measurement("weight caching; nanoGPT 1.3B, H100: 1.25x -> 1.29x over")
    assert quotes_a_measurement("# weights kept gathered, two H200s): GPT-2 124M made 241k tok/s")
    assert not quotes_a_measurement('(("h100", "pcie"), Peak("H100 PCIe", 756.5 * T, 1513 * T)),')
    assert all(GPU_NAME.search(t) for t in ("two H100s", "8xA100", "(GH200)", "on the b200"))
    assert not any(GPU_NAME.search(t) for t in ("batch100", "H1000", "sha100"))
    assert cites_a_bare_issue("(TransformerEngine issue #1860)")
    assert cites_a_bare_issue("the upstream fix, PR #21640, is unreleased")
    assert cites_a_bare_issue("see #42.")
    assert not cites_a_bare_issue("(pytorch/pytorch#144455; NVIDIA/TransformerEngine#1860)")
    assert not cites_a_bare_issue("Lightning-AI/pytorch-lightning#21487 issues the next step")
    assert not cites_a_bare_issue('color="#1f77b4"  # matplotlib\'s first colour')
    exempt = {(Path("fp8_lightning/flops.py"), n) for n in peak_table_lines()}
    files = sorted({p.relative_to(ROOT) for pattern in CODE_FILES for p in ROOT.glob(pattern)})
    assert Path("configs/ddp.yaml") in files and Path("benchmarks/harness.py") in files
    found = []
    for path in files:
        lines = (ROOT / path).read_text().splitlines()
        for i, line in enumerate(lines):
            where = f"{path}:{i + 1}: {line.strip()}"
            if GPU_NAME.search(line) and (path, i + 1) not in exempt:
                found.append(f"a GPU model named: {where}")
            elif FIGURE.search(line) and quotes_a_measurement(" ".join(lines[max(0, i - 2):i + 3])):
                found.append(f"a measured figure: {where}")
            if cites_a_bare_issue(line):
                found.append(f"an issue number without owner/repo: {where}")
    assert not found, "figures' home is docs/benchmarks.md, an issue's is owner/repo#N:\n" + \
        "\n".join(found)


FIGURE_HOMES = ("benchmarks.md", "convergence.md")  # the results; the loss curves' figures


def test_prose_docs_quote_no_speed_figures():
    """The user guides and the architecture (docs/*.md but the two result pages) quote no speed
    ratio (``1.15x``) and no throughput (``241k tok/s``): they say what a figure means and link
    to its one home in docs/benchmarks.md."""
    assert FIGURE.search("FP8 delayed is 1.46x the faster BF16")
    assert FIGURE.search("252k tok/s per GPU") and FIGURE.search("at 487,679 tok/s")
    assert not FIGURE.search("`tok/s` over all GPUs, 1 x 8192, 50257 -> 50304, 2.20 or newer")
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in FIGURE_HOMES)
    assert ROOT / "docs" / "fp8.md" in docs and ROOT / "docs" / "several-gpus.md" in docs
    found = [f"docs/{p.name}:{i + 1}: {line.strip()}" for p in docs
             for i, line in enumerate(p.read_text().splitlines()) if FIGURE.search(line)]
    assert not found, "a figure's home is docs/benchmarks.md; link to it there:\n" + \
        "\n".join(found)


PACKAGE = ROOT / "fp8_lightning"
# "fp8.plugin" -> its file; "fp8" -> fp8/__init__.py; "" -> the package's __init__.py
MODULES = {".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix("__init__")
           .strip("."): p for p in PACKAGE.rglob("*.py")}
# the package's names load their modules on first use (its __getattr__): the name is the import
LAZY = next(ast.literal_eval(n.value) for n in ast.parse((PACKAGE / "__init__.py").read_text()).body
            if isinstance(n, ast.Assign) and n.targets[0].id == "_EXPORTS")


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    return {inner for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)}


def package_imports(path: Path) -> set[str]:
    """The package's modules that importing ``path`` runs, at its top or inside functions (not
    under ``TYPE_CHECKING``), named below the package: ``from ..config import X`` in
    ``fp8/plugin.py`` -> ``config``; ``from . import recipes`` -> ``fp8.recipes``; ``from
    fp8_lightning import Checkpoint`` -> ``callbacks.checkpoint``; and each package above a
    module imported (its ``__init__`` runs first) that ``path`` is not inside of itself."""
    own = next(m for m, p in MODULES.items() if p == path)
    package = path.relative_to(PACKAGE).parent.parts
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            found |= {n.removeprefix("fp8_lightning.") if n != "fp8_lightning" else ""
                      for n in names if n == "fp8_lightning" or n.startswith("fp8_lightning.")}
            continue
        if node.level:
            base = ".".join((*package[:len(package) - node.level + 1],
                             *(node.module.split(".") if node.module else ())))
        elif node.module == "fp8_lightning" or (node.module or "").startswith("fp8_lightning."):
            base = node.module.removeprefix("fp8_lightning").strip(".")
        else:
            continue
        for alias in node.names:
            name = f"{base}.{alias.name}".strip(".")
            found.add(name if name in MODULES else LAZY.get(alias.name, "") if base == "" else base)
    unknown = found - set(MODULES)
    assert not unknown, f"{path}: imports no module of the package: {unknown}"
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return (found | {p for p in parents if not own.startswith(p + ".") and p != own}) - {own, ""}


def test_the_fp8_core_imports_nothing_above_it():
    """``fp8/`` (plugin, recipes, policy, engines) sits below the model and the Lightning module:
    it may use itself and the leaf modules under it, whose own imports stay outside the package,
    so the FP8 core can be read, tested and reused without the model."""
    leaves = {"config", "te_availability", "logs"}
    assert package_imports(ROOT / "fp8_lightning/fp8/plugin.py") >= {"config", "fp8.recipes"}
    above = {f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "fp8_lightning/fp8").rglob("*.py")
             for m in package_imports(p) if not (m == "fp8" or m.startswith("fp8.") or m in leaves)}
    assert not above, "fp8/ imports modules above it:\n" + "\n".join(sorted(above))
    leaf_imports = {f"{leaf}: {m}" for leaf in leaves
                    for m in package_imports(ROOT / "fp8_lightning" / f"{leaf}.py")}
    assert not leaf_imports, "a leaf imports the package:\n" + "\n".join(sorted(leaf_imports))


def test_no_module_of_the_package_imports_itself_back():
    """No import cycle, counting imports inside functions (the usual way to hide one)."""
    assert "fp8.recipes" in package_imports(PACKAGE / "fp8" / "plugin.py")
    graph = {m: package_imports(path) for m, path in MODULES.items()}

    def cycle_from(start):  # a path back to start, if any
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in graph[node]:
                if dep == start:
                    return path + [start]
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, path + [dep]))
        return None

    cycles = {" -> ".join(c) for m in MODULES if (c := cycle_from(m))}
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))
