"""A wrapper's hold on a shared engine, for every front end (LangChain, LlamaIndex).

The engine settings come from the wrapper's fields; the engine is taken from the shared
registry on the first call (or token count), never at construction, and given back by
`close()` (or a `with` block): the last wrapper to give it back frees its memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .chat.sampling import SAMPLING_FIELDS
from .engine.client import EngineClient
from .engine.config import ContextLengthError, EngineConfig
from .engine.factory import release_shared_engine, shared_engine
from .peer_settings import ENGINE_FIELDS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the embedded default model is called


def build_engine_config(
    explicit: dict[str, Any], engine_kwargs: dict[str, Any], vllm_kwargs: dict[str, Any]
) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine config, and the `vllm_kwargs` entries that are sampling parameters.

    `vllm_kwargs` mixes both kinds in LangChain's VLLM; an entry that is neither an engine
    setting nor a sampling parameter is a ValueError, never silently dropped.
    """
    engine_args = {k: v for k, v in explicit.items() if v is not None}
    engine, sampling = split_settings(vllm_kwargs, "vllm_kwargs")
    engine_args.update(engine)
    engine_args.update(engine_kwargs)
    return EngineConfig.from_kwargs(**engine_args), sampling


def split_settings(settings: dict[str, Any], where: str) -> tuple[dict, dict]:
    """(engine settings, sampling parameters) of a dict that mixes both, as VLLM's and
    LlamaIndex Vllm's `vllm_kwargs` do; ValueError for a key that is neither."""
    engine: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for key, value in settings.items():
        if key in ENGINE_FIELDS or key == "disable_custom_all_reduce":
            engine[key] = value
        elif key in SAMPLING_FIELDS:
            sampling[key] = value
        else:
            raise ValueError(
                f"{where}[{key!r}] is neither an engine setting nor a sampling parameter; "
                f"engine settings: {sorted(ENGINE_FIELDS)}; sampling: {sorted(SAMPLING_FIELDS)}"
            )
    return engine, sampling


def display_model_name(config: EngineConfig) -> str:
    """The name the engine will report, known without loading it."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model)
    if path.suffix == ".gguf":
        return path.stem
    return config.model if not path.exists() else path.name


class EngineOwner:
    """The shared engine of a wrapper, held from its first call until `close()` (mixed
    into the wrappers' pydantic models, which declare the private `_config` and
    `_engine`)."""

    _config: EngineConfig
    _engine: EngineClient | None
    _setting_names: dict[str, str]  # ours -> the name the user gave it (peer_settings.py)

    def _get_engine(self) -> EngineClient:
        # A shut-down engine (shutdown_shared_engines, close) is replaced on the next call.
        if self._engine is None or not self._engine.is_running:
            try:
                self._engine = shared_engine(self._config, owner=self)
            except ContextLengthError as error:
                # Name the setting the user gave (num_ctx, context_window, n_ctx).
                name = self._setting_names.get("max_model_len")
                if name is None:
                    raise
                message = (
                    f"{name}={error.requested} exceeds the model's context length "
                    f"{error.limit}: give at most {error.limit}, or leave {name} unset for "
                    "the model's own"
                )
                raise ContextLengthError(error.requested, error.limit, message) from None
        return self._engine

    @property
    def engine(self) -> EngineClient:
        """The shared engine (loads the model on first access)."""
        return self._get_engine()

    def close(self) -> None:
        """Give the shared engine back. Once no wrapper holds it any more, it is shut down
        and its weights and KV cache are freed; a later call loads it again."""
        if self._engine is not None:
            self._engine = None
            release_shared_engine(self._config, self)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _model_name(self) -> str:
        if self._engine is not None:
            return self._engine.model_name
        return display_model_name(self._config)

    def _token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids by the model's own tokenizer (LangChain's default would fetch GPT-2's
        from the Hugging Face Hub: it fails offline and miscounts online)."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        tokenizer = self._get_engine().tokenizer
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
