"""Checkpoints: the orbax manager, what a checkpoint holds, Hugging Face conversion, safetensors.

The step directory's layout (`STATE`, `DATA_ITER`, `CONFIG`, `saved_config_path`) is in storage/layout.py.
"""

from MaxLite.storage.layout import CONFIG, CONFIG_FILE, DATA_ITER, STATE, saved_config_path, step_dir_of

__all__ = ["CONFIG", "CONFIG_FILE", "DATA_ITER", "STATE", "saved_config_path", "step_dir_of"]
