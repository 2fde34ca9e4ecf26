"""torchrun worker (not collected by pytest): several ``megaloop rl`` / ``distill-prefill`` command
lines, one after the other, in the same processes (one launch instead of one per command)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/post/cli_worker.py JSON

``JSON``: a list of argument lists, each starting with ``rl`` or ``distill-prefill``. Prints one
``RESULT {"cmd", "rc"}`` line per command on rank 0; exits 1 if one did not return 0."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    import torch

    from megaloop.post.distill.cli import main as distill_main
    from megaloop.post.rl.cli import main as rl_main

    torch.set_num_threads(1)
    failed = False
    for argv in json.loads(sys.argv[1]):
        rc = {"rl": rl_main, "distill-prefill": distill_main}[argv[0]](argv[1:])
        if os.environ.get("RANK", "0") == "0":
            print("RESULT " + json.dumps({"cmd": argv[0], "rc": rc}), flush=True)
        failed |= rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
