"""Launching jobs: local multi-process runs, and the commands that start a job on every host of a TPU pod."""
