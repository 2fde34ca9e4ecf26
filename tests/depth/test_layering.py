"""megaloop.depth knows depths and losses only: none of its modules imports the model, the
trainer, checkpoints or data (SPEC §4-§5; the trainer hands it what it needs)."""

import ast
from pathlib import Path

import megaloop.depth

FORBIDDEN = ("megaloop.model", "megaloop.train", "megaloop.data", "megaloop.hf", "megaloop.inference",
             "megatron")


def test_depth_package_imports_no_model_trainer_or_data():
    for path in Path(megaloop.depth.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"
