"""Checks before anything heavy loads: a run that will fail for its configuration fails in its first seconds.

``preflight_policy(cfg, world_size)`` (``vlrft train-policy``), ``preflight_supervised(cfg)`` (``train-sft``,
``train-dpo``) and ``preflight_reward_model(cfg)`` (``vlrft train-reward-model``), run by the driver
(``vlrft.loop.training_run``) before the strategy starts, check, before any model is built: the ranks that
the world size needs,
the prompt template, the output folder (a file where the final model goes is refused), the model folder
(``config.json``, tokenizer and, for a vision-language model, processor files; a missing local path is
"no such folder", never the hub's "Repo id" message), the reward sources, and every data record (read
without decoding images) for the fields the configured reward sources need and for images a text-only
model cannot take. Each failure is a :class:`~vlrft.config.ConfigError` naming the key and value, or a
located :class:`~data_pipelines.errors.DataError` (file, line, field, record id); with
``on_bad_record=skip`` bad records are counted instead, and the run reads them with the same
:func:`record_check`, so it skips exactly those.
"""

from __future__ import annotations

import os
import string
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from data_pipelines.errors import DataError
from data_pipelines.formatting import PROMPT_TEMPLATES, judgment_as_prompt
from data_pipelines.readers import SkipReport, read_records
from data_pipelines.records import JudgmentRecord, PromptRecord
from data_pipelines.synthetic import check_options, synthetic_task
from reward_models.config import RewardModelTrainConfig
from reward_models.kinds import SOURCE_KINDS, check_source
from reward_models.pool import RewardPoolConfig
from vlrft.archs import VL_ARCHS
from vlrft.config import ConfigError
from vlrft.models.loading import (  # noqa: F401
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    check_model_folder,
    check_trainable,
    folder_config,
    path_like,
)
from vlrft.run_folder import check_output_dir
from vlrft.tools import check_tools
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.teacher import check_served_teacher, check_teacher


