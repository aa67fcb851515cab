"""The training objectives, each one module that registers itself (config/objectives.py says what one declares):
pretraining (the default), SFT (use_sft), DPO and ORPO (use_dpo with dpo_algo), GRPO (use_grpo).

Importing this package registers them and lists their key groups for the schema (config/key_groups.py); it imports
no jax, so `--help` and config validation stay fast. Adding an objective is adding its module here.
"""

import importlib

MODULES = ("pretraining", "sft", "dpo", "orpo", "grpo")
_loaded = [importlib.import_module(f"{__name__}.{name}") for name in MODULES]
KEY_GROUPS = tuple(group for module in _loaded for group in getattr(module, "KEY_GROUPS", ()))
