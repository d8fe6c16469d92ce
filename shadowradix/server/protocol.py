"""Request bodies of the OpenAI-compatible and SGLang-native endpoints, and API errors.

Bodies are checked strictly (a string where a number belongs is an error, not a guess)
and unknown fields are ignored, as OpenAI clients and benchmark tools send extras. Every
problem becomes an `ApiError` that the app turns into the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}` with HTTP 400 (never 422).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

MAX_CHOICES = 1024  # prompts x n one request may ask for (serve --max-choices)


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


class Asked(NamedTuple):
    """How many choices a raw body asks for (prompts x n), and the fields that say so."""

    prompts: int
    n: Any  # as sent: its own validation says what is wrong with a bad one
    prompt_param: str
    n_param: str = "n"


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def asked(cls, data: dict[str, Any]) -> Asked | None:
        """The choices a raw (unvalidated) body asks for; None: it generates nothing."""
        return None



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

    @classmethod
    def asked(cls, data: dict[str, Any]) -> Asked | None:
        return Asked(_count(data.get("prompt")), data.get("n", 1), "prompt")


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

    @classmethod
    def asked(cls, data: dict[str, Any]) -> Asked | None:
        return Asked(1, data.get("n", 1), "messages")


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

    @classmethod
    def asked(cls, data: dict[str, Any]) -> Asked | None:
        sampling = data.get("sampling_params")
        n = sampling.get("n", 1) if isinstance(sampling, dict) else 1
        field = "input_ids" if data.get("text") is None else "text"
        return Asked(_count(data.get(field)), n, field, "sampling_params.n")


class TokenizeRequest(Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    tokens: list[int]


B = TypeVar("B", bound=BaseModel)


def parse(cls: type[B], raw: bytes, max_choices: int = MAX_CHOICES) -> B:
    """The body as `cls`, or ApiError(400) naming the first field that is wrong. A body
    asking for more than `max_choices` choices is refused before it is validated."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object", code="invalid_json")
    if issubclass(cls, Body):
        check_choices(cls.asked(data), max_choices)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if isinstance(p, str) and not _tag(p))
        given = "" if err["type"] == "missing" else f", got {_short(err.get('input'))}"
        raise ApiError(f"{field or 'body'}: {err['msg']}{given}", param=field or None,
                       code="missing_field" if err["type"] == "missing" else "invalid_type"
                       if err["type"].endswith("_type") else "invalid_value") from None


def check_choices(asked: Asked | None, most: int) -> None:
    """ApiError (400) for a body that asks for more than `most` choices (prompts x n), read
    from the raw JSON before validation builds its items or anything is made per prompt
    (n=10**9 would otherwise build a billion choices before any queue limit applies)."""
    if asked is None or type(asked.n) is not int or asked.n < 1:
        return  # n's own validation says what is wrong with it
    if asked.n > most:
        raise ApiError(f"{asked.n_param}: at most {most} choices per request (the server's "
                       f"--max-choices), got {asked.n}", param=asked.n_param,
                       code="integer_above_max_value")
    if asked.prompts * asked.n > most:
        raise ApiError(f"{asked.prompt_param}: {asked.prompts} prompts x n={asked.n} ask for "
                       f"{asked.prompts * asked.n} choices; at most {most} per request (the "
                       f"server's --max-choices)", param=asked.prompt_param,
                       code="array_above_max_length")


def _count(prompt: Any) -> int:
    """Prompts in a raw `prompt` / `text` / `input_ids`: a list of strings or of id lists
    holds one each; anything else (a string, a list of ids) is one. Reads one item."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def _tag(part: str) -> bool:
    """Pydantic names the union member it tried in an error's location (`str`,
    `list[int]`, `literal[0]`, `function-after[...]`); a client never sees those."""
    return part in ("str", "int", "float", "bool", "none") or "[" in part


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
