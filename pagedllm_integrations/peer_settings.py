"""Settings of the libraries pagedllm replaces, mapped onto its own, or refused by name.

A user switching from ChatOllama, ChatHuggingFace / HuggingFacePipeline, VLLM / VLLMOpenAI
or LlamaIndex's Ollama / Vllm keeps their constructor call and changes the import line.
Every setting they pass is then one of:

- ours (same name and meaning);
- renamed onto ours (`model_id` -> `model`, `num_predict` -> `max_tokens`, ...);
- an engine setting (`num_ctx`, `context_window` -> `max_model_len`, `tensor_parallel_size`);
- a sampling setting applied to every call (`repeat_penalty` -> `repetition_penalty`);
- accepted with a logged note where it cannot mean anything in process (`keep_alive`,
  `base_url`, API keys): the note says why, once;
- refused with a ValueError that names it and says what to do.

Anything else is a ValueError naming the unknown setting: a setting is never silently
dropped. README.md has the table for users.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .engine.config import EngineConfig
from .engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(slots=True)
class Mapped:
    """What a constructor call's settings become."""

    fields: dict[str, Any] = field(default_factory=dict)  # the wrapper's own fields
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig settings
    sampling: dict[str, Any] = field(default_factory=dict)  # sampling defaults of every call

    def destination(self, into: str) -> dict[str, Any]:
        return {"field": self.fields, "engine": self.engine, "sampling": self.sampling}[into]


Convert = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class MapTo:
    """The same setting under our name: a wrapper field, an engine or a sampling setting."""

    into: str  # "field" | "engine" | "sampling"
    target: str
    convert: Convert | None = None


def rename(target: str, convert: Convert | None = None) -> MapTo:
    return MapTo("field", target, convert)


def to_engine(target: str, convert: Convert | None = None) -> MapTo:
    return MapTo("engine", target, convert)


def to_sampling(target: str, convert: Convert | None = None) -> MapTo:
    return MapTo("sampling", target, convert)


