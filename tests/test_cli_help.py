"""``--help`` of every config-driven command shows the values a run without CONFIG actually gets, and
``--print-config`` prints the config a run would use."""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

import pytest
import yaml

from vlrft.cli import build_parser, main
from vlrft.commands import config_from_args

CONFIG_COMMANDS = ["train-policy", "train-sft", "train-dpo", "train-reward-model", "probe-rewards"]
KEY_LINE = re.compile(r"^  (\S+) \((.*)$")


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _shown_defaults(text: str) -> dict[str, tuple[Any, bool]]:
    """dotted key -> (the default the help line shows, read back as Python; marked [demo])."""
    shown = {}
    for line in text.splitlines():
        match = KEY_LINE.match(line)
        if match is None:
            continue
        rest = match.group(2)
        rest = rest[rest.index(", default ") + len(", default ") :] if ", default " in rest else rest[8:]
        for end in [m.start() for m in re.finditer(r"\): ", rest)] + [len(rest) - 1]:
            candidate, marked = rest[:end], rest[:end].endswith(" [demo]")
            try:
                shown[match.group(1)] = (ast.literal_eval(candidate.removesuffix(" [demo]")), marked)
                break
            except (ValueError, SyntaxError):
                continue
        else:
            raise AssertionError(f"no readable default in: {line}")
    return shown


def _leaves(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_leaves(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def _agrees(shown: Any, value: Any) -> bool:
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):  # reward sources: set fields only
        return isinstance(shown, list) and [type(v)(**s) for v, s in zip(value, shown)] == value
    return shown == value and type(shown) is type(value)


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_help_shows_the_values_of_a_run_without_config(command, capsys):
    args = build_parser().parse_args([command])
    resolved = _leaves(config_from_args(args.config_schema, [], args.config_default))  # what run() resolves
    text = _help(command, capsys)
    shown = _shown_defaults(text)
    assert set(shown) == set(resolved)
    wrong = {key: (shown[key][0], value) for key, value in resolved.items() if not _agrees(shown[key][0], value)}
    assert wrong == {}
    assert "defaults shown are those of a run with no CONFIG" in text
    if args.config_default is None:
        assert not any(marked for _, marked in shown.values())


def test_policy_help_shows_the_embedded_demo_not_the_schema(capsys):
    text = _help("train-policy", capsys)
    shown = _shown_defaults(text)
    assert "the embedded vlrft/trainer/demo.yaml over the schema defaults" in text
    assert shown["rollout.n_samples_per_prompt"] == (64, True)  # schema: 8
    assert shown["rollout.rollout_batch_size"] == (8, True)  # schema: 16
    assert shown["optim.lr"] == (2e-3, True)  # schema: 1e-6
    assert shown["train.max_steps"] == (200, True)
    assert shown["algorithm.entropy_coef"] == (0.01, True)
    assert shown["rollout.top_p"] == (1.0, False)  # not in demo.yaml: the schema's, unmarked
    assert [s["name"] for s in shown["reward.sources"][0]] == ["accuracy"]


def test_print_config_prints_the_resolved_config_and_loads_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train-policy", "--print-config", "rollout.n_samples_per_prompt=4", f"train.output_dir={out}"])
    assert code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["n_samples_per_prompt"] == 4  # the override
    assert printed["rollout"]["rollout_batch_size"] == 8 and printed["optim"]["lr"] == 2e-3  # the embedded demo
    assert printed["rollout"]["top_p"] == 1.0  # the schema's
    assert [s["name"] for s in printed["reward"]["sources"]] == ["accuracy"]
    assert not out.exists()  # no run folder, no model

    config = tmp_path / "sft.yaml"
    config.write_text("optim:\n  lr: 0.5\n")
    assert main(["train-sft", "--print-config", str(config), "train.max_steps=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 0.5 and printed["train"]["max_steps"] == 3
    assert printed["data"]["synthetic_options"] != {"num_colors": 4, "noise": 24}  # a CONFIG replaces the demo


def test_print_config_refuses_a_bad_key_in_one_line(capsys):
    assert main(["train-dpo", "--print-config", "optim.lrr=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "vlrft train-dpo: config error: " in captured.err
    assert "did you mean 'lr'" in captured.err
