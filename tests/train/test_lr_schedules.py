"""train.lr_schedule (cosine, wsd, constant) at chosen steps from their formulas, their config checks, and
the resume rule: a changed schedule is refused, naming the fields and the override, which then follows
the new schedule from the resumed step."""
import dataclasses
import json
import math

import pytest

from gdn_parallel.config import ConfigError, TrainConfig
from gdn_parallel.train.__main__ import run
from gdn_parallel.train.schedule import check_resumed_schedule, lr_at

# warmup 10, then (cosine) 89 decay steps, or (wsd) 70 stable steps and a decay over the last 20
RUN = dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, steps=100)


def schedule(name: str, **fields) -> TrainConfig:
    return TrainConfig(**{**RUN, "lr_schedule": name, **fields})


def test_cosine_warms_up_then_falls_along_a_half_cosine_to_min_lr():
    train = schedule("cosine")
    assert lr_at(0, train) == pytest.approx(0.1) and lr_at(9, train) == 1.0        # warmup: (step + 1) / 10
    assert lr_at(10, train) == 1.0                                                 # the decay's start
    assert lr_at(40, train) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 30 / 89)))
    assert lr_at(99, train) == pytest.approx(0.1)                                  # min_lr at the last step
    lrs = [lr_at(step, train) for step in range(100)]
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(0, TrainConfig(lr=2.0, warmup_steps=0, steps=1)) == pytest.approx(0.2)  # the last: min_lr


@pytest.mark.parametrize("shape, scale", [("1-sqrt", lambda p: 1 - math.sqrt(p)),
                                          ("linear", lambda p: 1 - p)])
def test_wsd_holds_lr_then_decays_over_the_last_decay_fraction(shape, scale):
    train = schedule("wsd", decay_fraction=0.2, decay_shape=shape)
    assert train.decay_steps == 20
    # warmup end, stable
    assert lr_at(9, train) == 1.0 and lr_at(10, train) == 1.0 and lr_at(79, train) == 1.0
    # the decay's first step
    assert lr_at(80, train) == pytest.approx(0.1 + 0.9 * scale(1 / 20))
    assert lr_at(89, train) == pytest.approx(0.1 + 0.9 * scale(0.5))
    # min_lr at the last step
    assert lr_at(99, train) == pytest.approx(0.1)
    assert lr_at(120, train) == pytest.approx(0.1)                                         # and after it


def test_constant_holds_lr_after_the_warmup():
    train = schedule("constant")
    assert [lr_at(step, train) for step in (0, 9, 10, 50, 99)] == [pytest.approx(0.1), 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("fraction, steps, decay_steps", [(0.2, 30, 6), (0.001, 10, 1), (1.0, 7, 7)])
def test_the_wsd_decay_length_rounds_and_takes_at_least_one_step(fraction, steps, decay_steps):
    assert TrainConfig(steps=steps, decay_fraction=fraction).decay_steps == decay_steps


@pytest.mark.parametrize("fields, named", [
    (dict(lr_schedule="linear"), "train.lr_schedule='linear' is not supported"),
    (dict(decay_shape="cosine"), "train.decay_shape='cosine' is not supported"),
    (dict(decay_fraction=0.0), "train.decay_fraction=0.0 must be in (0, 1]"),
    (dict(decay_fraction=float("nan")), "train.decay_fraction=nan must be in (0, 1]"),
    (dict(lr_schedule="wsd", steps=100, warmup_steps=90, decay_fraction=0.2),
     "train.lr_schedule=wsd: train.warmup_steps=90 plus the decay's round(train.decay_fraction * steps) = 20 "
     "steps exceed train.steps=100; lower train.decay_fraction or train.warmup_steps"),
])
def test_bad_schedule_settings_name_the_field(fields, named):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**fields).validate()
    assert named in str(info.value)


def saved_config(train: TrainConfig) -> dict:
    return {"train": dataclasses.asdict(train)}


def test_a_changed_schedule_is_refused_naming_each_field_and_the_override():
    with pytest.raises(ConfigError) as info:
        check_resumed_schedule(saved_config(schedule("cosine")), schedule("cosine", steps=120, lr=0.5),
                               40, print)
    message = str(info.value)
    assert "train.lr: saved 1.0, new 0.5, train.steps: saved 100, new 120" in message, message
    assert "--set train.schedule_override=true" in message and "\n" not in message
    old, new = lr_at(40, schedule("cosine")), lr_at(40, schedule("cosine", steps=120, lr=0.5))
    assert f"LR at step 40: {old:.3e} saved, {new:.3e} new" in message, message


def test_only_the_settings_a_schedule_reads_are_compared():
    said = []
    # constant reads neither train.steps nor min_lr_ratio: extending a constant run keeps its LR
    check_resumed_schedule(saved_config(schedule("constant")),
                           schedule("constant", steps=300, min_lr_ratio=0.5), 50, said.append)
    check_resumed_schedule(saved_config(schedule("cosine")), schedule("cosine", decay_fraction=0.5),
                           50, said.append)
    assert said == []
    with pytest.raises(ConfigError, match=r"train.lr_schedule: saved 'cosine', new 'wsd', "
                                          r"train.decay_fraction: saved 0.2, new 0.3\)"):
        check_resumed_schedule(saved_config(schedule("cosine")), schedule("wsd", decay_fraction=0.3),
                               50, print)


def test_a_checkpoint_from_before_lr_schedule_ran_cosine_and_one_at_step_0_applied_none():
    older = saved_config(schedule("cosine"))
    for name in ("lr_schedule", "decay_fraction", "decay_shape", "schedule_override"):
        del older["train"][name]
    check_resumed_schedule(older, schedule("cosine"), 50, print)
    with pytest.raises(ConfigError, match="train.lr_schedule: saved 'cosine', new 'constant'"):
        check_resumed_schedule(older, schedule("constant"), 50, print)
    check_resumed_schedule(older, schedule("constant"), 0, print)   # gdn-convert from-hf's step-0 checkpoints


TINY = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2", "--set",
        "train.log_every=1", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1"]


def lr_by_step(out_dir) -> dict:
    """step -> lr from metrics.jsonl; a resumed process's records replace the earlier ones."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["lr"] for record in records if "lr" in record}


def test_extending_a_run_with_steps_is_refused_then_the_override_follows_the_new_schedule(tmp_path, capsys):
    out_dir = tmp_path / "run"
    run(["--steps", "3", *TINY, "--set", f"train.out_dir={out_dir}"])
    capsys.readouterr()
    extend = ["--steps", "5", *TINY, "--set", f"train.out_dir={out_dir}", "--resume", "auto"]
    with pytest.raises(SystemExit) as info:
        run(extend)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "train.steps: saved 3, new 5" in err and "--set train.schedule_override=true" in err, err

    summary = run([*extend, "--set", "train.schedule_override=true"])
    assert summary["start_step"] == 3 and summary["steps"] == 5
    saved, new = (TrainConfig(lr=3e-3, warmup_steps=1, steps=steps) for steps in (3, 5))  # tiny-cpu's lr
    lrs = lr_by_step(out_dir)
    assert [lrs[step] for step in range(5)] == \
        [lr_at(s, saved) for s in range(3)] + [lr_at(s, new) for s in (3, 4)]
    out = capsys.readouterr().out
    assert (f"resume | train.schedule_override: the new LR schedule from step 3 (train.steps: saved 3, "
            f"new 5); LR at step 3: {lr_at(3, saved):.3e} saved, {lr_at(3, new):.3e} new") in out, out
