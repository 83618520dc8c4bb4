"""What the runs trained with, and whether eq. 2.7's learning-rate law applies to it."""

from __future__ import annotations

import pytest

from gnsweep.analysis.recipe_warnings import lr_law, recipe_of
from gnsweep.config import Config, ConfigError


def _script(**task) -> Config:
    """A script sweep's config as the composition checks it (its task options validated)."""
    from gnsweep.tasks import checked

    return checked(Config.from_dict({
        "task": {"name": "script", "command": "python main.py", **task},
        "sweep": {"batch_sizes": [8], "learning_rates": [1.0]}}))


def test_a_script_recipe_is_the_users_words_never_gnsweeps_train_defaults():
    said = recipe_of(_script(optimizer="SGD", grad_clip=0.25, schedule="constant"))
    assert said.words() == "sgd, clip 0.25, schedule: constant"
    unsaid = recipe_of(_script())
    assert unsaid.words() == ("optimizer not said (the script's; not said: task.optimizer, "
                              "task.grad_clip, task.schedule)")
    assert "sgd" not in unsaid.words()  # train.optimizer's default is not the script's


@pytest.mark.parametrize(("config", "applies", "why"), [
    (_script(optimizer="sgd", grad_clip=0), True, "is that"),
    (_script(optimizer="sgd", grad_clip=0.25), False, "gradients clipped at 0.25"),
    (_script(optimizer="adamw", grad_clip=0), False, "adamw scales each parameter's step"),
    (_script(optimizer="sgd"), False, "not said: give task.grad_clip"),
    (Config(), True, "(sgd, no clipping) is that"),
    (Config.from_dict({"train": {"grad_clip": 1.0}}), False, "clipped at 1"),
])
def test_the_sgd_law_is_stated_and_marked_where_it_does_not_apply(config, applies, why):
    ok, sentence = lr_law(config)
    assert ok is applies and why in sentence
    assert sentence.startswith("the learning-rate law eq. 2.7") and "plain SGD" in sentence


def test_a_clip_that_is_no_norm_is_refused():
    with pytest.raises(ConfigError, match=r"task\.grad_clip"):
        _script(grad_clip=-1)