@dataclass(frozen=True, slots=True)
class Note:
    """Accepted; it cannot mean anything for an in-process engine; logged once."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """A ValueError unless the value is one of `accepted` (the peer's neutral values)."""

    reason: str
    accepted: tuple = (None,)


@dataclass(frozen=True, slots=True)
class Custom:
    apply: Callable[[Any, Mapped], None]


Setting = MapTo | Note | Refuse | Custom
_noted: set[tuple[str, str]] = set()


def translate(
    values: dict[str, Any],
    *,
    owner: str,
    own: set[str],
    peers: dict[str, Setting],
    engine_field: str,
    sampling_field: str,
) -> dict[str, Any]:
    """The constructor's keyword arguments with the peers' settings mapped onto `own`
    fields (engine settings merged into `engine_field`, sampling into `sampling_field`;
    what the user put there explicitly wins). ValueError for what cannot be honoured."""
    out = {k: v for k, v in values.items() if k in own}
    unknown = sorted(k for k in values if k not in own and k not in peers)
    if unknown:
        raise ValueError(
            f"{owner} has no setting {', '.join(map(repr, unknown))}. Its settings: "
            f"{sorted(own)}; settings of other libraries it maps: {sorted(peers)} "
            "(see the README's table)"
        )
    mapped = Mapped()
    for key, value in values.items():
        if key in own:
            continue
        rule = peers[key]
        if isinstance(rule, MapTo):
            destination = mapped.destination(rule.into)
            if rule.target in destination:
                raise ValueError(f"{owner}: {rule.target!r} is given twice (also as {key!r})")
            destination[rule.target] = rule.convert(value) if rule.convert else value
        elif isinstance(rule, Note):
            if value is not None and (owner, key) not in _noted:
                _noted.add((owner, key))
                logger.warning("%s: %s=%r has no effect: %s", owner, key, value, rule.reason)
        elif isinstance(rule, Refuse):
            if not any(value == ok for ok in rule.accepted):
                raise ValueError(f"{owner}: {key}={value!r} is not supported: {rule.reason}")
        else:
            rule.apply(value, mapped)
    for name, value in mapped.fields.items():
        given = out.get(name)
        if given is not None and given != value:
            raise ValueError(f"{owner}: {name!r} is given twice, with different values")
        out[name] = value
    for field_name, settings in ((engine_field, mapped.engine), (sampling_field, mapped.sampling)):
        if settings:
            out[field_name] = _merge(owner, field_name, settings, out.get(field_name) or {})
    return out


def _merge(owner: str, where: str, mapped: dict[str, Any], given: dict[str, Any]) -> dict:
    """Mapped settings and the ones given in the wrapper's own dict; a clash is an error."""
    for key, value in mapped.items():
        if key in given and given[key] != value:
            raise ValueError(
                f"{owner}: {key!r} is given twice with different values ({value!r} from "
                f"another library's setting, {given[key]!r} in {where})"
            )
    return {**mapped, **given}


def peer_settings_validator(peers: dict[str, Setting], engine_field: str, sampling_field: str):
    """A pydantic before-validator for a wrapper: its constructor's settings through
    `translate` (assign it to a class attribute of the wrapper)."""
    from pydantic import model_validator

    def map_peer_settings(cls: Any, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        return translate(
            values,
            owner=cls.__name__,
            own=own_names(cls),
            peers=peers,
            engine_field=engine_field,
            sampling_field=sampling_field,
        )

    return model_validator(mode="before")(classmethod(map_peer_settings))  # type: ignore[arg-type]


def own_names(model_class: Any) -> set[str]:
    """A pydantic model's field names and aliases."""
    names = set(model_class.model_fields)
    names.update(f.alias for f in model_class.model_fields.values() if f.alias)
    return names


# ------------------------------------------------------------------ conversions
IN_PROCESS = "pagedllm runs the model in this process; there is no server to reach"
KEEP_ALIVE = (
    "the engine runs in this process and stays loaded until close() or shutdown_shared_engines()"
)


def max_tokens_from_ollama(value: int | None) -> int | None:
    """num_predict: -1 (no limit) and -2 (fill the context) are our default, no limit."""
    if value is None or value in (-1, -2):
        return None
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"num_predict must be a positive integer, -1 or -2; got {value!r}")
    return value


def context_length(value: int | None) -> int | None:
    """num_ctx / context_window; -1 or None: the model's own context length."""
    return None if value in (None, -1) else value


def structured_format(value: Any) -> StructuredOutputsParams | None:
    """Ollama's `format`: "json" for any JSON object, or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return StructuredOutputsParams(json_object=True)
    if isinstance(value, dict):
        return StructuredOutputsParams(json=value)
    raise ValueError(f"format must be '', 'json' or a JSON schema dict; got {value!r}")


def logit_bias(value: dict | None) -> dict[int, float] | None:
    """Token id (int or its string, as OpenAI sends it) -> bias."""
    if not value:
        return None
    return {int(k): float(v) for k, v in value.items()}


# --------------------------------------------------------------- Ollama's options
# ChatOllama's fields and LlamaIndex Ollama's `additional_kwargs` are Ollama's options.
OLLAMA_OPTIONS: dict[str, Setting] = {
    "num_predict": to_sampling("max_tokens", max_tokens_from_ollama),
    "num_ctx": to_engine("max_model_len", context_length),
    "repeat_penalty": to_sampling("repetition_penalty"),
    "temperature": to_sampling("temperature"),
    "top_k": to_sampling("top_k"),
    "top_p": to_sampling("top_p"),
    "min_p": to_sampling("min_p"),
    "seed": to_sampling("seed"),
    "stop": to_sampling("stop"),
    "presence_penalty": to_sampling("presence_penalty"),
    "frequency_penalty": to_sampling("frequency_penalty"),
    "repeat_last_n": Refuse("the repetition penalty covers the whole text; drop repeat_last_n"),
    "mirostat": Refuse("Mirostat sampling is not implemented; use top_p / min_p", (None, 0)),
    "mirostat_eta": Refuse("Mirostat sampling is not implemented"),
    "mirostat_tau": Refuse("Mirostat sampling is not implemented"),
    "tfs_z": Refuse("tail-free sampling is not implemented; use min_p", (None, 1, 1.0)),
    "num_gpu": Refuse("choose the device with engine_kwargs={'device': 'cuda' | 'cpu'}"),
    "num_thread": Refuse("torch sets the CPU threads: call torch.set_num_threads(n)"),
}


def ollama_options(options: dict | None, mapped: Mapped, where: str) -> None:
    """Each Ollama option onto the engine or sampling settings (ValueError if refused)."""
    for key, value in (options or {}).items():
        rule = OLLAMA_OPTIONS.get(key)
        if rule is None:
            raise ValueError(
                f"{where}[{key!r}] is not an Ollama option pagedllm knows; known: "
                f"{sorted(OLLAMA_OPTIONS)}"
            )
        if isinstance(rule, Refuse):
            if not any(value == ok for ok in rule.accepted):
                raise ValueError(f"{where}[{key!r}]={value!r} is not supported: {rule.reason}")
            continue
        assert isinstance(rule, MapTo)
        value = rule.convert(value) if rule.convert is not None else value
        mapped.destination(rule.into)[rule.target] = value
