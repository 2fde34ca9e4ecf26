"""Which distributions a command really imports (how tools/gpu/fetch_wheels.sh's list was chosen).

    python tools/gpu/import_closure.py OUT.json -m megaloop.cli train --config tiny ...
    python tools/gpu/import_closure.py OUT.json tools/bench/bench_loop_overhead.py --hidden 64 ...

Runs the module or script in this process; at exit writes OUT.json with every imported top-level
module mapped to its distribution (``importlib.metadata.packages_distributions``) and prints the
distributions that the GPU image does not have (``IMAGE`` below). Run it in a full environment
(the project's .venv): modules imported only inside ``try: ... except ImportError`` show up too,
so the result is a superset; the minimal set is confirmed by running gpu_check.sh's CPU smoke
mode in an environment that has only the image's packages plus the wheels.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import sys

# Distributions of the lent GPU image (Python 3.12) that the training path may use.
IMAGE = {
    "torch", "transformers", "tokenizers", "huggingface_hub", "numpy", "safetensors", "accelerate", "click",
    "einops", "filelock", "fsspec", "jinja2", "matplotlib", "networkx", "packaging", "pillow", "protobuf",
    "psutil", "pyyaml", "regex", "requests", "rich", "sentencepiece", "sympy", "tqdm", "xxhash",
    "typing_extensions", "certifi", "idna", "urllib3", "charset_normalizer", "pytest", "mpmath", "markupsafe",
    "setuptools", "megaloop",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dump(out: str) -> None:
    from importlib.metadata import packages_distributions

    table = packages_distributions()
    tops = sorted({m.split(".")[0] for m in list(sys.modules)})
    dists: dict[str, list[str]] = {}
    for top in tops:
        for dist in table.get(top, []):
            dists.setdefault(dist, []).append(top)
    missing = sorted(d for d in dists if _norm(d) not in {_norm(i) for i in IMAGE})
    with open(out, "w") as f:
        json.dump({"distributions": dists, "not_in_image": missing, "top_level_modules": tops}, f, indent=1)
    print(f"import_closure: {len(dists)} distributions imported; not in the GPU image: {missing}",
          file=sys.stderr)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out, args = sys.argv[1], sys.argv[2:]
    atexit.register(_dump, out)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
