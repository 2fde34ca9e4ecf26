"""Hugging Face export of megaloop models.

The ``*_megaloop`` modules (configuration, layers, modeling with the recurrence API, cache, injection, adaptive depth)
are self-contained (torch + transformers only) and are copied into every exported folder; ``convert``
(megaloop checkpoint ⇄ HF folder, ``megaloop convert``) needs megatron; ``load`` is the one validated
loader of checkpoints and HF folders for every command.
"""

from megaloop.hf.configuration_megaloop import MegaloopConfig
from megaloop.hf.modeling_megaloop import MegaloopCache, MegaloopForCausalLM, MegaloopModel

__all__ = ["MegaloopCache", "MegaloopConfig", "MegaloopForCausalLM", "MegaloopModel"]
