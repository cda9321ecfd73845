"""Settings of the libraries pagedllm replaces, mapped onto its own, or refused by name.

A user switching from another library (ChatOllama, ChatLlamaCpp, ChatOpenAI, ChatHuggingFace,
HuggingFacePipeline, VLLM, VLLMOpenAI, OllamaLLM; LlamaIndex's Ollama, Vllm, LlamaCPP,
OpenAILike) keeps their constructor call and changes the import line. Every setting they
pass, and every entry of the option dicts they pass (Ollama's options, llama.cpp's
`model_kwargs` and `generate_kwargs`, OpenAI's `extra_body`), is then one of:

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

logger = logging.getLogger(__name__)

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(slots=True)
class Mapped:
    """What a constructor call's settings become."""

    owner: str = ""  # the wrapper's class name, for messages
    fields: dict[str, Any] = field(default_factory=dict)  # the wrapper's own fields
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig settings
    sampling: dict[str, Any] = field(default_factory=dict)  # sampling defaults of every call
    # The settings of a wrapped object (ChatHuggingFace's `llm=`): defaults that the
    # constructor's own explicit arguments override, never a clash.
    wrapped_fields: dict[str, Any] = field(default_factory=dict)
    wrapped_engine: dict[str, Any] = field(default_factory=dict)
    wrapped_sampling: dict[str, Any] = field(default_factory=dict)
    # Our setting -> the name the user gave it (`max_model_len` -> `num_ctx`), so that an
    # error about the setting names what the user wrote.
    names: dict[str, str] = field(default_factory=dict)

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
    """A setting with its own mapping (a dict of options, an object to take settings from)."""

    apply: Callable[[Any, Mapped], None]


@dataclass(frozen=True, slots=True)
class Filter:
    """For a wrapper's own dict field that peers also use with other entries: `apply`
    maps the peers' entries and returns what the field keeps."""

    apply: Callable[[Any, Mapped], Any]


Setting = MapTo | Note | Refuse | Custom | Filter
_noted: set[tuple[str, str]] = set()


def translate(
    values: dict[str, Any],
    *,
    owner: str,
    own: set[str],
    peers: dict[str, Setting],
    engine_field: str,
    sampling_field: str,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The constructor's keyword arguments with the peers' settings mapped onto `own`
    fields (engine settings merged into `engine_field`, sampling into `sampling_field`;
    what the user put there explicitly wins), and the names the user gave the settings
    mapped (ours -> theirs). ValueError for what cannot be honoured."""
    out = {k: v for k, v in values.items() if k in own}
    unknown = sorted(k for k in values if k not in own and k not in peers)
    if unknown:
        raise ValueError(
            f"{owner} has no setting {', '.join(map(repr, unknown))}. Its settings: "
            f"{sorted(own)}; settings of other libraries it maps: {sorted(peers)} "
            "(see the README's table)"
        )
    mapped = Mapped(owner=owner)
    for key, value in values.items():
        rule = peers.get(key)
        if key in own:
            if isinstance(rule, Filter):
                out[key] = rule.apply(value, mapped)
            continue
        apply_rule(rule, key, value, mapped)
    for name, value in mapped.fields.items():
        given = out.get(name)
        if given is not None and given != value:
            raise ValueError(f"{owner}: {name!r} is given twice, with different values")
        out[name] = value
    for field_name, settings in ((engine_field, mapped.engine), (sampling_field, mapped.sampling)):
        if settings:
            out[field_name] = _merge(owner, field_name, settings, out.get(field_name) or {})
    # A wrapped object's settings apply where the constructor gives none of its own.
    for name, value in mapped.wrapped_fields.items():
        if out.get(name) is None:
            out[name] = value
    for field_name, settings in (
        (engine_field, mapped.wrapped_engine),
        (sampling_field, mapped.wrapped_sampling),
    ):
        if settings:
            out[field_name] = {**settings, **(out.get(field_name) or {})}
    return out, mapped.names


def apply_rule(rule: Setting | None, label: str, value: Any, mapped: Mapped) -> None:
    """One setting (`label`: the name the user wrote, `where[key]` inside a dict) by its
    rule; ValueError where it is refused."""
    if isinstance(rule, MapTo):
        destination = mapped.destination(rule.into)
        if rule.target in destination:
            raise ValueError(f"{mapped.owner}: {rule.target!r} is given twice (also as {label})")
        destination[rule.target] = rule.convert(value) if rule.convert else value
        mapped.names[rule.target] = label
    elif isinstance(rule, Note):
        if value is not None:
            note_once(mapped.owner, label, value, rule.reason)
    elif isinstance(rule, Refuse):
        if not any(value == ok for ok in rule.accepted):
            raise ValueError(f"{mapped.owner}: {label}={value!r} is not supported: {rule.reason}")
    elif isinstance(rule, Custom | Filter):
        rule.apply(value, mapped)
    else:  # pragma: no cover - the tables name a rule for every key they hold
        raise AssertionError(f"no rule for {label}")


def map_options(
    options: dict | None, table: dict[str, Setting], mapped: Mapped, where: str, what: str
) -> None:
    """Each entry of an option dict (Ollama's options, llama.cpp's model_kwargs, ...) by
    `table`; ValueError naming an entry the table does not know (`what` it is not)."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"{where} must be a dict, got {type(options).__name__}")
    for key, value in (options or {}).items():
        if key not in table:
            raise ValueError(
                f"{where}[{key!r}] is not {what} pagedllm knows; known: {sorted(table)}"
            )
        apply_rule(table[key], f"{where}[{key!r}]", value, mapped)


def note_once(owner: str, key: str, value: Any, reason: str) -> None:
    """Log, once per wrapper class and setting, that a setting has no effect and why. The
    value of a key or token is not written to the log."""
    if (owner, key) in _noted:
        return
    _noted.add((owner, key))
    shown = "<hidden>" if "key" in key or "token" in key else repr(value)
    logger.warning("%s: %s=%s has no effect: %s", owner, key, shown, reason)


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
    """A pydantic wrap-validator for a wrapper: its constructor's settings through
    `translate` (assign it to a class attribute of the wrapper, above its own
    validators). The wrapper keeps the names the user gave mapped settings in its private
    `_setting_names`; pydantic runs the after-validators defined below this one after it,
    so they see those names (an engine loaded there names the user's settings)."""
    from pydantic import model_validator

    def map_peer_settings(cls: Any, values: Any, handler: Callable[[Any], Any]) -> Any:
        if not isinstance(values, dict):
            return handler(values)
        translated, names = translate(
            values,
            owner=cls.__name__,
            own=own_names(cls),
            peers=peers,
            engine_field=engine_field,
            sampling_field=sampling_field,
        )
        instance = handler(translated)
        instance._setting_names = names
        return instance

    return model_validator(mode="wrap")(classmethod(map_peer_settings))  # type: ignore[arg-type]


def own_names(model_class: Any) -> set[str]:
    """A pydantic model's field names and aliases."""
    names = set(model_class.model_fields)
    names.update(f.alias for f in model_class.model_fields.values() if f.alias)
    return names
