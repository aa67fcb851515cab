"""The README's fine-tuning walkthroughs, run as written (end_to_end/readme.py says how): SFT then DPO on the
shipped chats, Qwen3 SFT then DPO, ORPO, GRPO, LoRA; the exports load in transformers and continue as decode.py
printed."""

from __future__ import annotations

import math
import os

import pytest
import readme

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

PART = "fine_tuning"

ran = readme.ran_fixture(PART)
test_readme_step = readme.step_test(PART)


def test_qwen3_sft_then_dpo_exports_with_its_chat_template(ran):
  """Fine-tune Qwen3: SFT trained and evaluated, DPO's first loss is log 2 (the policy is its reference), the export
  is a Qwen3 with the chat template, and its greedy text is decode.py's."""
  import transformers

  sft, dpo = readme.metric_rows(ran, "qwen3-sft"), readme.metric_rows(ran, "qwen3-dpo")
  assert [r["step"] for r in sft if "loss" in r] == [1, 2] and all(r["trained_tokens"] > 0 for r in sft if "loss" in r)
  assert math.isclose(dpo[0]["loss"], math.log(2), rel_tol=1e-3)  # bfloat16, as the README trains
  out = os.path.join(ran["checkout"], "qwen3-dpo-hf")
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")
  prompt = 'The section "Lists" says:'
  printed = readme.printed_completion(readme.output(ran, r"decode\.py .*qwen3-dpo"), prompt)
  assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen3ForCausalLM"
  assert readme.greedy_in_transformers(out, prompt, 32, add_bos=False) == printed


def test_lora_export_has_merged_weights_adapter_and_base(ran):
  folder = os.path.join(ran["checkout"], "qwen3-sft-lora-hf")
  assert {"config.json", "adapter", "base"} <= set(os.listdir(folder))
  assert "adapter_config.json" in os.listdir(os.path.join(folder, "adapter"))
