#!/usr/bin/env python
"""Convert a megaloop training checkpoint (any TP/PP layout) to a Hugging Face folder.

    python tools/convert_to_hf.py --checkpoint RUN/checkpoints/step_00001000 --out hf/ [--dtype bf16]
        [--no-validate] [--tokenizer PATH] [--num-recurrences R] [--max-shard-size 2GB]

``--checkpoint`` may also name a run directory or its ``checkpoints/`` directory (newest complete
checkpoint). The folder loads with ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)``
without megaloop installed. Conversion validates native vs HF logits (FP32, eval mode, configured
depth) and fails when ``max|Δ| / max(1, max|logit|)`` exceeds 1e-4. ``--from-hf`` converts an HF
folder back into a megaloop checkpoint under ``--out``. Exit status 2 on bad input or failed validation.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")
os.environ.setdefault("PYTHONWARNINGS", "ignore")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint step dir, checkpoints dir or run dir "
                    "(with --from-hf: the HF folder)")
    ap.add_argument("--out", required=True, help="output HF folder (with --from-hf: checkpoints root)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="saved weight dtype")
    ap.add_argument("--no-validate", action="store_true", help="skip the native-vs-HF logits check")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (or its dir); default: from the run")
    ap.add_argument("--num-recurrences", type=int, default=None,
                    help="default depth written to config.json (default: the run's train.eval_depth)")
    ap.add_argument("--max-shard-size", default="2GB")
    ap.add_argument("--from-hf", action="store_true", help="convert an HF folder back to a megaloop checkpoint")
    args = ap.parse_args(argv)

    from megaloop.hf.convert import ConversionError, convert_from_hf, convert_to_hf

    try:
        if args.from_hf:
            path = convert_from_hf(args.checkpoint, args.out)
            print(f"wrote megaloop checkpoint {path}")
            return 0
        report = convert_to_hf(args.checkpoint, args.out, dtype=args.dtype, validate=not args.no_validate,
                               tokenizer=args.tokenizer, num_recurrences=args.num_recurrences,
                               max_shard_size=args.max_shard_size)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {report['checkpoint']} (step {report['step']}, {report['seconds']} s)")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip gloo/megatron teardown at exit
