"""The architecture the README describes is the one the imports obey.

`make lint` runs import-linter's layers contract from pyproject.toml; these tests keep the README's
layer table and that contract saying the same thing, and check what import-linter cannot: that no
module reaches into another module's private (underscore) names.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("smcd_daemon", "smc_handoff")


def _contract_layers() -> list[list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = data["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["id"] == "layers"]
    return [re.split(r"\s*[|:]\s*", layer) for layer in layers["layers"]]


def _readme_layers() -> list[list[str]]:
    """The README's table rows `| N. name | `pkg/`, `pkg/` | ... |`, innermost first."""
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d)\. [^|]+\| ([^|]+)\|", text, flags=re.M)
    assert rows, "README.md has no layer table (| 1. wire | `smcd_daemon/wire/` | ...)"
    out = []
    for _, cell in sorted(rows, key=lambda r: int(r[0])):
        paths = re.findall(r"`([^`]+)`", cell)
        out.append([p.rstrip("/").removesuffix(".py").replace("/", ".") for p in paths])
    return out


def test_readme_layer_table_matches_the_import_contract() -> None:
    contract = [sorted(layer) for layer in reversed(_contract_layers())]
    contract = [layer for layer in contract if layer != ["smcd_daemon.errors"]]
    # smc_handoff is a root package of its own (the application's side), under its own contract.
    readme = [sorted(p for p in layer if p != "smc_handoff") for layer in _readme_layers()]
    assert readme == contract, (
        "README.md's layer table and [tool.importlinter] in pyproject.toml disagree:\n"
        f"README:   {readme}\ncontract: {contract}"
    )


def test_every_daemon_package_is_in_a_layer() -> None:
    listed = {m for layer in _contract_layers() for m in layer}
    present = {
        f"smcd_daemon.{p.stem}"
        for p in (ROOT / "smcd_daemon").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.stem != "__init__")
    }
    present.discard("smcd_daemon.__main__")
    assert present <= listed, f"not in any layer of the contract: {sorted(present - listed)}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _in_package(me: str, target: str) -> bool:
    """May `me` use `target`? Private modules are for their own package; private names for none.

    A private submodule (`pkg._impl`) may be imported by the modules of `pkg`; a private attribute
    of another module (`pkg.mod._helper`) by no one else.
    """
    parts = target.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if not _private(part):
            continue
        prefix = ".".join(parts[: i + 1])
        if not _is_module(prefix):
            return False
        if not me.startswith(".".join(parts[:i]) + "."):
            return False
    return True


def _violations() -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            me = _module_name(path)
            where = path.relative_to(ROOT)
            tree = ast.parse(path.read_text(), str(path))
            aliases: dict[str, str] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    if not node.module.startswith(PACKAGES) or node.module == me:
                        continue
                    for a in node.names:
                        target = f"{node.module}.{a.name}"
                        if _private(a.name) and not _in_package(me, target):
                            found.append(f"{where}:{node.lineno}: imports {target}")
                        aliases[a.asname or a.name] = target
                    if not _in_package(me, node.module):
                        found.append(f"{where}:{node.lineno}: imports {node.module}")
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith(PACKAGES):
                            aliases[a.asname or a.name.split(".")[0]] = a.name
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and _private(node.attr)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                    and _is_module(aliases[node.value.id])
                    and not _is_module(f"{aliases[node.value.id]}.{node.attr}")
                ):
                    found.append(
                        f"{where}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}"
                    )
    return found


def test_no_module_touches_another_modules_private_names() -> None:
    found = _violations()
    assert not found, "private names used across modules:\n" + "\n".join(found)
