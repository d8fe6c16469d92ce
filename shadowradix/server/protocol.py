"""Request bodies of the OpenAI-compatible and SGLang-native endpoints, and API errors.

Bodies are checked strictly (a string where a number belongs is an error, not a guess)
and unknown fields are ignored, as OpenAI clients and benchmark tools send extras. Every
problem becomes an `ApiError` that the app turns into the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}` with HTTP 400 (never 422).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An error the client gets as JSON: HTTP `status`, OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = "invalid_value", type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message, status, param, code, type)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


PositiveInt = Annotated[int, Field(ge=1)]


def _zero(value: float) -> float:
    if value != 0:
        raise ValueError("only 0 is supported (no penalties)")
    return value


ZeroOnly = Annotated[float, AfterValidator(_zero)]
Stop = str | list[str] | None


class StreamOptions(Body):
    include_usage: bool = False


class Decoding(Body):
    """What every generating endpoint takes, under the same names."""

    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: PositiveInt = 1


class Sampling(Decoding):
    """What the OpenAI endpoints share."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted at their defaults only: anything else would change the answer silently.
    frequency_penalty: ZeroOnly | None = None
    presence_penalty: ZeroOnly | None = None
    best_of: Literal[1] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: PositiveInt | None = 16  # OpenAI's default for completions
    echo: Literal[False] = False
    logprobs: Literal[0] | None = None
    suffix: Literal[""] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        """For the chat template: OpenAI's `developer` role is the system prompt."""
        return {"role": "system" if self.role == "developer" else self.role,
                "content": self.text()}

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    tools: Literal[None] = None  # no tool calling: a clear error, not a silent plain answer

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class GenerateSampling(Decoding):
    """SGLang's `sampling_params`."""

    max_new_tokens: PositiveInt = 128
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None


class GenerateRequest(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    stream: bool = False
    rid: str | list[str] | None = None


class TokenizeRequest(Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    tokens: list[int]


B = TypeVar("B", bound=BaseModel)


def parse(cls: type[B], raw: bytes) -> B:
    """The body as `cls`, or ApiError(400) naming the first field that is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if isinstance(p, str) and not _tag(p))
        given = "" if err["type"] == "missing" else f", got {_short(err.get('input'))}"
        raise ApiError(f"{field or 'body'}: {err['msg']}{given}", param=field or None,
                       code="missing_field" if err["type"] == "missing" else "invalid_type"
                       if err["type"].endswith("_type") else "invalid_value") from None


def _tag(part: str) -> bool:
    """Pydantic names the union member it tried in an error's location (`str`,
    `list[int]`, `literal[0]`, `function-after[...]`); a client never sees those."""
    return part in ("str", "int", "float", "bool", "none") or "[" in part


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
