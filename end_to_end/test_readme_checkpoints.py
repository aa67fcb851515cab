"""The README's checkpoints and Hugging Face parts, run as written (end_to_end/readme.py says how): resume and
load, convert a Llama folder in and out, continue pretraining Llama 3.2 and check the export in transformers."""

from __future__ import annotations

import os

import pytest
import readme

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

PART = "checkpoints"

ran = readme.ran_fixture(PART)
test_readme_step = readme.step_test(PART)


def test_continued_llama3_exports_and_continues_as_decode_printed(ran):
  """Continue pretraining: the export is a Llama 3 folder transformers loads (BOS/EOS from the tokenizer, llama3 RoPE,
  the original context length), training moved it, and its greedy text is decode.py's."""
  import torch
  import transformers

  out, original = (os.path.join(ran["checkout"], d) for d in ("llama32-cpt-hf", "Llama-3.2-1B"))
  prompt = "The capital of France is"
  printed = readme.printed_completion(readme.output(ran, r"decode\.py .*llama32-cpt"), prompt)
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert (model.config.bos_token_id, model.config.eos_token_id) == (0, 1)  # from the tokenizer, not Llama 2's 1, 2
  assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.tie_word_embeddings
  assert model.config.max_position_embeddings == 131072
  base = transformers.AutoModelForCausalLM.from_pretrained(original)
  assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
  assert readme.greedy_in_transformers(out, prompt, 32, add_bos=True) == printed
