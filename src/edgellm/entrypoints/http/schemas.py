"""Request bodies of the OpenAI API subset edgellm serves. Unknown fields are ignored, as
OpenAI's API does; invalid known ones are a 400."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# C0/C1 control characters other than tab, newline and carriage return.
_CONTROL = dict.fromkeys([*range(0, 9), 11, 12, *range(14, 32), 127, *range(128, 160)])


def clean_text(text: str) -> str:
    """Strip control characters (they only confuse tokenizers and terminals); keep whitespace,
    emoji and CJK intact."""
    return text.translate(_CONTROL)


def check_unicode(value: Any, where: str = "body") -> None:
    """Every string in a request must be encodable Unicode: JSON's escapes can spell an unpaired
    UTF-16 surrogate ("\\ud800"), which no tokenizer, log or reply can carry."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} holds an unpaired UTF-16 surrogate (\\ud800-\\udfff): send valid Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where)
            check_unicode(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{where}[{i}]")


MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one /v1/completions request
# OpenAI fields edgellm does not do, with the values that mean "not used" (anything else is a 400)
UNSUPPORTED = {"audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
               "web_search_options": (None,), "functions": (None,), "function_call": (None, "none"),
               "store": (None, False), "suffix": (None, ""), "best_of": (None, 1)}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, max_length=200_000)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=64)  # checked by chat_messages
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, content):
        if isinstance(content, list):  # OpenAI's content parts: text only
            content = "".join(part.text for part in content)
        return None if content is None else clean_text(content)

    def plain(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True) | {"content": self.content}


class JSONSchemaFormat(_Lenient):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class EdgeLLMOptions(_Lenient):
    """edgellm's own request options, beside OpenAI's fields."""
    speculative: Literal["lookup", "draft", "self", "off"] | None = None  # None: the server's setting
    adapter: str | None = Field(default=None, max_length=64)  # a resident LoRA adapter (or model "base:adapter")
    cloud_fallback: bool = False  # may go to the server's --fallback-url when the device cannot answer
    private: bool = False  # never leaves the device, whatever else is set


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str
    max_tokens: int | None = Field(default=None, ge=0, le=32_768)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=32_768)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extension
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # extension
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False  # extension (vLLM's): generate max_tokens whatever the model says
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=4096)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    edgellm: EdgeLLMOptions | None = None  # extension
    # structured output: OpenAI's response_format, and vLLM's guided_* extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=1000)
    guided_regex: str | None = Field(default=None, max_length=10_000)
    guided_grammar: str | None = Field(default=None, max_length=100_000)

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported(cls, data: Any) -> Any:
        """OpenAI fields edgellm does not do are a 400 naming them, not silence."""
        if isinstance(data, dict):
            for name, default in UNSUPPORTED.items():
                if name in data and data[name] not in default:
                    raise ValueError(f"{name}: not supported by this server")
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for key, value in (bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return bias

    def sampling(self) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        options = {} if self.edgellm is None or self.edgellm.speculative is None else {
            "speculative": self.edgellm.speculative}
        return dict(max_tokens=256 if limit is None else limit, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(s for s in stop if s),
                    ignore_eos=self.ignore_eos, frequency_penalty=self.frequency_penalty,
                    presence_penalty=self.presence_penalty,
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, **options)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)  # checked by chat_messages
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(_Sampling):
    # a text, texts, token ids or lists of token ids: one choice (n choices) per prompt
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"between 1 and {MAX_PROMPTS} prompts")
        for one in prompts:
            if not one:
                raise ValueError("a prompt is empty")
            if isinstance(one, str) and len(one) > 200_000:
                raise ValueError("a prompt is longer than 200,000 characters")
            if isinstance(one, list) and (len(one) > 200_000 or min(one) < 0):
                raise ValueError("token ids must be >= 0 (and at most 200,000 of them)")
        return [clean_text(p) if isinstance(p, str) else p for p in prompts]
