"""Request bodies of the OpenAI-compatible and SGLang-native endpoints, and API errors.

Bodies are checked strictly (a string where a number belongs is an error, not a guess)
and unknown fields are ignored, as OpenAI clients and benchmark tools send extras; but a
known field that would change the answer and is not implemented (penalties, logit bias,
structured output, tools) is refused unless it has its neutral value, never ignored.
Every problem becomes an `ApiError` that the app turns into the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}` with HTTP 400 (never 422 or 500): that
includes JSON nested too deeply for the decoder, and strings that are not Unicode text (a
lone surrogate, which JSON's `\\ud800` escape can carry but no tokenizer or UTF-8 encoder
takes).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

MAX_MESSAGE = 1000  # characters of an error message (echoed input is cut far shorter)
MAX_CHOICES = 1024  # prompts x n one request may ask for (serve --max-choices)


class ApiError(Exception):
    """An error the client gets as JSON: HTTP `status`, OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = "invalid_value", type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        message = _printable(message)
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE - 3] + "..."
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


def neutral(*values: Any, hint: str = "") -> AfterValidator:
    """A field accepted only at values that change nothing (its default, an empty
    collection): any other value would be ignored, so it is refused, naming the field."""
    shown = " or ".join(json.dumps(v) for v in values)

    def check(value: Any) -> Any:
        if value not in values:
            raise PydanticCustomError("unsupported", "not supported by this server{hint}; only "
                                      "{shown} is accepted", {"hint": hint, "shown": shown})
        return value

    return AfterValidator(check)


NO_PENALTY = neutral(0.0, hint=" (no penalties)")
Unset = Annotated[Any, neutral(None)]
MAX_STOPS = 64  # stop strings a request may send: each is searched at every token
Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(Body):
    include_usage: bool = False


class Decoding(Body):
    """What every generating endpoint takes, under the same names. temperature below the
    engine's MIN_TEMPERATURE (0 included) is greedy; top_k 0 or -1 and min_p 0 are off."""

    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: PositiveInt = 1
    # Accepted at their neutral values only: anything else would change the answer silently.
    frequency_penalty: Annotated[float, NO_PENALTY] | None = None
    presence_penalty: Annotated[float, NO_PENALTY] | None = None
    repetition_penalty: Annotated[float, neutral(1.0, hint=" (no penalties)")] | None = None
    logit_bias: Annotated[dict[str, Any], neutral({})] | None = None
    include_stop_str_in_output: Annotated[bool, neutral(False)] = False  # vLLM's
    no_stop_trim: Annotated[bool, neutral(False)] = False  # SGLang's
    # vLLM's and SGLang's other answer-changing extras, not implemented: refused.
    allowed_token_ids: Annotated[list[Any], neutral([])] | None = None
    bad_words: Annotated[list[Any], neutral([])] | None = None
    truncate_prompt_tokens: Unset = None
    use_beam_search: Annotated[bool, neutral(False)] = False
    prompt_logprobs: Unset = None
    stop_regex: Unset = None
    custom_logit_processor: Unset = None
    logits_processors: Unset = None

    @property
    def top_k_or_off(self) -> int:
        """top_k for the engine: 0 is off (vLLM and SGLang also take -1 for off)."""
        return max(self.top_k, 0)


class Sampling(Decoding):
    """What the OpenAI endpoints share."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: Literal[1] | None = None
    response_format: Annotated[dict[str, Any], neutral({"type": "text"})] | None = None
    # vLLM's structured output: not implemented, so refused rather than ignored.
    guided_json: Unset = None
    guided_regex: Unset = None
    guided_choice: Unset = None
    guided_grammar: Unset = None


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
    tool_calls: Annotated[list[Any], neutral([], hint=" (no tool calling)")] | None = None

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
    # No tool calling: a clear error, not a silent plain answer. With no tools to call,
    # "auto" and "none" are the same plain answer, so those choices are accepted.
    tools: Annotated[list[Any], neutral([], hint=" (no tool calling)")] | None = None
    functions: Annotated[list[Any], neutral([], hint=" (no tool calling)")] | None = None
    tool_choice: Annotated[Any, neutral("none", "auto", hint=" (no tool calling)")] = None
    function_call: Annotated[Any, neutral("none", "auto", hint=" (no tool calling)")] = None
    chat_template_kwargs: Annotated[dict[str, Any], neutral({})] | None = None
    chat_template: Unset = None  # the model's own template only
    add_generation_prompt: Annotated[bool, neutral(True)] = True
    continue_final_message: Annotated[bool, neutral(False)] = False

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @classmethod
    def asked(cls, data: dict[str, Any]) -> Asked | None:
        return Asked(1, data.get("n", 1), "messages")


class GenerateSampling(Decoding):
    """SGLang's `sampling_params`."""

    max_new_tokens: PositiveInt = 128
    min_new_tokens: Annotated[int, Field(ge=0)] | None = None  # SGLang's name for min_tokens
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    json_schema: Unset = None  # SGLang's constrained decoding: not implemented
    regex: Unset = None
    ebnf: Unset = None
    structural_tag: Unset = None

    @property
    def least_tokens(self) -> int:
        return self.min_tokens if self.min_new_tokens is None else self.min_new_tokens


