"""Supervised warm start: task families, a scripted imperfect expert, a locally trained tokenizer, `gyre sft`.

The path a real model takes before RL, on CPU: demonstrations in the OpenAI or Anthropic message format are
rendered with the checkpoint's own chat template, the loss is on assistant tokens only, and the result is a
Hugging Face checkpoint directory that `gyre train` starts from (`[engine] model = DIR`).
"""
