"""What the test files share, by concept: a test file imports from here, never from another test file or conftest.py.

- fast_compile: the XLA flags the tests compile with (jax-free: conftest.py sets them before jax is imported).
- config: the repo's paths, configs of the simulated devices, the train.py command, ArrayRecord contents.
- end_to_end: end_to_end/'s helper modules (procs, gcs, bench_plan) for the files under tests/.
- layouts: the tiny training runs the parallelism-layout tests compare with one device.
- hf: tiny transformers models of each family, and a converted MaxLite step's config, parameters and logits.
- lora: the LoRA settings and the LoRA model's logits that the PEFT tests share.

tests/ is on sys.path because tests/conftest.py lives there (pytest's prepend import mode), so `from support.config
import make_config` works from every folder under tests/.
"""
