"""Every error edgellm raises on purpose; the CLI and server translate these in one place each."""
from __future__ import annotations


def type_and_stack(error: BaseException) -> str:
    """What a log may say of an unexpected failure: its type and stack, never its message
    (which may quote user text)."""
    import traceback

    return f"{type(error).__name__}\n" + "".join(traceback.format_tb(error.__traceback__)).rstrip()


class EdgeLLMError(Exception):
    """Base of all deliberate edgellm errors."""


class ModelFormatError(EdgeLLMError):
    """A model file is not what it claims to be (corrupt, truncated, unsupported)."""

    def __init__(self, path: object, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ModelNotFound(EdgeLLMError):
    """A model name or path that resolves to nothing."""


class UnsupportedModel(EdgeLLMError):
    """A valid file whose architecture or tensor type edgellm cannot run."""


class DraftMismatch(UnsupportedModel):
    """A speculative draft model that cannot draft for this target (another vocabulary)."""


class AdapterMismatch(UnsupportedModel):
    """A LoRA adapter that does not fit the base model (another architecture, shapes or rank)."""


class InvalidRequest(EdgeLLMError):
    """Bad generation arguments (negative max_tokens, top_p outside (0, 1], ...)."""


class ContextOverflow(InvalidRequest):
    """The prompt does not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, context_size: int):
        self.prompt_tokens = prompt_tokens
        self.context_size = context_size
        super().__init__(
            f"prompt has {prompt_tokens} tokens but the context holds {context_size}"
        )


class TokenizerError(EdgeLLMError):
    """A model's tokenizer or chat template that edgellm cannot build or use."""


class OutOfMemoryBudget(EdgeLLMError):
    """The work would exceed the memory budget the engine was given."""

    def __init__(self, needed_bytes: int, available_bytes: int, what: str = "KV cache"):
        self.needed_bytes, self.available_bytes = needed_bytes, available_bytes
        super().__init__(f"{what} needs {needed_bytes / 2**20:.1f} MiB but only "
                         f"{available_bytes / 2**20:.1f} MiB of the memory budget is available")


class StoreError(EdgeLLMError):
    """The model store: a download that failed or was refused, bytes that are not what was
    expected, a manifest that disagrees with its blob. Nothing is stored by a failed pull."""


class KVStateMismatch(EdgeLLMError):
    """A saved KV state belongs to another model or precision."""


class ServiceClosed(EdgeLLMError):
    """The service was closed: its requests end (running ones as "cancelled") and new ones are refused."""


class Busy(EdgeLLMError):
    """The request queue is full: try again later (HTTP 429)."""

    def __init__(self, queue_depth: int, queue_limit: int):
        self.queue_depth, self.queue_limit = queue_depth, queue_limit
        super().__init__(f"server busy: {queue_depth} requests waiting (limit {queue_limit})")
