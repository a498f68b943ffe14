"""The ``model.py`` contract of a model whose code is a Python function (the JAX and
plain-Python backends): ``execute`` takes one parameter per config input, by name (``params``
first when ``initialize`` is defined; ``state`` for a stateful model; an optional input needs
a default), and is a generator exactly when the model is decoupled. Checked at load, so that
a mistake is a load error naming the file, not a failure on the first request."""

from __future__ import annotations

import inspect

from ..protocols import Function, Model, sequence_tensor_names


def contract_problems(model: Model, where: str, in_config: str) -> list[str]:
    """The ways ``model``'s ``execute`` breaks the contract (empty when it keeps it):
    ``where`` names the code, ``in_config`` the config, in the messages."""
    code = model.code
    assert isinstance(code, Function)
    if sequence_tensor_names(model.config):
        return [
            f"{in_config}: sequence_batching control_input and state are for Triton's "
            "backends (ONNX and python models): a model.py with execute receives its "
            "sequence's state through execute (a state parameter, (outputs, new_state) back)"
        ]
    return _kind_problems(model, code, where, in_config) + _parameter_problems(model, code, where)


def _kind_problems(model: Model, code: Function, where: str, in_config: str) -> list[str]:
    """What the config says the model is (decoupled, stateful, batching) against its code."""
    config = model.config
    errors = []
    generator = inspect.isgeneratorfunction(code.execute) or inspect.isasyncgenfunction(
        code.execute
    )
    if generator and not config.decoupled:
        errors.append(
            f"{where}: execute is a generator, which is how decoupled models respond; set "
            "model_transaction_policy { decoupled: true } in the config"
        )
    if config.decoupled and not generator:
        errors.append(
            f"{where}: a decoupled model's execute is a generator: yield each response "
            "(zero or more), instead of returning one"
        )
    if config.decoupled and config.stateful:
        errors.append(f"{in_config}: a decoupled model cannot also be stateful")
    stateful = config.stateful
    if stateful and config.dynamic_batching is not None:
        errors.append(f"{in_config}: sequence_batching and dynamic_batching exclude each other")
    if code.initial_state is not None and not stateful:
        errors.append(
            f"{where}: initial_state is for stateful models; the config has no sequence_batching"
        )
    return errors


def _parameter_problems(model: Model, code: Function, where: str) -> list[str]:
    """``execute``'s parameters against the config's inputs (params and state first)."""
    config = model.config
    stateful = config.stateful
    errors: list[str] = []
    try:
        signature = inspect.signature(code.execute)
    except (TypeError, ValueError):
        return errors
    params = list(signature.parameters.values())
    inputs = {t.name for t in config.input}
    if code.initialize is not None:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not positional or positional[0].name in inputs:
            errors.append(
                f"{where}: initialize is defined, so execute receives its params first: "
                f"execute(params, {', '.join(t.name for t in config.input)})"
            )
            return errors
        params.remove(positional[0])
    params = [p for p in params if p.name != "request"]
    if stateful:
        if "state" not in {p.name for p in params}:
            errors.append(
                f"{where}: a stateful model (sequence_batching) receives its sequence's state: "
                f"execute({'params, ' if code.initialize else ''}state, "
                f"{', '.join(t.name for t in config.input)}) -> (outputs, new_state)"
            )
        params = [p for p in params if p.name != "state"]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return errors
    accepted = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
    missing = sorted(inputs - accepted)
    if missing:
        errors.append(
            f"{where}: execute has no parameter for inputs {', '.join(missing)} "
            "(one parameter per config input, by name)"
        )
    required = sorted(
        p.name
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,) and p.name not in inputs
    )
    if required:
        errors.append(
            f"{where}: execute requires parameters that are not config inputs: "
            + ", ".join(required)
        )
    optional_without_default = sorted(
        t.name
        for t in config.input
        if t.optional
        and t.name in signature.parameters
        and signature.parameters[t.name].default is inspect.Parameter.empty
    )
    if optional_without_default:
        errors.append(
            f"{where}: optional inputs need a default value in execute: "
            + ", ".join(optional_without_default)
        )
    return errors