class GenerateRequest(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: Annotated[bool, neutral(False)] = False
    lora_path: Unset = None
    image_data: Unset = None

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
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse(cls: type[B], raw: bytes, max_choices: int = MAX_CHOICES) -> B:
    """The body as `cls`, or ApiError(400) naming the first field that is wrong. A body
    asking for more than `max_choices` choices is refused before it is validated."""
    try:  # JSON over HTTP is UTF-8 (RFC 8259): no UTF-16/32 guessing past the checks below
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # the decoder recurses per level of nesting
        raise ApiError("the body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object", code="invalid_json")
    if issubclass(cls, Body):
        check_choices(cls.asked(data), max_choices)
    if _SURROGATE_ESCAPE.search(raw):  # raw UTF-8 cannot hold one: only an escape can
        check_text(data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if isinstance(p, str) and not _tag(p))
        given = "" if err["type"] == "missing" else f", got {quote(err.get('input'))}"
        raise ApiError(f"{field or 'body'}: {err['msg']}{given}", param=field or None,
                       code=_code(err["type"])) from None


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


def check_text(data: Any) -> None:
    """ApiError(400) for parsed JSON holding a string (or a key) that is not Unicode text:
    a lone surrogate would make the tokenizer fail, and any answer that echoes it (an error
    message, a stop string) fail to encode. The error names the first such field in
    document order. Iterative, so no nesting can exhaust the stack."""
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if not _is_text(value):
                _bad_text(path)
            continue
        if isinstance(value, dict):
            if not all(_is_text(k) for k in value):
                _bad_text(path, key=True)
            todo.extend((v, (*path, k)) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            todo.extend((v, (*path, i)) for i, v in reversed(list(enumerate(value))))


def _is_text(s: str) -> bool:
    """No lone surrogate (JSON joins a valid surrogate pair into one character)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_text(path: tuple[str | int, ...], key: bool = False) -> None:
    what = "a key" if key else "the string"
    raise ApiError(f"{_where(path)}: {what} is not valid Unicode text (it holds a lone "
                   f"surrogate, e.g. an unpaired \\ud800 escape)", param=_param(path))


def _where(path: tuple[str | int, ...]) -> str:
    """`messages[0].content`: the place in the body, for a message."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else p
    return out or "body"


def _param(path: tuple[str | int, ...]) -> str | None:
    """`messages.content`: the field, for `param` (indices left out, as for every error)."""
    return ".".join(p for p in path if isinstance(p, str)) or None


def _code(kind: str) -> str:
    if kind == "missing":
        return "missing_field"
    if kind == "unsupported":
        return "unsupported_value"
    return "invalid_type" if kind.endswith("_type") else "invalid_value"


def _tag(part: str) -> bool:
    """Pydantic names the union member it tried in an error's location (`str`,
    `list[int]`, `literal[0]`, `function-after[...]`); a client never sees those."""
    return part in ("str", "int", "float", "bool", "none") or "[" in part


def quote(value: Any, limit: int = 60) -> str:
    """A client's value, for an error message: at most `limit` characters (a 5 MB prompt is
    not echoed back), and always encodable (a lone surrogate shows as `\\ud800`)."""
    if isinstance(value, str):
        text = repr(value[:limit])
    else:
        text = _printable(json.dumps(_clip(value, limit), ensure_ascii=False, default=repr))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _clip(value: Any, limit: int, depth: int = 0) -> Any:
    """A copy small enough to render cheaply: strings cut to `limit`, containers to their
    first few items, nesting to a few levels (the cut rendering shows at most `limit`)."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list | dict) and depth >= 4:
        return "..."
    if isinstance(value, list):
        return [_clip(v, limit, depth + 1) for v in value[:limit // 2]]
    if isinstance(value, dict):
        return {_clip(k, limit, depth + 1): _clip(v, limit, depth + 1)
                for k, v in list(value.items())[:limit // 4]}
    return value


def _printable(text: str) -> str:
    """`text` with lone surrogates written as escapes, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
