"""A tiny word-level tokenizer, built in code, for the synthetic environments.

It is a real `transformers.PreTrainedTokenizerFast` (a `tokenizers` WordLevel
model with a whitespace pre-tokenizer) with a ChatML-style chat template, so
the synthetic environments go through exactly the same ReAct rendering and
parsing path (`trace_mega.rollout.react`) as a Qwen3 tokenizer does.

The trick that makes a policy trained from scratch viable: every complete
tool-call string (``<tool_call>{"name": …, "arguments": …}</tool_call>``) and
every complete final answer (``<answer>done</answer>``) is ONE added token, so
one sampled token is one well-formed action, while the parser still sees and
parses the JSON text after decoding.

Layout of the vocabulary: ``<pad>`` = 0, ``[UNK]`` = 1, ``<|im_start|>`` = 2,
``<|im_end|>`` = 3 (the EOS), then the plain words, then the added tokens
(``<tool_response>``, ``</tool_response>``, the actions). Text between tokens is whitespace; tokenisation is canonical (encode
∘ decode is the identity on in-vocabulary text), which the tests rely on.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, UNK, IM_START, IM_END = "<pad>", "[UNK]", "<|im_start|>", "<|im_end|>"
CONTROL_TOKENS = [PAD, UNK, IM_START, IM_END]

# ChatML with whitespace between every token. A tool message whose content
# starts with "Error" (parse errors, tool timeouts, bad arguments) is rendered as
# the single word `error`: the detailed English message would be all [UNK] for
# this vocabulary and would only make the tiny policy's context longer.
TINY_CHAT_TEMPLATE = (
    # No whitespace control: the source has no newlines, and every space is meant.
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %} <|im_start|> user{% endif %}"
    " <tool_response> {{ 'error' if m.content.startswith('Error') else m.content }} </tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %} <|im_end|>{% endif %}"
    "{% else %}"
    " <|im_start|> {{ m.role }} {{ m.content }}"
    "{% if m.role == 'system' and tools %} tools"
    "{% for t in tools %} {{ t.function.name if t.function is defined else t.name }}{% endfor %}"
    "{% endif %} <|im_end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %} <|im_start|> assistant{% endif %}"
)

BASE_WORDS = ["system", "user", "assistant", "tools", "error"]
# Added (not plain) tokens, as in Qwen3: the scaffold defuses added-token strings in tool output.
FORMAT_TOKENS = ["<tool_response>", "</tool_response>"]


def build_tiny_tokenizer(words: Iterable[str], action_tokens: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` plus one added token per action string.

    `words` must not contain whitespace; `action_tokens` may (they are matched
    as whole strings before pre-tokenisation). Duplicates are dropped, order
    is kept, so the ids are deterministic.
    """
    vocab: dict[str, int] = {}
    for w in [*CONTROL_TOKENS, *BASE_WORDS, *words]:
        if any(c.isspace() for c in w) or not w:
            raise ValueError(f"tiny-vocabulary word {w!r} is empty or contains whitespace")
        vocab.setdefault(w, len(vocab))
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    actions = [a for a in dict.fromkeys([*FORMAT_TOKENS, *action_tokens]) if a not in vocab]
    model.add_tokens([AddedToken(a, special=False, normalized=False) for a in actions])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok
