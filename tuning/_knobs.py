"""What `tune` may change in a pipeline's configs (`Knob`), the candidates it measures
(`Candidate`), and the repositories it writes for them.

How this works. `discover_knobs` reads the configs of the model and, for an ensemble, of every
model its steps use (`scan_closure`), and offers the knobs orchestrion honours: per model,
``instance_group`` count, the ``execution`` parameter (auto: measured, or a worker thread) and,
where ``max_batch_size > 1``, ``dynamic_batching`` (off, or on with a queue delay); per
ensemble, ``max_inflight_requests`` and the ``fusion`` parameter. Each knob's first value is
what the config says now. `parse_knob` reads a user's ``--knob MODEL.NAME=V1,V2`` instead.

A candidate's configs are written by editing Triton's own config message (``model_config_pb2``,
parsed and printed by ``google.protobuf.text_format``), so a config's values change only in
the fields a knob names; a file no knob changed is never rewritten. A rewritten file keeps
its leading comment lines; comments inside it are lost (the printer does not keep them).
`candidate_repository` lays a candidate out for a server to load: a folder per model whose
entries are links to the user's, but for the config files the candidate changes.
`write_repository` copies the pipeline's model folders for the user, with the winner's
configs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from ..protocols import ConfigError, ModelConfig
from ..repository import CONFIG_FILE, scan_closure

KnobValue = int | str | None
"""A knob's setting: a count, a mode, or None (``dynamic_batching`` off)."""

KNOB_NAMES = (
    "instance_count",
    "execution",
    "max_queue_delay_us",
    "max_inflight_requests",
    "fusion",
)
"""The knobs `tune` knows, in the order a quick search tries them."""

_ENSEMBLE_KNOBS = frozenset({"max_inflight_requests", "fusion"})
_MODES = {
    "execution": ("auto", "inline", "thread"),
    "fusion": ("on", "off", "xla"),
}


@attrs.frozen
class Knob:
    """One setting of one model that `tune` varies; ``values[0]`` is the configured one."""

    model: str
    name: str
    values: tuple[KnobValue, ...]

    @property
    def key(self) -> str:
        """``MODEL.NAME``, as ``--knob`` and the report write it."""
        return f"{self.model}.{self.name}"


Candidate = Mapping[str, KnobValue]
"""A configuration to measure: the knobs it sets (by `Knob.key`) away from the configured
values; empty: the configuration as it is."""


def label(candidate: Candidate) -> str:
    """How the report names ``candidate``."""
    if not candidate:
        return "as configured"
    return ", ".join(f"{key}={show(value)}" for key, value in sorted(candidate.items()))


def show(value: KnobValue) -> str:
    """A knob value as the report and ``--knob`` write it."""
    return "off" if value is None else str(value)


@attrs.frozen
class Pipeline:
    """The model `tune` measures and the configs of the models it runs."""

    root: Path
    model: str
    configs: Mapping[str, ModelConfig]
    folders: Mapping[str, Path]

    @property
    def config(self) -> ModelConfig:
        """The tuned model's config."""
        return self.configs[self.model]


def read_pipeline(root: Path, model: str) -> Pipeline:
    """The configs of ``model`` and of the models its ensembles use, read from ``root``.

    Raises:
        ConfigError: no such model folder, or a config is invalid.
    """
    if not root.is_dir():
        raise ConfigError(f"--model-repository: {root} is not a folder")
    entries, errors = scan_closure(root, [model], loaded=())
    if errors:
        raise ConfigError("; ".join(errors))
    found = {entry.name: entry for entry in entries}
    if model not in found:
        raise ConfigError(f"--model: no model folder '{model}' in {root}")
    return Pipeline(
        root,
        model,
        {name: entry.config for name, entry in found.items()},
        {name: entry.path for name, entry in found.items()},
    )


def discover_knobs(pipeline: Pipeline, cores: int | None = None) -> list[Knob]:
    """The knobs of ``pipeline`` worth sweeping on a machine with ``cores`` CPUs."""
    cores = cores or os.cpu_count() or 1
    knobs: list[Knob] = []
    for name in sorted(pipeline.configs, key=lambda n: (n == pipeline.model, n)):
        config = pipeline.configs[name]
        if config.is_ensemble:
            scheduling = config.ensemble_scheduling
            inflight = scheduling.max_inflight_requests if scheduling is not None else 0
            knobs.append(Knob(name, "max_inflight_requests", _first(inflight, (0, 4, 16))))
            fusion = config.parameters.get("fusion", "on")
            knobs.append(Knob(name, "fusion", _first(fusion, _MODES["fusion"])))
            continue
        if len(config.instance_group) <= 1:  # several groups: which one to scale is theirs
            count = sum(group.count for group in config.instance_group) or 1
            counts = [n for n in (1, 2, 4, 8) if n <= max(cores, 2)]
            knobs.append(Knob(name, "instance_count", _first(count, counts)))
        execution = config.parameters.get("execution", "auto")
        knobs.append(Knob(name, "execution", _first(execution, ("auto", "thread"))))
        if config.max_batch_size > 1 and config.sequence_batching is None:
            batching = config.dynamic_batching
            delay = None if batching is None else batching.max_queue_delay_microseconds
            knobs.append(Knob(name, "max_queue_delay_us", _first(delay, (None, 0, 1000))))
    return knobs


def _first(current: KnobValue, others: Iterable[KnobValue]) -> tuple[KnobValue, ...]:
    return tuple(dict.fromkeys([current, *others]))


def parse_knob(text: str, pipeline: Pipeline) -> Knob:
    """``MODEL.NAME=V1,V2,...`` (``--knob``): the configured value comes first, then these.

    Raises:
        ConfigError: an unknown model or knob, a knob that does not apply to the model, or
            a value of the wrong kind.
    """
    where, equals, listed = text.partition("=")
    model, dot, name = where.rpartition(".")
    if not equals or not dot or not listed:
        raise ConfigError(
            f"--knob {text!r}: expected MODEL.NAME=V1,V2 (e.g. pre.instance_count=1,2)"
        )
    if model not in pipeline.configs:
        known = ", ".join(sorted(pipeline.configs))
        raise ConfigError(f"--knob {text!r}: '{model}' is not in the pipeline ({known})")
    if name not in KNOB_NAMES:
        raise ConfigError(
            f"--knob {text!r}: unknown knob '{name}' (known: {', '.join(KNOB_NAMES)})"
        )
    ensemble = pipeline.configs[model].is_ensemble
    if (name in _ENSEMBLE_KNOBS) != ensemble:
        kind = "an ensemble" if ensemble else "a model that is not an ensemble"
        raise ConfigError(f"--knob {text!r}: '{name}' does not apply to {kind} ('{model}')")
    config = pipeline.configs[model]
    if name == "instance_count" and len(config.instance_group) > 1:
        raise ConfigError(
            f"--knob {text!r}: '{model}' has {len(config.instance_group)} instance groups "
            "(tune varies the count of a model with one group)"
        )
    if name == "max_queue_delay_us" and (config.max_batch_size <= 1 or config.sequence_batching):
        raise ConfigError(
            f"--knob {text!r}: '{model}' cannot batch requests dynamically "
            "(max_batch_size must be over 1, and it must not be a sequence model)"
        )
    values = [_value(name, item.strip(), text) for item in listed.split(",")]
    current = _configured(pipeline.configs[model], name)
    return Knob(model, name, _first(current, values))


def _value(name: str, item: str, text: str) -> KnobValue:
    if name in _MODES:
        if item not in _MODES[name]:
            raise ConfigError(f"--knob {text!r}: {name} is one of {', '.join(_MODES[name])}")
        return item
    if name == "max_queue_delay_us" and item.lower() in ("off", "none"):
        return None
    try:
        number = int(item)
    except ValueError:
        raise ConfigError(f"--knob {text!r}: {item!r} is not a whole number") from None
    least = 1 if name == "instance_count" else 0
    if number < least:
        raise ConfigError(f"--knob {text!r}: {name} must be at least {least}")
    return number


def _configured(config: ModelConfig, name: str) -> KnobValue:
    if name == "instance_count":
        return sum(group.count for group in config.instance_group) or 1
    if name == "execution":
        return config.parameters.get("execution", "auto")
    if name == "fusion":
        return config.parameters.get("fusion", "on")
    if name == "max_inflight_requests":
        scheduling = config.ensemble_scheduling
        return scheduling.max_inflight_requests if scheduling is not None else 0
    batching = config.dynamic_batching
    return None if batching is None else batching.max_queue_delay_microseconds


# -- configs and repositories -------------------------------------------------------------


def config_texts(pipeline: Pipeline, candidate: Candidate) -> dict[str, str]:
    """The ``config.pbtxt`` text of every model ``candidate`` changes (the others keep
    their files)."""
    changes: dict[str, dict[str, KnobValue]] = {}
    for key, value in candidate.items():
        model, _, name = key.rpartition(".")
        changes.setdefault(model, {})[name] = value
    texts = {}
    for model, settings in changes.items():
        path = pipeline.folders[model] / CONFIG_FILE
        original = path.read_text() if path.is_file() else f'name: "{model}"\n'
        message = model_config_pb2.ModelConfig()
        text_format.Parse(original, message)
        for name, value in settings.items():
            _apply(message, name, value)
        texts[model] = _leading_comments(original) + text_format.MessageToString(
            message, as_utf8=True
        )
    return texts


def _apply(message: Any, name: str, value: KnobValue) -> None:
    if name == "instance_count":
        groups = message.instance_group
        if not groups:
            groups.add()
        assert isinstance(value, int)
        groups[0].count = value  # one group (`discover_knobs` and `parse_knob` see to it)
    elif name in ("execution", "fusion"):
        message.parameters[name].string_value = str(value)
    elif name == "max_inflight_requests":
        message.ensemble_scheduling.max_inflight_requests = int(value or 0)
    elif value is None:
        message.ClearField("dynamic_batching")
    else:
        message.dynamic_batching.max_queue_delay_microseconds = int(value)


def _leading_comments(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "".join(f"{line}\n" for line in lines)


def candidate_repository(pipeline: Pipeline, texts: Mapping[str, str], into: Path) -> Path:
    """A repository at ``into`` that serves ``pipeline`` with ``texts`` as configs: links to
    the user's folders and files, nothing copied."""
    into.mkdir(parents=True)
    for model, folder in pipeline.folders.items():
        # A real folder of links: the server refuses a model folder that resolves outside
        # its repository.
        target = into / model
        target.mkdir()
        for entry in folder.iterdir():
            if entry.name != CONFIG_FILE or model not in texts:
                target.joinpath(entry.name).symlink_to(entry.resolve())
        if model in texts:
            (target / CONFIG_FILE).write_text(texts[model])
    return into


def write_repository(
    pipeline: Pipeline, texts: Mapping[str, str], into: Path, notes: Mapping[str, Sequence[str]]
) -> None:
    """Copy the pipeline's model folders to ``into`` (which must not exist) with ``texts``
    in place of those models' configs, each headed by its ``notes`` (comment lines).

    Links are copied as the files they point to: the copy is whole on its own, and writing
    a config never writes through a link into the user's files."""
    into.mkdir(parents=True)
    for model, folder in pipeline.folders.items():
        shutil.copytree(folder, into / model, symlinks=False)
    for model, text in texts.items():
        header = "".join(f"# {line}\n" for line in notes.get(model, ()))
        (into / model / CONFIG_FILE).write_text(header + text)
