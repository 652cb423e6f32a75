"""A Qwen3-style byte-level tokenizer and a replaying engine for BFCL episodes through the agent loop.

* `qwen3_style_tokenizer()` is a real `transformers.PreTrainedTokenizerFast`
  built in code (nothing is downloaded): byte-level BPE without merges (every
  UTF-8 byte is one token, so encoding is canonical and concatenation-exact),
  Qwen3's control tokens (`<|im_start|>`, `<|im_end|>` = EOS, `<tool_call>`,
  `</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>`;
  the first three special, the rest added non-special tokens as in Qwen3) and
  a chat template with the structure of Qwen3's: the tools as JSON lines inside
  `<tools></tools>` in the system message, tool results grouped into one user
  message of `<tool_response>` blocks, `<|im_start|>assistant\\n` as the
  generation prompt.
* `ReplayEngine` is a real `Engine` that replays a fixed list of turns (token
  ids) per task: it recognises the task of a prefix by its prompt and the turn
  by the number of generation prompts after it, then applies the sampling
  contract (stop after the first stop token, at most `max_new_tokens`).
  Log-probs are a deterministic function of (turn index, position).
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trace_mega.rollout.engines.base import Completion, Engine, SamplingParams

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
GENERATION_PROMPT = "<|im_start|>assistant\n"

QWEN3_STYLE_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_style_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    model = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    model.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    return tok


def tool_call_text(name: str, arguments: dict) -> str:
    """One call in Qwen3's format (what the model emits; generation stops at `</tool_call>`)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def replay_logprob(turn: int, position: int) -> float:
    return -0.001 * ((turn * 31 + position * 7) % 997) - 0.01


class ReplayEngine(Engine):
    """Replays, for each (prompt ids, turns) pair, the turns (lists of token ids) one per generation.

    Prompts must be distinct: the prompt is how a prefix is matched to its script
    (a few BFCL tasks share their first user turn and tools, hence their prompt).
    """

    def __init__(self, tokenizer, scripts: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> None:
        super().__init__()
        self.scripts: dict[tuple[int, ...], list[list[int]]] = {}
        for prompt, turns in scripts:
            key = tuple(int(t) for t in prompt)
            if key in self.scripts:
                raise ValueError("two scripts share one prompt; the engine could not tell their prefixes apart")
            self.scripts[key] = [[int(t) for t in turn] for turn in turns]
        self.prompt_lens = sorted({len(p) for p in self.scripts})
        self.gen_prompt = [int(t) for t in tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)]
        self.batch_sizes: list[int] = []
        """Prefixes per `generate` call."""
        self.turns_served: dict[tuple[int, ...], list[int]] = {}
        """Per prompt, the script turn indices served, in order."""

    def _locate(self, prefix: list[int]) -> tuple[tuple[int, ...], int]:
        """(the prompt `prefix` starts with, how many turns were generated after it)."""
        for n in self.prompt_lens:
            key = tuple(prefix[:n])
            if key in self.scripts:
                rest, k, head = prefix[n:], len(self.gen_prompt), self.gen_prompt[0]
                turn = sum(1 for i, t in enumerate(rest) if t == head and rest[i : i + k] == self.gen_prompt)
                return key, turn
        raise AssertionError("a prefix that starts with none of the scripted prompts")

    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        self.batch_sizes.append(len(prefixes))
        stops = set(sampling.stop_token_ids)
        out = []
        for prefix in prefixes:
            key, turn = self._locate(prefix)
            script = self.scripts[key]
            if turn >= len(script):
                raise AssertionError(f"the loop asked for turn {turn} of a {len(script)}-turn script")
            ids, reason = [], "length"
            for tok in script[turn]:
                if len(ids) == sampling.max_new_tokens:
                    break
                ids.append(int(tok))
                if tok in stops:
                    reason = "stop"
                    break
            else:
                reason = "stop" if len(ids) < sampling.max_new_tokens else reason
            self.turns_served.setdefault(key, []).append(turn)
            out.append(
                Completion(
                    token_ids=ids, logprobs=[replay_logprob(turn, j) for j in range(len(ids))], finish_reason=reason
                )
            )
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:
            pass
