"""RL for looped LMs with endpoint reuse (SPEC §9): gradient estimators (:mod:`.reuse`) over the
:class:`~megaloop.post.rl.parts.LoopedParts` interface, a GRPO loop (:mod:`.grpo`), verifiable
tasks (:mod:`.tasks`) and the ``megaloop rl`` command (:func:`megaloop.post.rl.cli.main`)."""

from megaloop.post.rl.parts import HFLoopedParts, LoopedParts, NativeLoopedParts, looped_parts
from megaloop.post.rl.reuse import (ARMS, GradStats, SavedTensorMeter, backward, bptt_backward, endpoint,
                               recompute_backward, reuse_backward)
from megaloop.post.rl.tasks import (ArithmeticTask, ByteTokenizer, Example, ExactAnswerReward, FinalNumberReward,
                               JsonlTask, RewardFn, Task, make_task)

__all__ = ["ARMS", "ArithmeticTask", "ByteTokenizer", "Example", "ExactAnswerReward", "FinalNumberReward",
           "GradStats", "HFLoopedParts", "JsonlTask", "LoopedParts", "NativeLoopedParts", "RewardFn",
           "SavedTensorMeter", "Task", "backward", "bptt_backward", "endpoint", "looped_parts", "make_task",
           "recompute_backward", "reuse_backward"]
