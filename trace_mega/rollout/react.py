"""The ReAct scaffold: chat-template rendering and robust tool-call parsing.

Turn format the parser accepts (documented in docs/rollout.md):

* Tool calls, in order of precedence:
  1. Qwen3 / Hermes tags: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``
     (several blocks per turn allowed);
  2. a fenced block ```` ```json {"name": …, "arguments": …} ``` ```` (or a
     JSON list of such objects);
  3. a bare JSON object ``{"name": …, "arguments": …}`` in the text.
  ``arguments`` may also be a JSON-encoded string (OpenAI style) and
  ``parameters`` is accepted as its alias.
* A final answer: ``<answer>…</answer>`` or a line starting with
  ``Final answer:`` (the rest of the text is the answer).
* Anything before the action is the thought. ``<think>…</think>`` blocks are
  reasoning: their content joins the thought and tags or JSON inside them are
  never read as actions. A leading ``…</think>`` without an opening tag (the
  generation prompt of Qwen3 thinking models ends with ``<think>``) is
  reasoning too.

A turn with both an explicit tool call (tags or a fence) and a final answer,
with neither, or with a malformed call (bad JSON, unknown tool, arguments that
violate the tool's JSON schema, arguments nested deeper than `MAX_ARG_DEPTH`
or larger than `MAX_ARG_ITEMS` values / `MAX_ARG_CHARS` characters, more calls
than the caller's `max_tool_calls`, unbalanced or nested tags, a generation
cut at the token limit) parses to a `ParsedTurn` with `error` set and no
actions; the agent loop shows it to the model as an error observation.
Parsing never raises, and nothing after `json.loads` (whose own recursion is
guarded) recurses deeper than `MAX_ARG_DEPTH` on what the model wrote.

`ReactScaffold` renders prompts with the tokenizer's chat template and
renders observations as tool-role messages of the same template, producing
token ids to APPEND after the generated tokens (generated tokens are never
decoded and re-encoded).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from trace_mega.envs.base import ParsedTurn, Task, ToolCall
from trace_mega.rollout.tree import Node

TOOL_TAG_RE = re.compile(r"</?tool_call>")
ANSWER_TAG_RE = re.compile(r"</?answer>")
FINAL_LINE_RE = re.compile(r"(?im)^[ \t]*final answer[ \t]*:")
FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|tool_call)?[ \t]*\n?(.*?)```", re.S)
THINK_RE = re.compile(r"</?think>")
MAX_BARE_JSON_STARTS = 64  # bounds the bare-JSON scan (each attempt is linear in the text)
# Bounds on one call's arguments: whatever passes is cheap to validate, copy (env.fork), store in the
# tree and serialise, all of which recurse on it (json.loads itself fails cleanly past ~1000 levels).
MAX_ARG_DEPTH = 32
"""Nesting levels of objects / arrays, the arguments object itself being level 1."""
MAX_ARG_ITEMS = 10_000
"""Values (objects, arrays, scalars) inside the arguments."""
MAX_ARG_CHARS = 1 << 18
"""Characters of all strings and keys inside the arguments (256 Ki: room for long code)."""

# BFCL writes a few Python type names into its JSON schemas.
_TYPE_ALIASES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "list": "array",
    "bool": "boolean",
    "int": "integer",
    "str": "string",
    "any": "any",
}


# --- JSON-schema argument validation ---------------------------------------------


def _type_ok(value: Any, tp: str) -> bool:
    tp = _TYPE_ALIASES.get(tp, tp)
    if tp == "any":
        return True
    if tp == "string":
        return isinstance(value, str)
    if tp == "boolean":
        return isinstance(value, bool)
    if tp == "integer":  # JSON Schema: 3.0 is an integer; a bool is not
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer()
        )
    if tp == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp == "array":
        return isinstance(value, list)
    if tp == "object":
        return isinstance(value, dict)
    if tp == "null":
        return value is None
    return True  # a type this validator does not know constrains nothing


def _json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def validate_value(value: Any, schema: Any, where: str) -> Optional[str]:
    """First violation of `schema` by `value` as a message naming `where`, or None.

    Checks type (or a list of types), enum, object properties / required keys /
    additionalProperties false, and array items — the parts of JSON Schema tool
    descriptions use.
    """
    if not isinstance(schema, dict):
        return None
    tp = schema.get("type")
    if tp is not None:
        types = tp if isinstance(tp, list) else [tp]
        if not any(_type_ok(value, str(t)) for t in types):
            want = " or ".join(str(t) for t in types)
            return f"{where} must be {want}, got {_json_type_name(value)}"
    enum = schema.get("enum")
    if isinstance(enum, list) and value not in enum:
        return f"{where} must be one of {json.dumps(enum)}, got {json.dumps(value)}"
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        missing = [k for k in required if k not in value]
        if missing:
            return f"{where} is missing required key(s) {', '.join(map(repr, missing))}"
        if schema.get("additionalProperties") is False:
            extra = sorted(k for k in value if k not in props)
            if extra:
                return f"{where} has unexpected key(s) {', '.join(map(repr, extra))}"
        for k, v in value.items():
            if k in props:
                err = validate_value(v, props[k], f"argument {k!r}" if where == "arguments" else f"{where}.{k}")
                if err:
                    return err
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            err = validate_value(v, schema["items"], f"{where}[{i}]")
            if err:
                return err
    return None


def tool_specs(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, for OpenAI-style ({"type": "function", "function": {...}}) or flat specs."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


# --- parsing -------------------------------------------------------------------


class _ParseError(Exception):
    pass


def _call_from_obj(obj: Any) -> ToolCall:
    """A ToolCall from a decoded JSON object; _ParseError when it is not one."""
    if not isinstance(obj, dict):
        raise _ParseError(f"a tool call must be a JSON object, got {_json_type_name(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _ParseError('a tool call needs a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments is a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise _ParseError(f"arguments of {name!r} are a string that is not valid JSON ({exc})") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise _ParseError(f'"arguments" of {name!r} must be a JSON object, got {_json_type_name(args)}')
    too_big = _shape_error(args)
    if too_big:
        raise _ParseError(f"arguments of {name!r} are {too_big}")
    call_id = obj.get("id")
    return ToolCall(name=name, arguments=args, call_id=call_id if isinstance(call_id, str) else None)


def _shape_error(args: dict[str, Any]) -> Optional[str]:
    """Why `args` exceeds the depth / size bounds, or None (an explicit stack: no recursion)."""
    stack: list[tuple[Any, int]] = [(args, 1)]
    items = chars = 0
    while stack:
        value, depth = stack.pop()
        items += 1
        if items > MAX_ARG_ITEMS:
            return f"more than {MAX_ARG_ITEMS} values"
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, (dict, list)):
            if depth > MAX_ARG_DEPTH:
                return f"nested deeper than {MAX_ARG_DEPTH} levels"
            if items + len(value) > MAX_ARG_ITEMS:
                return f"more than {MAX_ARG_ITEMS} values"
            if isinstance(value, dict):
                chars += sum(len(k) for k in value)
                stack.extend((v, depth + 1) for v in value.values())
            else:
                stack.extend((v, depth + 1) for v in value)
        if chars > MAX_ARG_CHARS:
            return f"longer than {MAX_ARG_CHARS} characters"
    return None


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _ParseError(f"{what} is not valid JSON: {exc.msg} at char {exc.pos}") from None
    except (ValueError, RecursionError):
        raise _ParseError(f"{what} is not valid JSON (nested too deeply or unparsable)") from None


def _calls_from_json(obj: Any) -> list[ToolCall]:
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise _ParseError("an empty list of tool calls")
    return [_call_from_obj(o) for o in items]


def _balanced_blocks(text: str, tag_re: re.Pattern, tag: str, truncated: bool) -> tuple[list[tuple[int, int]], int]:
    """(content spans of the <tag>…</tag> blocks, start of the first tag or -1); _ParseError if unbalanced/nested."""
    spans: list[tuple[int, int]] = []
    open_at = -1
    first = -1
    for m in tag_re.finditer(text):
        first = m.start() if first < 0 else first
        closing = m.group().startswith("</")
        if not closing:
            if open_at >= 0:
                raise _ParseError(f"nested <{tag}> tags: a <{tag}> opens before the previous one is closed")
            open_at = m.end()
        else:
            if open_at < 0:
                raise _ParseError(f"</{tag}> without a matching <{tag}>")
            spans.append((open_at, m.start()))
            open_at = -1
    if open_at >= 0:
        if truncated:
            raise _ParseError(f"generation hit the token limit inside <{tag}> (truncated)")
        raise _ParseError(f"<{tag}> is never closed (missing </{tag}>)")
    return spans, first


def _bare_json_call(text: str) -> tuple[Optional[list[ToolCall]], int]:
    """The first JSON object in `text` that looks like a call ({"name": …, "arguments"|"parameters": …})."""
    decoder = json.JSONDecoder()
    for n, m in enumerate(re.finditer(r"[\[{]", text)):
        if n >= MAX_BARE_JSON_STARTS:
            break
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except (ValueError, RecursionError):
            continue
        items = obj if isinstance(obj, list) else [obj]
        if items and all(
            isinstance(o, dict) and "name" in o and ("arguments" in o or "parameters" in o) for o in items
        ):
            return _calls_from_json(obj), m.start()
    return None, -1


def _split_think(text: str, truncated: bool) -> tuple[str, str]:
    """(reasoning inside <think> blocks, the rest of the text with those blocks removed)."""
    first = THINK_RE.search(text)
    if first is None:
        return "", text
    reasoning, rest = [], text
    if first.group() == "</think>":  # the opening tag was part of the prompt
        reasoning.append(text[: first.start()])
        rest = text[first.end() :]
    spans, _ = _balanced_blocks(rest, THINK_RE, "think", truncated)
    body, at = [], 0
    for a, b in spans:
        reasoning.append(rest[a:b])
        body.append(rest[at : a - len("<think>")])
        at = b + len("</think>")
    body.append(rest[at:])
    return "\n".join(r.strip() for r in reasoning if r.strip()), "".join(body)


def _check_count(n: int, max_calls: Optional[int]) -> None:
    if max_calls is not None and n > max_calls:
        raise _ParseError(f"{n} tool calls in one turn; at most {max_calls} are allowed (none was run)")


def _parse(raw: str, tools: list[dict[str, Any]], truncated: bool, max_calls: Optional[int]) -> ParsedTurn:
    if not raw.strip():
        raise _ParseError(
            "empty turn" + (" (generation truncated)" if truncated else "") + ": expected a tool call or a final answer"
        )
    reasoning, text = _split_think(raw, truncated)
    tool_spans, tool_at = _balanced_blocks(text, TOOL_TAG_RE, "tool_call", truncated)
    answer_spans, answer_at = _balanced_blocks(text, ANSWER_TAG_RE, "answer", truncated)
    final_line = FINAL_LINE_RE.search(text)
    fence = FENCE_RE.search(text) if not tool_spans else None
    fence_calls: Optional[list[ToolCall]] = None
    if fence is not None:
        try:
            fence_calls = _calls_from_json(json.loads(fence.group(1)))
        except (ValueError, RecursionError, _ParseError):
            fence_calls = None  # a fence that is not a call (e.g. code) is just text
    has_answer = bool(answer_spans) or final_line is not None
    if has_answer and (tool_spans or fence_calls):
        raise _ParseError("the turn has both a tool call and a final answer; give exactly one")

    calls: list[ToolCall] = []
    action_at = -1
    final: Optional[str] = None
    if tool_spans:
        _check_count(len(tool_spans), max_calls)  # before any JSON is decoded
        for a, b in tool_spans:
            body = text[a:b].strip()
            inner = FENCE_RE.fullmatch(body)
            calls += _calls_from_json(_loads(inner.group(1) if inner else body, "the <tool_call> content"))
        action_at = tool_at
    elif has_answer:
        if answer_spans:
            if len(answer_spans) > 1:
                raise _ParseError("more than one <answer> block")
            final, action_at = text[answer_spans[0][0] : answer_spans[0][1]].strip(), answer_at
        else:
            final, action_at = text[final_line.end() :].strip(), final_line.start()
        if not final:
            raise _ParseError("the final answer is empty")
    elif fence_calls:
        calls, action_at = fence_calls, fence.start()
    else:
        bare, action_at = _bare_json_call(text)
        if bare is None:
            if truncated:
                raise _ParseError("generation hit the token limit before a complete tool call or final answer")
            raise _ParseError(
                "no tool call or final answer found; call a tool with "
                '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or answer with <answer>...</answer>'
            )
        calls = bare
    _check_count(len(calls), max_calls)
    specs = tool_specs(tools)
    for call in calls:
        if call.name not in specs:
            valid = ", ".join(sorted(specs)) or "(no tools available)"
            raise _ParseError(f"unknown tool {call.name!r}; available tools: {valid}")
        err = validate_value(call.arguments, {"type": "object", **specs[call.name]}, "arguments")
        if err:
            raise _ParseError(f"bad arguments for tool {call.name!r}: {err}")
    thought = "\n".join(t for t in (reasoning, text[:action_at].strip()) if t)
    return ParsedTurn(raw=raw, thought=thought, tool_calls=calls, final_answer=final)


def parse_turn(
    text: str, tools: list[dict[str, Any]], *, truncated: bool = False, max_tool_calls: Optional[int] = None
) -> ParsedTurn:
    """Parse one generated turn into thought + tool calls, a final answer, or an error.

    `truncated` says the generation stopped at the token limit (not at a stop
    token), which changes error messages for unclosed tags. A turn with more
    than `max_tool_calls` calls is an error (None: no cap). Never raises.
    """
    try:
        return _parse(text, tools, truncated, max_tool_calls)
    except _ParseError as exc:
        return ParsedTurn(raw=text, thought="", error=str(exc))


def error_observation(error: str) -> str:
    """The observation text shown to the model for a malformed turn or failed tool call."""
    return f"Error: {error}"


# --- rendering -------------------------------------------------------------------

_MARKER = "TRACEMEGAASSISTANTMARKER"
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")


class ReactScaffold:
    """Chat-template rendering of prompts and observations, and turn parsing, for one tokenizer.

    Observations are rendered by the template itself: the text that the
    template emits after an assistant message when tool messages follow (the
    end-of-turn closer, the tool block, the next generation prompt) is cut out
    of a rendered probe conversation and encoded alone, then appended after
    the generated ids. If the generation already ended with the closer's first
    token (e.g. `<|im_end|>`), that token is not repeated.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_ids = self._ids_of(_END_OF_TURN_TEXTS)
        if tokenizer.eos_token_id is not None:
            self.end_of_turn_ids.add(int(tokenizer.eos_token_id))
        # Stop at the end of a tool call or answer: `</tool_call>` as a token (Qwen3), or
        # any added token that ENDS a call/answer (the tiny vocabulary's one-token actions).
        stops = set(self.end_of_turn_ids)
        for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if str(tok).endswith("</tool_call>") or str(tok).endswith("</answer>"):
                stops.add(int(tid))
        self.stop_token_ids = sorted(stops)
        # Strings the tokenizer would turn into control tokens wherever they appear in text.
        self._control_texts = sorted(
            {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
            | set(getattr(tokenizer, "all_special_tokens", [])),
            key=len,
            reverse=True,
        )
        self._observation_text(["probe"])  # fails now, clearly, if the template cannot be cut

    def _ids_of(self, texts: tuple[str, ...]) -> set[int]:
        vocab = self.tokenizer.get_vocab()
        return {int(vocab[t]) for t in texts if t in vocab}

    def prompt_ids(self, task: Task) -> list[int]:
        """Token ids of the prompt: the chat template with the tools and the generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            task.messages, tools=task.tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]

    def _continuation_text(self, messages: list[dict[str, Any]]) -> str:
        """What the template writes after an assistant turn when `messages` follow, up to the next generation prompt."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}, *messages]
        text = self.tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        at = text.find(_MARKER)
        if at < 0:
            raise ValueError("the chat template drops assistant content; observations cannot be rendered from it")
        return text[at + len(_MARKER) :]

    def _observation_text(self, observations: list[str]) -> str:
        return self._continuation_text([{"role": "tool", "content": o} for o in observations])

    def _append_ids(self, generated_ids: list[int], text: str) -> list[int]:
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]
        if ids and generated_ids and generated_ids[-1] == ids[0] and ids[0] in self.end_of_turn_ids:
            ids = ids[1:]
        return ids

    def defuse(self, observation: str) -> str:
        """`observation` with every control-token string (e.g. `<|im_end|>`, `</tool_response>`) broken by a
        zero-width space after its first character, so tool output cannot inject chat-format tokens, and
        with lone surrogates (a tool echoing a model's `"\\ud800"`) written as escapes, which the tokenizer
        would refuse."""
        try:
            observation.encode("utf-8")
        except UnicodeEncodeError:
            observation = observation.encode("utf-8", "backslashreplace").decode("utf-8")
        for t in self._control_texts:
            if t in observation:
                observation = observation.replace(t, t[0] + "\u200b" + t[1:])
        return observation

    def observation_ids(self, generated_ids: list[int], observations: list[str]) -> list[int]:
        """Ids to append after `generated_ids`: end of the assistant turn, tool messages, next generation prompt."""
        return self._append_ids(generated_ids, self._observation_text([self.defuse(o) for o in observations]))

    def user_turn_ids(self, generated_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """Ids to append after an answer when a multi-turn task goes on (`Env.next_turn`): the end of the
        assistant turn, the new user message(s) as the template renders them, the next generation prompt."""
        return self._append_ids(generated_ids, self._continuation_text(messages))

    def decode(self, ids: list[int]) -> str:
        """Generated text for the parser (special tokens such as <|im_end|> dropped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def parse(
        self,
        generated_ids: list[int],
        tools: list[dict[str, Any]],
        *,
        truncated: bool = False,
        max_tool_calls: Optional[int] = None,
    ) -> ParsedTurn:
        """Decode and parse one generated turn."""
        return parse_turn(self.decode(generated_ids), tools, truncated=truncated, max_tool_calls=max_tool_calls)


def turn_node(
    gen, lp, obs, kind, parsed: ParsedTurn, info: dict, observation: str = "", reward: Optional[float] = None
) -> Node:
    """A turn node: generated tokens (loss 1, behaviour log-probs) then observation tokens (loss 0)."""
    if parsed.final_answer is not None:
        action = parsed.final_answer
    else:
        action = (
            json.dumps([{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls])
            if parsed.tool_calls
            else ""
        )
    return Node(
        -1,
        gen + obs,
        [1] * len(gen) + [0] * len(obs),
        lp + [0.0] * len(obs),
        kind=kind,
        text=parsed.raw,
        thought=parsed.thought,
        action=action,
        observation=observation,
        reward=reward,
        info=info,
    )
