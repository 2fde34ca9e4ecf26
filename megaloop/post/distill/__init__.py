"""Distilled prefill (SPEC §10): a student predicts the looped teacher's endpoint from the prelude
output; prefill = student + one teacher recurrence + coda into a terminal KV cache
(:mod:`.prefill_student`); the ``megaloop distill-prefill`` command is :func:`megaloop.post.distill.cli.main`."""

from megaloop.post.distill.prefill_student import (DistillConfig, PrefillStudent, calibrate_sigma2, distill_loss,
                                              generate, load_student, save_student, student_prefill,
                                              train_student)

__all__ = ["DistillConfig", "PrefillStudent", "calibrate_sigma2", "distill_loss", "generate", "load_student",
           "save_student", "student_prefill", "train_student"]
