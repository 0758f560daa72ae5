"""The configuration contract: YAML + overrides into typed dataclasses, and clear one-line errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from common.configure import UserError, config_from_dict, load_config
from pipeline.prepare.config import PrepareConfig

ROOT = Path(__file__).resolve().parents[2]


def test_precedence_defaults_then_yaml_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seq_len: 64\nshard:\n  buckets: 3\n")
    cfg = load_config(PrepareConfig, path, ["shard.buckets=5"])
    assert cfg.seq_len == 64  # YAML over default (128)
    assert cfg.shard.buckets == 5  # command line over YAML
    assert cfg.shard.max_samples == PrepareConfig().shard.max_samples  # default kept
    assert cfg.source.paths == ["/usr/share/locale/de/LC_MESSAGES/*.mo"]  # interpolation resolved


# A file that sets a key: one that sets none is refused for that
# (tests/pipeline/test_input_edges.py).
SOME_KEY = "seq_len: 64\n"


@pytest.mark.parametrize(
    "yaml_text, overrides, expected",
    [
        ("shard:\n  bukets: 3\n", [], "shard.bukets: unknown key"),
        ("seq_len: many\n", [], "seq_len"),
        (SOME_KEY, ["tokenizer.vocab_sise=10"], "tokenizer.vocab_sise: unknown key"),
        (SOME_KEY, ["ray.num_workers=two"], "ray.num_workers"),
        (SOME_KEY, ["seq_len"], "not of the form"),
        ("seq_len: [1\n", [], "not valid YAML"),
        # A YAML object tag builds nothing, from a file or from the command line alike.
        (
            "seq_len: !!python/name:os.system\n",
            [],
            "not valid YAML: could not determine a constructor",
        ),
        (
            SOME_KEY,
            ["seq_len=!!python/name:os.system"],
            "seq_len: value '!!python/name:os.system' is not valid YAML: could not determine a constructor",
        ),
        (
            SOME_KEY,
            ["shard.buckets=!!python/object/apply:os.system [echo]"],
            "shard.buckets: value '!!python/object/apply:os.system [echo]' is not valid YAML",
        ),
        (
            SOME_KEY,
            ["seq_len=!!int many"],
            "seq_len: value '!!int many' is not valid YAML: invalid literal",
        ),
    ],
)
def test_bad_config_names_the_key_and_the_file(tmp_path, yaml_text, overrides, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(UserError) as err:
        load_config(PrepareConfig, path, overrides)
    message = str(err.value)
    assert expected in message and "\n" not in message
    if not overrides:
        assert str(path) in message


def test_cli_bad_key_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\nshard:\n  bukets: 3\n")
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.prepare", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0
    assert "shard.bukets" in run.stderr and str(path) in run.stderr
    assert not (tmp_path / "out").exists()


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(PrepareConfig, tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_in_configs_validates(path):
    if path.name.startswith("prepare"):
        assert load_config(PrepareConfig, path).tasks
        return
    if path.name.startswith(("main", "transfer")):
        from launch.config import MainConfig
        from launch.main.plan import check_main

        assert check_main(load_config(MainConfig, path))
        return
    from launch.config import TrainConfig
    from launch.resolve import check_config

    cfg = load_config(TrainConfig, path)
    if cfg.model.vocab_size == 0:  # taken from the dataset at run time
        cfg.model.vocab_size = 8000
    check_config(cfg)


def test_translation_gpu_stacks_are_gpt2_small_and_bert_base():
    """The GPU-scale fine-tuning config (the worked example in docs/slurm.md, configs/transfer_gpu.yaml)
    is warm-started from exported gpt2_small and bert_base: its decoder and encoder stacks agree
    with them on every field the warm start checks."""
    from launch.config import TrainConfig
    from model.warm_start import architecture_fields

    seq2seq = load_config(TrainConfig, ROOT / "configs" / "translation_gpu.yaml").model
    for stack, source in (("decoder", "gpt2_small.yaml"), ("encoder", "bert_base.yaml")):
        pretrained = load_config(TrainConfig, ROOT / "configs" / source).model
        # both taken from the dataset at run time
        pretrained.vocab_size = seq2seq.vocab_size = 32000
        # positions are resized
        fields = [name for name in architecture_fields(stack) if name != "max_seq_len"]
        side = seq2seq.for_stack(stack)
        assert {name: getattr(side, name) for name in fields} == {
            name: getattr(pretrained, name) for name in fields
        }, stack


@pytest.mark.parametrize(
    "schema,override,hint",
    [
        (
            "EvaluateConfig",
            "zero_stage=3",
            "zero_stage: unknown key (renamed: deepspeed.zero_stage)",
        ),
        (
            "EvaluateConfig",
            "deepspeed_config=ds.json",
            "deepspeed_config: unknown key (renamed: deepspeed.config_file)",
        ),
        ("AverageConfig", "run_dir=runs/x", "run_dir: unknown key (renamed: checkpoint)"),
        ("MainConfig", "zero_stage=3", "zero_stage: unknown key (renamed: deepspeed.zero_stage)"),
    ],
)
def test_a_renamed_key_names_its_new_spelling(schema, override, hint):
    """One name for one thing (issue #32 §5): the input of every tool is `checkpoint=`, DeepSpeed's
    options are `deepspeed.*`; the old spelling is refused in one line that gives the new one."""
    import launch.config

    with pytest.raises(UserError) as err:
        load_config(
            getattr(launch.config, schema),
            None,
            ["checkpoint=x", "out=y", override] if schema != "MainConfig" else [override],
        )
    assert hint in str(err.value)


# Issue #45, item 6: what OmegaConf or yaml report as a traceback or a line naming nothing.
BAD_SHAPES = {
    "a YAML list": ("- seq_len: 64\n- shard: 3\n", [], "holds a YAML list, not keys and values"),
    "a bare value": ("64\n", [], "holds a single value (int), not keys and values"),
    "a duplicate key": (
        "seq_len: 64\nshard:\n  buckets: 3\nseq_len: 32\n",
        [],
        "found duplicate key seq_len (line 4, column 1; while constructing a mapping at line 1)",
    ),
    "a list index": (
        SOME_KEY,
        ["sources[1].name=x"],
        "sources[1].name: a list's items are not set one by one; give the whole list (sources=[...])",
    ),
    "keys where a list belongs": (
        "source:\n  paths: {a: 1}\n",
        [],
        "source.paths: a list ([...]) belongs here, not keys and values",
    ),
    "a list where keys belong": (
        SOME_KEY,
        ["tokenizer=[1, 2]"],
        "tokenizer: keys and values belong",
    ),
}


@pytest.mark.parametrize("case", BAD_SHAPES, ids=list(BAD_SHAPES))
def test_a_config_of_the_wrong_shape_is_one_line_naming_where(tmp_path, case):
    yaml_text, overrides, expected = BAD_SHAPES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(UserError) as err:
        load_config(PrepareConfig, path, overrides)
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    assert str(path) in message if not overrides else f"command line {overrides[0]!r}" in message


@pytest.mark.parametrize("case", ["a YAML list", "a duplicate key", "a list index"])
def test_the_entry_points_say_a_wrong_shape_in_one_line(tmp_path, case):
    yaml_text, overrides, expected = BAD_SHAPES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\n" if yaml_text == SOME_KEY else yaml_text)
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.prepare", str(path), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr


# A config that reads the environment would store the value it read in
# config.yaml, checkpoints, W&B and every export's provenance.json.
ENV_READS = {
    "in the file": (
        "tokenizer:\n  path: ${oc.env:PRETRAIN_TEST_SECRET}\n",
        [],
        "tokenizer.path",
    ),
    "inside a path": ("output_dir: /data/${oc.env:PRETRAIN_TEST_SECRET}/x\n", [], "output_dir"),
    "on the command line": (
        SOME_KEY,
        ["source.paths=[a, '${oc.env:PRETRAIN_TEST_SECRET}']"],
        "source.paths[1]",
    ),
    "nested": (SOME_KEY, ["output_dir=${oc.decode:${oc.env:PRETRAIN_TEST_SECRET}}"], "output_dir"),
    "escaped": (SOME_KEY, ["output_dir=\\${oc.env:PRETRAIN_TEST_SECRET}"], "output_dir"),
}


@pytest.mark.parametrize("case", ENV_READS, ids=list(ENV_READS))
def test_a_config_reading_the_environment_is_refused(tmp_path, monkeypatch, case):
    monkeypatch.setenv("PRETRAIN_TEST_SECRET", "hunter2-token")
    yaml_text, overrides, key = ENV_READS[case]
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(UserError) as err:
        load_config(PrepareConfig, path, overrides)
    message = str(err.value)
    assert f": {key}: ${{oc.env:...}} is refused: configs are stored resolved" in message, message
    assert "hunter2" not in message and "\n" not in message
    # A saved config read back (a manifest's, a checkpoint's) is held to the same rule.
    with pytest.raises(UserError, match=r"manifest: output_dir: \$\{oc.env:...\} is refused"):
        config_from_dict(PrepareConfig, {"output_dir": "${oc.env:HOME}"}, "manifest")
    # Interpolations between keys stay as they were.
    assert load_config(PrepareConfig, None, ["output_dir=${seq_len}"]).output_dir == "128"