def world_size() -> int:
    """The number of processes of this launch (torchrun's ``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


TINY_HIDDEN = 256  # a language-model hidden size below this is a tiny test model (the smallest Qwen, 0.5B: 896)
REAL_MODEL_LR = 1e-4  # real models fine-tune at 1e-6 .. 2e-5; tiny ones (random or barely trained) need ~1e-3
TRAINER_FOLDER = Path(__file__).resolve().parent
DEMOS = {  # command -> the embedded (or ready) config whose optim.lr a tiny model learns at
    "train-policy": TRAINER_FOLDER / "demo.yaml",
    "train-sft": TRAINER_FOLDER / "sft_demo.yaml",
    "train-dpo": TRAINER_FOLDER / "dpo_demo.yaml",
    "train-reward-model": TRAINER_FOLDER.parents[1] / "configs" / "reward_model" / "srm_color.yaml",
}


def text_hidden_size(model: Any) -> tuple[int | None, bool]:
    """(the language model's hidden size, whether the run builds it with random weights) of a model section: the
    tiny model's ``tiny_hidden`` without a path, else its folder's ``config.json`` (None for a hub id)."""
    if not model.path:
        return model.tiny_hidden, True
    try:
        config = check_model_folder(model.path, "model.path") or {}
    except ConfigError:  # the preflight says what is wrong with it
        return None, False
    hidden = (config.get("text_config") or {}).get("hidden_size") or config.get("hidden_size")
    return (hidden if isinstance(hidden, int) else None), False


def learning_rate_warning(cfg: Any, command: str) -> str | None:
    """One warning line when the run cannot learn what it is asked in its steps: a tiny model (a language-model
    hidden size under :data:`TINY_HIDDEN`) at a real model's learning rate (under :data:`REAL_MODEL_LR`), the trap of
    a ready config (``configs/policy/grpo.yaml``) run without a model.path. None for a healthy run."""
    hidden, random = text_hidden_size(cfg.model)
    lr = cfg.optim.lr
    if hidden is None or hidden >= TINY_HIDDEN or lr >= REAL_MODEL_LR:
        return None
    what = (
        f"the model built for this run (model.tiny_arch={cfg.model.tiny_arch}, random weights) is tiny "
        f"(model.tiny_hidden={hidden})"
        if random
        else f"model.path={cfg.model.path} is a tiny model (hidden size {hidden})"
    )
    steps = f" in train.max_steps={cfg.train.max_steps} steps" if cfg.train.max_steps else ""
    demo = DEMOS.get(command)
    try:
        demo_lr = yaml.safe_load(demo.read_text())["optim"]["lr"]
        shown = f"{demo.relative_to(TRAINER_FOLDER.parents[1])} uses optim.lr={demo_lr:g}"
    except (AttributeError, OSError, ValueError, KeyError, TypeError):  # no such demo (an installed package)
        shown = "the demos use optim.lr=1e-3 to 3e-3"
    return (
        f"warning: optim.lr={lr:g} is a learning rate for a real model, but {what}: at this rate it will barely "
        f"move{steps}; tiny models learn at about 1e-3 ({shown}); `vlrft {command} --print-config` shows every "
        "value this run uses"
    )


SOURCES = ("train_source", "eval_source")
# each synthetic setting -> the sources that use it when they are synthetic:TASK
SYNTHETIC_SETTINGS = {
    "synthetic_train_size": ("train_source",),
    "synthetic_eval_size": ("eval_source",),
    "synthetic_options": SOURCES,
}


def unused_synthetic_warning(data: Any, base: Any = None) -> str | None:
    """One warning line naming the ``data.synthetic_*`` settings given (other than in ``base``, the data section the
    command starts from: its embedded demo's, or the schema's defaults) that no ``synthetic:TASK`` source draws: a size
    whose source is a file, a hub id or empty, the options where neither source is synthetic. They are not used, and
    said so rather than silently dropped. None when there are none."""
    synthetic = {key: synthetic_task(getattr(data, key)) is not None for key in SOURCES}  # "" (no source): None
    defaults = type(data)() if base is None else base
    unused = [
        f"data.{setting}={getattr(data, setting)} ({', '.join(f'data.{k}={getattr(data, k)!r}' for k in keys)})"
        for setting, keys in SYNTHETIC_SETTINGS.items()
        if getattr(data, setting) != getattr(defaults, setting) and not any(synthetic[k] for k in keys)
    ]
    return f"warning: not used, as no synthetic:TASK source draws them: {'; '.join(unused)}" if unused else None


def start_warnings(cfg: Any, command: str, base: Any = None) -> list[str]:
    """The lines a training command warns with as it starts: a learning rate its model cannot learn at
    (:func:`learning_rate_warning`) and synthetic settings no source uses (:func:`unused_synthetic_warning`; ``base``:
    the config the command starts from before the user's files and overrides, its embedded demo where it has one)."""
    lines = [learning_rate_warning(cfg, command) if hasattr(cfg, "optim") and hasattr(cfg, "model") else None]
    if hasattr(cfg, "data"):
        lines.append(unused_synthetic_warning(cfg.data, None if base is None else base.data))
    return [line for line in lines if line is not None]


def warn_at_start(cfg: Any, command: str, base: Any = None) -> None:
    """Print :func:`start_warnings` on stderr (rank 0 of a launch only); the training commands call it as they start
    (``vlrft.commands.add_config_command``), a run started from Python does not."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        for line in start_warnings(cfg, command, base):
            print(line, file=sys.stderr, flush=True)


def check_template(template: str, key: str) -> None:
    """A ``PROMPT_TEMPLATES`` name, or a format string whose only field is ``{prompt}``."""
    if template in PROMPT_TEMPLATES:
        return
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ConfigError(
            f"{key}={template!r}: not a format string ({exc}); write literal braces as {{{{ }}}}"
        ) from exc
    if fields != {"prompt"}:
        raise ConfigError(
            f"{key}={template!r}: want a name in PROMPT_TEMPLATES ({', '.join(PROMPT_TEMPLATES)}) or a format string "
            f"whose only field is {{prompt}} (found {sorted(fields) or 'none'})"
        )


def _sources_for(pool: RewardPoolConfig, task: str) -> list:
    recipe = pool.recipes.get(task, pool.recipes.get("default"))
    return [s for s in pool.sources if recipe is None or s.name in recipe]


def images_check(vision: bool, model_key: str) -> Callable[[Any], None]:
    """A text-only model gets no images nor videos: the rule for any record (prompt, preference or judgment)."""

    def check(record: Any) -> None:
        for name in ("images", "videos"):
            items = getattr(record, name, ())
            if items and not vision:
                raise DataError(
                    f"record {record.id!r} has {len(items)} {name[:-1]}(s), but the model ({model_key}) is text-only",
                    category=f"{name} for a text-only model",
                    field=name,
                )

    return check


def check_trainable_model(model: Any, key: str = "model.path") -> bool:
    """The model a run trains (its folder's, or a cached hub id's, ``config.json``) is of an architecture vlrft
    trains (:func:`vlrft.models.loading.check_trainable`); the tiny model built without a path always is, and a hub
    id not at hand is checked when it loads. Returns whether the model sees images (a ``vision_config`` in that
    ``config.json``, or a vision-language tiny architecture; a hub id not at hand counts as one), so the folder's
    config is read once."""
    if not model.path:
        return model.tiny_arch in VL_ARCHS
    config = folder_config(model.path, key)
    if config is None:
        return True
    check_trainable(config.get("model_type"), f"{key}={model.path}")
    return config.get("vision_config") is not None


def check_synthetic_images(data: Any, vision: bool, model: str) -> None:
    """Synthetic records carry images (every ``synthetic:`` task is visual): a text-only model (``model``: how errors
    name it) is refused for them in one line, naming the source, before anything loads."""
    for key in ("train_source", "eval_source"):
        source = getattr(data, key)
        if synthetic_task(source) is not None and not vision:  # "" (no source): None
            raise ConfigError(
                f"data.{key}={source}: synthetic records carry images, but the model ({model}) is text-only; "
                "use a vision-language model (e.g. model.tiny_arch=qwen2_5_vl) or text records of your own"
            )


def record_check(pool: RewardPoolConfig, vision: bool, model_key: str) -> Callable[[PromptRecord], None]:
    """The per-record rule of a run: each source that scores a record's task finds the fields it needs (its
    ``needs``: the reference answer, metadata fields; a served source's as its server says); a text-only model
    gets no images. Raises a ``DataError`` (located by the reader)."""
    for i, s in enumerate(pool.sources):
        check_source(s, f"reward.sources[{i}]")  # the kind's own rules: a model folder, a verifier, a function
    needs = {s.name: SOURCE_KINDS[s.kind].needs(s) for s in pool.sources}
    text_only = images_check(vision, model_key)

    def check(record: PromptRecord | JudgmentRecord) -> None:
        if isinstance(record, JudgmentRecord):  # judge RL: checked as the prompt it becomes
            try:
                record = judgment_as_prompt(record)
            except ValueError as e:
                raise DataError(str(e), category="no verdict", field="target") from None
        for s in _sources_for(pool, record.task):
            what = SOURCE_KINDS[s.kind].describe(s)
            kind = SOURCE_KINDS[s.kind]
            if getattr(record, "videos", None) and kind.reads_images and not kind.reads_videos:
                raise DataError(
                    f"record {record.id!r} has {len(record.videos)} video(s), which reward source {s.name!r} ({what}) "
                    "does not see (served reward models take images only): score video records with verifiers, "
                    "functions or local reward models (srm, grm)",
                    category="videos for an image-only reward source",
                    field="videos",
                )
            if "answer" in needs[s.name] and (record.answer is None or not str(record.answer).strip()):
                raise DataError(
                    f"record {record.id!r} has no answer, which reward source {s.name!r} ({what}) needs",
                    category="missing answer",
                    field="answer",
                )
            for field_name in sorted(needs[s.name] - {"answer"}):
                if record.metadata.get(field_name) is None:
                    raise DataError(
                        f"record {record.id!r} has no {field_name!r}, which reward source {s.name!r} ({what}) needs",
                        category=f"missing {field_name}",
                        field=field_name,
                    )
        text_only(record)

    return check


def check_data_source(
    source: str,
    key: str,
    kind: str,
    on_bad_record: str,
    check: Callable | None = None,
    column_map: Any = None,
    unique_ids: bool = False,
) -> SkipReport:
    """Read every record of ``source`` (images not decoded) through ``check`` (and, with ``unique_ids``, refusing
    a second record with an id); a missing local file is a ``ConfigError`` naming ``key``."""
    if path_like(source) and not Path(source).expanduser().exists():
        raise ConfigError(f"{key}={source}: no such file or folder")
    _, report = read_records(
        source,
        kind,
        column_map=dict(column_map or {}) or None,
        on_bad_record=on_bad_record,
        load_images=False,
        check=check,
        unique_ids=unique_ids,
    )
    return report


JUDGMENT_OPTIONS = ("judge_template", "judge_system_prompt", "rationale")  # make_judgment_records' own keywords


def check_synthetic(data: Any, extra: tuple[str, ...] = ()) -> None:
    """``data.synthetic_options`` are ones each synthetic source of ``data`` takes, with values its checks accept
    (``extra``: keywords of the record maker around the task), refused naming the key before any model loads."""
    options, checked = dict(data.synthetic_options), set()
    for key in ("train_source", "eval_source"):
        source = getattr(data, key)
        task = synthetic_task(source)  # "" (no source): None
        if task is None or task in checked:  # the held-out records of the same task: the same options, drawn once
            continue
        checked.add(task)
        try:
            check_options(task, options, extra)
        except ValueError as exc:
            raise ConfigError(f"data.synthetic_options={options} (data.{key}={source}): {exc}") from None


def model_key(cfg: PolicyTrainConfig) -> str:
    """How errors name the policy: its ``model.path``, or the tiny architecture built without one."""
    return f"model.path={cfg.model.path}" if cfg.model.path else f"model.tiny_arch={cfg.model.tiny_arch}"


def preflight_policy(cfg: PolicyTrainConfig, world: int | None = None) -> dict[str, SkipReport]:
    """Every check of ``vlrft train-policy`` that needs no model; returns the data sources' skip reports."""
    world = world_size() if world is None else world
    r = cfg.rollout
    if r.rollout_batch_size % world:
        raise ConfigError(
            f"rollout.rollout_batch_size={r.rollout_batch_size}: must be divisible by the number of processes "
            f"({world}), each of which samples an equal share of the prompts"
        )
    check_template(cfg.data.prompt_template, "data.prompt_template")
    check_output_dir(cfg.train.output_dir, "train.output_dir", final="final")
    check_tools(cfg.tools)
    check_synthetic(cfg.data, JUDGMENT_OPTIONS if cfg.data.record_kind == "judgment" else ())
    vision = check_trainable_model(cfg.model)
    check_synthetic_images(cfg.data, vision, model_key(cfg))
    if cfg.critic.path and cfg.algorithm.estimator.critic and not Path(cfg.critic.path).exists():
        if path_like(cfg.critic.path):
            raise ConfigError(f"critic.path={cfg.critic.path}: no such folder")
    teachers = cfg.teacher.named()
    served_teacher = "teacher.url: a served teacher takes token ids only (the completions API); use teacher.path"
    for name, t in teachers.items():
        if t.path:
            check_model_folder(t.path, f"teacher.by_name.{name}.path" if name else "teacher.path")
            if cfg.model.path:  # a tiny model built at the start is checked against the teacher then
                check_teacher(t.path, cfg.model.path)
        if t.url and synthetic_task(cfg.data.train_source) is not None:
            raise ConfigError(
                f"data.train_source={cfg.data.train_source}: synthetic records carry images, and {served_teacher} "
                "for records with images or videos"
            )
        if t.url and cfg.model.path:  # a tiny model built at the start is checked against the server then
            check_served_teacher(t, cfg.model.path, cfg.sequence_length())
    if teachers and "" not in teachers and synthetic_task(cfg.data.train_source) is not None:
        raise ConfigError(
            f"data.train_source={cfg.data.train_source}: synthetic records name no teacher (metadata.teacher); give "
            "teacher.path or teacher.url for them beside teacher.by_name"
        )
    check = record_check(cfg.reward, vision, model_key(cfg))
    if cfg.rollout.engine == "vllm":  # vlrft hands vLLM images only
        check = _refuse(check, ("videos",), "rollout.engine=vllm takes images only; use rollout.engine=hf")
    if cfg.teacher.url:  # (a named served teacher's records are refused by name below)
        check = _refuse(check, ("images", "videos"), served_teacher)
    if cfg.teacher.by_name:
        check = _named_teacher(check, teachers, served_teacher)
    reports = {}
    for key, source in (("data.train_source", cfg.data.train_source), ("data.eval_source", cfg.data.eval_source)):
        if source and synthetic_task(source) is None:
            reports[key] = check_data_source(
                source,
                key,
                cfg.data.record_kind,
                cfg.data.on_bad_record,
                check,
                column_map=cfg.data.column_map,
                unique_ids=key == "data.eval_source",  # held-out results are kept by id
            )
    train = reports.get("data.train_source")
    if train is not None and train.kept < r.rollout_batch_size:
        raise ConfigError(
            f"data.train_source={cfg.data.train_source}: {train.kept} usable prompts ({train.skipped} skipped), "
            f"fewer than rollout.rollout_batch_size={r.rollout_batch_size}"
        )
    return reports


def preflight_supervised(cfg: Any) -> dict[str, SkipReport]:
    """Every check of ``vlrft train-sft`` / ``train-dpo`` that needs no model: prompt template, output folder,
    model folder, and the data files (chat records are read by the run itself; prompt records and preference
    pairs are read here, images not decoded)."""
    check_template(cfg.data.prompt_template, "data.prompt_template")
    check_output_dir(cfg.train.output_dir, "train.output_dir", final="final")
    vision = check_trainable_model(cfg.model)
    dpo = hasattr(cfg, "dpo")
    if not dpo:
        check_tools(cfg.tools)
    check_synthetic(cfg.data)
    check_synthetic_images(cfg.data, vision, model_key(cfg))
    reports = {}
    for key, source, kind in (
        ("data.train_source", cfg.data.train_source, "preference" if dpo else None),
        ("data.eval_source", cfg.data.eval_source, "preference" if dpo else "prompt"),
    ):
        if not source or synthetic_task(source) is not None:
            continue
        if kind is None:  # chat records: the file must be there
            if path_like(source) and not Path(source).expanduser().exists():
                raise ConfigError(f"{key}={source}: no such file or folder")
            continue
        reports[key] = check_data_source(source, key, kind, cfg.data.on_bad_record)
    return reports


def _named_teacher(check: Callable[[Any], None], teachers: dict[str, Any], served: str) -> Callable[[Any], None]:
    """``check``, then a record's ``metadata.teacher`` refused unless it names a teacher of ``teachers`` (none: the
    unnamed one, ``""``, must exist); a served one's record refused with images or videos (``served`` says why)."""

    def checked(record: Any) -> None:
        check(record)
        name = record.metadata.get("teacher", "")
        if name not in teachers:
            have = ", ".join(n for n in teachers if n)
            why = (
                f"metadata.teacher={name!r}: no such teacher (teacher.by_name has {have})"
                if name
                else "names no teacher (metadata.teacher) and there is no teacher.path or teacher.url"
            )
            raise DataError(f"record {record.id!r} {why}", category="teacher", field="metadata")
        if teachers[name].url and (record.images or record.videos):
            raise DataError(
                f"record {record.id!r} has images or videos and its teacher {name!r} is served; {served}",
                category="images",
                field="images",
            )

    return checked


def _refuse(check: Callable[[Any], None], fields: tuple[str, ...], why: str) -> Callable[[Any], None]:
    """``check``, then a record with any of ``fields`` (``images``, ``videos``) refused: ``why`` says what does not
    take them and what does."""

    def checked(record: Any) -> None:
        check(record)
        for name in fields:
            items = getattr(record, name)
            if items:
                raise DataError(
                    f"record {record.id!r} has {len(items)} {name[:-1]}(s); {why} for records with {name}",
                    category=name,
                    field=name,
                )

    return checked


def preflight_reward_model(cfg: RewardModelTrainConfig) -> dict[str, SkipReport]:
    """Every check of ``vlrft train-reward-model`` that needs no model: model folder, data, output folder."""
    check_output_dir(cfg.train.output_dir, "train.output_dir", final="final")
    vision = check_trainable_model(cfg.model)
    kind = "preference" if cfg.model.kind == "srm" else "judgment"
    check_synthetic(cfg.data, ("response_template",) if kind == "preference" else JUDGMENT_OPTIONS)
    check_synthetic_images(cfg.data, vision, model_key(cfg))
    reports = {}
    for key, source in (("data.train_source", cfg.data.train_source), ("data.eval_source", cfg.data.eval_source)):
        if source and synthetic_task(source) is None:
            reports[key] = check_data_source(
                source, key, kind, cfg.data.on_bad_record, images_check(vision, model_key(cfg))
            )
    train = reports.get("data.train_source")
    if train is not None and train.kept == 0:
        raise ConfigError(f"data.train_source={cfg.data.train_source}: no usable records ({train.skipped} skipped)")
    return reports
