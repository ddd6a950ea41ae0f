"""Every flag of every command is a config field's (``cpvlm.config_cli``): the parser's options
are exactly the fields, with the fields' names, defaults, choices and help, so that a flag cannot
be added by hand; and flags -> config gives the config the fields describe."""

import argparse
import dataclasses
import typing

import pytest

from cpvlm import config_cli
from cpvlm.export import ExportConfig
from cpvlm.export import build_parser as export_parser
from cpvlm.simulate.command import PlanConfig
from cpvlm.simulate.command import _parser as plan_parser
from cpvlm.train.command import build_parser as train_parser
from cpvlm.train.config import LoRAConfig, TrainConfig
from cpvlm.train.prepare import PrepareConfig
from cpvlm.train.prepare import build_parser as prepare_parser
from cpvlm.verify import VerifyConfig
from cpvlm.verify import build_parser as verify_parser


def _commands(tmp_path):
    """``{command: (parser, config class, required flags, their config)}``."""
    data = tmp_path / "train.jsonl"
    data.write_text("")
    plan = dict(model="qwen3-vl-tiny", seq_len=1024, gpus=8, gpu_mem=80.0)
    prepare = dict(model=str(tmp_path), data=str(data), out=str(tmp_path / "out"))
    export = dict(run=str(tmp_path), out=str(tmp_path / "hf"))
    return {
        "train": (train_parser(), TrainConfig, [], TrainConfig()),
        "verify": (verify_parser(), VerifyConfig, [], VerifyConfig()),
        "prepare": (prepare_parser(), PrepareConfig, _flags(prepare), PrepareConfig(**prepare)),
        "plan": (plan_parser(), PlanConfig, _flags(plan), PlanConfig(**plan)),
        "export": (export_parser(), ExportConfig, _flags(export), ExportConfig(**export)),
    }


def _flags(fields: dict) -> list[str]:
    return [t for k, v in fields.items() for t in ("--" + k.replace("_", "-"), str(v))]


COMMANDS = ("train", "verify", "prepare", "plan", "export")


def _options(parser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flags_are_the_config_fields(tmp_path, command):
    parser, cls, _, _ = _commands(tmp_path)[command]
    fields = config_cli.dests(cls)
    assert set(_options(parser)) == set(fields)
    for dest, action in _options(parser).items():
        f, hint, unset = fields[dest]
        prefix = dest[: len(dest) - len(f.name)]
        flag = f.metadata.get("flag", "--" + dest.replace("_", "-"))
        assert action.option_strings[0] == flag, dest
        if action.nargs == 0 and isinstance(action, argparse.BooleanOptionalAction):
            assert action.option_strings == [flag, "--no-" + flag[2:]], dest
        text = f.metadata["help"]
        text = text() if callable(text) else text
        assert isinstance(text, str) and text and action.help == text, dest
        hint, _ = config_cli._optional(hint)
        if typing.get_origin(hint) is typing.Literal:
            assert tuple(action.choices) == typing.get_args(hint), dest
        else:
            assert action.choices == f.metadata.get("choices"), dest
        default = config_cli.field_default(f)
        assert action.required == (default is dataclasses.MISSING and not unset), dest
        if unset:  # the flags of an optional sub-config (LoRA): unset unless given
            assert action.default is None and prefix, dest


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flags_defaults_are_the_fields_defaults(tmp_path, command):
    parser, cls, required, config = _commands(tmp_path)[command]
    assert config_cli.from_args(cls, parser.parse_args(required)) == config
    parsed = parser.parse_args(required)
    for dest, (f, hint, unset) in config_cli.dests(cls).items():
        default = config_cli.field_default(f)
        if not unset and default is not dataclasses.MISSING:
            assert config_cli._value(getattr(parsed, dest), hint) == default, dest


def test_train_flags_round_trip_to_their_fields(tmp_path):
    flags = [
        "--no-shuffle", "--lora-r", "4", "--lora-targets", "q_proj", "v_proj", "--data-arg",
        "a=1", "--data-arg", "b=2", "--resume", "auto", "--out", str(tmp_path), "--attn",
        "hybrid", "--ulysses-size", "2", "--dtype", "bfloat16", "--async-save",
    ]  # fmt: skip
    config = config_cli.from_args(TrainConfig, train_parser().parse_args(flags))
    assert config == TrainConfig().replace(
        model={"dtype": "bfloat16", "lora": LoRAConfig(4, targets=("q_proj", "v_proj"))},
        parallel={"attn": "hybrid", "ulysses_size": 2},
        data={"shuffle": False, "data_args": ("a=1", "b=2")},
        run={"resume": "auto", "out": str(tmp_path), "async_save": True},
    )
    assert config_cli.from_args(TrainConfig, train_parser().parse_args([])).model.lora is None


def test_two_fields_of_one_flag_are_refused():
    @dataclasses.dataclass
    class A:
        seed: int = config_cli.arg(0, help="a")

    @dataclasses.dataclass
    class B:
        a: A = config_cli.arg(default_factory=A)
        seed: int = config_cli.arg(1, help="b")

    with pytest.raises(ValueError, match="two fields make the flag dest 'seed'"):
        config_cli.add_fields(argparse.ArgumentParser(), B)


def test_the_train_cp_options_are_cpoptions_fields():
    """``ParallelConfig`` takes the CP options' declarations from ``CPOptions`` (``like``): the
    same annotation, default and metadata (help, the parse that gives CPOptions' message)."""
    from cpvlm.options import CPOptions
    from cpvlm.train.config import ParallelConfig

    mine, theirs = config_cli.dests(ParallelConfig), config_cli.dests(CPOptions)
    for name in ("attn", "vision", "flow", "layout", "ulysses_size"):
        (f, hint, _), (g, ghint, _) = mine[name], theirs[name]
        assert hint == ghint and f.default == g.default and f.metadata == g.metadata, name
