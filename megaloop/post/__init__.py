"""DeepSpeed ZeRO glue for the post-training stages that run on the HF model (``megaloop rl``,
``megaloop distill-prefill``): config loading/validation (:mod:`.ds_config`) and one optimizer
interface over a plain single-process AdamW or a DeepSpeed engine (:mod:`.engine`); run folders and
checkpoint facts (:mod:`.runs`); the graceful stop on SIGTERM/SIGUSR1/Ctrl-C (:mod:`.stop`: checkpoint,
exit 75/130). Pretraining stays on megatron-core."""

from megaloop.post.ds_config import STAGES, load_ds_config, shipped_config
from megaloop.post.engine import DeepSpeedEngine, PlainEngine, PostEngine, dist_info, init_post_distributed

__all__ = ["DeepSpeedEngine", "PlainEngine", "PostEngine", "STAGES", "dist_info", "init_post_distributed",
           "load_ds_config", "shipped_config"]
