"""The layers of docs/concepts.md: ml/ never imports orchestration or tracking code; importing it does nothing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ML = Path(__file__).resolve().parents[2] / "ml"
FORBIDDEN = {"prefect", "mlflow", "dvc", "great_expectations", "boto3", "botocore"}


def test_ml_sources_do_not_import_orchestration():
    offenders = []
    for path in ML.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path}:{node.lineno} {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_importing_ml_pulls_in_no_orchestration():
    code = (
        "import importlib, pkgutil, sys, ml\n"
        "for m in pkgutil.walk_packages(ml.__path__, 'ml.'):\n"
        "    importlib.import_module(m.name)\n"
        f"bad = sorted(n for n in sys.modules if n.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
