"""`gyre train` on a Hugging Face checkpoint directory: the proxy gets that checkpoint's tokenizer and chat
template, and a checkpoint whose template the proxy cannot render is refused before anything runs."""

from pathlib import Path

import pytest

from gyre.config import EngineSection, RolloutSection, TrainConfig
from gyre.proxy.template_render import TemplateError, TemplateRenderer
from gyre.train.inprocess import TrainingRun
from tests.hf_checkpoint import save_checkpoint, train_tokenizer


def _config(tmp_path: Path, model: Path) -> TrainConfig:
    return TrainConfig(
        name="ckpt", run_dir=tmp_path / "run", seed=0, steps=1, engine=EngineSection(model=str(model)),
        rollout=RolloutSection(task_ids=("hello",), groups_per_step=1, group_size=1, max_concurrency=1, timeout_s=60),
    )


def test_the_proxy_uses_the_checkpoint_tokenizer_and_template(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path / "ckpt")
    run = TrainingRun(_config(tmp_path, checkpoint))
    try:
        proxy = run.topology.proxy.proxy
        assert isinstance(proxy.renderer, TemplateRenderer)
        assert len(proxy.codec.tokenizer) == len(train_tokenizer())
        assert proxy.codec.encode("print the file") == train_tokenizer().encode("print the file")
    finally:
        run.close()


def test_a_template_the_proxy_cannot_render_is_refused(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path / "ckpt")
    tokenizer = train_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no turns, no stop token
    tokenizer.save_pretrained(checkpoint)
    with pytest.raises(TemplateError, match="chat template"):
        TrainingRun(_config(tmp_path, checkpoint))
