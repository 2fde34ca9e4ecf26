"""Hugging Face export of megaloop models.

``configuration_megaloop`` / ``modeling_megaloop`` are self-contained (torch + transformers only) and
are copied into every exported folder; ``convert`` (megaloop checkpoint ⇄ HF folder) needs megatron.
"""

from megaloop.hf.configuration_megaloop import MegaloopConfig
from megaloop.hf.modeling_megaloop import MegaloopCache, MegaloopForCausalLM, MegaloopModel

__all__ = ["MegaloopCache", "MegaloopConfig", "MegaloopForCausalLM", "MegaloopModel"]
