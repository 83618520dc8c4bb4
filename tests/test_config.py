"""Config composition from conf/ and validation of user mistakes."""

import pytest

from gnsweep.compose import compose
from gnsweep.config import Config, ConfigError
from gnsweep.sweep import expand_grid


def test_default_composes_to_the_documented_grid():
    config = compose([])
    assert config.task.name == "digits"
    assert config.executor.kind == "local"
    assert len(config.sweep.batch_sizes) >= 6
    assert min(config.sweep.batch_sizes) <= 8 and max(config.sweep.batch_sizes) >= 1024
    assert len(expand_grid(config)) == (len(config.sweep.batch_sizes)
                                        * len(config.sweep.learning_rates))


def test_overrides_reach_typed_fields():
    config = compose(["sweep.batch_sizes=[16,64]", "sweep.learning_rates=[0.1,0.3]",
                      "task.hidden=32", "noise.every=4"])
    assert config.sweep.batch_sizes == [16, 64]
    assert config.sweep.learning_rates == [0.1, 0.3]
    assert config.task.options["hidden"] == 32
    assert config.noise.every == 4
    specs = expand_grid(config)
    assert [(s.batch_size, s.learning_rate) for s in specs] == [
        (16, 0.1), (16, 0.3), (64, 0.1), (64, 0.3)]
    assert len({s.run_id for s in specs}) == 4


def test_config_round_trips_through_json_form():
    config = compose(["sweep=tiny"])
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("override", "names"), [
    ("sweep.batch_sizes=[-4]", "sweep.batch_sizes: -4"),
    ("sweep.batch_sizes=[0]", "sweep.batch_sizes: 0"),
    ("sweep.batch_sizes=[8.5]", "sweep.batch_sizes: 8.5"),
    ("task=nope", "task=nope"),
    ("sweep.learning_rates=[abc]", "'abc' is not a number"),
    ("sweep.learning_rates=[]", "sweep.learning_rates: the list is empty"),
    ("sweep.learning_rates=[nan]", "sweep.learning_rates"),
    ("train.optimizer=lbfgs", "train.optimizer: 'lbfgs'"),
    ("noise.method=magic", "noise.method: 'magic'"),
    ("task.widht=3", "task.widht"),
    ("+sweep.colour=3", "sweep.colour"),
    ("executor.workers=-1", "executor.workers"),
    ("sweep.optimizer=adam", "sweep.optimizer is now train.optimizer"),
    ("sweep.momentum=0.9", "sweep.momentum is now train.momentum"),
    ("train.grad_clip=-1", "train.grad_clip: -1.0 must be >= 0"),
    ("train.microbatch_size=-4", "train.microbatch_size: -4 must be >= 0"),
    ("train.precision=fp8", "train.precision: 'fp8' is not one of fp32, bf16, fp16"),
    ("train.decay=exponential", "train.decay: 'exponential'"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.decay=cosine train.warmup_examples=100 train.decay_examples=50",
     "train.decay_examples (50) ends the decay before"),
    ("task.warmup=30", "write +task.warmup=30"),
    ("sweep.colour=3", "sweep.colour: unknown option; known: "),
    ("executor=slurm executor.gpus_per_node=2 executor.nproc_per_node=4",
     "use at most one per GPU"),
])
def test_bad_values_name_the_value(override, names):
    with pytest.raises(ConfigError) as info:
        compose(override.split(" "))
    message = str(info.value)
    assert names in message
    assert "\n" not in message


def test_both_warmups_are_refused_and_the_train_group_reaches_its_fields():
    with pytest.raises(ConfigError, match="both set; keep one"):
        compose(["train.warmup_steps=10", "train.warmup_examples=100"])
    config = compose(["train.optimizer=adamw", "train.weight_decay=0.1", "train.betas=[0.9,0.95]",
                      "train.warmup_examples=100", "train.decay=cosine", "train.grad_clip=1",
                      "train.precision=bf16", "train.microbatch_size=16"])
    train = config.train
    assert (train.optimizer, train.weight_decay, train.betas) == ("adamw", 0.1, [0.9, 0.95])
    assert (train.warmup_examples, train.decay, train.grad_clip) == (100, "cosine", 1.0)
    assert (train.precision, train.microbatch_size) == ("bf16", 16)
    # A sweep file picks its optimizer; the command line wins over it.
    assert compose(["sweep=chars", "task=chars"]).train.optimizer == "adam"
    assert compose(["sweep=chars", "task=chars", "train.optimizer=sgd"]).train.optimizer == "sgd"


def test_missing_group_lists_the_choices():
    with pytest.raises(ConfigError, match=r"choose one of .*digits"):
        compose(["task=nope"])


def test_digits_read_directly_match_sklearns_loader():
    from sklearn.datasets import load_digits as sklearn_digits

    from gnsweep.tasks.digits import load_digits

    pixels, labels = load_digits()
    reference = sklearn_digits()
    assert pixels.shape == (1797, 64)
    assert (pixels == reference.data).all() and (labels == reference.target).all()


def test_metrics_schema_holds_every_noise_estimate_field():
    from dataclasses import fields

    from gnsweep.noise import NoiseEstimate
    from gnsweep.store import METRICS_SCHEMA

    assert {f.name for f in fields(NoiseEstimate)} <= set(METRICS_SCHEMA.names)


def test_experiment_bundle_switches_several_groups():
    config = compose(["+experiment=linreg_truth"])
    assert config.task.name == "linreg"
    assert config.sweep.name == "linreg"
    assert config.noise.probe_per_octave > 0 and config.task.options["teacher_power"] == 1
